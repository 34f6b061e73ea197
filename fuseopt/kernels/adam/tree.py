"""Running the Adam update over lists of leaves: one driver for every moment
format (:mod:`.formats`), backends per leaf or per group of leaves, and the
leaves' placement on a mesh.

:func:`update_leaves` places each leaf once (kernels on unsharded leaves,
shard-local kernels in one ``shard_map`` per mesh on evenly sharded ones, the
reference on the rest), whatever its moments' format; :func:`run_local` runs
leaves that are local to this device (or shard), grouping them where the
backend groups that format; :func:`run_leaf` runs one leaf on one backend, or
on the reference where that backend does not cover the leaf (logged at debug
level). A format enters only where it must: which kernel entry point a leaf
or group takes, and how its moments are laid out and placed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fuseopt.kernels import dispatch
from fuseopt.kernels import elementwise_tiling
from fuseopt.kernels import mantissa
from fuseopt.kernels import sharding as sharding_lib
from fuseopt.kernels.adam import blocks
from fuseopt.kernels.adam import formats
from fuseopt.kernels.adam import reference
from fuseopt.kernels.adam.backends import BACKENDS
from fuseopt.kernels.adam.math import SEED_BASE, no_derivative

OP_NAME = "adam_update"


def _backend(impl):
  return BACKENDS[impl]


def _leaf_fallback(impl, p, g, mu, nu, out_dtype, config, index_map, lo) -> str | None:
  """Why backend ``impl`` leaves this leaf to the reference, or None."""
  if impl == "mosaic_gpu" and g.size < elementwise_tiling.MOSAIC_GPU_LANES:
    return f"a leaf of {g.size} elements has no warpgroup-wide block"
  if impl == "mosaic_tpu":
    return _backend(impl).leaf_reason(p, g, mu, nu, out_dtype, config, index_map, lo)
  return None


def _four(res):
  """A backend's ``(out, mu, nu)`` or ``(out, mu, nu, lo)`` as four (lo None: untracked)."""
  return tuple(res) if len(res) == 4 else tuple(res) + (None,)


def run_leaf(impl, scalars, seeds, p, g, mu, nu, *, nesterov, out_dtype, interpret, config,
             index_map=None, lo=None):
  """One leaf on backend ``impl``, the entry point of its moments' format;
  returns ``(out, mu, nu, lo)`` in the leaf's shape (``lo`` None unless the
  leaf has a companion)."""
  if formats.of(mu).quantized:
    return _four(_run_quantized(impl, scalars, seeds, p, g, mu, nu, nesterov=nesterov,
                                interpret=interpret, config=config, index_map=index_map, lo=lo))
  return _four(_run_leaf(impl, scalars, seeds, p, g, mu, nu, nesterov=nesterov,
                         out_dtype=out_dtype, interpret=interpret, config=config,
                         index_map=index_map, lo=lo))


