"""Fused Adam/AdamW update on blockwise moments: the Triton kernels (GPU) for
8-bit (:mod:`.quantized`) and 4-bit (:mod:`.int4`) moments, per leaf and
grouped (:mod:`.triton` re-exports the entry points: one backend)."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from fuseopt.kernels import counter_hash
from fuseopt.kernels import elementwise_tiling
from fuseopt.kernels import mantissa
from fuseopt.kernels import sharding as sharding_lib
from fuseopt.kernels.adam import blocks
from fuseopt.kernels.adam import int4
from fuseopt.kernels.adam import quantized
from fuseopt.kernels.adam.math import (APPLY, N_SCALARS, N_SEEDS, SEED_BASE, adam_cost,
                                       adam_math, check_companion, load_param, store)
from fuseopt.kernels.adam.triton_grid import (bisect, clamped, group_leaf, leaf_rows,
                                              program_starts)

# The per-leaf 4-bit launch (:func:`update_int4`) spills at 32 elements a
# thread (block 4096, 4 warps), as the grouped 8-bit launch does: its space is the
# per-leaf space's configs of at most 16 elements a thread.
INT4_SEARCH_SPACE = tuple(c for c in elementwise_tiling.TRITON_SEARCH_SPACE if c.block // (c.num_warps * 32) <= 16)


# ---------------------------------------------------- triton, blockwise moments --
# 8-bit (:mod:`.quantized`) and 4-bit (:mod:`.int4`) moments run the same
# kernels: programs of whole rows of ``blocks.ROW`` elements, per leaf or
# grouped. What differs between the formats is a :class:`_Blockwise`: how a
# row's elements, codes and scales tile into Triton blocks, and the fp32 step
# of the loaded rows.
@dataclasses.dataclass(frozen=True)
class _Blockwise:
  """A blockwise format as the Triton kernels tile it: a row's ``p`` and ``g``
  elements laid out as ``row`` (row-major: element ``e`` of the leaf's row at
  the position whose flat offset is ``e``), its codes as ``codes`` and its
  scales as ``scales`` (``()``: one a row); ``step`` the fp32 step of loaded
  rows (:func:`_quantized_step`); ``moment`` the moment's type; ``name`` the
  launch's."""
  name: str
  row: tuple[int, ...]
  codes: tuple[int, ...]
  scales: tuple[int, ...]
  step: Callable
  moment: type

  def tile(self, rows: int, per_row, at):
    """The spec of ``rows`` rows a program of an array laid out ``per_row``
    a row, program ``i`` at row block ``at(i)``."""
    return pl.BlockSpec((rows,) + per_row, lambda i: (at(i),) + (0,) * len(per_row))

  def specs(self, rows: int, apply: bool, at=lambda i: i, tracked: bool = False):
    """The inputs' specs, ``(p,) g, mu codes, mu scales, nu codes, nu
    scales, (lo)``; the outputs' are those after ``g`` (``out`` first, tiled
    as ``g``)."""
    tile, codes, scales = (self.tile(rows, s, at) for s in (self.row, self.codes, self.scales))
    return [tile] * apply + [tile, codes, scales, codes, scales] + [tile] * tracked

  def operands(self, p, g, mu, nu, lo=None):
    """A leaf's arrays in the kernel's layout (``p`` None: not read; ``lo``,
    a companion of ``p``, last); a reshape of the ``(R, ROW)`` rows, so the
    outputs still alias the operands."""
    rows = lambda a: a.reshape((a.shape[0],) + self.row)
    return ((() if p is None else (rows(p),))
            + (rows(g), mu.codes, mu.scales, nu.codes, nu.scales)
            + (() if lo is None else (rows(lo),)))

  def results(self, outs, g):
    """The kernel's outputs as ``(out, mu, nu)``, and ``(out, mu, nu, lo)``
    where there is a sixth (the companion); ``out`` and ``lo`` as ``g``'s rows."""
    res = (outs[0].reshape(g.shape), self.moment(*outs[1:3]), self.moment(*outs[3:5]))
    return res + tuple(o.reshape(g.shape) for o in outs[5:])


