"""Applying updates to parameters stored in bf16, with stochastic rounding."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fuseopt import kernels
from fuseopt.kernels import counter_hash
from fuseopt.kernels import sharding as kernel_sharding


def _optax_add(p, u):
  # optax.apply_updates's leaf expression (an integer parameter stays integer).
  return None if p is None else jnp.asarray(p + u).astype(jnp.asarray(p).dtype)


def apply_updates(params, updates, *, seed=None, implementation=None, shardings=None):
  """``params + updates``, leaf by leaf, rounding bf16 leaves stochastically.

  Without ``seed`` this is :func:`optax.apply_updates`, expression for
  expression: each leaf ``p + u`` cast back to ``p``'s dtype, ``None``
  parameters stay ``None`` (``apply_updates(None, u)`` is ``None``).

  With ``seed``, a bf16 parameter gets
  ``stochastic_round_bf16(float32(p) + float32(u))`` instead of a
  round-to-nearest add, so updates smaller than half a bf16 ulp still move
  the parameter in expectation (Gupta et al. 2015, "Deep Learning with
  Limited Numerical Precision"); other leaves (fp32, fp16, fp64, complex,
  integer) get optax's add in their own dtype, and ``None`` updates leave
  their parameter unchanged. The rounding seed of leaf ``i`` (in
  ``jax.tree.leaves`` order) is ``derive_seed(seed, 0, i, STREAM_PARAM)``:
  pass a different ``seed`` each step (e.g. the step count), or the same
  rounding bits repeat.

  Args:
    params: a pytree of arrays.
    updates: a pytree with the same structure.
    seed: ``None`` (optax's add) or an integer scalar in [0, 2**32) (may be traced).
    implementation: forwarded to :func:`fuseopt.kernels.stochastic_round_bf16`.
    shardings: the params' placement on an Auto mesh (a tree of
      ``NamedSharding`` / ``PartitionSpec``, a prefix, or one for all); the
      rounding then runs shard-local with global indices. ``None``: read
      from the types (Explicit axes). See docs/scaling.md.
  """
  if seed is None:
    return jax.tree.map(_optax_add, params, updates, is_leaf=lambda x: x is None)
  leaves, treedef = jax.tree.flatten(params)
  upd_leaves = treedef.flatten_up_to(updates)
  # Any uint32 value, also a Python int in [2**31, 2**32) (which jax's default
  # int32 cannot hold); floats, negatives and non-scalars raise naming `seed`.
  seed = counter_hash.uint32_scalar(seed, name="seed", owner="apply_updates")
  leaf_shardings = kernel_sharding.flatten_shardings(shardings, params, owner="apply_updates",
                                                     strict=True) or [None] * len(leaves)
  out = []
  for i, (p, u) in enumerate(zip(leaves, upd_leaves)):
    if u is None:
      out.append(p)
      continue
    p = jnp.asarray(p)
    if p.shape != jnp.shape(u):
      raise ValueError(f"apply_updates: update of leaf {i} has shape {jnp.shape(u)}, "
                       f"expected the parameter's {p.shape}")
    if p.dtype == jnp.bfloat16:
      leaf_seed = counter_hash.derive_seed(seed, 0, i, counter_hash.STREAM_PARAM)
      out.append(kernels.stochastic_round_bf16(
          p.astype(jnp.float32) + jnp.asarray(u).astype(jnp.float32), leaf_seed,
          sharding=leaf_shardings[i], implementation=implementation))
    else:
      out.append(_optax_add(p, u))
  return treedef.unflatten(out)
