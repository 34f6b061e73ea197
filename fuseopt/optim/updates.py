"""Applying updates to parameters stored in bf16, with stochastic rounding."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fuseopt import kernels
from fuseopt.kernels import counter_hash


def apply_updates(params, updates, *, seed, implementation=None):
  """``params + updates``, leaf by leaf, rounding bf16 leaves stochastically.

  Like :func:`optax.apply_updates`, but a bf16 parameter gets
  ``stochastic_round_bf16(float32(p) + float32(u))`` instead of a
  round-to-nearest add, so updates smaller than half a bf16 ulp still move
  the parameter in expectation (Gupta et al. 2015, "Deep Learning with
  Limited Numerical Precision"). fp32 (and other) leaves get a plain add in
  their own dtype, as optax does.

  The rounding seed of leaf ``i`` (in ``jax.tree.leaves`` order) is
  ``derive_seed(seed, 0, i, STREAM_PARAM)``: pass a different ``seed`` each
  step (e.g. the step count), or the same rounding bits repeat.

  Args:
    params: a pytree of arrays.
    updates: a pytree with the same structure (``None`` leaves are skipped).
    seed: an integer scalar in [0, 2**32) (may be traced).
    implementation: forwarded to :func:`fuseopt.kernels.stochastic_round_bf16`.
  """
  leaves, treedef = jax.tree.flatten(params)
  upd_leaves = treedef.flatten_up_to(updates)
  # Any uint32 value, also a Python int in [2**31, 2**32) (which jax's default
  # int32 cannot hold); floats, negatives and non-scalars raise naming `seed`.
  seed = counter_hash.uint32_scalar(seed, name="seed", owner="apply_updates")
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
          implementation=implementation))
    else:
      out.append((p + jnp.asarray(u).astype(p.dtype)).astype(p.dtype))
  return treedef.unflatten(out)
