"""Fused Adam/AdamW update: the Mosaic GPU backend (sm_90), per leaf and grouped.

The ``mosaic_gpu`` backend of :func:`fuseopt.kernels.adam_update`: the math
and the bf16 roundings of :mod:`fuseopt.kernels.adam.math` (``adam_math``,
``store``: the same counter hash on the same global flat index), tiled as
the Mosaic GPU stochastic rounding is
(:mod:`fuseopt.kernels.stochastic_round.mosaic_gpu`): a ``plgpu.kernel``
over a 1-D grid of the flattened leaf's first ``128 * (size // 128)``
elements, ``block`` elements a program, loaded from and stored to global
memory as one warpgroup's register arrays.

In place: ``plgpu.kernel`` has no ``input_output_aliases``; the parameter and
the moments go in as ``jax.new_ref`` refs, which the kernel overwrites, and
jax turns each written ref into an aliased operand of the custom call (with
the inputs donated to the enclosing jit: no copy). The direction
(``p=None``) is a fresh output, as in the Triton kernel. The last
``size % 128`` elements (Mosaic GPU has no masked loads), which the kernel
leaves as they were, are updated by the same math in XLA from the kernel's
results and written into them in place.

Grouped launches (:func:`update_group`; ``adam_update_tree`` with a
:class:`MosaicGPUGroupConfig`, as lowering them is slow: ``GROUP_SEARCH_SPACE``):
the leaves of one dtype signature in one kernel, a 1-D grid over the sum of
their block counts, program ``i`` updating leaf ``k``'s block ``i -
starts[k]`` with that leaf's own flat index, so the bits are the per-leaf
kernel's. Safe here where Mosaic TPU is not: a program touches only the
global memory it loads and stores, nothing is written back behind it.
8-bit moments (:func:`update_quantized`, :mod:`.quantized`): ``block``
elements a program as whole quantisation blocks of ``BLOCK`` (256), a loop
over them (``lax.fori_loop``: the code stays one block's whatever the
config), each block loaded as one warpgroup's 256-element register arrays;
its new absmax is a reduction over the warpgroup (through shared memory,
which Mosaic GPU's lowering provides), its scale stored as a scalar. Mosaic
GPU lowers no ``floor`` or ``is_finite``: the block arithmetic is written
with truncation and comparisons, the same bits (:mod:`.quantized`).
4-bit moments (:func:`update_int4`, :mod:`.int4`): the same loop a block of
``int4.BLOCK`` (128) elements, one warpgroup's arrays, the two blocks of a
row in turn rewriting their nibbles of the row's packed code bytes (integer
work on the bytes widened to int32), two scales a row. Both blockwise
kernels take a bf16 parameter's companion ``lo`` (:mod:`fuseopt.kernels.mantissa`)
as one more in-place ref in ``p``'s layout: the step reads the master and
writes it split, as the dense kernel and the reference do.

Compiles for sm_90 only
(:func:`supports` refuses other targets before lowering); runs anywhere in
interpret mode.
"""

from __future__ import annotations

import dataclasses
import functools

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
from fuseopt.kernels.adam import math as adam_lib
from fuseopt.kernels.adam import quantized
from fuseopt.kernels.elementwise_tiling import MosaicGPUConfig

Config = MosaicGPUConfig

# Not measured on hardware. Seven streams of up to 4 bytes in registers:
# block 4096 is 224 registers a thread for fp32 p, g, mu, nu (ptxas decides).
SEARCH_SPACE = elementwise_tiling.MOSAIC_GPU_SEARCH_SPACE


def heuristic(size: int) -> MosaicGPUConfig:
  return elementwise_tiling.mosaic_gpu_heuristic(size)


def supports(call) -> str | None:
  """An sm_90 GPU, or any machine in interpret mode."""
  return dispatch.mosaic_gpu_reason(call)


