"""Fused Adam/AdamW update of one leaf: reference, Triton and Mosaic-TPU kernels.

One pass over a leaf reads ``p, g, mu, nu`` once and writes ``mu, nu`` and
either the new parameter (``p`` given: the whole AdamW step) or the Adam
direction (``p=None``: :func:`optax.scale_by_adam`'s output) once. All
arithmetic is fp32 whatever the storage dtypes; the fp32 scalars (learning
rate, b1, b2, eps, eps_root, bias corrections, weight decay) travel as one
small fp32 array (SMEM on TPU), so the step count and a scheduled learning
rate may be traced.

bf16 outputs (moments, and parameters stored in bf16) are written with the
counter-hash stochastic rounding of :mod:`fuseopt.kernels.counter_hash`: the
random bits of element ``i`` of a leaf are ``hash_bits(i, seed_stream)`` with
``i`` the row-major flat index in the whole leaf and one seed per stream
(param, mu, nu) from :func:`derive_seed(seed, step, leaf_index, stream)
<fuseopt.kernels.counter_hash.derive_seed>`. The rounded mu is therefore
bitwise ``stochastic_round_bf16(mu_fp32_new, seed_mu)``, and every backend,
block size and grid gives the same bits.

Backends:

- ``xla``: the reference, plain ``jnp`` on the flattened leaf. It is single
  pass and memory-lean: each rounding builds its counter from a 1-D per-leaf
  iota inside its own expression, so XLA fuses it instead of materialising a
  shared index array (docs/measurements.md: a shared per-axis index cost 235 MB
  of temporaries on the 1.2 B tree);
- ``triton``: a 1-D grid over the flattened leaf, ``block`` elements a
  program (power of two), ragged tail masked. :func:`adam_update_tree` runs
  the leaves of one dtype signature in one launch (at most
  ``TritonGroupConfig.max_leaves_per_launch``): each leaf its own operand and
  in-place output, a 1-D grid over the sum of their block counts, program
  ``i`` updating leaf ``k``'s block ``i - starts[k]`` with that leaf's own
  flat index, so the bits are the per-leaf kernel's;
- ``mosaic_tpu``: the leaf on its own TPU layout, 2-D blocks of its last two
  dims that divide it, at most ``128 * block_rows`` elements a grid step
  (:func:`fuseopt.kernels._elementwise.mosaic_tiling`: a flat
  ``(rows, 128)`` view would be a relayout copy of every operand); 1-D leaves
  and last dims under 128 on the flat view. Leaves with no such tiling run
  the reference (on LLM trees at most small biases and norms whose size is
  not a multiple of 128). One launch per leaf: Mosaic's
  pipeline copies each output block it holds back to HBM (when its index
  changes and when the grid, or a core's share of it, ends), written or not,
  so in a grouped launch the clamped block of a leaf that a core's steps
  never update would be overwritten with an uninitialised VMEM buffer (a
  race with the core that does update it where the grid is split between
  cores), and every leaf's blocks would sit in VMEM at once. Grouping there
  needs ``memory_space=pl.ANY`` operands and manual DMA.
- ``mosaic_gpu``: Pallas's Mosaic GPU lowering, sm_90 only
  (:mod:`fuseopt.kernels.adam_mosaic_gpu`): a 1-D grid over the flattened
  leaf, ``block`` elements a program, in place through ``jax.new_ref``
  operands; the last ``size % 128`` elements (and leaves under 128) in XLA.
  One launch per leaf.

Non-finite gradients propagate as in optax: an element whose gradient is NaN
gets NaN mu, nu and parameter; ``+-Inf`` gives ``mu = +-Inf``, ``nu = +Inf``
and a NaN update (Inf/Inf). Other elements are unaffected. The rounding keeps
NaN and Inf (never turns a finite value into Inf). Skipping such steps is the
builder's job.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from fuseopt.kernels import _backend
from fuseopt.kernels import _validate
from fuseopt.kernels import counter_hash
from fuseopt.kernels import _elementwise
from fuseopt.kernels import sharding as sharding_lib
from fuseopt.kernels._elementwise import (LANES, MosaicConfig, MosaicGPUConfig, TritonConfig,
                                          triton_heuristic)

OP_NAME = "adam_update"

# Layout of the fp32 scalar vector handed to every backend. GRAD_SCALE
# multiplies g as it is loaded (a global-norm clip factor, 1.0 otherwise);
# APPLY is 1.0, or 0.0 to keep p, mu and nu as they are (a skipped step).
NEG_LR, B1, OMB1, B2, OMB2, EPS, EPS_ROOT, BC1, BC2, BC1_NEXT, WD, GRAD_SCALE, APPLY = range(13)
N_SCALARS = 16   # padded to a power of two (Triton block shapes)
N_SEEDS = 4      # uint32s: the param, mu and nu seeds, then the leaf's global index base
SEED_BASE = 3    # (sharding: the shard's first element's global flat index)

_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


# ----------------------------------------------------------------- configs --
# Block 4096 failed at run time inside XLA's CUDA graph on the H200
# (docs/pallas_notes.md, "CUDA graphs"): it stays in the search space, to be measured on the
# device, never in the heuristic.
TRITON_SEARCH_SPACE = tuple(TritonConfig(b, w) for b in (512, 1024, 2048, 4096)
                            for w in (4, 8))
# Budgets of 128 * block_rows elements a step (MosaicConfig). 7 streams
# double-buffered: 1024 * 128 fp32 elements are 7 MiB of VMEM, inside the
# 16 MiB default scoped limit of v5e.
MOSAIC_SEARCH_SPACE = tuple(MosaicConfig(r) for r in (128, 256, 512, 1024))


def mosaic_heuristic(size: int) -> MosaicConfig:
  # One budget for every size: a leaf under it is one full-extent block anyway.
  del size
  return MosaicConfig(block_rows=512)


# ------------------------------------------------------------- shared math --
def _adam_math(s, p32, g32, mu32, nu32, *, nesterov: bool, apply: bool):
  """fp32 math of one element block; ``s`` indexes the scalar vector.

  The operation order follows optax (clip's ``g * scale``, scale_by_adam,
  add_decayed_weights, scale_by_learning_rate, apply_updates), so fp32
  moments match optax to the last bit wherever the compiler keeps that order.
  Where ``APPLY`` is 0 the outputs are the inputs (the direction is 0): a
  select, so a skipped step costs no second pass; a stored bf16 value comes
  back bit for bit through the stochastic rounding, which leaves values that
  are already bf16 unchanged.
  """
  keep_old = s(APPLY) == 0
  g32 = g32 * s(GRAD_SCALE)
  mu_new = s(OMB1) * g32 + s(B1) * mu32
  nu_new = s(OMB2) * (g32 * g32) + s(B2) * nu32
  if nesterov:
    mu_hat = s(B1) * (mu_new / s(BC1_NEXT)) + s(OMB1) * (g32 / s(BC1))
  else:
    mu_hat = mu_new / s(BC1)
  nu_hat = nu_new / s(BC2)
  u = mu_hat / (jnp.sqrt(nu_hat + s(EPS_ROOT)) + s(EPS))
  if apply:
    u = u + s(WD) * p32
    out = jnp.where(keep_old, p32, p32 + s(NEG_LR) * u)
  else:
    out = jnp.where(keep_old, jnp.zeros_like(u), u)
  return out, jnp.where(keep_old, mu32, mu_new), jnp.where(keep_old, nu32, nu_new)


def _store(x32, dtype, index, seed):
  """fp32 → ``dtype``; bf16 with the counter-hash stochastic rounding."""
  if dtype == jnp.bfloat16:
    return counter_hash.stochastic_round_values(x32, index, seed)
  return x32.astype(dtype)


def _store_mosaic(x32, dtype, index, seed):
  if dtype == jnp.bfloat16:
    return counter_hash.stochastic_round_values_32bit(x32, index, seed)
  return x32.astype(dtype)


# --------------------------------------------------------------- reference --
def _reference(scalars, seeds, p, g, mu, nu, *, nesterov, out_dtype, order_for_in_place=False,
               index_map=None):
  s = lambda k: scalars[k]
  apply = p is not None
  f32 = lambda x: x.astype(jnp.float32)
  out, mu_new, nu_new = _adam_math(s, f32(p) if apply else None, f32(g), f32(mu), f32(nu),
                                   nesterov=nesterov, apply=apply)
  shape = g.shape
  # A fresh flat iota per rounding: XLA fuses each into its consumer rather
  # than materialising one shared index array (docs/measurements.md).
  idx = lambda: sharding_lib.global_index(jax.lax.iota(jnp.uint32, g.size).reshape(shape),
                                          index_map, seeds[SEED_BASE])
  # The param stream's seed whether ``out`` is the parameter or the
  # direction, as the kernels do.
  out = _store(out, out_dtype, idx(), seeds[0])
  if order_for_in_place:
    # XLA's CPU backend emits the three outputs as three loop fusions, each
    # re-reading the old moments; unordered, they make XLA copy the donated
    # moments (a whole leaf of temporaries). The barrier runs the param
    # fusion first, so each moment fusion can then overwrite its input.
    # Not on GPU: there XLA can fuse all three outputs into one pass
    # (docs/measurements.md: 46 KB of temporaries), which the barrier would split.
    out, mu, nu = jax.lax.optimization_barrier((out, mu, nu))
    _, mu_new, nu_new = _adam_math(s, None, f32(g), f32(mu), f32(nu),
                                   nesterov=False, apply=False)
  return (out,
          _store(mu_new, mu.dtype, idx(), seeds[1]),
          _store(nu_new, nu.dtype, idx(), seeds[2]))


def _kernel_body(s_ref, refs, *, nesterov, apply):
  """The math of both kernels on one block; returns the outputs' refs too."""
  if apply:
    p_ref, *refs = refs
    p32 = p_ref[...].astype(jnp.float32)
  else:
    p32 = None
  g_ref, mu_ref, nu_ref, *out_refs = refs
  f32 = lambda r: r[...].astype(jnp.float32)
  out, mu_new, nu_new = _adam_math(lambda k: s_ref[k], p32, f32(g_ref), f32(mu_ref), f32(nu_ref),
                                   nesterov=nesterov, apply=apply)
  return out, mu_new, nu_new, out_refs


