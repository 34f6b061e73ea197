"""Fused Adam/AdamW update: the Triton backend (GPU), per leaf and grouped.

The entry points of blockwise moments (8-bit, 4-bit) are
:mod:`.triton_blockwise`'s, re-exported here; the grouped launches' config
and grid arithmetic are :mod:`.triton_grid`'s.

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

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from fuseopt.kernels import dispatch
from fuseopt.kernels import elementwise_tiling
from fuseopt.kernels import sharding as sharding_lib
from fuseopt.kernels.adam.math import (N_SCALARS, N_SCALARS_USED, N_SEEDS, SEED_BASE,
                                       adam_cost, adam_math, in_place_aliases, kernel_body,
                                       load_param, store_outputs)
from fuseopt.kernels.adam.triton_blockwise import (INT4_SEARCH_SPACE,  # noqa: F401
                                                    update_int4, update_int4_group,
                                                    update_int4_group_jit, update_quantized,
                                                    update_quantized_group,
                                                    update_quantized_group_jit)
from fuseopt.kernels.adam.triton_grid import (GROUP_SEARCH_SPACE,  # noqa: F401
                                              QUANTIZED_GROUP_SEARCH_SPACE, Held,
                                              TritonGroupConfig, bisect, clamped,
                                              group_heuristic, group_leaf, leaf_config,
                                              leaf_rows, program_starts)
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


def _group_kernel(s_ref, seed_ref, *refs, block, starts, sizes, masked, nesterov, apply,
                  index_maps, tracked):
  n_leaves = len(starts) - 1
  n_in = (4 if apply else 3) + tracked
  n_out = 3 + tracked
  ins, outs = refs[:n_in * n_leaves], refs[n_in * n_leaves:]
  i = pl.program_id(0)
  k, first = group_leaf(i, starts)
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

  *loaded, index = bisect(k, 0, n_leaves, load)
  scalars = {j: s_ref[k * N_SCALARS + j] for j in range(N_SCALARS_USED)}
  f32 = lambda x: x.astype(jnp.float32)
  p32 = load_param(loaded[0], loaded[4] if tracked else None) if apply else None
  g, mu, nu = loaded[1:4] if apply else loaded[:3]
  out, mu_new, nu_new = adam_math(scalars.__getitem__, p32, f32(g), f32(mu), f32(nu),
                                  nesterov=nesterov, apply=apply)
  seed = lambda j: seed_ref[k * N_SEEDS + j]
  # Every leaf of a launch has the same dtypes: the values are converted
  # once, into holders standing in for the refs.
  new = [Held(r.dtype) for r in outs[:n_out]]
  store_outputs(new, out, mu_new, nu_new, index, seed, tracked=tracked)
  for j in range(n_leaves):
    # The other leaves' (clamped) blocks are neither loaded nor stored.
    @pl.when(k == j)
    def _(j=j):
      for r, v in zip(bound(j, outs[n_out * j:n_out * (j + 1)]), new):
        r[...] = v.value


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
  starts = program_starts(sizes, block)
  specs = [pl.BlockSpec((block,), lambda i, at=clamped(starts, k): (at(i),))
           for k in range(n_leaves)]
  scalars, seeds, row_specs = leaf_rows(scalars, seeds)
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