@dataclasses.dataclass(frozen=True)
class MosaicGPUGroupConfig:
  """A grouped launch: ``block`` elements a program and at most
  ``max_leaves_per_launch`` leaves a launch (the kernel holds one unrolled
  branch per leaf: this bounds its code size)."""
  block: int = 1024
  max_leaves_per_launch: int = 16

  def __post_init__(self):
    MosaicGPUConfig(self.block)  # same checks
    if not 1 <= self.max_leaves_per_launch <= 64:
      raise ValueError(f"max_leaves_per_launch must be in [1, 64], got "
                       f"{self.max_leaves_per_launch}")


# Lowering a grouped launch is slow and superlinear in its leaves (on the
# CPU, a 1-layer Llama tree: 37-43 s for 8 leaves, 142-192 s for 16, against
# 0.3 s a per-leaf kernel), so the space stops at 8 and no heuristic groups:
# adam_update_tree runs Mosaic GPU leaves one launch each unless given a
# MosaicGPUGroupConfig.

GROUP_SEARCH_SPACE = tuple(MosaicGPUGroupConfig(b, k) for b in (256, 1024, 4096) for k in (4, 8))


def leaf_config(group: MosaicGPUGroupConfig) -> MosaicGPUConfig:
  """A grouped launch's tiling for a leaf that runs one launch of its own."""
  return MosaicGPUConfig(group.block)


def _leaf(scalar, seed, g_ref, mu_ref, nu_ref, o_ref, p_ref, *, main, block, nesterov, apply,
          index_map, program=None, lo_ref=None):
  """One leaf's block of this program; ``scalar(k)`` / ``seed(k)`` read the
  leaf's scalar and seed vectors; ``lo_ref``: a tracked parameter's companion."""
  scalars = [scalar(k) for k in range(adam_lib.N_SCALARS)]
  seeds = [seed(k) for k in range(adam_lib.N_SEEDS)]

  def one(start, size):
    rows = pl.ds(start, size)
    f32 = lambda r: r.at[rows][...].astype(jnp.float32)
    s = _scalar_reader(scalars, size)
    p32 = None
    if apply:
      p32 = adam_lib.load_param(p_ref.at[rows][...],
                                None if lo_ref is None else lo_ref.at[rows][...])
    out, mu_new, nu_new = adam_lib.adam_math(
        s, p32, f32(g_ref), f32(mu_ref), f32(nu_ref), nesterov=nesterov, apply=apply)
    index = sharding_lib.global_index(elementwise_tiling.mosaic_gpu_flat_index(start, size),
                                      index_map, seeds[adam_lib.SEED_BASE])
    if lo_ref is not None:
      o_ref.at[rows][...], lo_ref.at[rows][...] = mantissa.split(out, lo_ref.dtype)
    else:
      o_ref.at[rows][...] = adam_lib.store(out, o_ref.dtype, index, seeds[0])
    mu_ref.at[rows][...], nu_ref.at[rows][...] = adam_lib.store_moments(
        mu_new, nu_new, mu_ref.dtype, nu_ref.dtype, index, seeds[1], seeds[2])

  elementwise_tiling.mosaic_gpu_blocks(main, block, one, program)


def _scalar_reader(scalars, size):
  """``s(k)`` for :func:`~fuseopt.kernels.adam.math.adam_math` on blocks of
  ``size``: the skip and cautious flags as blocks, since Mosaic GPU's
  warpgroup lowering has no select with a scalar predicate (an implicit
  broadcast); the other scalars as they are."""
  return lambda k: (jnp.broadcast_to(scalars[k], (size,))
                    if k in (adam_lib.APPLY, adam_lib.CAUTIOUS) else scalars[k])


def _split_refs(refs, apply, tracked=False):
  """(p, mu, nu, out, lo) of one leaf's refs: (p, mu, nu) or (p, mu, nu, lo)
  in place, or (mu, nu) and the direction's output."""
  if apply:
    p_ref, mu_ref, nu_ref, *lo = refs
    return p_ref, mu_ref, nu_ref, p_ref, (lo[0] if tracked else None)
  mu_ref, nu_ref, o_ref = refs
  return None, mu_ref, nu_ref, o_ref, None