# ------------------------------------------------------------------ triton --
def _triton_kernel(s_ref, seed_ref, *refs, block, nesterov, apply, index_map):
  out, mu_new, nu_new, (o_ref, mu_out, nu_out) = _kernel_body(s_ref, refs, nesterov=nesterov,
                                                              apply=apply)
  index = sharding_lib.global_index(_elementwise.triton_flat_index(block), index_map,
                                    seed_ref[SEED_BASE])
  o_ref[...] = _store(out, o_ref.dtype, index, seed_ref[0])
  mu_out[...] = _store(mu_new, mu_out.dtype, index, seed_ref[1])
  nu_out[...] = _store(nu_new, nu_out.dtype, index, seed_ref[2])


def _adam_cost(arrays, out_shape):
  """Adam's work per element (``_backend.ADAM_FLOPS_PER_ELEMENT``, one square
  root) and its compulsory traffic: every stream read once, p, mu, nu
  written once (20 B per parameter for fp32 p/g with bf16 moments)."""
  n = sum(o.size for o in out_shape) // 3
  return _backend.cost_estimate(
      flops=n * _backend.ADAM_FLOPS_PER_ELEMENT,
      transcendentals=n * _backend.ADAM_TRANSCENDENTALS_PER_ELEMENT,
      bytes_accessed=_backend.nbytes(*arrays, *out_shape))