def _run_leaf(impl, scalars, seeds, p, g, mu, nu, *, nesterov, out_dtype, interpret, config,
              index_map, lo):
  shape = g.shape
  n = g.size
  kw = dict(nesterov=nesterov, out_dtype=out_dtype, index_map=index_map, lo=lo)
  if impl != "xla":
    want = _backend(impl).Config
    if config is not None and not isinstance(config, want):
      raise TypeError(f"adam_update: config must be a {want.__name__} for {impl}, got {config!r}")
    if impl == "mosaic_tpu":
      config = config or _backend(impl).heuristic(n)
    if n:
      reason = _leaf_fallback(impl, p, g, mu, nu, out_dtype, config, index_map, lo)
      if reason is not None:
        dispatch.log_fallback(OP_NAME, impl, reason, runs="the reference")
        impl = "xla"
  if lo is not None and (impl == "xla" or interpret):
    # A tracked leaf's pass compiled by XLA reads its gradient in fp32, as an
    # fp32 master's run does (mantissa.widen_once); a compiled kernel widens
    # it in registers.
    g = mantissa.widen_once(g)
  if n == 0 or impl == "xla":
    # In the leaf's own shape: a reshape between a donated input and its
    # in-place output makes XLA copy the leaf.
    return reference.update(scalars, seeds, p, g, mu, nu,
                            order_for_in_place=dispatch.current_platform((g,)) == "cpu", **kw)
  interp = dispatch.interpret_arg(impl, interpret)
  if impl == "mosaic_tpu":
    # In the leaf's own shape too: the kernel picks a view that keeps the TPU layout.
    del kw["lo"]
    return no_derivative(impl, functools.partial(
        _with_companion(_backend(impl).update), config=config, interpret=interp, **kw),
        scalars, seeds, p, g, mu, nu, lo)
  flat = lambda a: None if a is None else a.reshape(-1)
  p, g, mu, nu, lo = flat(p), flat(g), flat(mu), flat(nu), flat(lo)
  del kw["lo"]
  if config is None and impl == "triton":
    # (the block follows the operands' widths: 128-bit accesses to each)
    widths = [jnp.dtype(a.dtype).itemsize for a in (p, g, mu, nu, lo) if a is not None]
    config = _backend(impl).heuristic(n, widths + [jnp.dtype(out_dtype).itemsize])
  config = config or _backend(impl).heuristic(n)
  if impl == "mosaic_gpu":
    # (the guard on the inputs, not around the kernel: jax cannot discharge
    # the kernel's in-place refs inside a custom_jvp)
    outs = _with_companion(_backend(impl).update_flat)(
        *no_derivative(impl, lambda *a: a, scalars, seeds, p, g, mu, nu, lo),
        config=config, interpret=interp, **kw)
  else:
    outs = no_derivative(impl, functools.partial(
        _with_companion(_backend(impl).update_flat), config=config, interpret=interp, **kw),
        scalars, seeds, p, g, mu, nu, lo)
  return tuple(o.reshape(shape) for o in outs)


def _with_companion(update):
  """``update`` taking the companion as its last positional operand (so
  that it passes through ``no_derivative`` with the others)."""
  def run(scalars, seeds, p, g, mu, nu, lo, **kw):
    return update(scalars, seeds, p, g, mu, nu, lo=lo, **kw)
  return run


def _groups_leaves(impl, group, config, fmt=formats.DENSE) -> bool:
  """Whether backend ``impl`` runs leaves of one dtype signature and moment
  format ``fmt`` in one launch: asked by ``group=True`` or by a grouped
  launch's config (Mosaic GPU groups dense moments only)."""
  if impl == "triton":
    return bool(group) or isinstance(config, _backend(impl).TritonGroupConfig)
  return (impl == "mosaic_gpu" and not fmt.quantized
          and isinstance(config, _backend(impl).MosaicGPUGroupConfig))


def _groups_format(impl, fmt) -> bool:
  """Whether backend ``impl`` has a grouped launch for moments of ``fmt``."""
  return not fmt.quantized or fmt.entry(_backend(impl), "update_{}_group_jit") is not None


def launch_chunks(sizes, max_leaves: int, *, by_size: bool = True) -> list[list[int]]:
  """The positions of ``sizes`` (one dtype signature's leaves, tree order)
  in grouped launches of at most ``max_leaves`` leaves.

  ``by_size``: leaves of one size fill launches of their own first: such
  launches are the same kernel (same sizes, same code), which jax traces and
  lowers once and XLA compiles once (a model's layers repeat a handful of
  shapes). What is left of each size, fewer than ``max_leaves``, shares
  launches in tree order. Without it (the direction-only mode, whose outputs
  are fresh buffers: a launch of the largest leaves alone would hold the most
  of them live at once) launches follow the tree order. The bits do not
  depend on the grouping (each leaf rounds with its own seeds on its own
  flat index).
  """
  if not by_size:
    order = list(range(len(sizes)))
    return [order[c:c + max_leaves] for c in range(0, len(order), max_leaves)]
  classes: dict[int, list[int]] = {}
  for j, n in enumerate(sizes):
    classes.setdefault(n, []).append(j)
  chunks, rest = [], []
  for members in classes.values():
    full = len(members) - len(members) % max_leaves
    chunks += [members[c:c + max_leaves] for c in range(0, full, max_leaves)]
    rest += members[full:]
  rest.sort()
  chunks += [rest[c:c + max_leaves] for c in range(0, len(rest), max_leaves)]
  return chunks


