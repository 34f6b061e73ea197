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
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from fuseopt.kernels import counter_hash
from fuseopt.kernels import dispatch
from fuseopt.kernels import elementwise_tiling
from fuseopt.kernels import pallas_common
from fuseopt.kernels import sharding as sharding_lib
from fuseopt.kernels.adam import quantized
from fuseopt.kernels.adam.math import (APPLY, SEED_BASE, adam_cost, adam_math, in_place_aliases,
                                       kernel_body, store, store_outputs)
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


# ------------------------------------------------- Mosaic TPU, 8-bit moments --
# The leaf as (M, L): its leading dims merged, the last axis whole (a 1-D
# leaf as (L / BLOCK, BLOCK)), so the view keeps the TPU layout (no relayout
# copies). A grid step holds whole rows. The scales, (M, L / BLOCK) in the
# state, go to the kernel transposed, (L / BLOCK, M), rows on lanes: libtpu
# lays a step's (M, L / BLOCK) scales arguments out with the long axis minor,
# so the transpose is a bitcast of them; taken (M, L / BLOCK) the kernel's
# lanes would be L / BLOCK wide (8 for a 2048-wide row), padded to 128, and
# libtpu copies every leaf's scales into that layout (docs/adam.md). The
# scales block's lanes make the rows a multiple of 128 (or all M). 128 rows of
# a row longer than _TRANSPOSED_MAX_LENGTH exceed VMEM (seven double-buffered
# streams): such a leaf (a vocabulary-wide head) takes its scales untransposed,
# whose minor axis is then long itself, with rows a multiple of 32 (int8's
# sublane tiling).
_INT8_ROWS = 32
_TRANSPOSED_ROWS = 128
_TRANSPOSED_MAX_LENGTH = 16384


def quantized_view(shape) -> tuple[int, int]:
  """``(M, L)``: the 2-D view of a leaf the 8-bit kernel runs on."""
  if len(shape) == 1:
    return shape[0] // quantized.BLOCK, quantized.BLOCK
  return math.prod(shape[:-1]), shape[-1]


def _rows(m: int, budget: int, unit: int) -> int | None:
  """All ``m`` rows under the budget, else the largest multiple of ``unit``
  under it that divides ``m``."""
  if m <= budget:
    return m
  for rows in range(budget - budget % unit, 0, -unit):
    if m % rows == 0:
      return rows
  return None


def quantized_tiling(view, config: MosaicTPUConfig) -> tuple[int, bool] | None:
  """``(rows a grid step, scales transposed)`` of an ``(M, L)`` view (None: no
  such tiling, the reference runs)."""
  m, length = view
  budget = config.block_elements // length
  if length <= _TRANSPOSED_MAX_LENGTH:
    rows = _rows(m, max(_TRANSPOSED_ROWS, budget), _TRANSPOSED_ROWS)
    if rows is not None:
      return rows, True
  rows = _rows(m, max(_INT8_ROWS, budget), _INT8_ROWS)
  return None if rows is None else (rows, False)


def quantized_leaf_reason(g, config, index_map) -> str | None:
  """Why this backend leaves an 8-bit leaf to the reference, or None."""
  if sharding_lib.needs_division(index_map):
    return "a shard's global index needs a vector integer division"
  if quantized_tiling(quantized_view(g.shape), config) is None:
    return (f"the leaf's {quantized_view(g.shape)} view has no grid step of whole rows: "
            f"neither a multiple of {_TRANSPOSED_ROWS} rows nor all of them (scales transposed) "
            f"nor a multiple of {_INT8_ROWS} (untransposed) divides it")
  return None


def _column(row):
  """A ``(1, rows)`` row of transposed scales as the ``(rows, 1)`` column
  that scales a block's rows: broadcast to 128 sublanes, one native transpose."""
  return jnp.broadcast_to(row, (128, row.shape[1])).T[:, :1]


def _row(column):
  """A ``(rows, 1)`` column of scales as the ``(1, rows)`` row of the
  transposed scales."""
  return jnp.broadcast_to(column, (column.shape[0], 128)).T[:1, :]


