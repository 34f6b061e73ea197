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
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from fuseopt.kernels import counter_hash
from fuseopt.kernels import dispatch
from fuseopt.kernels import elementwise_tiling
from fuseopt.kernels import mantissa
from fuseopt.kernels import pallas_common
from fuseopt.kernels import sharding as sharding_lib
from fuseopt.kernels.adam import blocks
from fuseopt.kernels.adam import int4
from fuseopt.kernels.adam import quantized
from fuseopt.kernels.adam.math import (APPLY, SEED_BASE, adam_cost, adam_math, check_companion,
                                       in_place_aliases, kernel_body, load_param, store,
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


# ------------------------------------ Mosaic TPU, 8-bit and 4-bit moments --
# The leaf as (M, L): its blocked view (kernels/adam/blocks.py) with the
# leading dims merged (a 1-D leaf as (L / ROW, ROW)); where the last axis
# alone holds whole rows of ROW elements the view keeps the TPU layout (no
# relayout copies). A grid step holds whole rows, each cut into row groups of
# ROW lanes, a format's blocks static lane slices of a group (8-bit: the
# group, one scale; 4-bit: its two halves, two scales, and ROW / 2 code bytes
# holding both halves' nibbles). The codes go to the kernel as (M, L) or
# (M, L / 2), the scales, (M, S) in the state (S = L / block), transposed,
# (S, M), rows on lanes: libtpu lays a step's (M, S) scales arguments out with
# the long axis minor, so the transpose is a bitcast of them; taken (M, S) the
# kernel's lanes would be S wide (8 for a 2048-wide row of 8-bit scales),
# padded to 128, and libtpu copies every leaf's scales into that layout
# (docs/adam.md). The scales block's lanes make the rows a multiple of 128 (or
# all M). 128 rows of a row longer than _TRANSPOSED_MAX_LENGTH exceed VMEM
# (seven double-buffered streams, the 8-bit ones the widest): such a leaf (a
# vocabulary-wide head) takes its scales untransposed, whose minor axis is then
# long itself, with rows a multiple of 32 (the sublane tiling of 8-bit codes,
# both formats' code bytes).
_INT8_ROWS = 32
_TRANSPOSED_ROWS = 128
_TRANSPOSED_MAX_LENGTH = 16384


class _Layout(NamedTuple):
  """How a blockwise moment format lies in a row group of ``ROW`` lanes."""
  name: str
  # the block math (:mod:`.quantized` or :mod:`.int4`): ``dequantize_mu(codes,
  # scale)``, ``quantize_mu(x, bits) -> (codes, scale)``, the same for nu
  math: Any
  block: int            # elements a scale
  codes_per_byte: int
  # a row group's code bytes -> its blocks' codes, in lane order; and back
  unpack: Callable
  pack: Callable
  moment: type

  @property
  def blocks_per_row(self) -> int:
    return blocks.ROW // self.block

  @property
  def code_lanes(self) -> int:
    """Code bytes of a row group."""
    return blocks.ROW // self.codes_per_byte


_INT8 = _Layout("int8", quantized, quantized.BLOCK, 1, lambda c: (c,), lambda cs: cs[0],
                quantized.QuantizedMoment)
_INT4 = _Layout("int4", int4, int4.BLOCK, 2, int4.unpack, lambda cs: int4.pack(*cs),
                int4.PackedMoment)


def quantized_view(shape) -> tuple[int, int]:
  """``(M, L)``: the 2-D view of a leaf the blockwise kernels run on: its
  blocked view (:func:`.blocks.blocked_shape`, the fewest trailing axes that
  hold whole rows of ``ROW`` merged) with its leading axes merged, so every
  block lies inside one row of the view. A 1-D leaf as ``(L / ROW, ROW)``:
  rows are what a grid step divides, and ``(1, L)`` would be one row."""
  if len(shape) == 1:
    return shape[0] // blocks.ROW, blocks.ROW
  b = blocks.blocked_shape(shape)
  return math.prod(b[:-1]), b[-1]


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
  such tiling, the reference runs); the same for both blockwise formats (their
  element and code blocks are whole rows, their scales a few lanes a row)."""
  m, length = view
  budget = config.block_elements // length
  if length <= _TRANSPOSED_MAX_LENGTH:
    rows = _rows(m, max(_TRANSPOSED_ROWS, budget), _TRANSPOSED_ROWS)
    if rows is not None:
      return rows, True
  rows = _rows(m, max(_INT8_ROWS, budget), _INT8_ROWS)
  return None if rows is None else (rows, False)


def quantized_leaf_reason(g, config, index_map) -> str | None:
  """Why this backend leaves a leaf with blockwise (8-bit or 4-bit) moments
  to the reference, or None."""
  if sharding_lib.needs_division(index_map):
    return "a shard's global index needs a vector integer division"
  if quantized_tiling(quantized_view(g.shape), config) is None:
    return (f"the leaf's {quantized_view(g.shape)} view has no grid step of whole rows: "
            f"neither a multiple of {_TRANSPOSED_ROWS} rows nor all of them (scales transposed) "
            f"nor a multiple of {_INT8_ROWS} (untransposed) divides it")
  return None


# (the 4-bit kernel tiles its leaves as the 8-bit one)
int4_leaf_reason = quantized_leaf_reason


def _column(row):
  """A ``(1, rows)`` row of transposed scales as the ``(rows, 1)`` column
  that scales a block's rows: broadcast to 128 sublanes, one native transpose."""
  return jnp.broadcast_to(row, (128, row.shape[1])).T[:, :1]