def _run_group(impl, members, scalars, seeds, ps, gs, mus, nus, *, nesterov, interpret, config,
               index_maps, los):
  """The leaves ``members`` (one dtype signature and moment format: all with
  a companion in ``los``, or none) in grouped launches; returns
  ``{leaf: (out, mu, nu, lo)}``."""
  if formats.of(mus[members[0]]).quantized:
    return _run_quantized_group(impl, members, scalars, seeds, ps, gs, mus, nus,
                                nesterov=nesterov, interpret=interpret, config=config,
                                index_maps=index_maps)
  apply = ps is not None
  tracked = los is not None and los[members[0]] is not None
  backend = _backend(impl)
  # (Mosaic GPU groups only with a config: its GROUP_SEARCH_SPACE)
  cfg = config or backend.group_heuristic([gs[i].size for i in members])
  out = {}
  for chunk in launch_chunks([gs[i].size for i in members], cfg.max_leaves_per_launch,
                             by_size=apply):
    chunk = [members[j] for j in chunk]
    flat = lambda arrays: [arrays[i].reshape(-1) for i in chunk]
    # (in interpret mode XLA compiles the pass: a tracked leaf's gradient
    # widened once, as in run_leaf)
    widen = mantissa.widen_once if tracked and interpret else (lambda g: g)
    args = (jnp.stack([scalars[i] for i in chunk]), jnp.stack([seeds[i] for i in chunk]),
            flat(ps) if apply else None, [widen(g) for g in flat(gs)], flat(mus), flat(nus),
            flat(los) if tracked else None)
    kw = dict(nesterov=nesterov, config=cfg, interpret=dispatch.interpret_arg(impl, interpret),
              index_maps=tuple(index_maps[i] for i in chunk))
    group = _with_companions(backend.update_group if impl == "mosaic_gpu"
                             else backend.update_group_jit)
    if impl == "mosaic_gpu":
      # (the inputs guarded, as in run_leaf)
      res = group(*no_derivative(impl, lambda *a: a, *args), **kw)
    else:
      res = no_derivative(impl, functools.partial(group, **kw), *args)
    for i, r in zip(chunk, res):
      out[i] = _four(tuple(x.reshape(gs[i].shape) for x in r))
  return out


def _with_companions(update_group):
  def run(scalars, seeds, ps, gs, mus, nus, los, **kw):
    return update_group(scalars, seeds, ps, gs, mus, nus, los=los, **kw)
  return run


def run_local(impl, scalars, seeds, ps, gs, mus, nus, *, nesterov, interpret, config, group,
              index_maps, los=None):
  """Runs leaves that are local to this device (or shard): lists in, four
  lists out (out, mu, nu, lo; lo None where a leaf has no companion)."""
  n = len(gs)
  apply = ps is not None
  los = los if los is not None else [None] * n
  # (a Mosaic GPU block spans at least one warpgroup's 128 elements)
  smallest = elementwise_tiling.MOSAIC_GPU_LANES if impl == "mosaic_gpu" else 1
  outs = ([None] * n, [None] * n, [None] * n, [None] * n)
  signatures = {}  # dtype signature and format -> leaf positions, in tree order
  for i in range(n):
    p, g, m, v = (ps[i] if apply else None), gs[i], mus[i], nus[i]
    fmt = formats.of(m)
    # (a tracked leaf on blockwise moments runs a launch of its own)
    grouped = (_groups_leaves(impl, group, config, fmt) and _groups_format(impl, fmt)
               and not (fmt.quantized and los[i] is not None))
    if grouped and g.size >= smallest:
      # (a tracked leaf has operands of its own: a launch of its own kind)
      sig = (p.dtype if apply else None, g.dtype, fmt.signature(m), fmt.signature(v),
             los[i] is not None)
      signatures.setdefault(sig, []).append(i)
      continue
    # (grouped: only empty (and, Mosaic GPU, tiny) leaves get here; the
    # group config is not theirs. A leaf of quantised moments takes a
    # group's config as its own launch's block.)
    r = run_leaf(impl, scalars[i], seeds[i], p, g, m, v, nesterov=nesterov,
                 out_dtype=(p if apply else g).dtype, interpret=interpret,
                 config=None if grouped else config, index_map=index_maps[i], lo=los[i])
    for lst, x in zip(outs, r):
      lst[i] = x
  for members in signatures.values():
    done = _run_group(impl, members, scalars, seeds, ps, gs, mus, nus, nesterov=nesterov,
                      interpret=interpret, config=config, index_maps=index_maps, los=los)
    for i, r in done.items():
      for lst, x in zip(outs, r):
        lst[i] = x
  return outs


