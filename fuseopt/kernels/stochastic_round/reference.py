"""Counter-hash stochastic rounding fp32 → bf16: the reference.

The specification of :func:`fuseopt.kernels.stochastic_round_bf16`, its CPU
path and the oracle every kernel is tested against: plain ``jnp`` over the
whole array (backend ``"xla"``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fuseopt.kernels import counter_hash
from fuseopt.kernels import dispatch
from fuseopt.kernels import sharding as sharding_lib

# The reference runs every call.
supports = dispatch.supports_every_call




def stochastic_round_reference(x: jax.Array, seed, *, offset=0, index_map=None) -> jax.Array:
  """The specification: plain jnp over the whole array.

  ``index_map`` (:mod:`fuseopt.kernels.sharding`) maps ``x``'s local flat
  indices to those of the global array ``x`` is a shard of; ``None``: ``x``
  is contiguous in it, from ``offset`` on.
  """
  x = jnp.asarray(x)
  seed = counter_hash.uint32_scalar(seed, name="seed", owner="stochastic_round_reference")
  offset = counter_hash.uint32_scalar(offset, name="offset", owner="stochastic_round_reference")
  local = jax.lax.iota(jnp.uint32, x.size).reshape(x.shape) if x.ndim else jnp.uint32(0)
  index = sharding_lib.global_index(local, index_map, offset)
  return counter_hash.stochastic_round_values(x, index, seed)


def round_tail(flat, start: int, seed, offset, index_map):
  """The reference on ``flat[start:]`` of a flat leaf, whose local indices
  continue from ``start`` (the tail a Mosaic kernel leaves)."""
  n = flat.shape[0]
  tail = jax.lax.iota(jnp.uint32, n - start)
  if start:
    tail = tail + jnp.uint32(start)
  return counter_hash.stochastic_round_values(
      flat[start:], sharding_lib.global_index(tail, index_map, offset), seed)
