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


def _kernel(s_ref, seed_ref, *refs, tiling, nesterov, apply, index_map, tracked, interpret):
  seed = lambda k: seed_ref[k].astype(jnp.uint32)

  def chunk(view, local):
    out, mu_new, nu_new, out_refs = kernel_body(s_ref, tuple(view(r) for r in refs),
                                                nesterov=nesterov, apply=apply, tracked=tracked)
    index = sharding_lib.global_index(local, index_map, seed(SEED_BASE))
    store_outputs(out_refs, out, mu_new, nu_new, index, seed, tracked=tracked)

  tiling.for_each_chunk(chunk, unrolled=interpret and not LOOPS_IN_INTERPRET)


def stream_bytes_of(p, g, mu, nu, out_dtype, lo=None) -> int:
  """Bytes a kernel step reads and writes an element: the operands and the
  results (Adam with fp32 p and g and bf16 moments: 4 + 4 + 2 + 2 in, 4 + 2
  + 2 out)."""
  ins = ((p, g, mu, nu) if p is not None else (g, mu, nu)) + ((lo,) if lo is not None else ())
  return (sum(a.dtype.itemsize for a in ins)
          + jnp.dtype(out_dtype).itemsize + mu.dtype.itemsize + nu.dtype.itemsize
          + (lo.dtype.itemsize if lo is not None else 0))


def tiling_of(p, g, mu, nu, out_dtype, config, lo=None) -> elementwise_tiling.MosaicTiling | None:
  """The leaf's tiling (None: no tiling covers it, the reference runs)."""
  return elementwise_tiling.mosaic_tiling(
      g.shape, config, stream_bytes=stream_bytes_of(p, g, mu, nu, out_dtype, lo))


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
  arrays = pallas_common.in_hbm((a.reshape(tiling.view) for a in leaf), interpret)
  spec = tiling.spec()
  out_shape = tuple(jax.ShapeDtypeStruct(tiling.view, d) for d in (
      (out_dtype, mu.dtype, nu.dtype) + ((lo.dtype,) if tracked else ())))
  outs = pl.pallas_call(
      functools.partial(_kernel, tiling=tiling, nesterov=nesterov, apply=apply,
                        index_map=index_map, tracked=tracked, interpret=bool(interpret)),
      out_shape=out_shape,
      grid=tiling.grid,
      in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM),
                pl.BlockSpec(memory_space=pltpu.SMEM)] + [spec] * len(arrays),
      out_specs=(spec,) * len(out_shape),
      input_output_aliases=in_place_aliases(2, 0, apply=apply, tracked=tracked),
      compiler_params=pallas_common.mosaic_compiler_params(
          interpret, tiling.semantics, vmem_limit_bytes=elementwise_tiling.mosaic_vmem_limit(
              tiling.vmem_bytes(stream_bytes_of(p, g, mu, nu, out_dtype, lo)))),
      interpret=interpret,
      name="fuseopt_adam_update",
      cost_estimate=adam_cost(arrays, out_shape, n=g.size),
  )(scalars, jax.lax.bitcast_convert_type(seeds, jnp.int32), *arrays)
  return tuple(o.reshape(g.shape) for o in outs)


# ------------------------------------ Mosaic TPU, 8-bit and 4-bit moments --
# The leaf as (M, L): its blocked view (kernels/adam/blocks.py) with the
# leading dims merged (a 1-D leaf as (L / ROW, ROW)); where the last axis
# alone holds whole rows of ROW elements the view keeps the TPU layout (no
# relayout copies). A grid step holds a (rows, groups * ROW) block: `groups`
# row groups of ROW lanes, each cut into a format's blocks, static lane slices
# of the group (8-bit: the group, one scale; 4-bit: its two halves, two
# scales, and ROW / 2 code bytes holding both halves' nibbles). The grid is
# 2-D (row blocks, column blocks), so a step's kernel body unrolls at most
# _GROUPS row groups whatever the leaf's width: its compile time does not
# grow with the leaf. The codes go to the kernel as (M, L) or (M, L / 2), the
# scales, (M, S) in the state (S = L / block), transposed, (S, M), rows on
# lanes: libtpu lays a step's (M, S) scales arguments out with the long axis
# minor, so the transpose is a bitcast of them; taken (M, S) the kernel's
# lanes would be S wide, padded to 128, and libtpu copies every leaf's scales
# into that layout (docs/adam.md). A step's scales block, (groups * blocks a
# group, rows), is turned once into rows on sublanes (one transpose of 128
# sublanes), each block reads its column by a static lane slice, and the new
# scales go back by one transpose: the transposes cost a fraction of the
# block's elementwise work (per block and group they cost twice the block's
# elements).
_GROUPS = 8            # row groups a grid step, at most
# Interpret mode runs a kernel's chunks unrolled (static offsets; jax's TPU
# interpreter with race detection runs loops of dynamic slices slowly); the
# tests set this to run the compiled kernels' loops there too.
LOOPS_IN_INTERPRET = False
CHUNK_ROWS = 32         # rows a chunk of a group (an int8 vreg tile's 32 rows)
_SCALE_ROWS = 128      # rows a step: a multiple of the scales' 128 lanes, or all M