def _run_quantized_group(impl, members, scalars, seeds, ps, gs, mus, nus, *, nesterov,
                         interpret, config, index_maps):
  """The leaves ``members`` (blockwise moments of one format, one dtype
  signature) in grouped launches; returns ``{leaf: (out, mu, nu, None)}``,
  the bits of their per-leaf launches."""
  backend = _backend(impl)
  apply = ps is not None
  fmt = formats.of(mus[members[0]])
  sizes = [gs[i].size for i in members]
  cfg = (config if isinstance(config, backend.TritonGroupConfig)
         else backend.group_heuristic(sizes))
  out = {}
  for chunk in launch_chunks(sizes, cfg.max_leaves_per_launch, by_size=apply):
    chunk = [members[j] for j in chunk]
    rows = fmt.leaf_layout
    args = (jnp.stack([scalars[i] for i in chunk]), jnp.stack([seeds[i] for i in chunk]),
            [rows(ps[i]) for i in chunk] if apply else None, [rows(gs[i]) for i in chunk],
            [fmt.kernel_layout(mus[i]) for i in chunk], [fmt.kernel_layout(nus[i]) for i in chunk])
    run = functools.partial(fmt.entry(backend, "update_{}_group_jit"), nesterov=nesterov,
                            config=cfg, interpret=dispatch.interpret_arg(impl, interpret),
                            index_maps=tuple(index_maps[i] for i in chunk))
    res = no_derivative(impl, run, *args)
    for i, (o, m, v) in zip(chunk, res):
      out[i] = (o.reshape(gs[i].shape), fmt.restore(m, mus[i]), fmt.restore(v, nus[i]), None)
  return out


def _run_quantized(impl, scalars, seeds, p, g, mu, nu, *, nesterov, interpret, config,
                   index_map=None, lo=None):
  """One local leaf with blockwise moments on ``impl`` (the reference where
  that backend leaves this leaf, or has no kernel for the format, logged);
  returns ``(out, mu, nu)``, and with a companion ``lo`` ``(out, mu, nu,
  lo)``."""
  out_dtype = (g if p is None else p).dtype
  fmt = formats.of(mu)
  companion = {} if lo is None else {"lo": lo}
  if impl != "xla":
    backend = _backend(impl)
    if not isinstance(config, backend.Config):
      # (a grouped launch's config, or none: a sharded blockwise leaf, or one
      # on Mosaic GPU, runs one launch of its own, at the group's block)
      to_leaf = getattr(backend, "leaf_config", None)
      config = (to_leaf(config) if config is not None and to_leaf is not None
                else backend.heuristic(g.size))
    why = fmt.entry(backend, "{}_leaf_reason")
    if fmt.entry(backend) is None:
      reason = f"no kernel for {fmt.name} moments"
    else:
      reason = (why(g, config, index_map, interpret=bool(dispatch.interpret_arg(impl, interpret)))
                if why is not None else None)
    if reason is not None:
      dispatch.log_fallback(OP_NAME, impl, reason, runs="the reference")
      impl = "xla"
  if lo is not None and (impl == "xla" or interpret):
    # (as in _run_leaf: a tracked leaf's pass compiled by XLA reads its
    # gradient in fp32, as an fp32 master's run does)
    g = mantissa.widen_once(g)
  if impl == "xla":
    return fmt.entry(reference)(scalars, seeds, p, g, mu, nu, nesterov=nesterov,
                                out_dtype=out_dtype, index_map=index_map, **companion)
  shape = g.shape
  entry = fmt.entry(backend)
  kw = dict(nesterov=nesterov, out_dtype=out_dtype, config=config,
            interpret=dispatch.interpret_arg(impl, interpret), index_map=index_map)

  def run(scalars, seeds, p, g, mu, nu, lo):
    # (the companion last among the operands, so that it passes through
    # no_derivative with the others; an entry point without one gets none)
    return entry(scalars, seeds, p, g, mu, nu, **kw, **({} if lo is None else {"lo": lo}))
  if impl == "mosaic_tpu":
    # (in the leaf's own shape: the kernel picks a view that keeps the TPU layout)
    return no_derivative(impl, run, scalars, seeds, p, g, mu, nu, lo)
  rows = fmt.leaf_layout
  operands = (scalars, seeds, None if p is None else rows(p), rows(g), fmt.kernel_layout(mu),
              fmt.kernel_layout(nu), None if lo is None else rows(lo))
  if impl == "mosaic_gpu":
    # (as in _run_leaf: the guard on the inputs, jax cannot discharge the
    # kernel's in-place refs inside a custom_jvp)
    res = run(*no_derivative(impl, lambda *a: a, *operands))
  else:
    res = no_derivative(impl, run, *operands)
  out, new_mu, new_nu = res[:3]
  back = (out.reshape(shape), fmt.restore(new_mu, mu), fmt.restore(new_nu, nu))
  return back if lo is None else back + (res[3].reshape(shape),)