def _adam_triton(scalars, seeds, p, g, mu, nu, *, nesterov, out_dtype, config, interpret,
                 index_map=None):
  from jax.experimental.pallas import triton as plgpu
  (n,) = g.shape
  block = config.block
  apply = p is not None
  spec = pl.BlockSpec((block,), lambda i: (i,))
  arrays = (p, g, mu, nu) if apply else (g, mu, nu)
  # In place: the new param overwrites p, the moments overwrite themselves.
  # The Adam direction (p=None) gets a fresh buffer rather than aliasing g,
  # which the caller usually still holds (XLA would copy it).
  first = 2
  aliases = ({first: 0, first + 2: 1, first + 3: 2} if apply
             else {first + 1: 1, first + 2: 2})
  return pl.pallas_call(
      functools.partial(_triton_kernel, block=block, nesterov=nesterov, apply=apply,
                        index_map=index_map),
      out_shape=(out_shape := (jax.ShapeDtypeStruct((n,), out_dtype),
                               jax.ShapeDtypeStruct((n,), mu.dtype),
                               jax.ShapeDtypeStruct((n,), nu.dtype))),
      grid=(pl.cdiv(n, block),),
      in_specs=[pl.BlockSpec((N_SCALARS,), lambda i: (0,)),
                pl.BlockSpec((N_SEEDS,), lambda i: (0,))] + [spec] * len(arrays),
      out_specs=(spec, spec, spec),
      input_output_aliases=aliases,
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1),
      interpret=interpret,
      name="fuseopt_adam_update",
      cost_estimate=_adam_cost(arrays, out_shape),
  )(scalars, seeds, *arrays)


# ---------------------------------------------------------- triton, grouped --
# One launch over a list of leaves (docs/measurements.md: 147 per-leaf launches
# cost about 15% of the step on the 1.2 B tree, each kernel's ramp-up and
# drain repeated). The leaves stay where they are: each is its own operand and
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


# Block 4096 failed at run time inside XLA's CUDA graph for per-leaf kernels
# (docs/pallas_notes.md, "CUDA graphs"): in the space, to be measured on the device, never in
# the heuristic.
TRITON_GROUP_SEARCH_SPACE = tuple(TritonGroupConfig(b, w, k) for b in (512, 1024, 2048, 4096)
                                  for w in (4, 8) for k in (8, 16))


def triton_group_heuristic(sizes) -> TritonGroupConfig:
  # Block 1024 / 8 warps: the per-leaf kernel's measured best on the H200;
  # a group of tiny leaves gets one small block, as triton_heuristic does.
  c = triton_heuristic(max(sizes, default=1))
  return TritonGroupConfig(block=c.block, num_warps=c.num_warps, max_leaves_per_launch=16)


def _triton_group_kernel(s_ref, seed_ref, *refs, block, starts, nesterov, apply, index_maps):
  n_leaves = len(starts) - 1
  n_in = 4 if apply else 3
  ins, outs = refs[:n_in * n_leaves], refs[n_in * n_leaves:]
  i = pl.program_id(0)
  for k in range(n_leaves):
    lo, hi = starts[k], starts[k + 1]

    # Unrolled branches: only leaf k's refs are touched in its programs; the
    # other leaves' (clamped) blocks are neither loaded nor stored.
    @pl.when((i >= lo) & (i < hi))
    def _(k=k, lo=lo):
      s = lambda j: s_ref[k * N_SCALARS + j]
      f32 = lambda r: r[...].astype(jnp.float32)
      leaf = ins[n_in * k:n_in * (k + 1)]
      p32 = f32(leaf[0]) if apply else None
      g_ref, mu_ref, nu_ref = leaf[-3:]
      out, mu_new, nu_new = _adam_math(s, p32, f32(g_ref), f32(mu_ref), f32(nu_ref),
                                       nesterov=nesterov, apply=apply)
      # The leaf's own flat index: the same bits as its per-leaf kernel.
      seed = lambda j: seed_ref[k * N_SEEDS + j]
      local = ((i - lo) * block).astype(jnp.uint32) + jax.lax.iota(jnp.uint32, block)
      index = sharding_lib.global_index(local, index_maps[k], seed(SEED_BASE))
      o_ref, mu_out, nu_out = outs[3 * k:3 * (k + 1)]
      o_ref[...] = _store(out, o_ref.dtype, index, seed(0))
      mu_out[...] = _store(mu_new, mu_out.dtype, index, seed(1))
      nu_out[...] = _store(nu_new, nu_out.dtype, index, seed(2))


def _adam_triton_group(scalars, seeds, ps, gs, mus, nus, *, nesterov, config, interpret,
                       index_maps=None):
  """One launch over flat leaves of one dtype signature.

  ``scalars``: ``(K, N_SCALARS)`` fp32 rows, ``seeds``: ``(K, N_SEEDS)``
  uint32 rows, one per leaf; ``ps`` is ``None`` for the direction-only mode.
  """
  from jax.experimental.pallas import triton as plgpu
  block = config.block
  apply = ps is not None
  n_leaves = len(gs)
  sizes = [g.shape[0] for g in gs]
  starts = [0]
  for n in sizes:
    starts.append(starts[-1] + pl.cdiv(n, block))

  def leaf_spec(lo, nblocks):
    # Outside its own programs a leaf's block index is clamped into range, so
    # every address the lowering forms stays inside the leaf.
    return pl.BlockSpec((block,), lambda i: (jnp.clip(i - lo, 0, nblocks - 1),))

  specs = [leaf_spec(starts[k], starts[k + 1] - starts[k]) for k in range(n_leaves)]
  # Triton block shapes are powers of two: pad the per-leaf rows.
  rows = pl.next_power_of_2(n_leaves)
  pad = lambda a: jnp.pad(a, ((0, rows - n_leaves), (0, 0))).reshape(-1)
  scalars, seeds = pad(scalars), pad(seeds)
  n_in = 4 if apply else 3
  arrays, in_specs, out_shape, out_specs, aliases = [], [], [], [], {}
  for k in range(n_leaves):
    leaf = (ps[k], gs[k], mus[k], nus[k]) if apply else (gs[k], mus[k], nus[k])
    arrays += leaf
    in_specs += [specs[k]] * n_in
    first = 2 + n_in * k
    out_dtype = leaf[0].dtype
    out_shape += [jax.ShapeDtypeStruct((sizes[k],), out_dtype),
                  jax.ShapeDtypeStruct((sizes[k],), mus[k].dtype),
                  jax.ShapeDtypeStruct((sizes[k],), nus[k].dtype)]
    out_specs += [specs[k]] * 3
    # As in _adam_triton: params and moments in place, the direction fresh.
    if apply:
      aliases.update({first: 3 * k, first + 2: 3 * k + 1, first + 3: 3 * k + 2})
    else:
      aliases.update({first + 1: 3 * k + 1, first + 2: 3 * k + 2})
  outs = pl.pallas_call(
      functools.partial(_triton_group_kernel, block=block, starts=tuple(starts),
                        nesterov=nesterov, apply=apply,
                        index_maps=tuple(index_maps or (None,) * n_leaves)),
      out_shape=tuple(out_shape),
      grid=(starts[-1],),
      in_specs=[pl.BlockSpec((rows * N_SCALARS,), lambda i: (0,)),
                pl.BlockSpec((rows * N_SEEDS,), lambda i: (0,))] + in_specs,
      out_specs=tuple(out_specs),
      input_output_aliases=aliases,
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1),
      interpret=interpret,
      name="fuseopt_adam_update_group",
      cost_estimate=_adam_cost(arrays, out_shape),
  )(scalars, seeds, *arrays)
  return [tuple(outs[3 * k:3 * (k + 1)]) for k in range(n_leaves)]