class BlockwiseTiling(NamedTuple):
  """A blockwise kernel's grid over an ``(M, L)`` view: ``rows`` rows and
  ``groups`` row groups of ``ROW`` lanes a step. A dim the steps do not
  divide has a padded last block (compiled kernels only): Pallas pads its
  load and clips its store, and the padding's blocks are whole blocks of
  their own (blocks never straddle a step), so no real element reads it."""
  rows: int
  groups: int
  grid: tuple[int, int]


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
_LAYOUTS = {"int8": _INT8, "int4": _INT4}


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


def _step_groups(n_groups: int, blocks_per_row: int, ragged: bool) -> int | None:
  """Row groups a step of a row of ``n_groups``: all of them where few (at
  most 2 * _GROUPS), else the most up to _GROUPS dividing them whose scales
  fill whole 8-sublane tiles; else _GROUPS with a padded last column step
  (``ragged``), or all of them (interpret mode, where the body's size costs
  nothing but tracing)."""
  if n_groups <= 2 * _GROUPS:
    return n_groups
  for g in range(_GROUPS, 0, -1):
    if n_groups % g == 0 and g * blocks_per_row % 8 == 0:
      return g
  return _GROUPS if ragged else n_groups


def quantized_tiling(view, config: MosaicTPUConfig, layout: str = "int8", *,
                     ragged: bool = True) -> BlockwiseTiling | None:
  """The grid of an ``(M, L)`` view (None: no tiling, the reference runs).
  ``ragged``: padded last blocks allowed (compiled kernels; jax's TPU
  interpreter returns an aliased output padded to whole blocks, a shape
  error)."""
  m, length = view
  fmt = _LAYOUTS[layout]
  n_groups = length // blocks.ROW
  groups = _step_groups(n_groups, fmt.blocks_per_row, ragged)
  if groups is None:
    return None
  # Rows: the config's element budget over the step's width, a multiple of the
  # scales' 128 lanes (at least 128); all M where that covers it.
  budget = max(_SCALE_ROWS, config.block_elements // (groups * blocks.ROW))
  budget -= budget % _SCALE_ROWS
  if m <= budget:
    rows = m
  else:
    rows = next((r for r in range(budget, 0, -_SCALE_ROWS) if m % r == 0), None)
    if rows is None:
      # (interpret mode, whose VMEM is host memory: all rows in one step)
      rows = budget if ragged else m
  return BlockwiseTiling(rows, groups, (pl.cdiv(m, rows), pl.cdiv(n_groups, groups)))


def quantized_leaf_reason(g, config, index_map, layout="int8", interpret=False) -> str | None:
  """Why this backend leaves a leaf with blockwise (8-bit or 4-bit) moments
  to the reference, or None."""
  if sharding_lib.needs_division(index_map):
    return "a shard's global index needs a vector integer division"
  view = quantized_view(g.shape)
  if quantized_tiling(view, config, layout, ragged=not interpret) is None:
    return f"the leaf's {view} view has no grid of whole row groups"
  return None


def int4_leaf_reason(g, config, index_map, interpret=False) -> str | None:
  return quantized_leaf_reason(g, config, index_map, "int4", interpret)


def _scale_columns(scales, n: int):
  """A step's ``(n, rows)`` scales (rows on lanes) as ``(rows, 128)``, block
  ``k``'s scales in column ``k``: the rows placed on 128 sublanes by selects,
  then one native transpose."""
  rows = scales.shape[1]
  sub = jax.lax.broadcasted_iota(jnp.int32, (128, rows), 0)
  full = jnp.zeros((128, rows), scales.dtype)
  for k in range(n):
    full = jnp.where(sub == k, jnp.broadcast_to(scales[k:k + 1, :], (128, rows)), full)
  return full.T


def _scale_rows(columns, n: int):
  """:func:`_scale_columns` back: ``(rows, 128)`` columns as ``(n, rows)``."""
  return columns.T[:n, :]


def _column(columns, lane, k):
  """Column ``k`` (traced) of ``(rows, 128)`` scale columns, as ``(rows, 1)``:
  a lane reduction over the one lane kept (exact: the others are -inf)."""
  return jnp.max(jnp.where(lane == k, columns, -jnp.inf), axis=1, keepdims=True)


def _chunk_rows(rows: int) -> int:
  """Rows of a chunk of a blockwise step: :data:`CHUNK_ROWS` where they
  divide the step's rows, else all of them (a small leaf: one chunk)."""
  return CHUNK_ROWS if rows % CHUNK_ROWS == 0 else rows


def _blockwise_kernel(s_ref, seed_ref, *refs, layout, tiling, length, nesterov, apply,
                      index_map, tracked, interpret):
  """One grid step of ``tiling.groups`` row groups of ``tiling.rows`` rows,
  a loop over the groups and, in each, over chunks of :func:`_chunk_rows`
  rows (one body, whatever their number: the kernel's compile time does not
  grow with the leaf, and a chunk's temporaries stay in registers): each
  chunk's code bytes read once (lanes at a dynamic multiple of 128) and
  unpacked into its blocks' codes, each block (a static lane slice of the
  group) dequantised, stepped and quantised with its scale reduced over its
  lanes, the new codes packed back into the chunk's bytes. The step's scales
  are read and written once, through :func:`_scale_columns`, and held in
  VMEM scratch between (``scratch``: the old mu and nu scale columns, then
  the new). ``tracked``: the companion ``lo`` is the last input and the last
  output, read and written on the parameter's lanes (the master ``join(p,
  lo)`` in, the new master split out, no rounding)."""
  *refs, mu_old, nu_old, mu_new_ref, nu_new_ref = refs
  lo_ref = lo_out = None
  if tracked:
    n_in = 7 if apply else 6
    lo_ref, lo_out = refs[n_in - 1], refs[-1]
    refs = refs[:n_in - 1] + refs[n_in:-1]
  p_ref, (g_ref, muc_ref, mus_ref, nuc_ref, nus_ref), (o_ref, muc_out, mus_out, nuc_out, nus_out) = (
      quantized.split_kernel_refs(refs, apply))
  rows, groups = tiling.rows, tiling.groups
  chunk_rows = _chunk_rows(rows)
  bpr = layout.blocks_per_row
  n_scales = groups * bpr
  block = layout.block
  shape = (chunk_rows, block)
  seed = lambda k: seed_ref[k].astype(jnp.uint32)
  skipped = s_ref[APPLY] == 0
  keep = lambda new, old: blocks.kept_on_skip(skipped, new, old)
  mu_old[...] = _scale_columns(mus_ref[...], n_scales)
  nu_old[...] = _scale_columns(nus_ref[...], n_scales)
  mu_new_ref[...] = jnp.zeros(mu_new_ref.shape, mu_new_ref.dtype)
  nu_new_ref[...] = jnp.zeros(nu_new_ref.shape, nu_new_ref.dtype)
  lane = jax.lax.broadcasted_iota(jnp.int32, (chunk_rows, 128), 1)
  fmt = layout.math
  aligned = lambda start, n: pl.ds(start if isinstance(start, int) else pl.multiple_of(start, n), n)

  def chunk(j, i):
    r = aligned(i * chunk_rows, chunk_rows)
    row = ((pl.program_id(0) * rows + i * chunk_rows).astype(jnp.uint32)
           + jax.lax.broadcasted_iota(jnp.uint32, shape, 0)) * jnp.uint32(length)
    col = ((pl.program_id(1) * (groups * blocks.ROW)).astype(jnp.uint32)
           + jax.lax.broadcasted_iota(jnp.uint32, shape, 1))
    code_lanes = aligned(j * layout.code_lanes, layout.code_lanes)
    mu_in, nu_in = layout.unpack(muc_ref[r, code_lanes]), layout.unpack(nuc_ref[r, code_lanes])
    mu_cols, nu_cols = mu_old[r, :], nu_old[r, :]
    new_mu_cols, new_nu_cols = mu_new_ref[r, :], nu_new_ref[r, :]
    mu_codes, nu_codes = [], []
    for h in range(bpr):
      k = j * bpr + h
      first = j * blocks.ROW + h * block
      lanes = aligned(first, block)
      mu32 = fmt.dequantize_mu(mu_in[h], _column(mu_cols, lane, k))
      nu32 = fmt.dequantize_nu(nu_in[h], _column(nu_cols, lane, k))
      p32 = load_param(p_ref[r, lanes], lo_ref[r, lanes] if tracked else None) if apply else None
      out, mu_new, nu_new = adam_math(lambda i: s_ref[i], p32, g_ref[r, lanes].astype(jnp.float32),
                                      mu32, nu32, nesterov=nesterov, apply=apply)
      index = sharding_lib.global_index(row + (col + jnp.asarray(first).astype(jnp.uint32)), index_map,
                                        seed(SEED_BASE))
      if tracked:
        o_ref[r, lanes], lo_out[r, lanes] = mantissa.split(out, lo_out.dtype)
      else:
        o_ref[r, lanes] = store(out, o_ref.dtype, index, seed(0))
      c, mu_scale = fmt.quantize_mu(mu_new, counter_hash.hash_bits(index, seed(1)))
      mu_codes.append(c)
      new_mu_cols = jnp.where(lane == k, mu_scale, new_mu_cols)
      c, nu_scale = fmt.quantize_nu(nu_new, counter_hash.hash_bits(index, seed(2)))
      nu_codes.append(c)
      new_nu_cols = jnp.where(lane == k, nu_scale, new_nu_cols)
    mu_new_ref[r, :], nu_new_ref[r, :] = new_mu_cols, new_nu_cols
    muc_out[r, code_lanes] = keep(layout.pack(mu_codes), muc_ref[r, code_lanes])
    nuc_out[r, code_lanes] = keep(layout.pack(nu_codes), nuc_ref[r, code_lanes])

  n_chunks = rows // chunk_rows
  if interpret and not LOOPS_IN_INTERPRET:
    # (jax's TPU interpreter with race detection runs a loop of dynamic lane
    # slices slowly enough that a sharded step's devices time out waiting for
    # each other: interpret mode unrolls the same body over static groups
    # and chunks)
    for j in range(groups):
      for i in range(n_chunks):
        chunk(j, i)
  else:
    def group(j, carry):
      def rows_chunk(i, carry):
        chunk(j, i)
        return carry
      return jax.lax.fori_loop(0, n_chunks, rows_chunk, carry)
    jax.lax.fori_loop(0, groups, group, 0)
  mus_out[...] = keep(_scale_rows(mu_new_ref[...], n_scales), mus_ref[...])
  nus_out[...] = keep(_scale_rows(nu_new_ref[...], n_scales), nus_ref[...])


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
  tiling = quantized_tiling((m, length), config, layout.name, ragged=not interpret)
  rows, groups = tiling.rows, tiling.groups
  n_scales = length // layout.block
  n_codes = length // layout.codes_per_byte
  width = groups * blocks.ROW
  tile = pl.BlockSpec((rows, width), lambda i, j: (i, j))
  code_tile = pl.BlockSpec((rows, width // layout.codes_per_byte), lambda i, j: (i, j))
  # The scales transposed: rows on lanes (above).
  vec = pl.BlockSpec((groups * layout.blocks_per_row, rows), lambda i, j: (j, i))
  view = lambda a: a.reshape(m, length)
  qview = lambda q: layout.moment(q.codes.reshape(m, n_codes), q.scales.reshape(m, n_scales).T)
  mu2, nu2 = qview(mu), qview(nu)
  arrays = (((view(p),) if apply else ()) + (view(g), mu2.codes, mu2.scales, nu2.codes,
                                             nu2.scales)
            + ((view(lo),) if tracked else ()))
  # Left free, libtpu prefetches whole small operands (codes, scales) into
  # on-chip memory ahead of the kernel, and every prefetch holds a 16 KiB
  # slot of the step's HBM temporaries (docs/adam.md).
  arrays = pallas_common.in_hbm(arrays, interpret)
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
  # VMEM: every operand's and result's block, double-buffered.
  stream = (sum(a.dtype.itemsize for a in arrays[:1 + apply]) + jnp.dtype(out_dtype).itemsize
            + 2 * 2 / layout.codes_per_byte + (2 * lo.dtype.itemsize if tracked else 0))
  block_bytes = int(2 * stream * rows * width) + 8 * 4 * 2 * 128 * max(rows, 128)
  outs = pl.pallas_call(
      functools.partial(_blockwise_kernel, layout=layout, tiling=tiling, length=length,
                        nesterov=nesterov, apply=apply, index_map=index_map, tracked=tracked,
                        interpret=bool(interpret)),
      out_shape=out_shape,
      grid=tiling.grid,
      in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM),
                pl.BlockSpec(memory_space=pltpu.SMEM)] + specs,
      out_specs=(tile, code_tile, vec, code_tile, vec) + ((tile,) if tracked else ()),
      input_output_aliases=aliases,
      # the step's old and new mu and nu scale columns (_blockwise_kernel)
      scratch_shapes=[pltpu.VMEM((rows, 128), jnp.float32)] * 4,
      compiler_params=pallas_common.mosaic_compiler_params(
          interpret, ("parallel", "parallel"),
          vmem_limit_bytes=elementwise_tiling.mosaic_vmem_limit(block_bytes)),
      interpret=interpret,
      name=f"fuseopt_adam_update_{layout.name}",
      cost_estimate=adam_cost(arrays, out_shape, n=g.size),
  )(scalars, jax.lax.bitcast_convert_type(seeds, jnp.int32), *arrays)
  back = lambda c, sc, q: layout.moment(c.reshape(q.codes.shape), sc.T.reshape(q.scales.shape))
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