def _kernel(s_ref, seed_ref, g_ref, *refs, main, block, nesterov, apply, index_map, tracked):
  p_ref, mu_ref, nu_ref, o_ref, lo_ref = _split_refs(refs, apply, tracked)
  _leaf(lambda k: s_ref[k], lambda k: seed_ref[k], g_ref, mu_ref, nu_ref, o_ref, p_ref,
        main=main, block=block, nesterov=nesterov, apply=apply, index_map=index_map,
        lo_ref=lo_ref)


def _group_kernel(s_ref, seed_ref, *refs, mains, starts, block, nesterov, apply, index_maps,
                  tracked):
  k_leaves = len(mains)
  # refs a leaf passes in: (p, mu, nu (, lo)) / (mu, nu)
  n_ref = (3 + tracked) if apply else 2
  gs = refs[:k_leaves]
  inout = refs[k_leaves:k_leaves + n_ref * k_leaves]
  outs = refs[k_leaves + n_ref * k_leaves:]   # the directions
  b = jax.lax.axis_index(elementwise_tiling.MOSAIC_GPU_AXIS)
  for k in range(k_leaves):
    lo, hi = starts[k], starts[k + 1]
    mine = inout[n_ref * k:n_ref * (k + 1)] + (() if apply else (outs[k],))
    p_ref, mu_ref, nu_ref, o_ref, lo_ref = _split_refs(mine, apply, tracked)

    # Unrolled branches: only leaf k's refs are touched in its programs.
    @pl.when((b >= lo) & (b < hi))
    def _(k=k, lo=lo, p_ref=p_ref, mu_ref=mu_ref, nu_ref=nu_ref, o_ref=o_ref, lo_ref=lo_ref):
      _leaf(lambda j: s_ref[k * adam_lib.N_SCALARS + j],
            lambda j: seed_ref[k * adam_lib.N_SEEDS + j], gs[k], mu_ref, nu_ref, o_ref, p_ref,
            main=mains[k], block=block, nesterov=nesterov, apply=apply,
            index_map=index_maps[k], program=b - lo, lo_ref=lo_ref)


def _tail(scalars, seeds, p, g, mu, nu, *, main, nesterov, out_dtype, index_map, lo=None):
  """The last ``size - main`` elements, in XLA, with their own flat indices
  (``(out, mu, nu)``, and the companion's tail with ``lo``)."""
  f32 = lambda a: a[main:].astype(jnp.float32)
  apply = p is not None
  p32 = adam_lib.load_param(p[main:], None if lo is None else lo[main:]) if apply else None
  out, mu_new, nu_new = adam_lib.adam_math(
      lambda k: scalars[k], p32, f32(g), f32(mu), f32(nu), nesterov=nesterov, apply=apply)
  local = jax.lax.iota(jnp.uint32, g.shape[0] - main) + jnp.uint32(main)
  index = lambda: sharding_lib.global_index(local, index_map, seeds[adam_lib.SEED_BASE])
  if lo is not None:
    out, new_lo = mantissa.split(out, lo.dtype)
  else:
    out, new_lo = adam_lib.store(out, out_dtype, index(), seeds[0]), None
  res = (out,) + adam_lib.store_moments(mu_new, nu_new, mu.dtype, nu.dtype, index(), seeds[1],
                                        seeds[2])
  return res if lo is None else res + (new_lo,)