# -------------------------------------------------------------- mosaic_tpu --
def _mosaic_kernel(s_ref, seed_ref, *refs, tiling, nesterov, apply, index_map):
  out, mu_new, nu_new, (o_ref, mu_out, nu_out) = _kernel_body(s_ref, refs, nesterov=nesterov,
                                                              apply=apply)
  seed = lambda k: seed_ref[k].astype(jnp.uint32)
  index = sharding_lib.global_index(tiling.flat_index(), index_map, seed(SEED_BASE))
  o_ref[...] = _store_mosaic(out, o_ref.dtype, index, seed(0))
  mu_out[...] = _store_mosaic(mu_new, mu_out.dtype, index, seed(1))
  nu_out[...] = _store_mosaic(nu_new, nu_out.dtype, index, seed(2))


def _mosaic_tiling(p, g, mu, nu, out_dtype, config) -> _elementwise.MosaicTiling | None:
  ins = (p, g, mu, nu) if p is not None else (g, mu, nu)
  stream_bytes = (sum(a.dtype.itemsize for a in ins)
                  + jnp.dtype(out_dtype).itemsize + mu.dtype.itemsize + nu.dtype.itemsize)
  return _elementwise.mosaic_tiling(g.shape, config, stream_bytes=stream_bytes)


def _adam_mosaic(scalars, seeds, p, g, mu, nu, *, nesterov, out_dtype, config, interpret,
                 index_map=None):
  from jax.experimental.pallas import tpu as pltpu
  tiling = _mosaic_tiling(p, g, mu, nu, out_dtype, config)
  apply = p is not None
  # Reshapes that keep the TPU layout (_elementwise.mosaic_tiling): no copies.
  arrays = tuple(a.reshape(tiling.view) for a in ((p, g, mu, nu) if apply else (g, mu, nu)))
  spec = tiling.spec()
  first = 2
  aliases = ({first: 0, first + 2: 1, first + 3: 2} if apply
             else {first + 1: 1, first + 2: 2})
  outs = pl.pallas_call(
      functools.partial(_mosaic_kernel, tiling=tiling, nesterov=nesterov, apply=apply,
                        index_map=index_map),
      out_shape=(out_shape := (jax.ShapeDtypeStruct(tiling.view, out_dtype),
                               jax.ShapeDtypeStruct(tiling.view, mu.dtype),
                               jax.ShapeDtypeStruct(tiling.view, nu.dtype))),
      grid=tiling.grid,
      in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM),
                pl.BlockSpec(memory_space=pltpu.SMEM)] + [spec] * len(arrays),
      out_specs=(spec, spec, spec),
      input_output_aliases=aliases,
      compiler_params=_backend.mosaic_compiler_params(interpret, tiling.semantics),
      interpret=interpret,
      name="fuseopt_adam_update",
      cost_estimate=_adam_cost(arrays, out_shape),
  )(scalars, jax.lax.bitcast_convert_type(seeds, jnp.int32), *arrays)
  return tuple(o.reshape(g.shape) for o in outs)


# ------------------------------------------------------------------ public --
def _f32(x) -> jax.Array:
  return jnp.asarray(x, jnp.float32)


@functools.partial(jax.jit, inline=True)
def _bias_correction(decay, count):
  """``1 - decay**count`` inside a jit, as optax.tree.bias_correction computes
  it: called eagerly, ``decay ** count`` with a concrete integer ``count``
  takes ``lax.integer_pow`` (repeated multiplication), which rounds
  differently (1e-5 relative for b2 = 0.999) from the ``pow`` of a jitted
  call."""
  return 1 - decay ** count


