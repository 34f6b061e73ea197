"""A product rounded where it stands: arithmetic no compiler contracts into an FMA.

XLA (on the CPU, and on GPUs through LLVM) may contract a multiply and the
add that consumes it into one fused multiply-add, rounded once instead of
twice, wherever the instruction set has FMA. Which products it contracts is
decided per program -- by the fusions around them and, on XLA:CPU since jax
0.12, by the shape of the loop -- so a sharded step and the unsharded step
of the same operations in the same order can round an element differently
in its last bit (docs/testing.md, "FMA"). A value passed through
:func:`rounded` has been rounded to its dtype before any consumer sees it:
its bits pass through an integer OR with a zero the compiler cannot see
(the output of an optimization barrier), which no compiler folds, so the
multiply cannot be fused into the add that follows. Two programs that write
every product feeding an add this way compute the same bits, FMA or not.

The cost is one integer OR per element and a scalar operand; nothing is
materialised (the fusion around it stays one pass). Used in the plain-jnp
arithmetic that runs as XLA programs (the references, Muon's passes, the
fused steps' finishing passes); the Pallas kernels on GPU and TPU compute
every element with one instruction sequence whatever the block, grid or
shard, and do without it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_BITS = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


@jax.custom_jvp
def rounded(x):
  """``x``, rounded to its dtype here (bit for bit ``x`` when nothing follows):
  a product written ``rounded(a * b) + c`` is never contracted into
  ``fma(a, b, c)``. Non-float values pass through."""
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype.itemsize not in _BITS:
    return x
  uint = _BITS[x.dtype.itemsize]
  if uint == jnp.uint64 and not jax.config.jax_enable_x64:
    return x   # (float64 only exists with x64 on)
  zero = jax.lax.optimization_barrier(jnp.zeros((), uint))
  return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x, uint) | zero, x.dtype)


@rounded.defjvp
def _rounded_jvp(primals, tangents):
  (x,), (t,) = primals, tangents
  return rounded(x), t
