"""Fused Adam/AdamW update: the Triton backend (GPU), per leaf and grouped.

Per leaf (:func:`update_flat`): a 1-D grid over the flattened leaf, ``block``
elements a program (power of two), the ragged last block's loads and
stores masked (:class:`~fuseopt.kernels.elementwise_tiling.TritonBounded`). Grouped
(:func:`update_group`, what :func:`fuseopt.kernels.adam_update_tree` runs):
the leaves of one dtype signature in one launch (at most
``TritonGroupConfig.max_leaves_per_launch``), each leaf its own operand and
in-place output, a 1-D grid over the sum of their block counts, program
``i`` updating leaf ``k``'s block ``i - starts[k]`` with that leaf's own
flat index, so the bits are the per-leaf kernel's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from fuseopt.kernels import counter_hash
from fuseopt.kernels import dispatch
from fuseopt.kernels import elementwise_tiling
from fuseopt.kernels import mantissa
from fuseopt.kernels import sharding as sharding_lib
from fuseopt.kernels.adam import blocks
from fuseopt.kernels.adam import int4
from fuseopt.kernels.adam import quantized
from fuseopt.kernels.adam.math import (APPLY, N_SCALARS, N_SCALARS_USED, N_SEEDS, SEED_BASE,
                                       adam_cost, adam_math, in_place_aliases, kernel_body,
                                       load_param, store, store_outputs)
from fuseopt.kernels.elementwise_tiling import TritonConfig

Config = TritonConfig
SEARCH_SPACE = elementwise_tiling.TRITON_SEARCH_SPACE


def heuristic(size: int, itemsizes=(4,)) -> TritonConfig:
  """The per-leaf launch's config for a leaf of ``size`` elements whose
  operands and outputs are ``itemsizes`` bytes wide: the elementwise
  heuristic (block 1024, 8 warps: 4 elements a thread, 128-bit accesses to
  fp32), or, where every operand is 2 bytes wide (bf16 params, grads and
  moments), 8 elements a thread (block 2048, 8 warps), which gives each of
  them 128-bit loads and stores where 4 would give 64-bit ones, with no spill
  and no shared memory (the compiled PTX, docs/compile_tier.md, "PTX: access
  widths"). A mix of widths keeps 4 elements a thread: at 8 the fp32 outputs
  are stored through shared memory."""
  config = elementwise_tiling.triton_heuristic(size)
  if max(itemsizes, default=4) <= 2 and size >= 2 * config.block and config.num_warps == 8:
    return TritonConfig(block=2 * config.block, num_warps=config.num_warps)
  return config


# Every float32/bfloat16 leaf (the public functions check the dtypes).
supports = dispatch.supports_every_call


def _kernel(s_ref, seed_ref, *refs, block, n, masked, nesterov, apply, index_map, tracked):
  local = elementwise_tiling.triton_flat_index(block)
  refs = elementwise_tiling.triton_bound(refs, local < n, masked)
  out, mu_new, nu_new, out_refs = kernel_body(s_ref, refs, nesterov=nesterov, apply=apply,
                                              tracked=tracked)
  index = sharding_lib.global_index(local, index_map, seed_ref[SEED_BASE])
  store_outputs(out_refs, out, mu_new, nu_new, index, lambda k: seed_ref[k], tracked=tracked)


def update_flat(scalars, seeds, p, g, mu, nu, *, nesterov, out_dtype, config, interpret,
                index_map=None, lo=None):
  """One flat leaf (``p`` None: the direction); returns ``(out, mu, nu)``, and
  ``(out, mu, nu, lo)`` with a companion ``lo`` (the master written split)."""
  from jax.experimental.pallas import triton as plgpu
  (n,) = g.shape
  block = config.block
  apply = p is not None
  tracked = lo is not None
  spec = pl.BlockSpec((block,), lambda i: (i,))
  arrays = ((p, g, mu, nu) if apply else (g, mu, nu)) + ((lo,) if tracked else ())
  out_shape = (jax.ShapeDtypeStruct((n,), out_dtype), jax.ShapeDtypeStruct((n,), mu.dtype),
               jax.ShapeDtypeStruct((n,), nu.dtype)) + (
                   (jax.ShapeDtypeStruct((n,), lo.dtype),) if tracked else ())
  return pl.pallas_call(
      functools.partial(_kernel, block=block, n=n, nesterov=nesterov, apply=apply,
                        index_map=index_map, tracked=tracked,
                        masked=elementwise_tiling.triton_masks(n, block, interpret)),
      out_shape=out_shape,
      grid=(pl.cdiv(n, block),),
      in_specs=[pl.BlockSpec((N_SCALARS,), lambda i: (0,)),
                pl.BlockSpec((N_SEEDS,), lambda i: (0,))] + [spec] * len(arrays),
      out_specs=(spec,) * len(out_shape),
      input_output_aliases=in_place_aliases(2, 0, apply=apply, tracked=tracked),
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1),
      interpret=interpret,
      name="fuseopt_adam_update",
      cost_estimate=adam_cost(arrays, out_shape, n=n),
  )(scalars, seeds, *arrays)


# ---------------------------------------------------------- triton, grouped --
# One launch over a list of leaves (per-leaf launches repeat each kernel's
# ramp-up and drain; docs/measurements.md has what they cost on the 1.2 B tree). The leaves stay where they are: each is its own operand and
# in-place output, the 1-D grid runs over the sum of their block counts, and
# program ``i`` works on leaf ``k`` where ``starts[k] <= i < starts[k + 1]``.
@dataclasses.dataclass(frozen=True)
class TritonGroupConfig:
  """Tiling of a grouped launch: ``block`` elements a program, ``num_warps``,
  and at most ``max_leaves_per_launch`` leaves a launch (the kernel body holds
  one unrolled branch per leaf, so this bounds the kernel's code size)."""
  block: int = 1024
  num_warps: int = 8
  max_leaves_per_launch: int = 16

  def __post_init__(self):
    TritonConfig(self.block, self.num_warps)  # same checks
    if not 1 <= self.max_leaves_per_launch <= 64:
      raise ValueError(f"max_leaves_per_launch must be in [1, 64], got "
                       f"{self.max_leaves_per_launch}")


# Measured on the H200 inside CUDA graphs (bench/results/nvidia-h200/device_run.json).
GROUP_SEARCH_SPACE = tuple(TritonGroupConfig(b, w, k) for b in (512, 1024, 2048, 4096)
                           for w in (4, 8) for k in (8, 16))


# The grouped launch over 8-bit leaves holds a block's codes, scales and
# fp32 moments and the loaded leaf's values across the branch that picks the
# leaf: at 32 elements a thread (block 4096, 4 warps) ptxas spills 120-200
# bytes a thread on the H200 and L4 (the compile tier), so its space stops at 16.
# The grouped launch over 4-bit leaves holds more (a row's two halves' bytes,
# nibbles and scales) and uses the same space: the compile tier's
# llama-1-layer-int4 cases compile without spills at every config of it.
QUANTIZED_GROUP_SEARCH_SPACE = tuple(c for c in GROUP_SEARCH_SPACE
                                     if c.block // (c.num_warps * 32) <= 16)
# The per-leaf 4-bit launch (:func:`update_int4`) spills at 32 elements a
# thread (block 4096, 4 warps), as the grouped 8-bit launch does: its space is the
# per-leaf space's configs of at most 16 elements a thread.
INT4_SEARCH_SPACE = tuple(c for c in SEARCH_SPACE if c.block // (c.num_warps * 32) <= 16)


def leaf_config(group: TritonGroupConfig) -> TritonConfig:
  """A grouped launch's tiling for a leaf that runs one launch of its own."""
  return TritonConfig(group.block, group.num_warps)


def group_heuristic(sizes) -> TritonGroupConfig:
  # Block 1024 / 8 warps: the per-leaf kernel's measured best on the H200;
  # a group of tiny leaves gets one small block, as triton_heuristic does.
  c = elementwise_tiling.triton_heuristic(max(sizes, default=1))
  return TritonGroupConfig(block=c.block, num_warps=c.num_warps, max_leaves_per_launch=16)


def _group_leaf(i, starts):
  """``(k, first)``: the leaf of program ``i`` and its first program, from
  ``starts`` (static): integer arithmetic, no table in memory. (Pallas's
  Triton lowering cannot add a converted comparison to an integer: ``past``
  is 1 where ``i >= starts[j]`` by a clamp instead.)"""
  k = jnp.int32(0)
  first = jnp.int32(0)
  for j in range(1, len(starts) - 1):
    past = jnp.clip(i - (starts[j] - 1), 0, 1)
    k = k + past
    first = first + past * (starts[j] - starts[j - 1])
  return k, first


def _bisect(k, lo: int, hi: int, branch):
  """``branch(j)`` for the static ``j == k`` in ``[lo, hi)``, as a balanced
  tree of two-way conds (Pallas's Triton lowering nests an n-way switch n
  deep)."""
  if hi - lo == 1:
    return branch(lo)
  mid = (lo + hi) // 2
  return jax.lax.cond(k < mid, lambda: _bisect(k, lo, mid, branch),
                      lambda: _bisect(k, mid, hi, branch))


class _Held:
  """A stand-in for an output ref: keeps what is stored into it."""

  def __init__(self, dtype):
    self.dtype = dtype
    self.value = None

  def __setitem__(self, key, value):
    self.value = value


def _group_kernel(s_ref, seed_ref, *refs, block, starts, sizes, masked, nesterov, apply,
                  index_maps, tracked):
  n_leaves = len(starts) - 1
  n_in = (4 if apply else 3) + tracked
  n_out = 3 + tracked
  ins, outs = refs[:n_in * n_leaves], refs[n_in * n_leaves:]
  i = pl.program_id(0)
  k, first = _group_leaf(i, starts)
  local = ((i - first) * block).astype(jnp.uint32) + jax.lax.iota(jnp.uint32, block)

  # Only what differs between the leaves is per leaf: which refs are read and
  # written, and the leaf's global index (its sharding's index map). The math
  # and the three roundings are emitted once, so the kernel's code (and its
  # lowering and compile time) does not grow with the leaves' count
  # (docs/fused_step.md, "Compile time").
  def bound(j, leaf_refs):
    # Leaf j's last block runs past its end unless the block divides it.
    return elementwise_tiling.triton_bound(leaf_refs, local < sizes[j], masked[j])

  def load(j):
    leaf = bound(j, ins[n_in * j:n_in * (j + 1)])
    index = sharding_lib.global_index(local, index_maps[j], seed_ref[j * N_SEEDS + SEED_BASE])
    return tuple(r[...] for r in leaf) + (index,)

  *loaded, index = _bisect(k, 0, n_leaves, load)
  scalars = {j: s_ref[k * N_SCALARS + j] for j in range(N_SCALARS_USED)}
  f32 = lambda x: x.astype(jnp.float32)
  p32 = load_param(loaded[0], loaded[4] if tracked else None) if apply else None
  g, mu, nu = loaded[1:4] if apply else loaded[:3]
  out, mu_new, nu_new = adam_math(scalars.__getitem__, p32, f32(g), f32(mu), f32(nu),
                                  nesterov=nesterov, apply=apply)
  seed = lambda j: seed_ref[k * N_SEEDS + j]
  # Every leaf of a launch has the same dtypes: the values are converted
  # once, into holders standing in for the refs.
  new = [_Held(r.dtype) for r in outs[:n_out]]
  store_outputs(new, out, mu_new, nu_new, index, seed, tracked=tracked)
  for j in range(n_leaves):
    # The other leaves' (clamped) blocks are neither loaded nor stored.
    @pl.when(k == j)
    def _(j=j):
      for r, v in zip(bound(j, outs[n_out * j:n_out * (j + 1)]), new):
        r[...] = v.value


def _program_starts(counts, per_program: int) -> list[int]:
  """A grouped launch's first program of each leaf (``counts`` of elements
  or rows, ``per_program`` of them a program), and the grid's size last."""
  starts = [0]
  for n in counts:
    starts.append(starts[-1] + pl.cdiv(n, per_program))
  return starts


def _clamped(starts, k: int):
  """Leaf ``k``'s block index in program ``i``: clamped into range outside
  its own programs, so every address the lowering forms stays inside the leaf."""
  lo, nblocks = starts[k], starts[k + 1] - starts[k]
  return lambda i: jnp.clip(i - lo, 0, nblocks - 1)


def _leaf_rows(scalars, seeds):
  """A grouped launch's ``(K, N_SCALARS)`` scalar and ``(K, N_SEEDS)`` seed
  rows, flat, padded to a power of two rows (Triton block shapes are powers
  of two), and their two whole-array specs."""
  n_leaves = scalars.shape[0]
  rows = pl.next_power_of_2(n_leaves)
  pad = lambda a: jnp.pad(a, ((0, rows - n_leaves), (0, 0))).reshape(-1)
  specs = [pl.BlockSpec((rows * N_SCALARS,), lambda i: (0,)),
           pl.BlockSpec((rows * N_SEEDS,), lambda i: (0,))]
  return pad(scalars), pad(seeds), specs


def update_group(scalars, seeds, ps, gs, mus, nus, *, nesterov, config, interpret,
                 index_maps=None, los=None):
  """One launch over flat leaves of one dtype signature.

  ``scalars``: ``(K, N_SCALARS)`` fp32 rows, ``seeds``: ``(K, N_SEEDS)``
  uint32 rows, one per leaf; ``ps`` is ``None`` for the direction-only mode;
  ``los`` (every leaf tracked) their companions (int16 or int8), or ``None``.
  Returns ``[(out, mu, nu)]`` (``[(out, mu, nu, lo)]`` with ``los``).
  """
  from jax.experimental.pallas import triton as plgpu
  block = config.block
  apply = ps is not None
  tracked = los is not None
  n_leaves = len(gs)
  sizes = [g.shape[0] for g in gs]
  starts = _program_starts(sizes, block)
  specs = [pl.BlockSpec((block,), lambda i, at=_clamped(starts, k): (at(i),))
           for k in range(n_leaves)]
  scalars, seeds, row_specs = _leaf_rows(scalars, seeds)
  n_in = (4 if apply else 3) + tracked
  n_out = 3 + tracked
  arrays, in_specs, out_shape, out_specs, aliases = [], [], [], [], {}
  for k in range(n_leaves):
    leaf = (ps[k], gs[k], mus[k], nus[k]) if apply else (gs[k], mus[k], nus[k])
    leaf += (los[k],) if tracked else ()
    arrays += leaf
    in_specs += [specs[k]] * n_in
    out_dtypes = (leaf[0].dtype, mus[k].dtype, nus[k].dtype) + (
        (los[k].dtype,) if tracked else ())
    out_shape += [jax.ShapeDtypeStruct((sizes[k],), d) for d in out_dtypes]
    out_specs += [specs[k]] * n_out
    # As in update_flat: params, moments (and companions) in place, the direction fresh.
    aliases.update(in_place_aliases(2 + n_in * k, n_out * k, apply=apply, tracked=tracked))
  outs = pl.pallas_call(
      functools.partial(_group_kernel, block=block, starts=tuple(starts), sizes=tuple(sizes),
                        masked=tuple(elementwise_tiling.triton_masks(n, block, interpret)
                                     for n in sizes),
                        nesterov=nesterov, apply=apply, tracked=tracked,
                        index_maps=tuple(index_maps or (None,) * n_leaves)),
      out_shape=tuple(out_shape),
      grid=(starts[-1],),
      in_specs=row_specs + in_specs,
      out_specs=tuple(out_specs),
      input_output_aliases=aliases,
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1),
      interpret=interpret,
      name="fuseopt_adam_update_group",
      cost_estimate=adam_cost(arrays, out_shape, n=sum(sizes)),
  )(scalars, seeds, *arrays)
  return [tuple(outs[n_out * k:n_out * (k + 1)]) for k in range(n_leaves)]


# A jitted launch: equal static arguments and operand shapes give the same
# traced kernel, so repeated launches over the same leaf sizes are lowered to
# Triton once and compiled once (see tree.launch_chunks).
update_group_jit = jax.jit(update_group,
                           static_argnames=("nesterov", "config", "interpret", "index_maps"))


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
                                  nesterov=nesterov, apply=apply, reciprocal=True)
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
                                  nesterov=nesterov, apply=apply, reciprocal=True)
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
  if tracked and not apply:
    raise ValueError("lo (a companion of p) needs p; got p=None")
  if tracked and lo.shape != p.shape:
    raise ValueError(f"lo has shape {lo.shape}, p {p.shape}: a companion is p's shape")
  if tracked and lo.dtype not in mantissa.COMPANION_DTYPES:
    raise TypeError(f"lo must be int16 or int8 (a companion), got {lo.dtype}")
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
  k, first = _group_leaf(i, starts)
  row = ((i - first) * rows).astype(jnp.uint32) + jax.lax.iota(jnp.uint32, rows)
  bound = lambda j, leaf_refs: elementwise_tiling.triton_bound(leaf_refs, row < n_rows[j],
                                                               masked[j])

  def load(j):
    index = _block_index(row, index_maps[j], seed_ref[j * N_SEEDS + SEED_BASE], fmt.row)
    return tuple(r[...] for r in bound(j, ins[n_in * j:n_in * (j + 1)])) + (index,)

  *loaded, index = _bisect(k, 0, n_leaves, load)
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
  starts = _program_starts(n_rows, rows)
  index_maps = tuple(index_maps or (None,) * n_leaves)
  scalars, seeds, row_specs = _leaf_rows(scalars, seeds)
  arrays, in_specs, out_shape, out_specs, aliases = [], [], [], [], {}
  n_in = 6 if apply else 5
  for k in range(n_leaves):
    leaf = fmt.operands(ps[k] if apply else None, gs[k], mus[k], nus[k])
    specs = fmt.specs(rows, apply, _clamped(starts, k))
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