def update_leaves(impl, scalars, seeds, ps, gs, mus, nus, placements, *, nesterov, interpret,
                  config, group, los=None):
  """Places each leaf (``placements``: :func:`sharding_lib.resolve_placements`'
  answers, one per leaf), whatever its moments' format: kernels on unsharded
  leaves, shard-local kernels (one ``shard_map`` per mesh) on evenly sharded
  ones, the reference on the rest. A leaf whose shards would split its
  moments' quantisation blocks runs shard-local with its blocked axes whole
  (a block's scale is its absmax), its results placed back as it was.
  ``los``: None, or one companion (or None) per leaf. Returns four lists:
  out, mu, nu (in their format: :class:`QuantizedMoment` for 8-bit moments,
  :class:`PackedMoment` for 4-bit) and the new companions (None where a leaf
  has none)."""
  n = len(gs)
  los = los if los is not None else [None] * n
  outs = ([None] * n, [None] * n, [None] * n, [None] * n)
  run = functools.partial(run_local, nesterov=nesterov, interpret=interpret, config=config,
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
                      index_maps=[None] * len(idx), los=pick(los, idx)))

  Placement = sharding_lib.Placement
  given = list(placements)
  placements = [_fitting(impl, p, gs[i].shape, formats.of(mus[i])) for i, p in enumerate(given)]
  run_here([i for i, p in enumerate(placements) if p is sharding_lib.UNSHARDED], impl)
  # No placement on a multi-device mesh, or an uneven one: the reference, which
  # XLA partitions (no kernel ever sees a sharded operand).
  uneven = [i for i, p in enumerate(placements)
            if isinstance(p, Placement) and not p.is_even(gs[i].shape)]
  if uneven and impl != "xla":
    dispatch.log_fallback(OP_NAME, impl, f"{len(uneven)} leaves do not divide evenly over "
                          f"their mesh axes", runs="the reference, partitioned by XLA,")
  run_here(sorted([i for i, p in enumerate(placements) if p is sharding_lib.UNKNOWN] + uneven),
           "xla")
  for mesh, idx in _by_mesh(placements, gs):
    assign(idx, _run_sharded(run, impl, mesh, idx, placements, given, scalars, seeds, ps, gs,
                             mus, nus, los))
  return outs


def _fitting(impl, placement, shape, fmt):
  """``placement``, or where an even placement's shards would split ``fmt``'s
  quantisation blocks, the same with the blocked trailing axes whole."""
  if not (isinstance(placement, sharding_lib.Placement) and placement.is_even(shape)
          and not fmt.shard_fits(shape, placement.local_shape(shape))):
    return placement
  dispatch.log_fallback(OP_NAME, impl, f"a leaf with {fmt.name} moments whose shards split "
                        f"blocks", runs="the kernel with the blocked axes gathered")
  return sharding_lib.Placement(placement.mesh, blocks.gathered_spec(placement.spec, shape))


def _by_mesh(placements, gs):
  """``[(mesh, leaf indices)]`` of the evenly sharded leaves, one entry a mesh."""
  meshes = []
  for i, p in enumerate(placements):
    if isinstance(p, sharding_lib.Placement) and p.is_even(gs[i].shape):
      for mesh, idx in meshes:
        if sharding_lib.same_mesh(mesh, p.mesh):
          idx.append(i)
          break
      else:
        meshes.append((p.mesh, [i]))
  return meshes