def update_flat(scalars, seeds, p, g, mu, nu, *, nesterov, out_dtype, config: MosaicGPUConfig,
                interpret, index_map=None, lo=None):
  """One leaf, flattened (``p`` None: the direction); returns ``(out, mu, nu)``,
  and ``(out, mu, nu, lo)`` with a companion ``lo`` (written in place too).

  The caller runs leaves under 128 elements in the reference, and guards the
  inputs against differentiation (a custom_jvp around the kernel itself would
  hide its refs from the state discharge of the enclosing jit)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  (n,) = g.shape
  main = elementwise_tiling.mosaic_gpu_split(n)
  apply = p is not None
  tracked = lo is not None
  kernel = plgpu.kernel(
      functools.partial(_kernel, main=main, block=config.block, nesterov=nesterov,
                        apply=apply, index_map=index_map, tracked=tracked),
      out_type=() if apply else (jax.ShapeDtypeStruct((n,), out_dtype),),
      grid=(elementwise_tiling.mosaic_gpu_programs(main, config.block),),
      grid_names=(elementwise_tiling.MOSAIC_GPU_AXIS,),
      interpret=interpret or None,
      kernel_name="fuseopt_adam_update",
  )
  mu_ref, nu_ref = jax.new_ref(mu), jax.new_ref(nu)
  if apply:
    p_ref = jax.new_ref(p)
    lo_refs = (jax.new_ref(lo),) if tracked else ()
    kernel(scalars, seeds, g, p_ref, mu_ref, nu_ref, *lo_refs)
    outs = (jax.freeze(p_ref), jax.freeze(mu_ref), jax.freeze(nu_ref)) + tuple(
        jax.freeze(r) for r in lo_refs)
  else:
    (u,) = kernel(scalars, seeds, g, mu_ref, nu_ref)
    outs = (u, jax.freeze(mu_ref), jax.freeze(nu_ref))
  if main < n:
    # The kernel leaves the tail as it was: read back from its results, not
    # from the donated inputs (keeping those alive past the in-place kernel
    # would make XLA copy every leaf), and written into them in place.
    tail = _tail(scalars, seeds, outs[0] if apply else None, g, outs[1], outs[2], main=main,
                 nesterov=nesterov, out_dtype=out_dtype, index_map=index_map,
                 lo=outs[3] if tracked else None)
    outs = tuple(o.at[main:].set(t) for o, t in zip(outs, tail))
  return outs


def update_group(scalars, seeds, ps, gs, mus, nus, *, nesterov, config: MosaicGPUGroupConfig,
                 interpret, index_maps=None, los=None):
  """One launch over flat leaves of one dtype signature, each of at least
  128 elements; ``scalars`` ``(K, N_SCALARS)``, ``seeds`` ``(K, N_SEEDS)``
  rows, ``ps`` None for the direction, ``los`` every leaf's companion or
  None. Returns ``[(out, mu, nu)]`` (``[(out, mu, nu, lo)]``) per leaf.
  The caller guards the inputs against differentiation."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  k_leaves = len(gs)
  apply = ps is not None
  tracked = los is not None
  index_maps = tuple(index_maps or (None,) * k_leaves)
  sizes = [g.shape[0] for g in gs]
  mains = tuple(elementwise_tiling.mosaic_gpu_split(n) for n in sizes)
  starts = [0]
  for m in mains:
    starts.append(starts[-1] + elementwise_tiling.mosaic_gpu_programs(m, config.block))
  kernel = plgpu.kernel(
      functools.partial(_group_kernel, mains=mains, starts=tuple(starts), block=config.block,
                        nesterov=nesterov, apply=apply, index_maps=index_maps,
                        tracked=tracked),
      out_type=() if apply else tuple(jax.ShapeDtypeStruct((n,), g.dtype)
                                      for n, g in zip(sizes, gs)),
      grid=(starts[-1],),
      grid_names=(elementwise_tiling.MOSAIC_GPU_AXIS,),
      interpret=interpret or None,
      kernel_name="fuseopt_adam_update_group",
  )
  mu_refs, nu_refs = [jax.new_ref(m) for m in mus], [jax.new_ref(v) for v in nus]
  if apply:
    p_refs = [jax.new_ref(p) for p in ps]
    lo_refs = [jax.new_ref(x) for x in los] if tracked else []
    kernel(scalars.reshape(-1), seeds.reshape(-1), *gs,
           *(r for k in range(k_leaves) for r in (p_refs[k], mu_refs[k], nu_refs[k])
             + ((lo_refs[k],) if tracked else ())))
    firsts = [jax.freeze(r) for r in p_refs]
  else:
    firsts = list(kernel(scalars.reshape(-1), seeds.reshape(-1), *gs,
                         *(r for k in range(k_leaves) for r in (mu_refs[k], nu_refs[k]))))
  out = []
  for k in range(k_leaves):
    outs = (firsts[k], jax.freeze(mu_refs[k]), jax.freeze(nu_refs[k])) + (
        (jax.freeze(lo_refs[k]),) if tracked else ())
    main, n = mains[k], sizes[k]
    if main < n:   # as in update_flat: from the kernel's results, in place
      tail = _tail(scalars[k], seeds[k], outs[0] if apply else None, gs[k], outs[1], outs[2],
                   main=main, nesterov=nesterov, out_dtype=outs[0].dtype,
                   index_map=index_maps[k], lo=outs[3] if tracked else None)
      outs = tuple(o.at[main:].set(t) for o, t in zip(outs, tail))
    out.append(outs)
  return out