def _block_index(row, index_map, base, layout=(quantized.BLOCK,)):
  """The flat index in the whole leaf of each element of the rows ``row``,
  each row's elements laid out as ``layout`` (a row-major tile of the row)."""
  stride = math.prod(layout)
  local = row[(slice(None),) + (None,) * len(layout)] * jnp.uint32(stride)
  for axis, extent in enumerate(layout):
    stride //= extent
    at = jax.lax.broadcasted_iota(jnp.uint32, (1,) + tuple(layout), axis + 1)
    local = local + (at if stride == 1 else at * jnp.uint32(stride))
  return sharding_lib.global_index(local, index_map, base)


def _quantized_step(scalar, seed, loaded, index, *, nesterov, apply):
  """The fp32 step of whole 8-bit quantisation blocks: ``loaded`` the
  ``(p or None, g, mu codes, mu scales, nu codes, nu scales)`` of the rows,
  ``index`` their elements' flat indices, ``scalar(k)`` / ``seed(k)`` the
  step's scalars and seeds. Returns ``(out, mu codes, mu scales, nu codes,
  nu scales)``, ``out`` in fp32 (the caller rounds it into its ref's dtype);
  each block's new absmax is a row reduction in registers."""
  p, g, muc, mus, nuc, nus = loaded
  f32 = lambda x: x.astype(jnp.float32)
  mu32 = quantized.dequantize_mu(muc, mus[:, None])
  nu32 = quantized.dequantize_nu(nuc, nus[:, None])
  out, mu_new, nu_new = adam_math(scalar, f32(p) if apply else None, f32(g), mu32, nu32,
                                  nesterov=nesterov, apply=apply)
  mu_codes, mu_scale = quantized.quantize_mu(mu_new, counter_hash.hash_bits(index, seed(1)))
  nu_codes, nu_scale = quantized.quantize_nu(nu_new, counter_hash.hash_bits(index, seed(2)))
  keep = lambda new, old: blocks.kept_on_skip(scalar(APPLY) == 0, new, old)
  return (out, keep(mu_codes, muc), keep(mu_scale[:, 0], mus), keep(nu_codes, nuc),
          keep(nu_scale[:, 0], nus))


def _nibble_shift():
  """``(1, 2, 1)`` int32: where a row half's nibble sits in its byte (0: the
  low nibble, the first half; 4: the high one)."""
  return 4 * jax.lax.broadcasted_iota(jnp.int32, (1, 2, 1), 1)


def _unpack_halves(codes):
  """``(rows, BLOCK)`` packed bytes → their ``(rows, 2, BLOCK)`` int32
  nibbles, a row's halves on axis 1: Triton values cannot be sliced, so the
  byte is broadcast over both halves and each shifted by its own amount."""
  return (codes.astype(jnp.int32)[:, None, :] >> _nibble_shift()) & 15


def _pack_halves(nibbles):
  """``(rows, 2, BLOCK)`` int32 nibbles (0..15) → ``(rows, BLOCK)`` bytes:
  each half shifted into its nibble, the two summed over axis 1 (disjoint
  bits: the sum is :func:`.int4.pack`'s or)."""
  return jnp.sum(nibbles << _nibble_shift(), axis=1).astype(int4.CODE_DTYPE)


def _int4_step(scalar, seed, loaded, index, *, nesterov, apply):
  """The fp32 step of whole 4-bit rows, as :func:`_quantized_step`: ``p``,
  ``g`` and ``index`` ``(rows, 2, BLOCK)`` (a row's two blocks on axis 1),
  codes ``(rows, BLOCK)`` bytes, scales ``(rows, 2)``. Each half's absmax is
  a reduction over the last axis; the arithmetic is :mod:`.int4`'s, the
  reference's on the same values."""
  p, g, muc, mus, nuc, nus = loaded
  f32 = lambda x: x.astype(jnp.float32)
  mu32 = int4.dequantize_mu(_unpack_halves(muc), mus[:, :, None])
  nu32 = int4.dequantize_nu(_unpack_halves(nuc), nus[:, :, None])
  out, mu_new, nu_new = adam_math(scalar, f32(p) if apply else None, f32(g), mu32, nu32,
                                  nesterov=nesterov, apply=apply)
  mu_codes, mu_scale = int4.quantize_mu(mu_new, counter_hash.hash_bits(index, seed(1)))
  nu_codes, nu_scale = int4.quantize_nu(nu_new, counter_hash.hash_bits(index, seed(2)))
  keep = lambda new, old: blocks.kept_on_skip(scalar(APPLY) == 0, new, old)
  return (out, keep(_pack_halves(mu_codes), muc), keep(mu_scale[:, :, 0], mus),
          keep(_pack_halves(nu_codes), nuc), keep(nu_scale[:, :, 0], nus))