def _row(column):
  """A ``(rows, 1)`` column of scales as the ``(1, rows)`` row of the
  transposed scales."""
  return jnp.broadcast_to(column, (column.shape[0], 128)).T[:1, :]


def _blockwise_kernel(s_ref, seed_ref, *refs, layout, rows, length, transposed, nesterov,
                      apply, index_map, tracked):
  """One grid step of whole rows, row group by row group: each group's code
  bytes read once and unpacked into its blocks' codes, each block (a static
  lane slice of the group) dequantised, stepped and quantised with its scale
  reduced over its lanes, the new codes packed back into the group's bytes.
  ``tracked``: the companion ``lo`` is the last input and the last output,
  read and written on the parameter's lanes (the master ``join(p, lo)`` in,
  the new master split out, no rounding)."""
  lo_ref = lo_out = None
  if tracked:
    n_in = 7 if apply else 6
    lo_ref, lo_out = refs[n_in - 1], refs[-1]
    refs = refs[:n_in - 1] + refs[n_in:-1]
  p_ref, (g_ref, muc_ref, mus_ref, nuc_ref, nus_ref), (o_ref, muc_out, mus_out, nuc_out, nus_out) = (
      quantized.split_kernel_refs(refs, apply))
  block = layout.block
  shape = (rows, block)
  seed = lambda k: seed_ref[k].astype(jnp.uint32)
  row = ((pl.program_id(0) * rows).astype(jnp.uint32)
         + jax.lax.broadcasted_iota(jnp.uint32, shape, 0)) * jnp.uint32(length)
  col = jax.lax.broadcasted_iota(jnp.uint32, shape, 1)
  # Scale column k of every row: row k of transposed scales, else column k.
  if transposed:
    read = lambda ref, k: _column(ref[k:k + 1, :])
    def write(ref, k, column):
      ref[k:k + 1, :] = _row(column)
  else:
    read = lambda ref, k: ref[:, k:k + 1]
    def write(ref, k, column):
      ref[:, k:k + 1] = column
  keep = lambda new, old: blocks.kept_on_skip(s_ref[APPLY] == 0, new, old)
  f32 = lambda r, lanes: r[:, lanes].astype(jnp.float32)
  param = lambda lanes: load_param(p_ref[:, lanes], lo_ref[:, lanes] if tracked else None)
  fmt = layout.math
  for j in range(length // blocks.ROW):
    code_lanes = slice(j * layout.code_lanes, (j + 1) * layout.code_lanes)
    mu_in, nu_in = layout.unpack(muc_ref[:, code_lanes]), layout.unpack(nuc_ref[:, code_lanes])
    mu_codes, nu_codes = [], []
    for h in range(layout.blocks_per_row):
      k = j * layout.blocks_per_row + h
      first = j * blocks.ROW + h * block
      lanes = slice(first, first + block)
      mu32 = fmt.dequantize_mu(mu_in[h], read(mus_ref, k))
      nu32 = fmt.dequantize_nu(nu_in[h], read(nus_ref, k))
      out, mu_new, nu_new = adam_math(lambda i: s_ref[i], param(lanes) if apply else None,
                                      f32(g_ref, lanes), mu32, nu32, nesterov=nesterov,
                                      apply=apply)
      index = sharding_lib.global_index(row + (col + jnp.uint32(first)), index_map,
                                        seed(SEED_BASE))
      if tracked:
        o_ref[:, lanes], lo_out[:, lanes] = mantissa.split(out, lo_out.dtype)
      else:
        o_ref[:, lanes] = store(out, o_ref.dtype, index, seed(0))
      c, mu_scale = fmt.quantize_mu(mu_new, counter_hash.hash_bits(index, seed(1)))
      mu_codes.append(c)
      write(mus_out, k, keep(mu_scale, read(mus_ref, k)))
      c, nu_scale = fmt.quantize_nu(nu_new, counter_hash.hash_bits(index, seed(2)))
      nu_codes.append(c)
      write(nus_out, k, keep(nu_scale, read(nus_ref, k)))
    muc_out[:, code_lanes] = keep(layout.pack(mu_codes), muc_ref[:, code_lanes])
    nuc_out[:, code_lanes] = keep(layout.pack(nu_codes), nuc_ref[:, code_lanes])


def _update_blockwise(layout, scalars, seeds, p, g, mu, nu, *, nesterov, out_dtype, config,
                      interpret, index_map, lo=None):
  """One leaf with ``layout``'s moments, in its own shape; returns ``(out, mu,
  nu)`` in place, in the shapes they came in, and ``(out, mu, nu, lo)`` with
  a companion ``lo`` (p's view and tile, the last input and output)."""
  from jax.experimental.pallas import tpu as pltpu
  shape = g.shape
  apply = p is not None
  tracked = lo is not None
  if tracked:
    check_companion(p, lo, name="lo")
  m, length = quantized_view(shape)
  rows, transposed = quantized_tiling((m, length), config)
  n_scales = length // layout.block
  n_codes = length // layout.codes_per_byte
  tile = pl.BlockSpec((rows, length), lambda i: (i, 0))
  code_tile = pl.BlockSpec((rows, n_codes), lambda i: (i, 0))
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
  qview = lambda q: layout.moment(q.codes.reshape(m, n_codes), scales_in(q.scales))
  mu2, nu2 = qview(mu), qview(nu)
  arrays = (((view(p),) if apply else ()) + (view(g), mu2.codes, mu2.scales, nu2.codes,
                                             nu2.scales)
            + ((view(lo),) if tracked else ()))
  if not interpret:
    # The operands stay in HBM, where the kernel's pipeline reads them: left
    # free, libtpu prefetches whole small operands (codes, scales) into
    # on-chip memory ahead of the kernel, and every prefetch holds a 16 KiB
    # slot of the step's HBM temporaries (docs/adam.md).
    arrays = tuple(pltpu.with_memory_space_constraint(a, pltpu.HBM) for a in arrays)
  specs = ([tile] if apply else []) + [tile, code_tile, vec, code_tile, vec] + (
      [tile] if tracked else [])
  out_shape = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (
      jax.ShapeDtypeStruct((m, length), out_dtype), mu2.codes, mu2.scales, nu2.codes,
      nu2.scales) + ((arrays[-1],) if tracked else ()))
  first = 2 + apply
  aliases = {first + 1 + j: 1 + j for j in range(4)}
  if apply:
    aliases[2] = 0
  if tracked:
    aliases[first + 5] = 5
  # Whole rows a step: a long last axis (a vocabulary) needs more than the
  # default scoped VMEM (16 MiB on v5e) for 32 rows of 7 double-buffered streams.
  # A companion adds a stream read and written beside p's, double-buffered;
  # a bf16 p with its companion is no wider than an fp32 p, so the rows a
  # step (quantized_tiling) stay those of an fp32 leaf.
  vmem = 2 * sum(rows * length * a.dtype.itemsize for a in arrays[:2 + apply]) * 3
  if tracked:
    vmem += 2 * 2 * rows * length * lo.dtype.itemsize
  outs = pl.pallas_call(
      functools.partial(_blockwise_kernel, layout=layout, rows=rows, length=length,
                        transposed=transposed, nesterov=nesterov, apply=apply,
                        index_map=index_map, tracked=tracked),
      out_shape=out_shape,
      grid=(m // rows,),
      in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM),
                pl.BlockSpec(memory_space=pltpu.SMEM)] + specs,
      out_specs=(tile, code_tile, vec, code_tile, vec) + ((tile,) if tracked else ()),
      input_output_aliases=aliases,
      compiler_params=pallas_common.mosaic_compiler_params(
          interpret, ("parallel",), vmem_limit_bytes=max(32 << 20, min(vmem, 100 << 20))),
      interpret=interpret,
      name=f"fuseopt_adam_update_{layout.name}",
      cost_estimate=adam_cost(arrays, out_shape, n=g.size),
  )(scalars, jax.lax.bitcast_convert_type(seeds, jnp.int32), *arrays)
  back = lambda c, sc, q: layout.moment(c.reshape(q.codes.shape), scales_out(sc, q.scales))
  res = outs[0].reshape(shape), back(*outs[1:3], mu), back(*outs[3:5], nu)
  return (res + (outs[5].reshape(shape),)) if tracked else res


