"""Exact bf16 parameters: an fp32 master split into a bf16 half and a uint16 half.

An fp32 value's 32 bits are ``hi << 16 | lo``: ``hi`` (sign, exponent and the
top 7 mantissa bits) is exactly a bfloat16 -- the parameter the model reads --
and ``lo`` (the low 16 mantissa bits) is a uint16 companion kept in the
optimizer state. Joined, they are the fp32 master bit for bit, so an update
computed in fp32 and split again loses nothing: the parameters follow an fp32
run of the same optimizer exactly, at 2 extra bytes per parameter instead of
the 4 of a separate fp32 master copy ("mantissa tracking", modded-nanogpt
speedrun record #57, 2025).

The bf16 half is the fp32 master *truncated* toward zero (its low bits
dropped), not rounded: the pair must be the master, so the model sees a
value within one bf16 ulp of it, always on the side of zero. A stochastic or
nearest rounding of the visible half would need a signed companion.

Plain ``jnp`` on fp32/uint32 values (bit casts, shifts, masks), so the same
functions run in XLA and inside the Pallas kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

COMPANION_DTYPE = jnp.dtype(jnp.uint16)
_HI_MASK = 0xFFFF0000
_LO_MASK = 0x0000FFFF


def join(hi, lo) -> jax.Array:
  """The fp32 master of a bf16 half ``hi`` and its uint16 companion ``lo``.

  ``hi`` widened to fp32 is exact (its bits become the top 16 of the fp32
  word), so OR-ing ``lo`` into the low 16 bits restores the master.
  """
  return jax.lax.bitcast_convert_type(_bits(hi) | lo.astype(jnp.uint32), jnp.float32)


def _bits(x32) -> jax.Array:
  return jax.lax.bitcast_convert_type(x32.astype(jnp.float32), jnp.uint32)


def _halves(bits) -> tuple[jax.Array, jax.Array]:
  # The high word as an fp32 whose low bits are zero is a bf16 value, so the
  # conversion to bf16 is exact (no rounding happens).
  hi = jax.lax.bitcast_convert_type(bits & jnp.uint32(_HI_MASK), jnp.float32)
  return hi.astype(jnp.bfloat16), (bits & jnp.uint32(_LO_MASK)).astype(COMPANION_DTYPE)


def split(x32) -> tuple[jax.Array, jax.Array]:
  """``x32`` (fp32) as ``(hi, lo)``: its truncation to bf16 and the uint16
  of its low 16 bits. ``join(*split(x))`` is ``x`` bit for bit (NaN and
  Inf included: their payload's top bits stay in ``hi``)."""
  return _halves(_bits(x32))


def split_once(x32) -> tuple[jax.Array, jax.Array]:
  """:func:`split` for code that XLA fuses (not inside a kernel): the fp32
  value's bits pass an ``optimization_barrier`` first.

  Without it XLA may recompute ``x32`` in two fusions, one for each half,
  and a compiler that contracts a multiply and an add into a fused
  multiply-add in one and not the other (XLA's CPU and GPU backends do, per
  fusion) gives the halves of two different values: where the two differ
  across the 16-bit boundary, the joined master is off by a whole bf16 ulp.
  The barrier makes the value once (one uint32 buffer of the leaf's size).
  """
  return _halves(jax.lax.optimization_barrier(_bits(x32)))


def widen_once(g) -> jax.Array:
  """``g`` in fp32 for an fp32 master's step, made once in memory.

  A pass that reads a bf16 gradient and widens it in registers is another
  program than the fp32 run's, which reads fp32; XLA contracts ``a*b + c*d``
  (Adam's ``b1*mu + (1-b1)*g``) into a fused multiply-add choosing the
  product per program, so the two round a rare element differently (seen on
  XLA's CPU backend). Behind an ``optimization_barrier`` the widened
  gradient is an fp32 array, and the pass that reads it the fp32 run's
  program. fp32 (and wider, and non-float) leaves are returned as they are.
  """
  dtype = jnp.result_type(g)
  if not jnp.issubdtype(dtype, jnp.floating) or jnp.finfo(dtype).bits >= 32:
    return g
  return jax.lax.optimization_barrier(jnp.asarray(g).astype(jnp.float32))