_INT8 = _Blockwise("int8", (quantized.BLOCK,), (quantized.BLOCK,), (), _quantized_step,
                   quantized.QuantizedMoment)
_INT4 = _Blockwise("int4", (2, int4.BLOCK), (int4.BLOCK,), (2,), _int4_step, int4.PackedMoment)


def _rows_a_program(config) -> int:
  """Rows of ``blocks.ROW`` elements a program: ``config.block`` elements,
  at least one row."""
  return max(1, config.block // blocks.ROW)


def _blockwise_aliases(apply: bool, first_in: int, first_out: int,
                       tracked: bool = False) -> dict[int, int]:
  """One leaf's in-place outputs: the parameter (when read), the four
  moment arrays and the companion (``tracked``: the last input and output);
  its inputs from operand ``first_in``, its outputs from ``first_out``."""
  n_in = (6 if apply else 5) + tracked
  moments = first_in + n_in - 4 - tracked
  aliases = {moments + j: first_out + 1 + j for j in range(4)}
  if apply:
    aliases[first_in] = first_out
  if tracked:
    aliases[first_in + n_in - 1] = first_out + 5
  return aliases


def _blockwise_kernel(s_ref, seed_ref, *refs, fmt, rows, n_rows, masked, nesterov, apply,
                      index_map, tracked):
  """``rows`` whole rows a program, tiled as ``fmt`` says. ``tracked``: the
  refs end with a companion ``lo`` among the inputs and among the outputs;
  the step reads the master ``join(p, lo)`` and writes it split (no
  rounding), as the reference does."""
  first = (pl.program_id(0) * rows).astype(jnp.uint32)
  row = first + jax.lax.iota(jnp.uint32, rows)
  # The last program's rows past the leaf's end: masked loads and stores.
  refs = elementwise_tiling.triton_bound(refs, row < n_rows, masked)
  n_in = (6 if apply else 5) + tracked
  lo_ref, lo_out = (refs[n_in - 1], refs[-1]) if tracked else (None, None)
  ins, outs = refs[:n_in - tracked], refs[n_in:len(refs) - tracked]
  p_ref, ins, outs = quantized.split_kernel_refs(ins + outs, apply)
  # (an fp32 p: the step's widening of it is the identity)
  p32 = load_param(p_ref[...], lo_ref[...] if tracked else None) if apply else None
  loaded = (p32,) + tuple(r[...] for r in ins)
  index = _block_index(row, index_map, seed_ref[SEED_BASE], fmt.row)
  out, *moments = fmt.step(lambda k: s_ref[k], lambda k: seed_ref[k], loaded, index,
                           nesterov=nesterov, apply=apply)
  if tracked:
    outs[0][...], lo_out[...] = mantissa.split(out, lo_out.dtype)
  else:
    outs[0][...] = store(out, outs[0].dtype, index, seed_ref[0])
  for r, v in zip(outs[1:], moments):
    r[...] = v


def _update_blockwise(fmt, scalars, seeds, p, g, mu, nu, *, nesterov, out_dtype, config,
                      interpret, index_map, lo=None):
  from jax.experimental.pallas import triton as plgpu
  n_rows = g.shape[0]
  rows = _rows_a_program(config)
  apply = p is not None
  tracked = lo is not None
  if tracked:
    check_companion(p, lo, name="lo")
  arrays = fmt.operands(p, g, mu, nu, lo)
  specs = fmt.specs(rows, apply, tracked=tracked)
  moments = arrays[1 + apply:5 + apply]
  out_shape = ((jax.ShapeDtypeStruct(arrays[apply].shape, out_dtype),)
               + tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in moments)
               + ((jax.ShapeDtypeStruct(arrays[-1].shape, lo.dtype),) if tracked else ()))
  outs = pl.pallas_call(
      functools.partial(_blockwise_kernel, fmt=fmt, rows=rows, n_rows=n_rows,
                        nesterov=nesterov, apply=apply, index_map=index_map, tracked=tracked,
                        masked=elementwise_tiling.triton_masks(n_rows, rows, interpret)),
      out_shape=out_shape,
      grid=(pl.cdiv(n_rows, rows),),
      in_specs=[pl.BlockSpec((N_SCALARS,), lambda i: (0,)),
                pl.BlockSpec((N_SEEDS,), lambda i: (0,))] + specs,
      out_specs=tuple(specs[apply:]),
      input_output_aliases=_blockwise_aliases(apply, 2, 0, tracked),
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1),
      interpret=interpret,
      name=f"fuseopt_adam_update_{fmt.name}",
      cost_estimate=adam_cost(arrays, out_shape, n=g.size),
  )(scalars, seeds, *arrays)
  return fmt.results(outs, g)