def update_quantized(scalars, seeds, p, g, mu, nu, *, nesterov, out_dtype, config, interpret,
                     index_map=None, lo=None):
  """One leaf with 8-bit moments in its own shape (viewed by
  :func:`quantized_view`); returns ``(out, mu, nu)`` in place, the moments
  :class:`~.quantized.QuantizedMoment`. ``lo``: a bf16 ``p``'s int16 or int8
  companion in ``p``'s shape; the step reads the master ``join(p, lo)`` and
  writes it split into ``p`` and ``lo`` (in place, no rounding), and returns
  ``(out, mu, nu, lo)``: the reference's
  (:func:`.reference.update_quantized`)."""
  return _update_blockwise(_INT8, scalars, seeds, p, g, mu, nu, nesterov=nesterov,
                           out_dtype=out_dtype, config=config, interpret=interpret,
                           index_map=index_map, lo=lo)


def update_int4(scalars, seeds, p, g, mu, nu, *, nesterov, out_dtype, config, interpret,
                index_map=None, lo=None):
  """One leaf with 4-bit moments in its own shape (viewed by
  :func:`quantized_view`, the codes as ``(M, L / 2)``, the scales ``(M, L /
  128)``); returns ``(out, mu, nu)`` in place, the moments
  :class:`~.int4.PackedMoment`: the codes and scales of
  :func:`fuseopt.kernels.adam.reference.update_int4`. ``lo``: a companion,
  as in :func:`update_quantized` (returns ``(out, mu, nu, lo)``)."""
  return _update_blockwise(_INT4, scalars, seeds, p, g, mu, nu, nesterov=nesterov,
                           out_dtype=out_dtype, config=config, interpret=interpret,
                           index_map=index_map, lo=lo)
