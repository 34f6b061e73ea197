"""Fused Adam/AdamW update: the Mosaic TPU backend.

The leaf on its own TPU layout, 2-D blocks of its last two dims that divide
it, at most ``128 * block_rows`` elements a grid step
(:func:`fuseopt.kernels.elementwise_tiling.mosaic_tiling`: a flat
``(rows, 128)`` view would be a relayout copy of every operand); 1-D leaves
and last dims under 128 on the flat view. Leaves with no such tiling run the
reference (on LLM trees at most small biases and norms whose size is not a
multiple of 128), logged at debug level. One launch per leaf: Mosaic's
pipeline copies each output block it holds back to HBM (when its index
changes and when the grid, or a core's share of it, ends), written or not,
so in a grouped launch the clamped block of a leaf that a core's steps never
update would be overwritten with an uninitialised VMEM buffer (a race with
the core that does update it where the grid is split between cores), and
every leaf's blocks would sit in VMEM at once. Grouping there needs
``memory_space=pl.ANY`` operands and manual DMA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from fuseopt.kernels import dispatch
from fuseopt.kernels import elementwise_tiling
from fuseopt.kernels import pallas_common
from fuseopt.kernels import sharding as sharding_lib
from fuseopt.kernels.adam.math import (SEED_BASE, adam_cost, in_place_aliases, kernel_body,
                                       store_outputs)
from fuseopt.kernels.elementwise_tiling import MosaicTPUConfig

Config = MosaicTPUConfig
# Budgets of 128 * block_rows elements a step (MosaicTPUConfig). 7 streams
# double-buffered: 1024 * 128 fp32 elements are 7 MiB of VMEM, inside the
# 16 MiB default scoped limit of v5e.
SEARCH_SPACE = tuple(MosaicTPUConfig(r) for r in (128, 256, 512, 1024))


def heuristic(size: int) -> MosaicTPUConfig:
  # One budget for every size: a leaf under it is one full-extent block anyway.
  del size
  return MosaicTPUConfig(block_rows=512)


# Every float32/bfloat16 tree; a leaf it cannot tile runs the reference
# (:func:`leaf_reason`).
supports = dispatch.supports_every_call


def leaf_reason(p, g, mu, nu, out_dtype, config, index_map, lo=None) -> str | None:
  """Why this backend leaves a leaf to the reference, or None."""
  if sharding_lib.needs_division(index_map):
    # (Mosaic has no vector integer division to rebuild the global index of
    # a shard cut along a later axis whose sizes are not powers of two.)
    return "a shard's global index needs a vector integer division"
  if tiling_of(p, g, mu, nu, out_dtype, config, lo) is None:
    return f"no tiling of a leaf of shape {g.shape} divides it"
  return None


def _kernel(s_ref, seed_ref, *refs, tiling, nesterov, apply, index_map, tracked):
  out, mu_new, nu_new, out_refs = kernel_body(s_ref, refs, nesterov=nesterov, apply=apply,
                                              tracked=tracked)
  seed = lambda k: seed_ref[k].astype(jnp.uint32)
  index = sharding_lib.global_index(tiling.flat_index(), index_map, seed(SEED_BASE))
  store_outputs(out_refs, out, mu_new, nu_new, index, seed, tracked=tracked)


def tiling_of(p, g, mu, nu, out_dtype, config, lo=None) -> elementwise_tiling.MosaicTiling | None:
  """The leaf's tiling (None: no tiling covers it, the reference runs)."""
  ins = ((p, g, mu, nu) if p is not None else (g, mu, nu)) + ((lo,) if lo is not None else ())
  stream_bytes = (sum(a.dtype.itemsize for a in ins)
                  + jnp.dtype(out_dtype).itemsize + mu.dtype.itemsize + nu.dtype.itemsize
                  + (lo.dtype.itemsize if lo is not None else 0))
  return elementwise_tiling.mosaic_tiling(g.shape, config, stream_bytes=stream_bytes)


def update(scalars, seeds, p, g, mu, nu, *, nesterov, out_dtype, config, interpret,
           index_map=None, lo=None):
  """One leaf in its own shape (the view keeps its TPU layout); returns
  ``(out, mu, nu)``, and ``(out, mu, nu, lo)`` with a companion ``lo``."""
  from jax.experimental.pallas import tpu as pltpu
  tiling = tiling_of(p, g, mu, nu, out_dtype, config, lo)
  apply = p is not None
  tracked = lo is not None
  # Reshapes that keep the TPU layout (elementwise_tiling.mosaic_tiling): no copies.
  leaf = ((p, g, mu, nu) if apply else (g, mu, nu)) + ((lo,) if tracked else ())
  arrays = tuple(a.reshape(tiling.view) for a in leaf)
  spec = tiling.spec()
  out_shape = tuple(jax.ShapeDtypeStruct(tiling.view, d) for d in (
      (out_dtype, mu.dtype, nu.dtype) + ((lo.dtype,) if tracked else ())))
  outs = pl.pallas_call(
      functools.partial(_kernel, tiling=tiling, nesterov=nesterov, apply=apply,
                        index_map=index_map, tracked=tracked),
      out_shape=out_shape,
      grid=tiling.grid,
      in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM),
                pl.BlockSpec(memory_space=pltpu.SMEM)] + [spec] * len(arrays),
      out_specs=(spec,) * len(out_shape),
      input_output_aliases=in_place_aliases(2, 0, apply=apply, tracked=tracked),
      compiler_params=pallas_common.mosaic_compiler_params(interpret, tiling.semantics),
      interpret=interpret,
      name="fuseopt_adam_update",
      cost_estimate=adam_cost(arrays, out_shape, n=g.size),
  )(scalars, jax.lax.bitcast_convert_type(seeds, jnp.int32), *arrays)
  return tuple(o.reshape(g.shape) for o in outs)
