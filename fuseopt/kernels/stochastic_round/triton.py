"""Counter-hash stochastic rounding fp32 → bf16: the Triton backend (GPU).

A 1-D grid over the flattened array, ``block`` elements a program (a power
of two); the ragged last block's loads and stores are masked
(:class:`~fuseopt.kernels.elementwise_tiling.TritonBounded`).
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
from fuseopt.kernels.elementwise_tiling import TritonConfig

Config = TritonConfig
SEARCH_SPACE = elementwise_tiling.TRITON_SEARCH_SPACE
heuristic = elementwise_tiling.triton_heuristic
# Every fp32 array (the public function checks the dtype).
supports = dispatch.supports_every_call


def _kernel(scalars_ref, x_ref, o_ref, *, block, n, masked, index_map):
  seed = scalars_ref[0]
  offset = scalars_ref[1]
  local = elementwise_tiling.triton_flat_index(block)
  x_ref, o_ref = elementwise_tiling.triton_bound((x_ref, o_ref), local < n, masked)
  index = sharding_lib.global_index(local, index_map, offset)
  o_ref[...] = counter_hash.stochastic_round_values(x_ref[...], index, seed)


def round_flat(flat, scalars, *, config: TritonConfig, interpret, index_map=None):
  """Rounds a flat fp32 array; ``scalars`` is ``[seed, offset]`` (uint32)."""
  from jax.experimental.pallas import triton as plgpu
  (n,) = flat.shape
  block = config.block
  return pl.pallas_call(
      functools.partial(_kernel, block=block, n=n, index_map=index_map,
                        masked=elementwise_tiling.triton_masks(n, block, interpret)),
      out_shape=jax.ShapeDtypeStruct((n,), jnp.bfloat16),
      grid=(pl.cdiv(n, block),),
      in_specs=[pl.BlockSpec((2,), lambda i: (0,)),
                pl.BlockSpec((block,), lambda i: (i,))],
      out_specs=pl.BlockSpec((block,), lambda i: (i,)),
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1),
      interpret=interpret,
      name="fuseopt_stochastic_round",
      cost_estimate=pallas_common.cost_estimate(flops=0,
                                                bytes_accessed=n * (flat.dtype.itemsize + 2)),
  )(scalars, flat)


def round_leaf(x, seed, offset, scalars, *, config, interpret, index_map):
  """Rounds one local array (any shape)."""
  out = round_flat(x.reshape(-1), scalars, config=config or heuristic(x.size),
                   interpret=interpret, index_map=index_map)
  return out.reshape(x.shape)