# --------------------------------------------------- blockwise moments --
def _blockwise_refs(refs, apply, tracked=False):
  """``(p_ref or None, out_ref, moment refs, lo_ref or None)`` of a
  blockwise kernel: ``(p, *moments)`` or ``(p, *moments, lo)`` in place, or
  ``(*moments, direction)``."""
  if apply:
    if tracked:
      return refs[0], refs[0], refs[1:-1], refs[-1]
    return refs[0], refs[0], refs[1:], None
  return None, refs[-1], refs[:-1], None


def _blockwise_param(p_ref, lo_ref, elems):
  """The fp32 parameter of the block ``elems``: ``p`` widened, or with a
  companion the master ``join(p, lo)`` (:func:`.math.load_param`)."""
  return adam_lib.load_param(p_ref[elems], None if lo_ref is None else lo_ref[elems])


def _blockwise_store(o_ref, lo_ref, elems, out, index, seed):
  """The block's fp32 ``out`` written: rounded into ``o_ref``'s dtype (bf16
  stochastically), or with a companion the new master split into ``p`` and
  ``lo`` (:func:`fuseopt.kernels.mantissa.split`: to nearest, no seed), as
  the reference does."""
  if lo_ref is None:
    o_ref[elems] = adam_lib.store(out, o_ref.dtype, index, seed)
  else:
    o_ref[elems], lo_ref[elems] = mantissa.split(out, lo_ref.dtype)


