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
from fuseopt.kernels.adam.math import SEED_BASE, adam_cost, kernel_body, store
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


def leaf_reason(p, g, mu, nu, out_dtype, config, index_map) -> str | None:
  """Why this backend leaves a leaf to the reference, or None."""
  if sharding_lib.needs_division(index_map):
    # (Mosaic has no vector integer division to rebuild the global index of
    # a shard cut along a later axis whose sizes are not powers of two.)
    return "a shard's global index needs a vector integer division"
  if tiling_of(p, g, mu, nu, out_dtype, config) is None:
    return f"no tiling of a leaf of shape {g.shape} divides it"
  return None


def _kernel(s_ref, seed_ref, *refs, tiling, nesterov, apply, index_map):
  out, mu_new, nu_new, (o_ref, mu_out, nu_out) = kernel_body(s_ref, refs, nesterov=nesterov,
                                                             apply=apply)
  seed = lambda k: seed_ref[k].astype(jnp.uint32)
  index = sharding_lib.global_index(tiling.flat_index(), index_map, seed(SEED_BASE))
  o_ref[...] = store(out, o_ref.dtype, index, seed(0))
  mu_out[...] = store(mu_new, mu_out.dtype, index, seed(1))
  nu_out[...] = store(nu_new, nu_out.dtype, index, seed(2))


def tiling_of(p, g, mu, nu, out_dtype, config) -> elementwise_tiling.MosaicTiling | None:
  """The leaf's tiling (None: no tiling covers it, the reference runs)."""
  ins = (p, g, mu, nu) if p is not None else (g, mu, nu)
  stream_bytes = (sum(a.dtype.itemsize for a in ins)
                  + jnp.dtype(out_dtype).itemsize + mu.dtype.itemsize + nu.dtype.itemsize)
  return elementwise_tiling.mosaic_tiling(g.shape, config, stream_bytes=stream_bytes)


def update(scalars, seeds, p, g, mu, nu, *, nesterov, out_dtype, config, interpret,
           index_map=None):
  """One leaf in its own shape (the view keeps its TPU layout); returns ``(out, mu, nu)``."""
  from jax.experimental.pallas import tpu as pltpu
  tiling = tiling_of(p, g, mu, nu, out_dtype, config)
  apply = p is not None
  # Reshapes that keep the TPU layout (elementwise_tiling.mosaic_tiling): no copies.
  arrays = tuple(a.reshape(tiling.view) for a in ((p, g, mu, nu) if apply else (g, mu, nu)))
  spec = tiling.spec()
  first = 2
  aliases = ({first: 0, first + 2: 1, first + 3: 2} if apply
             else {first + 1: 1, first + 2: 2})
  outs = pl.pallas_call(
      functools.partial(_kernel, tiling=tiling, nesterov=nesterov, apply=apply,
                        index_map=index_map),
      out_shape=(out_shape := (jax.ShapeDtypeStruct(tiling.view, out_dtype),
                               jax.ShapeDtypeStruct(tiling.view, mu.dtype),
                               jax.ShapeDtypeStruct(tiling.view, nu.dtype))),
      grid=tiling.grid,
      in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM),
                pl.BlockSpec(memory_space=pltpu.SMEM)] + [spec] * len(arrays),
      out_specs=(spec, spec, spec),
      input_output_aliases=aliases,
      compiler_params=pallas_common.mosaic_compiler_params(interpret, tiling.semantics),
      interpret=interpret,
      name="fuseopt_adam_update",
      cost_estimate=adam_cost(arrays, out_shape),
  )(scalars, jax.lax.bitcast_convert_type(seeds, jnp.int32), *arrays)
  return tuple(o.reshape(g.shape) for o in outs)
