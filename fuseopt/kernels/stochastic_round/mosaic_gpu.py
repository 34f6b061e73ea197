"""Counter-hash stochastic rounding fp32 → bf16: the Mosaic GPU backend (sm_90).

The ``mosaic_gpu`` backend of :func:`fuseopt.kernels.stochastic_round_bf16`:
a ``plgpu.kernel`` over a 1-D grid of the flattened array's first
``128 * (size // 128)`` elements, ``block`` elements a program
(:func:`fuseopt.kernels.elementwise_tiling.mosaic_gpu_blocks`), each block loaded
from and stored to global memory directly as one warpgroup's register array.
Not through shared memory: a TMA copy moves at most 256 elements along a
dimension, and a flat view of more dims would not fit ragged sizes. The last
``size % 128`` elements (Mosaic GPU has no masked loads) are rounded by the
reference and written into the kernel's output in place. The random bits
depend only on ``(seed, global flat index)``, so the result is bitwise the
reference's, whatever the block, vmap or sharding.

Compiles for sm_90 only (:func:`supports` refuses other GPUs before
lowering); runs anywhere in interpret mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from fuseopt.kernels import counter_hash
from fuseopt.kernels import dispatch
from fuseopt.kernels import elementwise_tiling
from fuseopt.kernels import sharding as sharding_lib
from fuseopt.kernels.elementwise_tiling import MosaicGPUConfig
from fuseopt.kernels.stochastic_round import reference

Config = MosaicGPUConfig

# Not measured on hardware: the whole range a warpgroup holds in registers
# (4096 fp32 in, bf16 out: 48 registers a thread).
SEARCH_SPACE = elementwise_tiling.MOSAIC_GPU_SEARCH_SPACE


def heuristic(size: int) -> MosaicGPUConfig:
  return elementwise_tiling.mosaic_gpu_heuristic(size)


def supports(call) -> str | None:
  """An sm_90 GPU, or any machine in interpret mode."""
  return dispatch.mosaic_gpu_reason(call)


def _kernel(scalars_ref, x_ref, o_ref, *, main, block, index_map):
  seed = scalars_ref[0]
  offset = scalars_ref[1]

  def one(start, size):
    rows = pl.ds(start, size)
    index = sharding_lib.global_index(elementwise_tiling.mosaic_gpu_flat_index(start, size),
                                      index_map, offset)
    o_ref.at[rows][...] = counter_hash.stochastic_round_values(x_ref.at[rows][...], index, seed)

  elementwise_tiling.mosaic_gpu_blocks(main, block, one)


def round_flat(flat, scalars, *, config: MosaicGPUConfig, interpret, index_map=None):
  """Rounds a flat fp32 array; ``scalars`` is ``[seed, offset]`` (uint32).
  ``interpret``: ``False`` or ``plgpu.InterpretGPUParams()``."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  (n,) = flat.shape
  main = elementwise_tiling.mosaic_gpu_split(n)
  seed, offset = scalars[0], scalars[1]
  if not main:
    return reference.round_tail(flat, 0, seed, offset, index_map)
  out = plgpu.kernel(
      functools.partial(_kernel, main=main, block=config.block, index_map=index_map),
      out_type=jax.ShapeDtypeStruct((n,), jnp.bfloat16),
      grid=(elementwise_tiling.mosaic_gpu_programs(main, config.block),),
      grid_names=(elementwise_tiling.MOSAIC_GPU_AXIS,),
      interpret=interpret or None,
      kernel_name="fuseopt_stochastic_round",
  )(scalars, flat)
  if main < n:
    # The kernel leaves the tail unwritten; the reference fills it in place
    # (a dynamic update of the kernel's output, no copy).
    out = out.at[main:].set(reference.round_tail(flat, main, seed, offset, index_map))
  return out


def round_leaf(x, seed, offset, scalars, *, config, interpret, index_map):
  """Rounds one local array (any shape)."""
  out = round_flat(x.reshape(-1), scalars, config=config or heuristic(x.size),
                   interpret=interpret, index_map=index_map)
  return out.reshape(x.shape)
