"""Newton–Schulz over sharded matrices: whole matrices per device, by all-to-all.

Muon's momentum is sharded like the parameters (FSDP rows or columns, tensor
parallel, a sharded layers or experts axis, replicas on a data axis).
Newton–Schulz needs whole matrices, and letting XLA partition the iteration
of a sharded matrix puts collectives inside every step (each ``X Xᵀ``
becomes a reduce over the shards); a Pallas kernel handed a sharded operand
is gathered whole onto every device (GPU) or refused (TPU). Instead, inside
one ``shard_map``:

1. each device cuts its shard of a leaf into the leaf's pieces (its matrix
   views, :class:`~fuseopt.kernels.newton_schulz.layout.Views`; a plain leaf
   is one piece) locally: a shard holds whole groups of the view axis, or
   one ``all_to_all`` first moves that axis's mesh axes onto another axis;
2. same-shaped pieces sharded alike form a family; each device flattens its
   blocks of them to ``(b, segments...)``, batch axes first, where a matrix
   side's segments are its axes merged up to the next sharded one (so a
   block is contiguous in every segment, whichever axis of a side is
   sharded);
3. the batch is padded to a multiple of the devices that share the family;
   mesh axes that hold *replicas* of it (axes the leaves are not sharded
   over) each take a slice;
4. one ``all_to_all`` per sharded segment (split the batch, concatenate the
   segment) leaves every device ``k`` *whole* matrices, no matrix on two
   devices;
5. the NS kernel runs locally; the same collectives in reverse (and an
   ``all_gather`` over the replica axes) put the result back in the
   parameters' sharding, the views merged back into their leaf locally.

:class:`Plan` holds which device gets which matrix. Per step and device this
moves the family's local shard twice (there and back; four times for a leaf
whose views had to be moved whole), against a collective per NS step and
matrix product when XLA partitions the iteration (docs/scaling.md gives the
model). Padding slots are zero matrices, orthogonalised like the others
(to zeros), so that no conditional holds the slot stack (:meth:`_Family.run`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from fuseopt.kernels import sharding as sharding_lib
from fuseopt.kernels.newton_schulz import layout
from fuseopt.kernels.newton_schulz.layout import Views

# One side of a matrix as the shards hold it: (global extent, mesh axes) per
# segment, outermost first (see _segments).
Segments = tuple[tuple[int, tuple[str, ...]], ...]


def _as_views(v) -> Views:
  """A :class:`~fuseopt.kernels.newton_schulz.layout.Views`, or a
  ``(reduction axes, output axes)`` pair read as one."""
  return v if isinstance(v, Views) else Views(*v)


def why_not(shape: Sequence[int], placement: sharding_lib.Placement, views) -> str | None:
  """Why :func:`orthogonalize_sharded` cannot take a leaf laid out this way
  (``None``: it can). ``views``: a ``Views`` or ``(reduction axes, output
  axes)``."""
  if not placement.is_even(shape):
    return (f"its shape {tuple(shape)} does not divide evenly by its mesh axes "
            f"{placement.spec}")
  try:
    _relayout(tuple(shape), placement, _as_views(views))
  except ValueError as e:
    return str(e)
  return None


def supported(shape: Sequence[int], placement: sharding_lib.Placement, views) -> bool:
  """Whether :func:`orthogonalize_sharded` takes a leaf laid out this way."""
  return why_not(shape, placement, views) is None


def _names(placement, a) -> tuple[str, ...]:
  """The mesh axes of size > 1 that shard array axis ``a``."""
  return tuple(n for n in placement.axis_names(a) if placement.mesh.shape[n] > 1)


def _axis(names: tuple[str, ...]):
  return names if len(names) > 1 else names[0]


def _size(mesh, names) -> int:
  return math.prod(mesh.shape[n] for n in names)


def _entry(names: tuple[str, ...]):
  return None if not names else _axis(names)


def _relayout(shape, placement, views):
  """The placement the leaf is split into views in, and the move that gets
  it there: ``(placement, None)`` when every shard holds whole groups of
  the view axis (or there are no views), else ``(placement', (names, t,
  a))``: the mesh axes ``names`` of the view axis ``a`` move onto axis
  ``t`` (one ``all_to_all``, undone after the NS) so that ``a`` is whole on
  every device. Raises ValueError when no axis can take them."""
  a = views.axis
  names = () if a is None else _names(placement, a)
  if not names or views.groups % _size(placement.mesh, names) == 0:
    return placement, None
  n = _size(placement.mesh, names)
  order = layout.batch_axes(len(shape), views.red, views.out) + tuple(views.red) + tuple(views.out)
  for t in order:
    if t != a and shape[t] % (placement.shards(t) * n) == 0:
      spec = list(placement.spec)
      spec[t] = _entry(placement.axis_names(t) + names)
      spec[a] = None
      return sharding_lib.Placement(placement.mesh, PartitionSpec(*spec)), (names, t, a)
  raise ValueError(
      f"its view axis {a} (groups of {views.period}, {views.groups} groups) is sharded "
      f"{n} ways over {names}, which cuts views apart, and no other axis of shape "
      f"{tuple(shape)} divides by {n} to take those mesh axes")


def _segments(shape, names_of, axes) -> Segments:
  """A matrix side (``axes``, outermost first) as segments: a sharded axis
  starts one, an unsharded axis continues the one before it (the shard
  then holds a contiguous block of the segment's range)."""
  segs: list[list] = []
  for ax in axes:
    names = names_of[ax]
    if segs and not names:
      segs[-1][0] *= shape[ax]
    else:
      segs.append([shape[ax], names])
  return tuple((e, n) for e, n in segs)


def matrices_per_call(max_elements: int | None, matrix_elements: int) -> int | None:
  """How many matrices of ``matrix_elements`` one NS call holds under a
  budget of ``max_elements`` (``None``: no budget); at least one. The
  unsharded step's calls and this module's rounds and per-device batches
  follow the same count, so both run a family in the same batch sizes."""
  return None if max_elements is None else max(1, int(max_elements) // matrix_elements)


@dataclasses.dataclass(frozen=True)
class _Leaf:
  """A leaf as the plan reads it."""
  views: Views
  placement: sharding_lib.Placement      # the leaf's own
  effective: sharding_lib.Placement      # the one its views are cut in
  moved: tuple | None                    # (mesh axes, to axis, from axis), see _relayout
  pieces: int

  def statistic_spec(self) -> PartitionSpec:
    """Where a column statistic of the leaf lands (statistic layout of
    :class:`Views`): the effective sharding, replicated over the reduction
    side, except a view axis on that side, which keeps its groups' axes."""
    v = self.views
    return PartitionSpec(*[None if a in v.red and a != v.axis else e
                           for a, e in enumerate(self.effective.spec)])


@dataclasses.dataclass(frozen=True)
class _Member:
  """One piece of one leaf: a family member."""
  leaf: int
  piece: int
  perm: tuple[int, ...]          # grouped layout -> (batch, reduction, output)
  local: tuple[int, ...]         # the shard's shape in perm order
  batch_axes: int                # how many leading axes of ``local`` are batch axes
  red_axes: int                  # how many reduction axes follow them
  count: int                     # matrices in the shard
  total: int                     # matrices in the whole piece
  key: tuple                     # the family: (red segments, out segments, dtype, free axes)


class Plan:
  """Which device orthogonalises which matrix, for sharded leaves.

  Every leaf is cut into pieces (its views; a plain leaf is one piece), and
  same-shaped pieces sharded alike form a *family*. Within a family each
  device holds ``count`` matrices of the shard (a block of rows and columns
  of each); one ``all_to_all`` per sharded matrix segment trades those
  blocks so that each device holds ``k`` whole matrices (slots), ``k =
  max(ceil(count / share), min_batch)``, where ``share`` is the number of
  devices the family's matrices are spread over (the mesh axes of its
  matrix sides, and the replica axes where they help: :meth:`slots`).
  Everything about placement is decided here, from shapes alone; the
  collectives that carry it out live in ``_Family``. Slots past the family's matrices are
  zero padding; families are rotated round-robin so that single matrices
  of different shapes land on different devices.

  Args:
    leaves: arrays or ``jax.ShapeDtypeStruct`` (only shapes and dtypes are
      read), one mesh for all.
    placements: the leaves' placements (even; see :func:`why_not`).
    views: per leaf a :class:`Views` (or ``(reduction axes, output axes)``).
    max_elements: the unsharded step's most matrix elements per NS call.
  """

  def __init__(self, leaves, placements, views, max_elements: int | None = None):
    self.mesh = placements[0].mesh
    for p in placements[1:]:
      if not sharding_lib.same_mesh(p.mesh, self.mesh):
        raise ValueError("orthogonalize_sharded: all leaves must live on one mesh")
    self.max_elements = max_elements
    self.leaves: list[_Leaf] = []
    self.members: dict[tuple[int, int], _Member] = {}
    self.families: dict[tuple, list[tuple[int, int]]] = {}
    for i, (x, p, v) in enumerate(zip(leaves, placements, views)):
      v = _as_views(v)
      effective, moved = _relayout(tuple(x.shape), p, v)
      shapes = v.piece_shapes(x.shape)
      self.leaves.append(_Leaf(v, p, effective, moved, len(shapes)))
      for j, shape in enumerate(shapes):
        m = self._member(i, j, shape, x.dtype, v, effective)
        self.members[(i, j)] = m
        self.families.setdefault(m.key, []).append((i, j))
    # The unsharded step batches every (rows, cols, dtype) group of two or
    # more matrices (unless its budget holds one matrix a call): so does
    # every device here, padding where it holds one.
    self.totals: dict[tuple, int] = {}
    for key, ms in self.families.items():
      shape = self._shape(key)
      self.totals[shape] = self.totals.get(shape, 0) + sum(self.members[m].total for m in ms)

  def _member(self, i, j, shape, dtype, v, effective) -> _Member:
    red, out = v.piece_axes()
    spec = list(effective.spec)
    if v.axis is not None:   # the groups keep the view axis's mesh axes, the chunk has none
      spec[v.axis + 1:v.axis + 1] = [None]
    grouped = sharding_lib.Placement(self.mesh, PartitionSpec(*spec))
    names_of = [_names(grouped, a) for a in range(len(shape))]
    local = grouped.local_shape(shape)
    batch = layout.batch_axes(len(shape), red, out)
    perm = layout.permutation(len(shape), red, out)
    used = {n for ns in names_of for n in ns}
    free = tuple(n for n in self.mesh.axis_names if n not in used and self.mesh.shape[n] > 1)
    key = (_segments(shape, names_of, red), _segments(shape, names_of, out),
           jnp.dtype(dtype).name, free)
    return _Member(i, j, perm, tuple(local[a] for a in perm), len(batch), len(red),
                   math.prod(local[a] for a in batch), math.prod(shape[a] for a in batch), key)

  @staticmethod
  def _shape(key):
    red, out, dtype, _ = key
    return (math.prod(e for e, _ in red), math.prod(e for e, _ in out), dtype)

  def share(self, key) -> int:
    """The devices one family's matrices are spread over."""
    red, out, _, free = key
    return _size(self.mesh, free) * math.prod(_size(self.mesh, n) for _, n in red + out)

  def slots(self, key, count: int) -> tuple[int, tuple[str, ...]]:
    """``(k, replica axes)``: how many whole matrices each device of a
    family holding ``count`` matrices a shard gets, and the replica axes
    that split the family (each takes a slice; the results are gathered
    back). Replica axes split it only where that lowers ``k``: a family
    too small to fill its devices twice runs whole on each replica instead
    (the same slots a device, and no gather)."""
    red, out, _, free = key
    share = math.prod(_size(self.mesh, n) for _, n in red + out)
    least = self.min_batch(key)
    alone = max(-(-count // share), least)
    if free:
      split = max(-(-count // (share * _size(self.mesh, free))), least)
      if split < alone:
        return split, free
    return alone, ()

  def min_batch(self, key) -> int:
    """Slots per device at least: 2 where the unsharded step runs the
    family's (rows, cols, dtype) group batched (a compiler may lower a batch
    of one differently: XLA's CPU backend drops the unit batch axis and
    picks another dot, whose rounding differs), else 1."""
    R, O, _ = shape = self._shape(key)
    batched = self.totals[shape] >= 2 and (matrices_per_call(self.max_elements, R * O) or 2) >= 2
    return 2 if batched else 1

  def rounds(self) -> list[list[int]]:
    """The leaves split into rounds (lists of leaf indices, each a call of
    its own) so that no device's NS call in a round exceeds
    ``max_elements`` matrix elements a family: whole leaves, in order."""
    if self.max_elements is None:
      return [list(range(len(self.leaves)))]
    room = {key: matrices_per_call(self.max_elements, math.prod(self._shape(key)[:2]))
            * self.share(key) for key in self.families}
    need = [{} for _ in self.leaves]
    for (i, _), m in self.members.items():
      need[i][m.key] = need[i].get(m.key, 0) + m.count
    out, assigned = [], set()
    for members in self.families.values():
      current, used = [], {}
      for i in dict.fromkeys(i for i, _ in members):
        if i in assigned:
          continue
        if current and any(used.get(k, 0) + c > room[k] for k, c in need[i].items()):
          out.append(current)
          current, used = [], {}
        current.append(i)
        assigned.add(i)
        for k, c in need[i].items():
          used[k] = used.get(k, 0) + c
      if current:
        out.append(current)
    return out

  def run(self, arrays: Sequence[jax.Array], ns: Callable,
                    which: Sequence[int] | None = None) -> list:
    """Runs ``ns`` on every matrix of the leaves ``which`` (default: all),
    whose arrays are ``arrays``; see :func:`orthogonalize_sharded`."""
    which = list(range(len(self.leaves))) if which is None else list(which)
    chosen = set(which)
    families = {}
    for key, ms in self.families.items():
      ms = [m for m in ms if m[0] in chosen]
      if ms:
        families[key] = ms
    with_stats = _returns_stats(ns, next(iter(families)), self)
    leaves = [self.leaves[i] for i in which]

    def body(*locals_):
      pieces = {}
      for i, leaf, x in zip(which, leaves, locals_):
        if leaf.moved:
          names, t, a = leaf.moved
          x = jax.lax.all_to_all(x, _axis(names), t, a, tiled=True)
        for j, p in enumerate(leaf.views.split(x)):
          pieces[(i, j)] = p
      results, placed = {}, 0
      for key, ms in families.items():
        family = _Family(self, key, ms, placed)
        placed += family.size
        for m, part in zip(ms, family.scatter(family.run(family.gather(pieces), ns))):
          results[m] = part
      outs = []
      for i, leaf in zip(which, leaves):
        parts = [results[(i, j)] for j in range(leaf.pieces)]
        y = leaf.views.merge([p[0] for p in parts] if with_stats else parts)
        if leaf.moved:
          names, t, a = leaf.moved
          y = jax.lax.all_to_all(y, _axis(names), a, t, tiled=True)
        outs.append((y, leaf.views.statistic().merge([p[1] for p in parts])) if with_stats else y)
      return tuple(outs)

    specs = tuple(leaf.placement.spec for leaf in leaves)
    out_specs = (tuple((leaf.placement.spec, leaf.statistic_spec()) for leaf in leaves)
                 if with_stats else specs)
    fitted = [sharding_lib.to_spec(x, leaf.placement) for x, leaf in zip(arrays, leaves)]
    outs = sharding_lib.shard_local(body, self.mesh, specs, out_specs)(*fitted)
    if with_stats:
      return [(sharding_lib.like(y, x), st) for (y, st), x in zip(outs, arrays)]
    return [sharding_lib.like(y, x) for y, x in zip(outs, arrays)]


def rounds(leaves, placements, views, max_elements: int | None) -> list[list[int]]:
  """:meth:`Plan.rounds` of these leaves."""
  return Plan(leaves, placements, views, max_elements).rounds()


def orthogonalize_sharded(leaves: Sequence[jax.Array],
                          placements: Sequence[sharding_lib.Placement],
                          views: Sequence,
                          ns: Callable[[jax.Array], jax.Array],
                          max_elements: int | None = None) -> list:
  """Runs ``ns`` on every matrix of sharded ``leaves``, each matrix on one device.

  Args:
    leaves: global arrays (one mesh for all). :func:`why_not` must be
      ``None`` for each.
    placements: the leaves' placements (even).
    views: per leaf, how it holds its matrices: a :class:`Views` (reduction
      and output axes, and a view cut) or a ``(reduction axes, output
      axes)`` pair; the other axes are batch axes.
    ns: ``(b, R, O) -> (b, R, O)`` on whole matrices, run inside
      ``shard_map`` (a Pallas kernel is fine: its operands are local); or
      ``(b, R, O) -> ((b, R, O), (b, O))``: the result and a statistic per
      output column of each matrix (NorMuon's column sums of squares),
      computed where the matrix is whole, so it is the unsharded step's.
    max_elements: the unsharded step's most matrix elements per NS call
      (``None``: no limit). A group of two or more same-shaped matrices
      runs at least two to a device's ``ns`` call (padding slots fill it)
      unless the unsharded step would run them one at a time
      (``max_elements`` below two matrices). All leaves go in one call:
      :meth:`Plan.rounds` splits them to keep within ``max_elements``.

  Returns:
    ``ns``'s result for each leaf, in the leaf's layout and sharding; with a
    column statistic, ``(result, statistic)`` pairs, the statistic in the
    statistic layout of :class:`Views` (the leaf's with its reduction axes
    of size 1, but for a view axis on that side: one entry per view),
    replicated over the mesh axes of the reduction side.
  """
  return Plan(leaves, placements, views, max_elements).run(leaves, ns)


def _returns_stats(ns, key, plan) -> bool:
  """Whether ``ns`` returns ``(result, column statistic)``."""
  R, O, dtype = plan._shape(key)
  return isinstance(jax.eval_shape(ns, jax.ShapeDtypeStruct((2, R, O), dtype)), tuple)


class _Family:
  """One family inside ``shard_map``: its pieces' blocks gathered into whole
  matrices on their devices (:meth:`gather`), Newton–Schulz run on them
  (:meth:`run`), and the results laid back (:meth:`scatter`)."""

  def __init__(self, plan: Plan, key, members, placed):
    self.plan, self.members = plan, [plan.members[m] for m in members]
    red, out, _, _ = key
    self.segments = red + out
    self.n_red = len(red)
    self.R, self.O, _ = plan._shape(key)
    # (position among the matrix axes, mesh axes) of each sharded segment
    self.sharded = [(s, names) for s, (_, names) in enumerate(self.segments) if names]
    self.size = sum(m.count for m in self.members)
    self.k, self.free = plan.slots(key, self.size)
    self.share = _size(plan.mesh, self.free) * math.prod(
        _size(plan.mesh, n) for _, n in self.sharded)
    self.placed = placed

  def gather(self, pieces):
    """The family's local blocks as one stack, padded to the devices that
    share it, re-laid out so that every device holds ``k`` whole matrices."""
    mesh = self.plan.mesh
    mats = []
    for m in self.members:
      y = pieces[(m.leaf, m.piece)]
      if not layout.is_identity(m.perm):
        y = jnp.transpose(y, m.perm)
      local = tuple(e // _size(mesh, n) for e, n in self.segments)
      mats.append(y.reshape((m.count,) + local))
    x = mats[0] if len(mats) == 1 else jnp.concatenate(mats, axis=0)
    B = self.B = x.shape[0]
    k = self.k
    padded = self.padded = k * self.share
    shift = self.shift = self.placed % padded
    if padded != B:
      x = jnp.concatenate([x, jnp.zeros((padded - B,) + x.shape[1:], x.dtype)])
      if shift:
        x = jnp.roll(x, shift, axis=0)
    self.f_idx = jax.lax.axis_index(_axis(self.free)) if self.free else 0
    if self.free:
      per_free = padded // _size(mesh, self.free)
      x = jax.lax.dynamic_slice_in_dim(x, self.f_idx * per_free, per_free, axis=0)
    if self._one_slot_rows():
      # One whole matrix a device, its rows sharded: the device's stack of
      # row blocks as one 2-D array, the all-to-all splitting and
      # concatenating rows. The same blocks in the same order as the 3-D
      # form below, without its size-1 slot axis, which libtpu re-laid out
      # as bf16[R, 1, O] and padded to a tile (2x the matrix on v5p).
      x = jax.lax.optimization_barrier(x).reshape(x.shape[0] * x.shape[1], -1)
      return jax.lax.all_to_all(x, _axis(self.sharded[0][1]), 0, 0, tiled=True).reshape(
          1, self.R, self.O)
    for s, names in self.sharded:
      # (the barrier: XLA's CPU backend otherwise gives the all-to-all's
      # operands different layouts when they are slices of transposed
      # pieces, and its verifier rejects the program)
      x = jax.lax.all_to_all(jax.lax.optimization_barrier(x), _axis(names), 0, 1 + s, tiled=True)
    # (the barrier: the whole matrices as arrays of their own. Left a view of
    # the all-to-all's (k, R, s, O / s) result, XLA:CPU folds the view into
    # Newton-Schulz's first pass and sums the squares of the norm by that
    # shape's windows, in another order than the unsharded program's sum:
    # with jax 0.12.1 the norm, and the update, differed from the unsharded
    # step's for a matrix sharded by columns)
    return jax.lax.optimization_barrier(x.reshape(k, self.R, self.O))

  def _one_slot_rows(self, statistic: bool = False) -> bool:
    """One slot a device and one sharded segment, the first (rows): the
    all-to-all is one of rows of 2-D arrays (:meth:`gather`)."""
    return (self.k == 1 and not statistic and len(self.sharded) == 1
            and self.sharded[0][0] == 0)

  def run(self, x, ns):
    """``ns`` on this device's whole matrices, padding slots included.

    A device whose whole share is padding orthogonalises zero matrices
    (zeros, exactly) rather than skipping its NS behind a ``lax.cond``: the
    round ends in the collectives that bring the results back, so it waits
    for the busy devices either way, and a conditional holds its operand,
    the round's whole slot stack, until its last instruction (one whole
    8192 x 28672 matrix, 448 MiB a device, through the 80 B step's NS)."""
    return ns(x)

  def scatter(self, y):
    """The results back in each piece's local layout (the collectives of
    :meth:`gather` in reverse, and an ``all_gather`` over the replica axes);
    for ``(result, column statistic)``, pairs."""
    if isinstance(y, tuple):
      y, stat = y
      return list(zip(self._scatter(y), self._scatter(stat, statistic=True)))
    return self._scatter(y)

  def _scatter(self, y, statistic=False):
    # statistic: ``y`` is ``(k, O)``, one row per matrix: the devices of the
    # reduction side each get all of it (an all_gather, in the order the
    # all_to_all concatenated matrices), not a block of rows.
    mesh = self.plan.mesh
    full = tuple(1 if statistic and s < self.n_red else e
                 for s, (e, _) in enumerate(self.segments))
    rows_2d = self._one_slot_rows(statistic)
    if rows_2d:
      # The inverse of gather's 2-D all-to-all: this device's matrix split
      # by rows, block j to device j; the blocks received stacked by source.
      y = jax.lax.all_to_all(y.reshape(full[0], -1), _axis(self.sharded[0][1]), 0, 0, tiled=True)
      y = y.reshape((-1,) + tuple(e // _size(mesh, n) if n else e
                                  for e, (_, n) in zip(full, self.segments)))
    else:
      y = y.reshape((self.k,) + full)
    for s, names in ([] if rows_2d else reversed(self.sharded)):
      if statistic and s < self.n_red:
        y = jax.lax.all_gather(y, _axis(names), axis=0, tiled=True)
      else:
        y = jax.lax.all_to_all(y, _axis(names), 1 + s, 0, tiled=True)
    if self.free:
      y = jax.lax.all_gather(y, _axis(self.free), axis=0, tiled=True)
    if self.padded != self.B:
      if self.shift:
        y = jnp.roll(y, -self.shift, axis=0)
      y = y[:self.B]
    parts, start = [], 0
    for m in self.members:
      part = y if len(self.members) == 1 else jax.lax.slice_in_dim(y, start, start + m.count)
      start += m.count
      local = m.local
      if statistic:   # the reduction axes (after the batch axes in perm order) of size 1
        local = local[:m.batch_axes] + (1,) * m.red_axes + local[m.batch_axes + m.red_axes:]
      part = part.reshape(local)
      if not layout.is_identity(m.perm):
        part = jnp.transpose(part, layout.inverse(m.perm))
      parts.append(part)
    return parts