def adam_scalars(*, count, learning_rate=0.0, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0,
                 weight_decay=0.0, nesterov=False, grad_scale=1.0, apply=True) -> jax.Array:
  """The fp32 scalar vector of one step (shared by all leaves of a tree).

  ``grad_scale`` (fp32, may be traced) multiplies the gradient inside the
  kernel; ``apply`` (bool, may be traced) False returns p, mu and nu unchanged.

  ``count`` is the step number after increment (1 on the first step), as in
  optax; bias corrections are ``1 - b**count`` computed in fp32 as optax does
  (a bf16 ``0.999`` would be 1.0 and nu would never decay).
  """
  if isinstance(count, (bool, float)):
    raise TypeError(f"adam_update: count must be an integer scalar, got {count!r}")
  if isinstance(count, int) and not 1 <= count < 2**31:
    # (a Python int past int32 would otherwise fail inside jnp.asarray)
    raise ValueError(f"adam_update: count must be >= 1 (the step number after increment, "
                     f"1 on the first step) and < 2**31, got {count}")
  count = jnp.asarray(count)
  if count.ndim or not jnp.issubdtype(count.dtype, jnp.integer):
    raise TypeError(f"adam_update: count must be an integer scalar, got "
                    f"{count.dtype}{list(count.shape)}")
  if not isinstance(count, jax.core.Tracer) and int(count) < 1:
    # 1 - b ** 0 = 0: the bias corrections would divide by zero.
    raise ValueError(f"adam_update: count must be >= 1 (the step number after increment, "
                     f"1 on the first step), got {int(count)}")
  _validate.check_real("adam_update", "b1", b1, lo=0.0, hi=1.0, hi_open=True)
  _validate.check_real("adam_update", "b2", b2, lo=0.0, hi=1.0, hi_open=True)
  _validate.check_real("adam_update", "eps", eps, lo=0.0)
  _validate.check_real("adam_update", "eps_root", eps_root, lo=0.0)
  _validate.check_real("adam_update", "learning_rate", learning_rate)
  _validate.check_real("adam_update", "weight_decay", weight_decay)
  # Same expressions as optax.tree.bias_correction / update_moment, so the
  # fp32 values agree bit for bit with optax's (python floats stay exact
  # until they meet the fp32 operand).
  bc1 = _bias_correction(b1, count)
  bc2 = _bias_correction(b2, count)
  bc1_next = _bias_correction(b1, optax_safe_increment(count)) if nesterov else bc1
  vals = [-learning_rate if not isinstance(learning_rate, (int, float)) else -float(learning_rate),
          b1, 1 - b1, b2, 1 - b2, eps, eps_root, bc1, bc2, bc1_next, weight_decay, grad_scale,
          jnp.where(apply, 1.0, 0.0) if isinstance(apply, jax.Array) else float(bool(apply))]
  vals = [_f32(v) for v in vals]
  return jnp.stack(vals + [jnp.float32(0)] * (N_SCALARS - len(vals)))


def optax_safe_increment(count):
  """``count + 1`` saturating at the dtype's maximum (optax.safe_increment)."""
  count = jnp.asarray(count)
  max_value = jnp.iinfo(count.dtype).max
  return jnp.where(count < max_value, count + 1, max_value).astype(count.dtype)


def adam_seeds(seed, step, leaf_index) -> jax.Array:
  """uint32 seeds ``[param, mu, nu, 0]`` of one leaf at one step."""
  return jnp.stack([counter_hash.derive_seed(seed, step, leaf_index, counter_hash.STREAM_PARAM),
                    counter_hash.derive_seed(seed, step, leaf_index, counter_hash.STREAM_MU),
                    counter_hash.derive_seed(seed, step, leaf_index, counter_hash.STREAM_NU),
                    jnp.uint32(0)])


def _check(p, g, mu, nu):
  g = jnp.asarray(g)
  for name, a in (("grads", g), ("mu", mu), ("nu", nu)) + ((("params", p),) if p is not None else ()):
    a = jnp.asarray(a)
    if a.dtype not in _FLOAT_DTYPES:
      raise TypeError(f"adam_update: {name} must be float32 or bfloat16, got {a.dtype}")
    if a.shape != g.shape:
      raise ValueError(f"adam_update: {name} has shape {a.shape}, expected the gradient's {g.shape}")


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _no_derivative(impl, fn, *args):
  return fn(*args)


@_no_derivative.defjvp
def _no_derivative_jvp(impl, fn, primals, tangents):
  # pallas_call's own rule fails with "JVP with aliasing not supported".
  raise TypeError(f"adam_update: implementation={impl!r} has no derivative (its kernels "
                  "write their outputs in place of their inputs); differentiate through "
                  "implementation='xla', the plain-jnp reference")


def _run(impl, scalars, seeds, p, g, mu, nu, *, nesterov, out_dtype, interpret, config,
         index_map=None):
  shape = g.shape
  n = g.size
  kw = dict(nesterov=nesterov, out_dtype=out_dtype, index_map=index_map)
  want = {"triton": TritonConfig, "mosaic_tpu": MosaicConfig,
          "mosaic_gpu": MosaicGPUConfig}.get(impl)
  if config is not None and want is not None and not isinstance(config, want):
    raise TypeError(f"adam_update: config must be a {want.__name__} for {impl}, got {config!r}")
  if impl == "mosaic_gpu" and n < _elementwise.MOSAIC_GPU_LANES:
    impl = "xla"   # no warpgroup-wide block: the leaf is all tail
  if impl == "mosaic_tpu":
    config = config or mosaic_heuristic(n)
    if (sharding_lib.needs_division(index_map)
        or _mosaic_tiling(p, g, mu, nu, out_dtype, config) is None):
      # (Mosaic has no vector integer division to rebuild the global index of
      # a shard cut along a later axis whose sizes are not powers of two.)
      impl = "xla"
  if n == 0 or impl == "xla":
    # In the leaf's own shape: a reshape between a donated input and its
    # in-place output makes XLA copy the leaf.
    return _reference(scalars, seeds, p, g, mu, nu,
                      order_for_in_place=_backend.current_platform((g,)) == "cpu", **kw)
  if impl == "mosaic_tpu":
    # In the leaf's own shape too: the kernel picks a view that keeps the TPU layout.
    return _no_derivative(impl, functools.partial(
        _adam_mosaic, config=config, interpret=_backend.interpret_arg(impl, interpret), **kw),
        scalars, seeds, p, g, mu, nu)
  flat = lambda a: None if a is None else a.reshape(-1)
  p, g, mu, nu = flat(p), flat(g), flat(mu), flat(nu)
  if impl == "mosaic_gpu":
    from fuseopt.kernels import adam_mosaic_gpu
    # (the guard on the inputs, not around the kernel: jax cannot discharge
    # the kernel's in-place refs inside a custom_jvp)
    outs = adam_mosaic_gpu.update_flat(
        *_no_derivative(impl, lambda *a: a, scalars, seeds, p, g, mu, nu),
        config=config or adam_mosaic_gpu.heuristic(n),
        interpret=_backend.interpret_arg(impl, interpret), **kw)
    return tuple(o.reshape(shape) for o in outs)
  config = config or triton_heuristic(n)
  if not isinstance(config, TritonConfig):
    raise TypeError(f"adam_update: config must be a TritonConfig for triton, got {config!r}")
  outs = _no_derivative(impl, functools.partial(
      _adam_triton, config=config, interpret=_backend.interpret_arg(impl, interpret), **kw),
      scalars, seeds, p, g, mu, nu)
  return tuple(o.reshape(shape) for o in outs)