def _quantized_kernel(s_ref, seed_ref, *refs, rows, length, transposed, nesterov, apply,
                      index_map):
  p_ref, (g_ref, muc_ref, mus_ref, nuc_ref, nus_ref), (o_ref, muc_out, mus_out, nuc_out, nus_out) = (
      quantized.split_kernel_refs(refs, apply))
  block = quantized.BLOCK
  shape = (rows, block)
  seed = lambda k: seed_ref[k].astype(jnp.uint32)
  row = ((pl.program_id(0) * rows).astype(jnp.uint32)
         + jax.lax.broadcasted_iota(jnp.uint32, shape, 0)) * jnp.uint32(length)
  col = jax.lax.broadcasted_iota(jnp.uint32, shape, 1)
  # Block j's scales, one per row: row j of transposed scales, else column j.
  if transposed:
    read = lambda ref, j: _column(ref[j:j + 1, :])
    def write(ref, j, column):
      ref[j:j + 1, :] = _row(column)
  else:
    read = lambda ref, j: ref[:, j:j + 1]
    def write(ref, j, column):
      ref[:, j:j + 1] = column
  # One quantisation block of every row at a time: static lane slices, each
  # block's absmax a row reduction in VMEM.
  for j in range(length // block):
    lanes = slice(j * block, (j + 1) * block)
    f32 = lambda r: r[:, lanes].astype(jnp.float32)
    mu32 = quantized.dequantize_mu(muc_ref[:, lanes], read(mus_ref, j))
    nu32 = quantized.dequantize_nu(nuc_ref[:, lanes], read(nus_ref, j))
    out, mu_new, nu_new = adam_math(lambda k: s_ref[k], f32(p_ref) if apply else None,
                                    f32(g_ref), mu32, nu32, nesterov=nesterov, apply=apply,
                                    reciprocal=True)
    index = sharding_lib.global_index(row + (col + jnp.uint32(j * block)), index_map,
                                      seed(SEED_BASE))
    o_ref[:, lanes] = store(out, o_ref.dtype, index, seed(0))
    keep = lambda new, old: quantized.kept_on_skip(s_ref[APPLY] == 0, new, old)
    mu_codes, mu_scale = quantized.quantize_mu(mu_new, counter_hash.hash_bits(index, seed(1)))
    nu_codes, nu_scale = quantized.quantize_nu(nu_new, counter_hash.hash_bits(index, seed(2)))
    muc_out[:, lanes] = keep(mu_codes, muc_ref[:, lanes])
    nuc_out[:, lanes] = keep(nu_codes, nuc_ref[:, lanes])
    write(mus_out, j, keep(mu_scale, read(mus_ref, j)))
    write(nus_out, j, keep(nu_scale, read(nus_ref, j)))


def update_quantized(scalars, seeds, p, g, mu, nu, *, nesterov, out_dtype, config, interpret,
                     index_map=None):
  """One leaf with 8-bit moments in its own shape (viewed by
  :func:`quantized_view`); returns ``(out, mu, nu)`` in place, the moments
  :class:`QuantizedMoment`."""
  from jax.experimental.pallas import tpu as pltpu
  shape = g.shape
  m, length = quantized_view(shape)
  rows, transposed = quantized_tiling((m, length), config)
  n_scales = length // quantized.BLOCK
  apply = p is not None
  tile = pl.BlockSpec((rows, length), lambda i: (i, 0))
  # The scales transposed where they fit (above): rows on lanes.
  if transposed:
    vec = pl.BlockSpec((n_scales, rows), lambda i: (0, i))
    scales_in = lambda sc: sc.reshape(m, n_scales).T
    scales_out = lambda sc, like: sc.T.reshape(like.shape)
  else:
    vec = pl.BlockSpec((rows, n_scales), lambda i: (i, 0))
    scales_in = lambda sc: sc.reshape(m, n_scales)
    scales_out = lambda sc, like: sc.reshape(like.shape)
  view = lambda a: a.reshape(m, length)
  qview = lambda q: quantized.QuantizedMoment(view(q.codes), scales_in(q.scales))
  mu2, nu2 = qview(mu), qview(nu)
  arrays = ((view(p),) if apply else ()) + (view(g), mu2.codes, mu2.scales, nu2.codes,
                                            nu2.scales)
  if not interpret:
    # The operands stay in HBM, where the kernel's pipeline reads them: left
    # free, libtpu prefetches whole 8-bit operands (codes, scales: small
    # enough) into on-chip memory ahead of the kernel, and every prefetch
    # holds a 16 KiB slot of the step's HBM temporaries (1.2 B AdamW step on
    # v6e: 82.3 MB with them, 12.2 MB without; docs/adam.md).
    arrays = tuple(pltpu.with_memory_space_constraint(a, pltpu.HBM) for a in arrays)
  specs = ([tile] if apply else []) + [tile, tile, vec, tile, vec]
  out_shape = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (
      jax.ShapeDtypeStruct((m, length), out_dtype), mu2.codes, mu2.scales, nu2.codes,
      nu2.scales))
  first = 2 + apply
  aliases = {first + 1 + j: 1 + j for j in range(4)}
  if apply:
    aliases[2] = 0
  # Whole rows a step: a long last axis (a vocabulary) needs more than the
  # default scoped VMEM (16 MiB on v5e) for 32 rows of 7 double-buffered streams.
  vmem = 2 * sum(rows * length * a.dtype.itemsize for a in arrays[:2 + apply]) * 3
  outs = pl.pallas_call(
      functools.partial(_quantized_kernel, rows=rows, length=length, transposed=transposed,
                        nesterov=nesterov, apply=apply, index_map=index_map),
      out_shape=out_shape,
      grid=(m // rows,),
      in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM),
                pl.BlockSpec(memory_space=pltpu.SMEM)] + specs,
      out_specs=(tile, tile, vec, tile, vec),
      input_output_aliases=aliases,
      compiler_params=pallas_common.mosaic_compiler_params(
          interpret, ("parallel",), vmem_limit_bytes=max(32 << 20, min(vmem, 100 << 20))),
      interpret=interpret,
      name="fuseopt_adam_update_int8",
      cost_estimate=adam_cost(arrays, out_shape, n=g.size),
  )(scalars, jax.lax.bitcast_convert_type(seeds, jnp.int32), *arrays)
  back = lambda c, sc, q: quantized.QuantizedMoment(c.reshape(shape), scales_out(sc, q.scales))
  return outs[0].reshape(shape), back(*outs[1:3], mu), back(*outs[3:5], nu)
