"""Newton–Schulz over sharded matrices: whole matrices per device, by all-to-all.

Muon's momentum is sharded like the parameters (FSDP rows or columns, tensor
parallel, a sharded layers or experts axis). Newton–Schulz needs whole
matrices, and letting XLA partition the iteration of a sharded matrix puts
collectives inside every step (each ``X Xᵀ`` becomes a reduce over the
shards). Instead, for every family of same-shaped matrices:

1. each device flattens its local shards to ``(b, R_loc, O_loc)`` (batch axes
   first; only the first reduction and the first output axis may be sharded,
   so a local block is a contiguous block of rows / columns);
2. the batch is padded to a multiple of the devices that share it, and mesh
   axes that hold *replicas* of the family (axes the leaves are not sharded
   over) each take a slice of it;
3. one ``all_to_all`` per sharded matrix side (split the batch, concatenate
   the rows, then the columns) leaves every device ``ceil(B / N)`` *whole*
   matrices, no matrix on two devices (at least two slots for a family of
   two or more, so that the result is bitwise the unsharded step's);
4. the NS kernel runs locally; the same collectives in reverse (and an
   ``all_gather`` over the replica axes) put the result back in the
   parameters' sharding.

Per step and device this moves the family's local shard twice (there and
back), against a collective per NS step and matrix product when XLA
partitions the iteration (docs/scaling.md gives the model). Padding slots
are zero matrices; where a device's whole share is padding it skips the NS
(``lax.cond``), and the families are placed round-robin so that single
matrices of different shapes land on different devices.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from fuseopt.kernels import sharding as sharding_lib
from fuseopt.kernels.newton_schulz import layout


def supported(shape: Sequence[int], placement: sharding_lib.Placement,
              red: Sequence[int], out: Sequence[int]) -> bool:
  """Whether :func:`orthogonalize_sharded` takes a leaf laid out this way."""
  if not placement.is_even(shape):
    return False
  # A local block must be a contiguous block of the matrix's rows / columns.
  return all(not placement.axis_names(a) for a in tuple(red[1:]) + tuple(out[1:]))


def _names(placement, axes) -> tuple[str, ...]:
  return tuple(n for a in axes for n in placement.axis_names(a))


def _axis(names: tuple[str, ...]):
  return names if len(names) > 1 else names[0]


def _size(mesh, names) -> int:
  return math.prod(mesh.shape[n] for n in names)


def _family_key(x_shape, dtype, placement, red, out, mesh):
  used = {n for a in range(len(x_shape)) for n in placement.axis_names(a)}
  free = tuple(n for n in mesh.axis_names if n not in used and mesh.shape[n] > 1)
  R = math.prod(x_shape[a] for a in red)
  O = math.prod(x_shape[a] for a in out)
  return (R, O, jnp.dtype(dtype).name, _names(placement, red[:1]), _names(placement, out[:1]),
          free)


def matrices_per_call(max_elements: int | None, matrix_elements: int) -> int | None:
  """How many matrices of ``matrix_elements`` one NS call holds under a
  budget of ``max_elements`` (``None``: no budget); at least one. The
  unsharded step's calls and this module's rounds and per-device batches
  follow the same count, so both run a family in the same batch sizes."""
  return None if max_elements is None else max(1, int(max_elements) // matrix_elements)


def rounds(leaves: Sequence[jax.Array], placements: Sequence[sharding_lib.Placement],
           axes: Sequence[tuple[tuple[int, ...], tuple[int, ...]]],
           max_elements: int | None) -> list[list[int]]:
  """Splits :func:`orthogonalize_sharded`'s work into rounds (lists of leaf
  indices, each a call of its own) so that no device's NS call in a round
  exceeds ``max_elements`` matrix elements: whole leaves, a family's leaves
  in order, and never a round holding one lone matrix of a larger family
  (it would run unbatched, see :func:`orthogonalize_sharded`)."""
  mesh = placements[0].mesh
  families: dict[tuple, list[int]] = {}
  for i, (x, p, (red, out)) in enumerate(zip(leaves, placements, axes)):
    families.setdefault(_family_key(x.shape, x.dtype, p, red, out, mesh), []).append(i)
  out_rounds = []
  for (R, O, _, red_names, out_names, free), members in families.items():
    share = _size(mesh, red_names) * _size(mesh, out_names) * _size(mesh, free)
    # Two a device at least, unless the budget holds one matrix alone: then
    # the unsharded step too runs this family one matrix a call.
    per_call = matrices_per_call(max_elements, R * O)
    per_device = 2 if per_call is None else per_call
    room = per_device * share
    count = lambda i: math.prod(d for a, d in enumerate(leaves[i].shape)
                                if a not in axes[i][0] and a not in axes[i][1])
    current, used = [], 0
    family_rounds = []
    for i in members:
      if current and (max_elements is not None) and used + count(i) > room:
        family_rounds.append(current)
        current, used = [], 0
      current.append(i)
      used += count(i)
    family_rounds.append(current)
    if per_device > 1 and len(family_rounds) > 1 and sum(count(i) for i in family_rounds[-1]) == 1:
      family_rounds[-2:] = [family_rounds[-2] + family_rounds[-1]]
    out_rounds += family_rounds
  return out_rounds


def orthogonalize_sharded(leaves: Sequence[jax.Array],
                          placements: Sequence[sharding_lib.Placement],
                          axes: Sequence[tuple[tuple[int, ...], tuple[int, ...]]],
                          ns: Callable[[jax.Array], jax.Array],
                          max_elements: int | None = None) -> list[jax.Array]:
  """Runs ``ns`` on every matrix of sharded ``leaves``, each matrix on one device.

  Args:
    leaves: global arrays (one mesh for all), each holding a family of
      matrices: ``axes[i] = (reduction_axes, output_axes)``, the other axes
      batch axes. :func:`supported` must hold for each.
    placements: the leaves' placements (even).
    axes: per leaf, the reduction and output axes (non-negative ints).
    ns: ``(b, R, O) -> (b, R, O)`` on whole matrices, run inside
      ``shard_map`` (a Pallas kernel is fine: its operands are local); or
      ``(b, R, O) -> ((b, R, O), (b, O))``: the result and a statistic per
      output column of each matrix (NorMuon's column sums of squares),
      computed where the matrix is whole, so it is the unsharded step's.
    max_elements: the unsharded step's most matrix elements per NS call
      (``None``: no limit). A family of two or more matrices runs at least
      two to a device's ``ns`` call (padding slots fill it) unless the
      unsharded step would run them one at a time (``max_elements`` below
      two matrices).

  Returns:
    ``ns``'s result for each leaf, in the leaf's layout and sharding; with a
    column statistic, ``(result, statistic)`` pairs, the statistic in the
    leaf's layout with its reduction axes of size 1 (sharded as the leaf,
    replicated over the mesh axes of the reduction side).
  """
  mesh = placements[0].mesh
  for p in placements[1:]:
    if not sharding_lib.same_mesh(p.mesh, mesh):
      raise ValueError("orthogonalize_sharded: all leaves must live on one mesh")
  plans, families = _plan(leaves, placements, axes, mesh)

  def body(*locals_):
    results = [None] * len(locals_)
    placed = 0   # matrices placed so far, for round-robin padding
    for key, members in families.items():
      family = _Family(mesh, key, [plans[i] for i in members], max_elements, placed)
      placed += family.size()
      y = family.run(family.gather(locals_, members), ns)
      for i, part in zip(members, family.scatter(y)):
        results[i] = part
    return tuple(results)

  specs = tuple(p.spec for p in placements)
  out_specs = specs
  with_stats = _returns_stats(ns, leaves, axes)
  if with_stats:
    # The statistic is replicated over the reduction side's mesh axes.
    out_specs = tuple((p.spec, _without(p.spec, red)) for p, (red, _) in zip(placements, axes))
  fitted = [sharding_lib.to_spec(x, p) for x, p in zip(leaves, placements)]
  outs = sharding_lib.shard_local(body, mesh, specs, out_specs)(*fitted)
  if with_stats:
    return [(sharding_lib.like(y, x), st) for (y, st), x in zip(outs, leaves)]
  return [sharding_lib.like(y, x) for y, x in zip(outs, leaves)]


def _returns_stats(ns, leaves, axes) -> bool:
  """Whether ``ns`` returns ``(result, column statistic)``."""
  x, (red, out) = leaves[0], axes[0]
  R = math.prod(x.shape[a] for a in red)
  O = math.prod(x.shape[a] for a in out)
  return isinstance(jax.eval_shape(ns, jax.ShapeDtypeStruct((2, R, O), x.dtype)), tuple)


def _without(spec, axes):
  """``spec`` with the entries of ``axes`` replaced by None."""
  return jax.sharding.PartitionSpec(*[None if a in axes else e for a, e in enumerate(spec)])


def _plan(leaves, placements, axes, mesh):
  """Per leaf ``(perm, local shape in perm order, batch axes, reduction axes)``, and the
  families: ``{family key: leaf indices}``."""
  plans = []
  families: dict[tuple, list[int]] = {}
  for i, (x, p, (red, out)) in enumerate(zip(leaves, placements, axes)):
    perm = layout.permutation(x.ndim, red, out)
    local = p.local_shape(x.shape)
    plans.append((perm, tuple(local[a] for a in perm), len(layout.batch_axes(x.ndim, red, out)),
                  len(red)))
    families.setdefault(_family_key(x.shape, x.dtype, p, red, out, mesh), []).append(i)
  return plans, families


class _Family:
  """One family of same-shaped matrices inside ``shard_map``: its local
  blocks gathered into whole matrices on their devices (:meth:`gather`),
  Newton–Schulz run on them (:meth:`run`), and the results laid back
  (:meth:`scatter`)."""

  def __init__(self, mesh, key, plans, max_elements, placed):
    R, O, _, self.red_names, self.out_names, self.free = key
    self.R, self.O, self.plans, self.max_elements, self.placed = R, O, plans, max_elements, placed
    self.n_red, self.n_out, self.n_free = (_size(mesh, self.red_names),
                                           _size(mesh, self.out_names), _size(mesh, self.free))

  def size(self) -> int:
    """Matrices in the family."""
    return sum(math.prod(pshape[:nb]) for (_, pshape, nb, _) in self.plans)

  def gather(self, locals_, members):
    """The family's local blocks as one ``(b, R_loc, O_loc)`` stack, padded
    to the devices that share it, re-laid out so that every device holds
    ``k`` whole matrices."""
    mats, self.counts = [], []
    for i, (perm, pshape, nb, _) in zip(members, self.plans):
      y = locals_[i]
      if not layout.is_identity(perm):
        y = jnp.transpose(y, perm)
      b = math.prod(pshape[:nb])
      mats.append(y.reshape(b, self.R // self.n_red, self.O // self.n_out))
      self.counts.append(b)
    x = mats[0] if len(mats) == 1 else jnp.concatenate(mats, axis=0)
    B = self.B = x.shape[0]
    share = self.share = self.n_red * self.n_out * self.n_free
    # Slots per device: a family of two or more matrices runs batched on
    # every device, never as a lone matrix, because the unsharded step runs
    # it batched and a compiler may lower a batch of one differently (XLA's
    # CPU backend drops the unit batch axis and picks another dot, whose
    # rounding differs). The result then stays bitwise the unsharded one.
    min_batch = min(2, matrices_per_call(self.max_elements, self.R * self.O) or 2)
    k = self.k = max(-(-B // share), min(B, min_batch))
    padded = self.padded = k * share
    shift = self.shift = self.placed % padded
    if padded != B:
      x = jnp.concatenate([x, jnp.zeros((padded - B,) + x.shape[1:], x.dtype)])
      if shift:
        x = jnp.roll(x, shift, axis=0)
    per_free = padded // self.n_free
    self.f_idx = jax.lax.axis_index(_axis(self.free)) if self.free else 0
    if self.free:
      x = jax.lax.dynamic_slice_in_dim(x, self.f_idx * per_free, per_free, axis=0)
    if self.red_names:
      x = jax.lax.all_to_all(x, _axis(self.red_names), 0, 1, tiled=True)
    if self.out_names:
      x = jax.lax.all_to_all(x, _axis(self.out_names), 0, 2, tiled=True)
    return x

  def run(self, x, ns):
    """``ns`` on this device's whole matrices, skipped where all of them are
    padding."""
    # Device (f, r, o) holds slots [k·d, k·(d+1)), d = (f·n_red + r)·n_out + o.
    k, padded, shift, B = self.k, self.padded, self.shift, self.B
    real = [(pos - shift) % padded < B for pos in range(padded)]
    busy = [any(real[d * k:(d + 1) * k]) for d in range(self.share)]
    if all(busy):
      return ns(x)
    r_idx = jax.lax.axis_index(_axis(self.red_names)) if self.red_names else 0
    o_idx = jax.lax.axis_index(_axis(self.out_names)) if self.out_names else 0
    d = (self.f_idx * self.n_red + r_idx) * self.n_out + o_idx
    shaped = jax.eval_shape(ns, x)
    return jax.lax.cond(jnp.asarray(busy)[d], ns,
                        lambda v: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shaped), x)

  def scatter(self, y):
    """The results back in each leaf's local layout (the collectives of
    :meth:`gather` in reverse, and an ``all_gather`` over the replica axes);
    for ``(result, column statistic)``, pairs."""
    if isinstance(y, tuple):
      y, stat = y
      return list(zip(self._scatter(y), self._scatter(stat[:, None, :], gather_rows=True)))
    return self._scatter(y)

  def _scatter(self, y, gather_rows=False):
    # gather_rows: ``y`` has one row per matrix (a column statistic): the
    # devices of the reduction side each get all of it (an all_gather, in
    # the order the all_to_all concatenates matrices), not a block of rows.
    if self.out_names:
      y = jax.lax.all_to_all(y, _axis(self.out_names), 2, 0, tiled=True)
    if self.red_names:
      y = (jax.lax.all_gather(y, _axis(self.red_names), axis=0, tiled=True) if gather_rows else
           jax.lax.all_to_all(y, _axis(self.red_names), 1, 0, tiled=True))
    if self.free:
      y = jax.lax.all_gather(y, _axis(self.free), axis=0, tiled=True)
    if self.padded != self.B:
      if self.shift:
        y = jnp.roll(y, -self.shift, axis=0)
      y = y[:self.B]
    parts, start = [], 0
    for (perm, pshape, nb, n_red), b in zip(self.plans, self.counts):
      part = y if len(self.plans) == 1 else jax.lax.slice_in_dim(y, start, start + b)
      start += b
      if gather_rows:   # the reduction axes (after the batch axes in perm order) of size 1
        pshape = pshape[:nb] + (1,) * n_red + pshape[nb + n_red:]
      part = part.reshape(pshape)
      if not layout.is_identity(perm):
        part = jnp.transpose(part, layout.inverse(perm))
      parts.append(part)
    return parts