def adam_update(params, grads, mu, nu, *, count, learning_rate=0.0, b1=0.9, b2=0.999,
                eps=1e-8, eps_root=0.0, weight_decay=0.0, nesterov=False, seed=0,
                leaf_index=0, sharding=None, implementation=None, interpret=False, config=None,
                grad_scale=1.0, apply=True):
  r"""One fused Adam/AdamW step of one leaf.

  With :math:`t` = ``count`` (the step number after increment, 1 first) and
  everything in fp32:

  .. math::
    m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t,\quad
    v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2,\\
    \hat m_t = m_t / (1-\beta_1^t)\ \ (\text{nesterov: }
      \beta_1 m_t/(1-\beta_1^{t+1}) + (1-\beta_1) g_t/(1-\beta_1^t)),\quad
    \hat v_t = v_t / (1-\beta_2^t),\\
    u_t = \hat m_t / (\sqrt{\hat v_t + \bar\varepsilon} + \varepsilon),\quad
    p_t = p_{t-1} - \alpha_t (u_t + \lambda p_{t-1})

  (Kingma & Ba 2014, "Adam"; Loshchilov & Hutter 2019, "Decoupled Weight
  Decay Regularization"; Dozat 2016 for Nesterov), exactly optax's
  ``scale_by_adam`` → ``add_decayed_weights`` → ``scale_by_learning_rate`` →
  ``apply_updates``. bf16 outputs are stochastically rounded with seeds
  :func:`adam_seeds` ``(seed, count, leaf_index)``.

  Args:
    params: the leaf's parameters (fp32 or bf16), or ``None`` to return the
      Adam direction :math:`u_t` (no weight decay, no learning rate) in the
      gradient's dtype instead of new parameters.
    grads: the gradient, fp32 or bf16, same shape.
    mu, nu: the moments, fp32 or bf16, same shape.
    count: integer scalar (may be traced), the step number after increment;
      a concrete count must be >= 1.
    learning_rate, weight_decay: scalars (may be traced, e.g. a schedule's
      value); ignored when ``params`` is ``None``.
    b1, b2, eps, eps_root, nesterov: as in :func:`optax.scale_by_adam`:
      b1, b2 in [0, 1), eps, eps_root >= 0. Concrete values (numbers or
      arrays) are checked and must be finite, as must a concrete learning
      rate and weight decay; traced ones are used as they are.
    seed: integer scalar in [0, 2**32) mixed into the rounding seeds.
    leaf_index: the leaf's index in its tree (another seed input), an
      integer in [0, 2**32).
    sharding: the leaf's placement on an Auto mesh (``NamedSharding`` or
      ``PartitionSpec``); ``None`` reads it from the type (Explicit axes).
      On a multi-device mesh the kernel runs shard-local with global
      indices (:mod:`fuseopt.kernels.sharding`), bitwise the unsharded
      result; on an Auto mesh without it the reference runs and a warning
      says so.
    implementation: ``None`` (by platform), ``"xla"``, ``"triton"``,
      ``"mosaic_tpu"`` or ``"mosaic_gpu"`` (sm_90 GPUs only: on any other
      target a ValueError names the device and its compute capability
      before anything is lowered; any machine in interpret mode).
    interpret: run a Pallas backend in interpret mode (CPU debugging).
    config: a :class:`TritonConfig` / :class:`MosaicConfig` /
      :class:`MosaicGPUConfig`.
    grad_scale: fp32 scalar (may be traced) the gradient is multiplied by as
      it is read, before everything above (a global-norm clip factor).
    apply: bool scalar (may be traced); False returns ``params``, ``mu`` and
      ``nu`` bit for bit (a zero direction when ``params`` is ``None``), in
      the same single pass (a skipped non-finite step).

  Returns:
    ``(new_params or update, new_mu, new_nu)`` in the dtypes of
    ``params`` (or ``grads``), ``mu`` and ``nu``. Pallas backends write them
    in place of their inputs (``input_output_aliases``): donate the inputs to
    the enclosing ``jit`` to avoid copies. Only the ``xla`` implementation
    has a derivative; differentiating through a kernel raises a TypeError.
  """
  _check(params, grads, mu, nu)
  seed = counter_hash.uint32_scalar(seed, name="seed", owner="adam_update")
  leaf_index = counter_hash.uint32_scalar(leaf_index, name="leaf_index", owner="adam_update")
  grads = jnp.asarray(grads)
  if params is not None:
    params = jnp.asarray(params)
  scalars = adam_scalars(count=count, learning_rate=learning_rate, b1=b1, b2=b2, eps=eps,
                         eps_root=eps_root,
                         weight_decay=weight_decay if params is not None else 0.0,
                         nesterov=nesterov, grad_scale=grad_scale, apply=apply)
  seeds = adam_seeds(seed, count, leaf_index)
  impl = _backend.resolve_implementation(OP_NAME, implementation, (grads,),
                                         available=_backend.IMPLEMENTATIONS)
  if impl == "mosaic_gpu":
    _backend.check_mosaic_gpu_target("adam_update", interpret, (grads,))
  if config is not None and impl == "triton" and not isinstance(config, TritonConfig):
    raise TypeError(f"adam_update: config must be a TritonConfig for triton, got {config!r}")
  outs = _update_leaves(impl, [scalars], [seeds], None if params is None else [params], [grads],
                        [jnp.asarray(mu)], [jnp.asarray(nu)], [sharding], nesterov=nesterov,
                        interpret=interpret, config=config, group=False, op="adam_update",
                        argument="sharding=")
  return tuple(o[0] for o in outs)


def adam_update_reference(params, grads, mu, nu, *, count, learning_rate=0.0, b1=0.9,
                          b2=0.999, eps=1e-8, eps_root=0.0, weight_decay=0.0, nesterov=False,
                          seed=0, leaf_index=0):
  """The specification of :func:`adam_update`: plain jnp, any platform."""
  return adam_update(params, grads, mu, nu, count=count, learning_rate=learning_rate, b1=b1,
                     b2=b2, eps=eps, eps_root=eps_root, weight_decay=weight_decay,
                     nesterov=nesterov, seed=seed, leaf_index=leaf_index, implementation="xla")


