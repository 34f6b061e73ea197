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
    per_device = 2 if max_elements is None else max(2, max_elements // (R * O))
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
    if len(family_rounds) > 1 and sum(count(i) for i in family_rounds[-1]) == 1:
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
      ``shard_map`` (a Pallas kernel is fine: its operands are local).
    max_elements: the unsharded step's most matrix elements per NS call
      (``None``: no limit). A family of two or more matrices runs at least
      two to a device's ``ns`` call (padding slots fill it) unless the
      unsharded step would run them one at a time (``max_elements`` below
      two matrices).

  Returns:
    ``ns``'s result for each leaf, in the leaf's layout and sharding.
  """
  mesh = placements[0].mesh
  for p in placements[1:]:
    if not sharding_lib.same_mesh(p.mesh, mesh):
      raise ValueError("orthogonalize_sharded: all leaves must live on one mesh")
  all_names = tuple(mesh.axis_names)

  plans = []   # per leaf: perm, local perm shape, group key
  groups: dict[tuple, list[int]] = {}
  for i, (x, p, (red, out)) in enumerate(zip(leaves, placements, axes)):
    batch = tuple(a for a in range(x.ndim) if a not in red and a not in out)
    perm = batch + tuple(red) + tuple(out)
    local = p.local_shape(x.shape)
    used = {n for a in range(x.ndim) for n in p.axis_names(a)}
    free = tuple(n for n in all_names if n not in used and mesh.shape[n] > 1)
    R = math.prod(x.shape[a] for a in red)
    O = math.prod(x.shape[a] for a in out)
    key = (R, O, jnp.dtype(x.dtype).name, _names(p, red[:1]), _names(p, out[:1]), free)
    plans.append((perm, tuple(local[a] for a in perm), len(batch)))
    groups.setdefault(key, []).append(i)

  def body(*locals_):
    results = [None] * len(locals_)
    placed = 0   # matrices placed so far, for round-robin padding
    for (R, O, _, red_names, out_names, free), members in groups.items():
      n_red, n_out, n_free = (_size(mesh, red_names), _size(mesh, out_names),
                              _size(mesh, free))
      mats, counts = [], []
      for i in members:
        perm, pshape, nb = plans[i]
        y = locals_[i]
        if perm != tuple(range(y.ndim)):
          y = jnp.transpose(y, perm)
        b = math.prod(pshape[:nb])
        mats.append(y.reshape(b, R // n_red, O // n_out))
        counts.append(b)
      x = mats[0] if len(mats) == 1 else jnp.concatenate(mats, axis=0)
      B = x.shape[0]
      share = n_red * n_out * n_free
      # Slots per device: a family of two or more matrices runs batched on
      # every device, never as a lone matrix, because the unsharded step runs
      # it batched and a compiler may lower a batch of one differently (XLA's
      # CPU backend drops the unit batch axis and picks another dot, whose
      # rounding differs). The result then stays bitwise the unsharded one.
      min_batch = 2 if max_elements is None or max_elements // (R * O) >= 2 else 1
      k = max(-(-B // share), min(B, min_batch))
      padded = k * share
      shift = placed % padded
      placed += B
      if padded != B:
        x = jnp.concatenate([x, jnp.zeros((padded - B,) + x.shape[1:], x.dtype)])
        if shift:
          x = jnp.roll(x, shift, axis=0)
      per_free = padded // n_free
      f_idx = jax.lax.axis_index(_axis(free)) if free else 0
      if free:
        x = jax.lax.dynamic_slice_in_dim(x, f_idx * per_free, per_free, axis=0)
      if red_names:
        x = jax.lax.all_to_all(x, _axis(red_names), 0, 1, tiled=True)
      if out_names:
        x = jax.lax.all_to_all(x, _axis(out_names), 0, 2, tiled=True)
      # Device (f, r, o) holds slots [k·d, k·(d+1)), d = (f·n_red + r)·n_out + o.
      real = [(pos - shift) % padded < B for pos in range(padded)]
      busy = [any(real[d * k:(d + 1) * k]) for d in range(share)]
      if not all(busy):
        # Skip the NS where all of this device's slots are padding.
        r_idx = jax.lax.axis_index(_axis(red_names)) if red_names else 0
        o_idx = jax.lax.axis_index(_axis(out_names)) if out_names else 0
        d = (f_idx * n_red + r_idx) * n_out + o_idx
        shaped = jax.eval_shape(ns, x)
        y = jax.lax.cond(jnp.asarray(busy)[d], ns,
                         lambda v: jnp.zeros(shaped.shape, shaped.dtype), x)
      else:
        y = ns(x)
      if out_names:
        y = jax.lax.all_to_all(y, _axis(out_names), 2, 0, tiled=True)
      if red_names:
        y = jax.lax.all_to_all(y, _axis(red_names), 1, 0, tiled=True)
      if free:
        y = jax.lax.all_gather(y, _axis(free), axis=0, tiled=True)
      if padded != B:
        if shift:
          y = jnp.roll(y, -shift, axis=0)
        y = y[:B]
      start = 0
      for i, b in zip(members, counts):
        perm, pshape, _ = plans[i]
        part = y if len(members) == 1 else jax.lax.slice_in_dim(y, start, start + b)
        start += b
        part = part.reshape(pshape)
        if perm != tuple(range(len(perm))):
          part = jnp.transpose(part, tuple(sorted(range(len(perm)), key=perm.__getitem__)))
        results[i] = part
    return tuple(results)

  specs = tuple(p.spec for p in placements)
  fitted = [sharding_lib.to_spec(x, p) for x, p in zip(leaves, placements)]
  outs = sharding_lib.shard_local(body, mesh, specs, specs)(*fitted)
  return [sharding_lib.like(y, x) for y, x in zip(outs, leaves)]