def _run_sharded(run, impl, mesh, idx, placements, given, scalars, seeds, ps, gs, mus, nus,
                 los):
  """The leaves ``idx`` of one mesh, shard-local in one ``shard_map``, with
  each shard's global index base in its seed row. A companion is sharded as
  its parameter (the same shape, the same spec); 8-bit moments' codes and
  scales as their leaf. A leaf that ran on another placement than its
  ``given`` one (its last axis gathered, :func:`_fitting`) is placed back."""
  apply = ps is not None
  tracked = [j for j, i in enumerate(idx) if los[i] is not None]
  P = jax.sharding.PartitionSpec
  pick = lambda arrays: [arrays[i] for i in idx]
  fmts = [formats.of(mus[i]) for i in idx]
  specs = [placements[i].spec for i in idx]
  moment_specs = [f.spec(spec, gs[i].shape) for f, spec, i in zip(fmts, specs, idx)]
  shapes = [gs[i].shape for i in idx]
  maps = [sharding_lib.index_map_of(s, placements[i].local_shape(s))
          for i, s in zip(idx, shapes)]

  def body(s_rows, seed_rows, *leaves):
    bases = jnp.stack([placements[i].base(shape) for i, shape in zip(idx, shapes)])
    seed_rows = seed_rows.at[:, SEED_BASE].set(bases)
    k = len(idx)
    lp = list(leaves[:k]) if apply else None
    lg, lm, lv = (list(leaves[(n_groups - 3) * k:][j * k:(j + 1) * k]) for j in range(3))
    llo = [None] * k
    for j, x in zip(tracked, leaves[n_groups * k:]):
      llo[j] = x
    out, mu, nu, lo = run(impl, list(s_rows), list(seed_rows), lp, lg, lm, lv, index_maps=maps,
                          los=llo)
    return out, mu, nu, [lo[j] for j in tracked]

  fit = lambda arrays: [sharding_lib.to_spec(arrays[i], placements[i]) for i in idx]
  on = lambda i, spec: sharding_lib.Placement(placements[i].mesh, spec)
  fit_moments = lambda arrays: [
      f.map(lambda a, spec, i=i: sharding_lib.to_spec(a, on(i, spec)), arrays[i], ms)
      for f, i, ms in zip(fmts, idx, moment_specs)]
  leaves = (fit(ps) if apply else []) + fit(gs) + fit_moments(mus) + fit_moments(nus)
  lo_leaves = [sharding_lib.to_spec(los[idx[j]], placements[idx[j]]) for j in tracked]
  lo_specs = [specs[j] for j in tracked]
  n_groups = 4 if apply else 3
  res_p, res_mu, res_nu, res_lo = sharding_lib.shard_local(
      body, mesh,
      (P(), P()) + tuple(specs) * (n_groups - 2) + tuple(moment_specs) * 2 + tuple(lo_specs),
      (specs, moment_specs, moment_specs, lo_specs))(
          jnp.stack(pick(scalars)), jnp.stack(pick(seeds)), *leaves, *lo_leaves)

  def back(y, x, i, spec=None):
    # x's own placement; a leaf run on another one (gathered), its given one
    # (``spec``: the given spec of a moment's array, its codes' or scales')
    if placements[i] is given[i]:
      return sharding_lib.like(y, x)
    to = given[i] if spec is None else sharding_lib.Placement(given[i].mesh, spec)
    return sharding_lib.put_back(y, x, to)

  # The moments keep their own placement (the direction follows the grads').
  given_specs = [f.spec(given[i].spec, gs[i].shape) for f, i in zip(fmts, idx)]
  res_mu = [f.map(lambda y, x, sp, i=i: back(y, x, i, sp), y, mus[i], gsp)
            for f, y, i, gsp in zip(fmts, res_mu, idx, given_specs)]
  res_nu = [f.map(lambda y, x, sp, i=i: back(y, x, i, sp), y, nus[i], gsp)
            for f, y, i, gsp in zip(fmts, res_nu, idx, given_specs)]
  res_p = [y if apply and placements[i] is given[i] else back(y, ps[i] if apply else gs[i], i)
           for y, i in zip(res_p, idx)]
  new_lo = [None] * len(idx)
  for j, y in zip(tracked, res_lo):
    # (a companion is placed as its parameter, gathered with it where it ran so)
    new_lo[j] = back(y, los[idx[j]], idx[j])
  return res_p, res_mu, res_nu, new_lo