def _tree_run(impl, scalars, seeds, ps, gs, mus, nus, *, nesterov, interpret, config, group,
              index_maps):
  """Runs leaves that are local to this device (or shard): lists in, lists out."""
  n = len(gs)
  apply = ps is not None
  if impl == "mosaic_gpu":
    from fuseopt.kernels import adam_mosaic_gpu
  grouped = group and (impl == "triton" or (
      impl == "mosaic_gpu" and isinstance(config, adam_mosaic_gpu.GroupConfig)))
  # (a Mosaic GPU block spans at least one warpgroup's 128 elements)
  smallest = _elementwise.MOSAIC_GPU_LANES if impl == "mosaic_gpu" else 1
  outs = ([None] * n, [None] * n, [None] * n)
  groups = {}  # dtype signature -> leaf positions, in tree order
  for i in range(n):
    p, g, m, v = (ps[i] if apply else None), gs[i], mus[i], nus[i]
    if grouped and g.size >= smallest:
      sig = (p.dtype if apply else None, g.dtype, m.dtype, v.dtype)
      groups.setdefault(sig, []).append(i)
      continue
    # (grouped: only empty (and, Mosaic GPU, tiny) leaves get here; the
    # group config is not theirs)
    r = _run(impl, scalars[i], seeds[i], p, g, m, v, nesterov=nesterov,
             out_dtype=(p if apply else g).dtype, interpret=interpret,
             config=None if grouped else config, index_map=index_maps[i])
    for lst, x in zip(outs, r):
      lst[i] = x
  for members in groups.values():
    # (Mosaic GPU groups only with a config: adam_mosaic_gpu.GROUP_SEARCH_SPACE)
    cfg = config or triton_group_heuristic([gs[i].size for i in members])
    step = cfg.max_leaves_per_launch
    for c in range(0, len(members), step):
      chunk = members[c:c + step]
      flat = lambda arrays: [arrays[i].reshape(-1) for i in chunk]
      if impl == "mosaic_gpu":
        # (the inputs guarded, as in _run)
        args = _no_derivative(impl, lambda *a: a, jnp.stack([scalars[i] for i in chunk]),
                              jnp.stack([seeds[i] for i in chunk]),
                              flat(ps) if apply else None, flat(gs), flat(mus), flat(nus))
        res = adam_mosaic_gpu.update_group(
            *args, nesterov=nesterov, config=cfg,
            interpret=_backend.interpret_arg(impl, interpret),
            index_maps=[index_maps[i] for i in chunk])
        for i, r in zip(chunk, res):
          for lst, x in zip(outs, r):
            lst[i] = x.reshape(gs[i].shape)
        continue
      res = _no_derivative(impl, functools.partial(
          _adam_triton_group, nesterov=nesterov, config=cfg,
          interpret=_backend.interpret_arg(impl, interpret),
          index_maps=[index_maps[i] for i in chunk]),
          jnp.stack([scalars[i] for i in chunk]), jnp.stack([seeds[i] for i in chunk]),
          flat(ps) if apply else None, flat(gs), flat(mus), flat(nus))
      for i, r in zip(chunk, res):
        for lst, x in zip(outs, r):
          lst[i] = x.reshape(gs[i].shape)
  return outs


def _update_leaves(impl, scalars, seeds, ps, gs, mus, nus, shardings, *, nesterov, interpret,
                   config, group, op, argument):
  """Places each leaf: kernels on unsharded leaves, shard-local kernels (one
  ``shard_map`` per mesh) on evenly sharded ones, the reference on the rest."""
  n = len(gs)
  apply = ps is not None
  placements = sharding_lib.resolve_placements(ps if apply else gs, shardings, op=op,
                                               argument=argument)
  outs = ([None] * n, [None] * n, [None] * n)
  run = functools.partial(_tree_run, nesterov=nesterov, interpret=interpret, config=config,
                          group=group)

  def assign(idx, res):
    for lst, r in zip(outs, res):
      for i, x in zip(idx, r):
        lst[i] = x

  def pick(arrays, idx):
    return None if arrays is None else [arrays[i] for i in idx]

  def run_here(idx, implementation):
    if idx:
      assign(idx, run(implementation, pick(scalars, idx), pick(seeds, idx), pick(ps, idx),
                      pick(gs, idx), pick(mus, idx), pick(nus, idx),
                      index_maps=[None] * len(idx)))

  Placement = sharding_lib.Placement
  run_here([i for i, p in enumerate(placements) if p is sharding_lib.UNSHARDED], impl)
  # No placement on a multi-device mesh, or an uneven one: the reference, which
  # XLA partitions (no kernel ever sees a sharded operand).
  run_here([i for i, p in enumerate(placements)
            if p is sharding_lib.UNKNOWN or (isinstance(p, Placement)
                                             and not p.is_even(gs[i].shape))], "xla")
  meshes = []
  for i, p in enumerate(placements):
    if isinstance(p, Placement) and p.is_even(gs[i].shape):
      for mesh, idx in meshes:
        if sharding_lib.same_mesh(mesh, p.mesh):
          idx.append(i)
          break
      else:
        meshes.append((p.mesh, [i]))
  P = jax.sharding.PartitionSpec
  for mesh, idx in meshes:
    specs = [placements[i].spec for i in idx]
    shapes = [gs[i].shape for i in idx]
    maps = [sharding_lib.index_map_of(s, placements[i].local_shape(s))
            for i, s in zip(idx, shapes)]

    def body(s_rows, seed_rows, *leaves, idx=idx, shapes=shapes, maps=maps):
      bases = jnp.stack([placements[i].base(shape) for i, shape in zip(idx, shapes)])
      seed_rows = seed_rows.at[:, SEED_BASE].set(bases)
      k = len(idx)
      lp = list(leaves[:k]) if apply else None
      lg, lm, lv = (list(leaves[-3 * k:][j * k:(j + 1) * k]) for j in range(3))
      return run(impl, list(s_rows), list(seed_rows), lp, lg, lm, lv, index_maps=maps)

    fit = lambda arrays: [sharding_lib.to_spec(arrays[i], placements[i]) for i in idx]
    leaves = (fit(ps) if apply else []) + fit(gs) + fit(mus) + fit(nus)
    n_groups = 4 if apply else 3
    res_p, res_mu, res_nu = sharding_lib.shard_local(
        body, mesh, (P(), P()) + tuple(specs) * n_groups, (specs, specs, specs))(
            jnp.stack(pick(scalars, idx)), jnp.stack(pick(seeds, idx)), *leaves)
    # The moments keep their own placement (the direction follows the grads').
    res_mu = [sharding_lib.like(y, mus[i]) for y, i in zip(res_mu, idx)]
    res_nu = [sharding_lib.like(y, nus[i]) for y, i in zip(res_nu, idx)]
    if not apply:
      res_p = [sharding_lib.like(y, gs[i]) for y, i in zip(res_p, idx)]
    assign(idx, (res_p, res_mu, res_nu))
  return outs