def update_quantized(scalars, seeds, p, g, mu, nu, *, nesterov, out_dtype, config, interpret,
                     index_map=None, lo=None):
  """One leaf with 8-bit moments as ``(R, BLOCK)`` rows (``p``, ``g``, the
  codes) and ``(R,)`` scales; returns ``(out, mu, nu)``, the moments
  :class:`QuantizedMoment`, all in place. ``config.block`` elements a
  program (at least one quantisation block). ``lo``: a bf16 ``p``'s int16 or
  int8 companion in ``p``'s rows; the step reads the master ``join(p, lo)``
  and writes it split into ``p`` and ``lo`` (in place, no rounding), and
  returns ``(out, mu, nu, lo)``: the reference's
  (:func:`.reference.update_quantized`)."""
  return _update_blockwise(_INT8, scalars, seeds, p, g, mu, nu, nesterov=nesterov,
                           out_dtype=out_dtype, config=config, interpret=interpret,
                           index_map=index_map, lo=lo)


def update_int4(scalars, seeds, p, g, mu, nu, *, nesterov, out_dtype, config, interpret,
                index_map=None, lo=None):
  """One leaf with 4-bit moments: ``p``, ``g`` ``(R, ROW)`` rows (``p`` None:
  the direction), ``mu``, ``nu`` :class:`~.int4.PackedMoment` with ``(R,
  BLOCK)`` codes and ``(R, 2)`` scales; returns ``(out, mu, nu)`` in that
  layout, all in place: the reference's codes and scales
  (:func:`.reference.update_int4`). ``config.block`` elements a program (at
  least one row). A row's two blocks are an axis of the kernel's tiles
  (``(rows, 2, BLOCK)``, a reshape of the rows). At 32 elements a thread
  (block 4096, 4 warps) ptxas spills, where the 8-bit kernel does not
  (:data:`INT4_SEARCH_SPACE` leaves that config out). ``lo``: a companion,
  as in :func:`update_quantized` (``(R, ROW)`` rows; returns ``(out, mu,
  nu, lo)``)."""
  return _update_blockwise(_INT4, scalars, seeds, p, g, mu, nu, nesterov=nesterov,
                           out_dtype=out_dtype, config=config, interpret=interpret,
                           index_map=index_map, lo=lo)


def _blockwise_group_kernel(s_ref, seed_ref, *refs, fmt, rows, starts, n_rows, masked,
                            nesterov, apply, index_maps):
  """:func:`_blockwise_kernel` over a launch's leaves: program ``i`` works on
  leaf ``k``'s rows (``starts`` as in :func:`_group_kernel`). Only the loads,
  the flat index and the stores are per leaf; the rows' math and their
  roundings are emitted once."""
  n_leaves = len(starts) - 1
  n_in, n_out = 6 if apply else 5, 5
  ins, outs = refs[:n_in * n_leaves], refs[n_in * n_leaves:]
  i = pl.program_id(0)
  k, first = group_leaf(i, starts)
  row = ((i - first) * rows).astype(jnp.uint32) + jax.lax.iota(jnp.uint32, rows)
  bound = lambda j, leaf_refs: elementwise_tiling.triton_bound(leaf_refs, row < n_rows[j],
                                                               masked[j])

  def load(j):
    index = _block_index(row, index_maps[j], seed_ref[j * N_SEEDS + SEED_BASE], fmt.row)
    return tuple(r[...] for r in bound(j, ins[n_in * j:n_in * (j + 1)])) + (index,)

  *loaded, index = bisect(k, 0, n_leaves, load)
  loaded = tuple(loaded) if apply else (None,) + tuple(loaded)
  seed = lambda j: seed_ref[k * N_SEEDS + j]
  out, *moments = fmt.step(lambda j: s_ref[k * N_SCALARS + j], seed, loaded, index,
                           nesterov=nesterov, apply=apply)
  # (every leaf of a launch has the same dtypes: converted once)
  new = (store(out, outs[0].dtype, index, seed(0)),) + tuple(moments)
  for j in range(n_leaves):
    # The other leaves' (clamped) blocks are neither loaded nor stored.
    @pl.when(k == j)
    def _(j=j):
      for r, v in zip(bound(j, outs[n_out * j:n_out * (j + 1)]), new):
        r[...] = v


