"""Counter-hash stochastic rounding fp32 → bf16: the Mosaic TPU backend.

The array in its own TPU layout, blocks of its last two dims
(:func:`fuseopt.kernels.elementwise_tiling.mosaic_tiling`) when the last dim
spans the 128 lanes (any width past that); other arrays are viewed as flat
``(rows, 128)`` lanes, and a tail of fewer than 128 elements (sizes that are
not a multiple of 128) is rounded by the reference, with its offset. A shard
whose global index needs an integer division by a non-power of two runs the
reference (Mosaic has no vector integer division), logged at debug level.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from fuseopt.kernels import counter_hash
from fuseopt.kernels import dispatch
from fuseopt.kernels import elementwise_tiling
from fuseopt.kernels import pallas_common
from fuseopt.kernels import sharding as sharding_lib
from fuseopt.kernels.elementwise_tiling import LANES, MosaicTPUConfig
from fuseopt.kernels.stochastic_round import reference

Config = MosaicTPUConfig
SEARCH_SPACE = tuple(MosaicTPUConfig(r) for r in (256, 512, 1024, 2048))

# fp32 in, bf16 out; no output is aliased, so a ragged last block is fine.
_TILING = dict(stream_bytes=4 + 2, ragged_edge=True)


def heuristic(size: int) -> MosaicTPUConfig:
  # One budget for every size: an array under it is one full-extent block anyway.
  del size
  return MosaicTPUConfig(block_rows=1024)


# Every fp32 array (leaves it cannot tile are rounded in part or whole by
# the reference, see the module docstring).
supports = dispatch.supports_every_call


def _kernel(scalars_ref, x_ref, o_ref, *, tiling, index_map, interpret):
  seed = scalars_ref[0].astype(jnp.uint32)
  offset = scalars_ref[1].astype(jnp.uint32)

  def chunk(view, local):
    index = sharding_lib.global_index(local, index_map, offset)
    view(o_ref)[...] = counter_hash.stochastic_round_values(view(x_ref)[...], index, seed)

  tiling.for_each_chunk(chunk, unrolled=interpret)


def _round_tiled(x, scalars, *, tiling: elementwise_tiling.MosaicTiling, interpret,
                 index_map=None):
  from jax.experimental.pallas import tpu as pltpu
  out = pl.pallas_call(
      functools.partial(_kernel, tiling=tiling, index_map=index_map,
                        interpret=bool(interpret)),
      out_shape=jax.ShapeDtypeStruct(tiling.view, jnp.bfloat16),
      grid=tiling.grid,
      in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), tiling.spec()],
      out_specs=tiling.spec(),
      compiler_params=pallas_common.mosaic_compiler_params(
          interpret, tiling.semantics, vmem_limit_bytes=elementwise_tiling.mosaic_vmem_limit(
              tiling.vmem_bytes(_TILING["stream_bytes"]))),
      interpret=interpret,
      name="fuseopt_stochastic_round",
      cost_estimate=pallas_common.cost_estimate(
          flops=0, bytes_accessed=x.size * (x.dtype.itemsize + 2)),
  )(scalars.astype(jnp.int32), pallas_common.in_hbm((x.reshape(tiling.view),), interpret)[0])
  return out.reshape(x.shape)


def round_leaf(x, seed, offset, scalars, *, config, interpret, index_map):
  """Rounds one local array: tiled in its layout, else flat lanes and a tail."""
  if sharding_lib.needs_division(index_map):
    dispatch.log_fallback("stochastic_round", "mosaic_tpu",
                          "a shard's global index needs a vector integer division",
                          runs="the shard-local reference")
    return reference.stochastic_round_reference(x, seed, offset=offset, index_map=index_map)
  n = x.size
  config = config or heuristic(n)
  tiling = elementwise_tiling.mosaic_tiling(x.shape, config, **_TILING)
  if tiling is not None:
    return _round_tiled(x, scalars, tiling=tiling, interpret=interpret, index_map=index_map)
  # No tiling of the whole array (a size that is not a multiple of 128, 1-D
  # or with a last dim under 128): flat lanes and a tail.
  flat = x.reshape(-1)
  main = (n // LANES) * LANES
  parts = []
  if main:
    parts.append(_round_tiled(
        flat[:main], scalars, interpret=interpret, index_map=index_map,
        tiling=elementwise_tiling.mosaic_tiling((main,), config, **_TILING)))
  if main < n:
    parts.append(reference.round_tail(flat, main, seed, offset, index_map))
  out = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
  return out.reshape(x.shape)