def adam_update_tree(params, grads, mu, nu, *, count, learning_rate=0.0, b1=0.9, b2=0.999,
                     eps=1e-8, eps_root=0.0, weight_decay=0.0, nesterov=False, seed=0,
                     shardings=None, implementation=None, interpret=False, config=None,
                     group=True, grad_scale=1.0, apply=True):
  """:func:`adam_update` over lists of leaves sharing one step's scalars.

  ``params`` is a list of arrays or ``None`` (direction only);
  ``weight_decay`` a scalar or a list with one value per leaf (0 where masked).
  ``grad_scale`` and ``apply`` (see :func:`adam_update`) hold for every leaf.
  Leaf ``i`` rounds with ``adam_seeds(seed, count, i)``.

  Launches: with the ``triton`` implementation and ``group=True`` (the
  default) the leaves of one dtype signature (params, grads, mu, nu) share one
  kernel launch, at most ``config.max_leaves_per_launch`` leaves a launch
  (``config``: a :class:`TritonGroupConfig`), each leaf read and written in
  place where it lies; per-leaf launches cost about 15% over one flat buffer
  on the 1.2 B tree (147 leaves, docs/measurements.md). The bits are those of
  the per-leaf kernels. ``mosaic_gpu`` groups the same way, but only when
  ``config`` is an :class:`~fuseopt.kernels.adam_mosaic_gpu.GroupConfig`
  (lowering a grouped Mosaic GPU launch takes tens of seconds).
  ``group=False`` (for measurement) and the other implementations run one
  kernel per leaf (``config``: a :class:`TritonConfig` /
  :class:`MosaicConfig` / :class:`MosaicGPUConfig`). Mosaic TPU stays per leaf
  (module docstring): its pipeline writes back the output blocks it holds,
  written or not, so another leaf's clamped, unwritten block would overwrite
  that leaf's memory.

  Sharding: ``shardings`` is ``None`` (placements read from the types:
  Explicit mesh axes) or a list with one ``NamedSharding`` /
  ``PartitionSpec`` / ``None`` per leaf (Auto axes). Evenly sharded leaves
  run shard-local inside one ``shard_map`` per mesh (grouped launches still
  apply, per device), with global indices: bitwise the unsharded result.

  Returns:
    Three lists: new params (or updates), new mu, new nu.
  """
  n = len(grads)
  if params is not None and len(params) != n:
    raise ValueError(f"adam_update: params has {len(params)} leaves, grads has {n}")
  if len(mu) != n or len(nu) != n:
    raise ValueError(f"adam_update: mu/nu have {len(mu)}/{len(nu)} leaves, grads has {n}")
  wds = weight_decay if isinstance(weight_decay, (list, tuple)) else [weight_decay] * n
  if len(wds) != n:
    raise ValueError(f"adam_update: weight_decay has {len(wds)} values, grads has {n} leaves")
  seed = counter_hash.uint32_scalar(seed, name="seed", owner="adam_update")
  applies = apply  # the step's flag; `apply` below says whether params are given
  apply = params is not None
  grads = [jnp.asarray(g) for g in grads]
  impl = _backend.resolve_implementation(OP_NAME, implementation, grads,
                                         available=_backend.IMPLEMENTATIONS)
  if impl == "mosaic_gpu":
    _backend.check_mosaic_gpu_target("adam_update_tree", interpret, grads)
  if impl == "triton" and group and config is not None and not isinstance(config,
                                                                          TritonGroupConfig):
    raise TypeError(f"adam_update: config must be a TritonGroupConfig for grouped triton "
                    f"launches (or pass group=False), got {config!r}")
  if impl == "mosaic_gpu" and config is not None:
    from fuseopt.kernels import adam_mosaic_gpu
    if not isinstance(config, (MosaicGPUConfig, adam_mosaic_gpu.GroupConfig)) or (
        not group and isinstance(config, adam_mosaic_gpu.GroupConfig)):
      raise TypeError(f"adam_update: config must be a MosaicGPUConfig (one launch per leaf) "
                      f"or, with group=True, an adam_mosaic_gpu.GroupConfig for mosaic_gpu, "
                      f"got {config!r}")
  ps = [jnp.asarray(p) for p in params] if apply else None
  mus, nus = [jnp.asarray(m) for m in mu], [jnp.asarray(v) for v in nu]
  scalars, seeds, base = [], [], None
  for i in range(n):
    _check(ps[i] if apply else None, grads[i], mus[i], nus[i])
    key = wds[i] if isinstance(wds[i], (int, float)) else id(wds[i])
    if base is None or base[0] != key:
      base = (key, adam_scalars(count=count, learning_rate=learning_rate, b1=b1, b2=b2, eps=eps,
                                eps_root=eps_root, weight_decay=wds[i] if apply else 0.0,
                                nesterov=nesterov, grad_scale=grad_scale, apply=applies))
    scalars.append(base[1])
    seeds.append(adam_seeds(seed, count, i))
  return tuple(list(o) for o in _update_leaves(
      impl, scalars, seeds, ps, grads, mus, nus, shardings, nesterov=nesterov,
      interpret=interpret, config=config, group=group, op="adam_update_tree",
      argument="shardings="))