def _update_blockwise_group(fmt, scalars, seeds, ps, gs, mus, nus, *, nesterov, config,
                            interpret, index_maps):
  from jax.experimental.pallas import triton as plgpu
  rows = _rows_a_program(config)
  apply = ps is not None
  n_leaves = len(gs)
  n_rows = [g.shape[0] for g in gs]
  starts = program_starts(n_rows, rows)
  index_maps = tuple(index_maps or (None,) * n_leaves)
  scalars, seeds, row_specs = leaf_rows(scalars, seeds)
  arrays, in_specs, out_shape, out_specs, aliases = [], [], [], [], {}
  n_in = 6 if apply else 5
  for k in range(n_leaves):
    leaf = fmt.operands(ps[k] if apply else None, gs[k], mus[k], nus[k])
    specs = fmt.specs(rows, apply, clamped(starts, k))
    arrays += leaf
    in_specs += specs
    out_dtype = (ps[k] if apply else gs[k]).dtype
    out_shape += [jax.ShapeDtypeStruct(leaf[apply].shape, out_dtype)] + [
        jax.ShapeDtypeStruct(a.shape, a.dtype) for a in leaf[-4:]]
    out_specs += specs[apply:]
    aliases.update(_blockwise_aliases(apply, 2 + n_in * k, 5 * k))
  outs = pl.pallas_call(
      functools.partial(_blockwise_group_kernel, fmt=fmt, rows=rows, starts=tuple(starts),
                        n_rows=tuple(n_rows),
                        masked=tuple(elementwise_tiling.triton_masks(n, rows, interpret)
                                     for n in n_rows),
                        nesterov=nesterov, apply=apply, index_maps=index_maps),
      out_shape=tuple(out_shape),
      grid=(starts[-1],),
      in_specs=row_specs + in_specs,
      out_specs=tuple(out_specs),
      input_output_aliases=aliases,
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1),
      interpret=interpret,
      name=f"fuseopt_adam_update_{fmt.name}_group",
      cost_estimate=adam_cost(arrays, out_shape, n=sum(g.size for g in gs)),
  )(scalars, seeds, *arrays)
  return [fmt.results(outs[5 * k:5 * k + 5], gs[k]) for k in range(n_leaves)]


def update_quantized_group(scalars, seeds, ps, gs, mus, nus, *, nesterov, config, interpret,
                           index_maps=None):
  """One launch over leaves with 8-bit moments of one dtype signature, each as
  in :func:`update_quantized` (``(R, BLOCK)`` rows, ``(R,)`` scales);
  ``scalars`` ``(K, N_SCALARS)``, ``seeds`` ``(K, N_SEEDS)``, one row a leaf.
  Returns ``[(out, mu, nu)]``, all in place: the bits of the per-leaf kernel
  (each leaf its own seeds and flat index)."""
  return _update_blockwise_group(_INT8, scalars, seeds, ps, gs, mus, nus, nesterov=nesterov,
                                 config=config, interpret=interpret, index_maps=index_maps)


def update_int4_group(scalars, seeds, ps, gs, mus, nus, *, nesterov, config, interpret,
                      index_maps=None):
  """One launch over leaves with 4-bit moments of one dtype signature, each as
  in :func:`update_int4`; ``scalars``, ``seeds`` and the result as in
  :func:`update_quantized_group`: the bits of the per-leaf kernel."""
  return _update_blockwise_group(_INT4, scalars, seeds, ps, gs, mus, nus, nesterov=nesterov,
                                 config=config, interpret=interpret, index_maps=index_maps)


_GROUP_STATIC = ("nesterov", "config", "interpret", "index_maps")
update_quantized_group_jit = jax.jit(update_quantized_group, static_argnames=_GROUP_STATIC)
update_int4_group_jit = jax.jit(update_int4_group, static_argnames=_GROUP_STATIC)