def _block_loop(n, block, step, one):
  """This program's blocks of ``step`` elements (``block // step`` of them,
  the last program what is left of the ``n``), ``one(start)`` a
  ``lax.fori_loop`` iteration each: the kernel's code stays one block's
  whatever the config."""
  def program(start, size):
    def body(j, carry):
      one(start + j * step)
      return carry
    jax.lax.fori_loop(0, size // step, body, 0)

  elementwise_tiling.mosaic_gpu_blocks(n, block, program)


def _kept_codes(keep_block, new, old):
  """A skipped step's codes (:func:`.blocks.kept_on_skip`: ``old`` where
  ``keep_block``, else ``new``) in int32, back in ``old``'s dtype, as
  arithmetic, ``new + (old - new) * keep`` (exact: codes are 8-bit). Mosaic
  GPU has no pointwise select on 8-bit types, and a select in int32 does not
  avoid one from jax 0.12.1: MLIR's canonicalizer narrows a select of two
  sign-extended int8 values, truncated back, to a select of the int8 values."""
  n, o = new.astype(jnp.int32), old.astype(jnp.int32)
  return (n + (o - n) * keep_block.astype(jnp.int32)).astype(old.dtype)


def _blockwise_launch(body, name, scalars, seeds, p, g, arrays, *, out_dtype, block, interpret,
                      lo=None):
  """One ``plgpu.kernel`` launch of the blockwise kernel ``body`` over the
  leaf's ``g.size`` elements, ``block`` a program; ``p`` (None: the
  direction, a fresh output), the moment ``arrays`` and a companion ``lo``
  go in flat as refs, written in place. Returns ``(out, arrays, lo)``,
  ``out`` and ``lo`` (None without one) in their own shapes, the arrays
  flat."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  n = g.size
  apply = p is not None
  tracked = lo is not None
  if tracked:
    adam_lib.check_companion(p, lo, name="lo")
  kernel = plgpu.kernel(
      functools.partial(body, n=n, block=block, apply=apply, tracked=tracked),
      out_type=() if apply else (jax.ShapeDtypeStruct((n,), out_dtype),),
      grid=(elementwise_tiling.mosaic_gpu_programs(n, block),),
      grid_names=(elementwise_tiling.MOSAIC_GPU_AXIS,),
      interpret=interpret or None,
      kernel_name=name,
  )
  refs = [jax.new_ref(a.reshape(-1))
          for a in ((p,) if apply else ()) + tuple(arrays) + ((lo,) if tracked else ())]
  results = kernel(scalars, seeds, g.reshape(-1), *refs)
  outs = [jax.freeze(r) for r in refs]
  new_lo = outs.pop().reshape(lo.shape) if tracked else None
  out = outs.pop(0) if apply else results[0]
  return out.reshape(g.shape), outs, new_lo


# ------------------------------------------------------- 8-bit moments --
def _quantized_kernel(s_ref, seed_ref, g_ref, *refs, n, block, nesterov, apply, index_map,
                      tracked):
  """``block // BLOCK`` quantisation blocks a program (the last program: what
  is left), one loop iteration each; every ref flat, the scales one per
  ``BLOCK`` elements; ``tracked``: a companion ``lo`` ref after the moments."""
  q_block = quantized.BLOCK
  p_ref, o_ref, (muc_ref, mus_ref, nuc_ref, nus_ref), lo_ref = _blockwise_refs(
      refs, apply, tracked)
  apply_flag = s_ref[adam_lib.APPLY]
  s = _scalar_reader([s_ref[k] for k in range(adam_lib.N_SCALARS)], q_block)
  seeds = [seed_ref[k] for k in range(adam_lib.N_SEEDS)]
  wide = lambda x: jnp.broadcast_to(x, (q_block,))

  def one_block(start):
    elems = pl.ds(start, q_block)
    row = start // q_block
    f32 = lambda r: r[elems].astype(jnp.float32)
    mu32 = quantized.dequantize_mu(muc_ref[elems], mus_ref[row])
    nu32 = quantized.dequantize_nu(nuc_ref[elems], nus_ref[row])
    out, mu_new, nu_new = adam_lib.adam_math(
        s, _blockwise_param(p_ref, lo_ref, elems) if apply else None, f32(g_ref), mu32, nu32,
        nesterov=nesterov, apply=apply)
    index = sharding_lib.global_index(elementwise_tiling.mosaic_gpu_flat_index(start, q_block),
                                      index_map, seeds[adam_lib.SEED_BASE])
    _blockwise_store(o_ref, lo_ref, elems, out, index, seeds[0])
    # The scale is reduced here (a scalar) and handed to the block arithmetic
    # as a block: Mosaic GPU lowers scalar constants only inside vector ops.
    # A skipped step keeps the stored codes and scales (quantized.kept_on_skip):
    # the codes selected on the flag's block (_kept_codes), the scales on the
    # scalar flag.
    keep_block = s(adam_lib.APPLY) == 0
    keep_scalar = apply_flag == 0
    old_mus, old_nus = mus_ref[row], nus_ref[row]

    scale = quantized.mu_scale(mu_new, axis=None)
    codes, _ = quantized.quantize_mu(mu_new, counter_hash.hash_bits(index, seeds[1]), wide(scale),
                                    floor=blocks.floor)
    muc_ref[elems] = _kept_codes(keep_block, codes, muc_ref[elems])
    mus_ref[row] = quantized.kept_on_skip(keep_scalar, scale, old_mus)
    scale = quantized.nu_scale(nu_new, axis=None)
    codes, _ = quantized.quantize_nu(nu_new, counter_hash.hash_bits(index, seeds[2]), wide(scale),
                                    floor=blocks.floor)
    nuc_ref[elems] = _kept_codes(keep_block, codes, nuc_ref[elems])
    nus_ref[row] = quantized.kept_on_skip(keep_scalar, scale, old_nus)

  _block_loop(n, block, q_block, one_block)


def update_quantized(scalars, seeds, p, g, mu, nu, *, nesterov, out_dtype,
                     config: MosaicGPUConfig, interpret, index_map=None, lo=None):
  """One leaf with 8-bit moments as ``(R, BLOCK)`` rows (``p``, ``g``, the
  codes) and ``(R,)`` scales, as the Triton kernel takes them; returns
  ``(out, mu, nu)``, the moments :class:`~.quantized.QuantizedMoment`, all
  in place (``p`` None: the direction, a fresh output). With ``lo``, a bf16
  ``p``'s int16 or int8 companion in ``p``'s layout: the step reads the
  master ``join(p, lo)`` and writes it split into ``p`` and ``lo``, both in
  place, and returns ``(out, mu, nu, lo)``. ``config.block`` elements a
  program, at least one quantisation block. The caller guards the inputs
  against differentiation."""
  body = functools.partial(_quantized_kernel, nesterov=nesterov, index_map=index_map)
  out, (muc, mus, nuc, nus), new_lo = _blockwise_launch(
      body, "fuseopt_adam_update_int8", scalars, seeds, p, g,
      (mu.codes, mu.scales, nu.codes, nu.scales), out_dtype=out_dtype,
      block=max(config.block, quantized.BLOCK), interpret=interpret, lo=lo)
  moment = lambda codes, scales, like: quantized.QuantizedMoment(
      codes.reshape(g.shape), scales.reshape(like.scales.shape))
  res = (out, moment(muc, mus, mu), moment(nuc, nus, nu))
  return res if lo is None else res + (new_lo,)


# ------------------------------------------------------- 4-bit moments --
def _int4_kernel(s_ref, seed_ref, g_ref, *refs, n, block, nesterov, apply, index_map,
                 tracked):
  """``block // BLOCK`` quantisation blocks a program (the last program: what
  is left), one loop iteration each, a row's two halves in turn: ``BLOCK``
  elements as one warpgroup's register arrays, their scale (the block's
  index in the flat scales), and the row's ``BLOCK`` code bytes (byte ``t``:
  element ``t`` in the low nibble, ``t + BLOCK`` in the high one), of which
  the iteration rewrites its own nibble and keeps the other. A block a
  iteration rather than a row: Mosaic GPU's layout inference grows faster
  than linearly with the ops of one loop body (a whole row's body lowered
  many times slower). The second half reads the bytes the first wrote, in the
  same program (a program holds whole rows: ``block`` is a multiple of
  ``ROW``), by the same load and store instructions and so the same thread
  a byte, in program order. ``tracked``: a companion ``lo`` ref after the
  moments, read and written with ``p``."""
  half = int4.BLOCK
  p_ref, o_ref, (muc_ref, mus_ref, nuc_ref, nus_ref), lo_ref = _blockwise_refs(
      refs, apply, tracked)
  apply_flag = s_ref[adam_lib.APPLY]
  s = _scalar_reader([s_ref[k] for k in range(adam_lib.N_SCALARS)], half)
  seeds = [seed_ref[k] for k in range(adam_lib.N_SEEDS)]
  wide = lambda x: jnp.broadcast_to(x, (half,))

  def one_block(start):
    blk = start // half                      # the block's scale
    hi = blk % 2                             # which half of its row
    code_bytes = pl.ds((blk - hi) * (half // 2), half)
    shift = 4 * hi                           # its nibble in the row's bytes
    other = 0xF0 >> shift                    # the other half's nibble, kept
    elems = pl.ds(start, half)
    f32 = lambda r: r[elems].astype(jnp.float32)
    # (in int32: Mosaic GPU's integer and shift lowering wants 32 bits)
    old_mu = muc_ref[code_bytes].astype(jnp.int32)
    old_nu = nuc_ref[code_bytes].astype(jnp.int32)
    old_mus, old_nus = mus_ref[blk], nus_ref[blk]
    out, mu_new, nu_new = adam_lib.adam_math(
        s, _blockwise_param(p_ref, lo_ref, elems) if apply else None, f32(g_ref),
        int4.dequantize_mu((old_mu >> shift) & 15, old_mus),
        int4.dequantize_nu((old_nu >> shift) & 15, old_nus), nesterov=nesterov, apply=apply)
    index = sharding_lib.global_index(elementwise_tiling.mosaic_gpu_flat_index(start, half),
                                      index_map, seeds[adam_lib.SEED_BASE])
    _blockwise_store(o_ref, lo_ref, elems, out, index, seeds[0])
    # As in the 8-bit kernel: the scale reduced as a scalar and handed to the
    # block arithmetic as a block; on a skip the scale kept on the scalar
    # flag, the bytes on the flag's block.
    keep_block = s(adam_lib.APPLY) == 0
    keep_scalar = apply_flag == 0

    def write(codes_ref, scales_ref, codes, scale, old, old_scale):
      new = (old & other) | (codes << shift)
      codes_ref[code_bytes] = _kept_codes(keep_block, new, old).astype(codes_ref.dtype)
      scales_ref[blk] = blocks.kept_on_skip(keep_scalar, scale, old_scale)

    scale = int4.mu_scale(mu_new, axis=None)
    codes, _ = int4.quantize_mu(mu_new, counter_hash.hash_bits(index, seeds[1]), wide(scale),
                               floor=blocks.floor)
    write(muc_ref, mus_ref, codes, scale, old_mu, old_mus)
    scale = int4.nu_scale(nu_new, axis=None)
    codes, _ = int4.quantize_nu(nu_new, counter_hash.hash_bits(index, seeds[2]), wide(scale),
                               floor=blocks.floor)
    write(nuc_ref, nus_ref, codes, scale, old_nu, old_nus)

  _block_loop(n, block, half, one_block)


def update_int4(scalars, seeds, p, g, mu, nu, *, nesterov, out_dtype, config: MosaicGPUConfig,
                interpret, index_map=None, lo=None):
  """One leaf with 4-bit moments (:mod:`.int4`) as ``(R, ROW)`` rows (``p``,
  ``g``), ``(R, BLOCK)`` code bytes and ``(R, 2)`` scales; returns ``(out,
  mu, nu)``, the moments :class:`~.int4.PackedMoment` in that layout, all in
  place (``p`` None: the direction, a fresh output). With a companion ``lo``
  (as :func:`update_quantized`): ``(out, mu, nu, lo)``. ``config.block``
  elements a program, at least one row: a program holds whole rows, so the
  two blocks that share a row's code bytes are written by one program.
  The caller guards the inputs against differentiation."""
  body = functools.partial(_int4_kernel, nesterov=nesterov, index_map=index_map)
  out, (muc, mus, nuc, nus), new_lo = _blockwise_launch(
      body, "fuseopt_adam_update_int4", scalars, seeds, p, g,
      (mu.codes, mu.scales, nu.codes, nu.scales), out_dtype=out_dtype,
      block=max(config.block, int4.ROW), interpret=interpret, lo=lo)
  moment = lambda codes, scales, like: int4.PackedMoment(codes.reshape(like.codes.shape),
                                                         scales.reshape(like.scales.shape))
  res = (out, moment(muc, mus, mu), moment(nuc, nus, nu))
  return res if lo is None else res + (new_lo,)
