"""The Newton-Schulz calls of a Muon update: how same-shaped matrices are
batched into calls (at most ``max_elements`` a call; :func:`_stages` plans
them, :func:`_run_call` is the one loop that runs a call), which leaves take the
distributed all-to-all path, and the two orders the calls run in: all momentum
passes first (``update``), or one call at a time with its momentum pass and
parameter update around it (the fused step)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from fuseopt.kernels import sharding as kernel_sharding
from fuseopt.kernels.newton_schulz import distributed as distributed_ns
from fuseopt.optim import matrix_views
from fuseopt.optim.muon_step import _MuonConfig, _MuonStep, _piece_shapes


def _call_plan(batches, matrix_elements, max_elements):
  """How a family of same-shaped matrices (``batches[k]`` of them in member
  ``k``) goes into NS calls of at most ``max_elements`` elements: a list of
  calls, each a list of ``(k, start, stop)`` batch ranges."""
  total = sum(batches)
  per_call = distributed_ns.matrices_per_call(max_elements, matrix_elements) or total
  sizes = [per_call] * (total // per_call) + ([total % per_call] if total % per_call else [])
  if per_call > 1 and len(sizes) > 1 and sizes[-1] == 1:
    # No lone matrix in a batched family: the sharded step runs every
    # family batched (distributed_ns.orthogonalize_sharded), and a batch of
    # one may round differently. With two per call, the last call takes three.
    sizes[-2:] = [sizes[-2] - 1, 2] if sizes[-2] > 2 else [sizes[-2] + 1]
  calls, current = [], []
  room = sizes[0] if sizes else 0
  for k, batch in enumerate(batches):
    start = 0
    while start < batch:
      take = min(room, batch - start)
      current.append((k, start, start + take))
      start += take
      room -= take
      if room == 0:
        calls.append(current)
        current = []
        room = sizes[len(calls)] if len(calls) < len(sizes) else 0
  if current:
    calls.append(current)
  return calls


def _slice(y, a, b):
  """Batch rows ``[a, b)`` of an NS result (or of a ``(result, column
  sums)`` pair: both have the batch first)."""
  return jax.tree.map(lambda t: jax.lax.slice_in_dim(t, a, b), y)


def _concat(parts):
  """NS results (or pairs) joined along the batch."""
  if len(parts) == 1:
    return parts[0]
  return jax.tree.map(lambda *t: jnp.concatenate(t, axis=0), *parts)


def _stages(groups, max_elements):
  """The batched NS calls of same-shaped families, in order: ``groups`` maps
  ``(rows, cols, dtype)`` to its members ``[(leaf, piece, batch)]``;
  returns ``[(members, call)]``, ``call`` one call's ``(member, start,
  stop)`` batch ranges (:func:`_call_plan`)."""
  stages = []
  for (rows, cols, _), members in groups.items():
    for call in _call_plan([b for _, _, b in members], rows * cols, max_elements):
      stages.append((members, call))
  return stages


def _run_call(members, call, matrix, ns):
  """The one batching loop: one NS call over the batch ranges ``call`` of
  the members' matrices (``matrix(leaf, piece)``, each ``(batch, rows,
  cols)``) joined along the batch, its result cut back; returns
  ``[((leaf, piece), result part)]`` in batch order."""
  xs = []
  for k, a, b in call:
    i, j, batch = members[k]
    x = matrix(i, j)
    xs.append(x if (a, b) == (0, batch) else jax.lax.slice_in_dim(x, a, b))
  y = ns(xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=0))
  out, offset = [], 0
  for k, a, b in call:
    i, j, _ = members[k]
    out.append(((i, j), y if len(call) == 1 else _slice(y, offset, offset + b - a)))
    offset += b - a
  return out


def _place_ns_inputs(mu_hat, specs, leaf_shardings, paths, ns_budget, ns_input_dtype=None):
  """Which Muon leaves take the distributed (all-to-all) Newton-Schulz.

  Returns ``(plan, {leaf: position in the plan})``: the
  :class:`~fuseopt.kernels.newton_schulz.distributed.Plan` of every Muon
  leaf on a multi-device mesh whose placement is known (plain matrices and
  matrix views alike), or ``(None, {})``. Leaves not in it run the
  single-device path: one device, or an Auto mesh without ``shardings``
  (XLA partitions it, with a warning), or a layout the plan cannot take
  (uneven shards: replicated, with a warning naming the leaf).
  """
  taken, placements, views, structs = {}, [], [], []
  for i, (h, s) in enumerate(zip(mu_hat, specs)):
    if s is None:
      continue
    where = kernel_sharding.placement_of(
        h, leaf_shardings[i] if leaf_shardings else None,
        what=f"scale_by_muon: shardings of the leaf at {paths[i]!r}")
    if where is kernel_sharding.UNKNOWN:
      kernel_sharding.warn_unknown("scale_by_muon", "shardings=")
      continue
    if not isinstance(where, kernel_sharding.Placement):
      continue
    geometry = matrix_views.geometry(s, h.shape, paths[i])
    why = distributed_ns.why_not(h.shape, where, geometry)
    if why is not None:
      _warn_replicated(paths[i], why)
      continue
    taken[i] = len(placements)
    placements.append(where)
    views.append(geometry)
    structs.append(jax.ShapeDtypeStruct(h.shape, ns_input_dtype or h.dtype))
  if not taken:
    return None, {}
  return distributed_ns.Plan(structs, placements, views, ns_budget), taken


_warned_replicated: set[str] = set()


def _warn_replicated(path, why):
  """Once per leaf: its Newton-Schulz runs replicated (gathered whole on
  every device), and why."""
  if path in _warned_replicated:
    return
  _warned_replicated.add(path)
  warnings.warn(f"scale_by_muon: the Muon leaf at {path or '<root>'} is gathered whole onto every "
                f"device for its Newton-Schulz: {why}", stacklevel=3)


def _replicated_ns(ns):
  """``ns`` for a stack that may live on a multi-device mesh: gathered, then
  run whole on every device (the fallback for layouts the all-to-all path
  does not take; a Pallas kernel must never see a sharded operand)."""
  def run(x):
    where = kernel_sharding.placement_of(x)
    if not isinstance(where, kernel_sharding.Placement):
      return ns(x)
    replicated = kernel_sharding.Placement(where.mesh,
                                           jax.sharding.PartitionSpec(*[None] * x.ndim))
    out_specs = jax.tree.map(lambda t: jax.sharding.PartitionSpec(*[None] * t.ndim),
                             jax.eval_shape(ns, x))
    return kernel_sharding.shard_local(ns, where.mesh, replicated.spec, out_specs)(
        kernel_sharding.to_spec(x, replicated))
  return run


def _direction(config: _MuonConfig, updates, state, ns_input_dtype=None, placement=None,
               finish=None, grad_fn=None, param_leaves=None):
  """The Muon direction of ``updates`` from the direction's ``state``:
  ``(u leaves, treedef, new state)``; the new momentum keeps its stored
  dtype (and a piece's state, NorMuon's ``nu``, is updated with it), the NS
  input is in ``ns_input_dtype`` (None: the gradient's).

  With ``finish`` (``(leaf index, u, parameter) -> new parameter``, and
  ``param_leaves``) the leaves are finished as their Newton-Schulz call
  completes and the first element is the finished leaves: see
  :func:`_sequenced`. ``grad_fn`` maps each gradient leaf before use (the
  clip factor of the fused step).
  """
  if grad_fn is None:
    grad_fn = lambda g: g
  piece = config.piece
  step = _MuonStep(config, updates, state.mu, state.count, ns_input_dtype,
                   grad_fn=grad_fn if finish is None else None,
                   piece_state=None if piece is None else piece.state_tree(state),
                   param_leaves=param_leaves if finish is not None else None)
  leaf_shardings = kernel_sharding.flatten_shardings(
      config.shardings if placement is None else placement, state.mu, owner="scale_by_muon",
      strict=True)
  if finish is not None:
    out, mu_leaves = _sequenced(step, param_leaves, leaf_shardings, grad_fn, finish)
  else:
    out, mu_leaves = _unsequenced(step, leaf_shardings)
  new_state = state._replace(count=step.count_inc, mu=step.treedef.unflatten(mu_leaves))
  if piece is not None:
    new_state = piece.with_state_tree(new_state, step.treedef.unflatten(step.piece_new))
  return out, step.treedef, new_state


def _unsequenced(step: _MuonStep, leaf_shardings):
  """The direction of every leaf, the momentum passes first, then the NS
  calls (``update``'s path); returns ``(u leaves, new mu leaves)``."""
  config, specs, paths = step.config, step.specs, step.paths
  mu_leaves, mu_hat, active = [], [], []
  for i, (g, m) in enumerate(zip(step.g_leaves, step.m_old)):
    stored, h, a = step.momentum(i, g, m)
    mu_leaves.append(stored)
    mu_hat.append(h)
    active.append(a)

  # Leaves on a multi-device mesh: whole matrices per device (all-to-all).
  plan, distributed = _place_ns_inputs(mu_hat, specs, leaf_shardings, paths, step.ns_budget)
  # Cut every other Muon leaf into (batch, rows, cols) families; group them by shape.
  plans = [None] * len(mu_hat)
  groups: dict[tuple, list[tuple[int, int, int]]] = {}
  for i, (h, s) in enumerate(zip(mu_hat, specs)):
    if s is None or i in distributed:
      continue
    pieces, merge = matrix_views.split(h, s, paths[i])
    plans[i] = (pieces, merge)
    for j, p in enumerate(pieces):
      groups.setdefault(p.matrix.shape[1:] + (p.matrix.dtype,), []).append(
          (i, j, p.matrix.shape[0]))

  results: dict[tuple[int, int], jax.Array] = {}
  if distributed:
    leaf_of = {k: i for i, k in distributed.items()}
    for members in plan.rounds():
      ys = plan.run([mu_hat[leaf_of[k]] for k in members], config.ns, members)
      for k, y in zip(members, ys):
        results[(leaf_of[k], 0)] = y
  parts: dict[tuple[int, int], list] = {}
  run = _replicated_ns(config.ns)
  for members, call in _stages(groups, step.ns_budget):
    for key, part in _run_call(members, call, lambda i, j: plans[i][0][j].matrix, run):
      parts.setdefault(key, []).append(part)
  results.update((key, _concat(ps)) for key, ps in parts.items())

  out = []
  for i, (h, s) in enumerate(zip(mu_hat, specs)):
    if s is None:
      out.append(h)
    elif i in distributed:
      leaf = plan.leaves[distributed[i]]
      out.append(step.in_leaf_layout(
          step.finish_distributed(i, h, results[(i, 0)], leaf.views, active[i], leaf.placement)))
    else:
      out.append(step.in_leaf_layout(step.finish_grouped(i, plans[i], results, active[i])))
  return out, mu_leaves


class _Sequencer:
  """The state of :func:`_sequenced`: finished parameters, new momenta, and
  the leaves the previous NS call finished."""

  def __init__(self, step: _MuonStep, p_leaves, grad_fn, finish):
    n = len(step.g_leaves)
    self.step, self.p_leaves, self.grad_fn, self.finish = step, p_leaves, grad_fn, finish
    self.new_p, self.mu_leaves = [None] * n, [None] * n
    self.done = []   # the leaves finished by the previous call

  def barrier(self, starting):
    """Every input of the call's leaves (gradient, momentum, parameter),
    tied to the previous call's finished parameters: whatever the compiler
    makes of the inputs (a TPU re-lays out a tall matrix for its transposed
    NS input) is made within the call. The finished parameters are taken
    from the barrier too, or the compiler drops that half."""
    step = self.step
    inputs = [(step.g_leaves[i], step.m_old[i], self.p_leaves[i]) for i in starting]
    inputs, finished = jax.lax.optimization_barrier((inputs, [self.new_p[i] for i in self.done]))
    for i, p in zip(self.done, finished):
      self.new_p[i] = p
    return inputs

  def finished(self, i, u, p):
    """Leaf ``i``'s new parameter (``finish``), in the leaf's layout."""
    return self.step.in_leaf_layout(self.finish(i, u, p))


def _sequenced(step: _MuonStep, p_leaves, leaf_shardings, grad_fn, finish):
  """The fused step's Muon leaves, one Newton-Schulz call at a time.

  Each call's leaves get their momentum pass (new momentum and NS input)
  just before the call and are finished (``finish``: the parameter update)
  right after it; an ``optimization_barrier`` ties every call's inputs to
  the previous call's finished parameters, so the compiler can neither hoist
  a later momentum pass nor defer an earlier update. Only one call's NS
  input, working set and result are live at a time, whatever the size of the
  tree. The arithmetic is the unsequenced path's. Returns ``(new parameter
  leaves, new momentum leaves)``.
  """
  seq = _Sequencer(step, p_leaves, grad_fn, finish)
  plan, distributed = _place_ns_inputs(step.g_leaves, step.specs, leaf_shardings, step.paths,
                                       step.ns_budget, step.ns_input_dtype)
  if distributed:
    _sequenced_distributed(seq, plan, distributed)
  _sequenced_grouped(seq, distributed)
  return seq.new_p, seq.mu_leaves


def _sequenced_distributed(seq: _Sequencer, plan, distributed):
  """The leaves of the all-to-all Newton-Schulz, one round at a time: a
  device's share of a round is at most ``ns_max_elements`` a family, so
  the sharded step too holds one round at a time."""
  step = seq.step
  leaf_of = {k: i for i, k in distributed.items()}
  for members in plan.rounds():
    leaves = [leaf_of[k] for k in members]
    started = {}
    for i, (g, m, p) in zip(leaves, seq.barrier(leaves)):
      started[i] = step.momentum(i, seq.grad_fn(g), m) + (p,)
    ys = plan.run([started[i][1] for i in leaves], step.config.ns, members)
    for i, k, y in zip(leaves, members, ys):
      stored, h, a, p = started[i]
      leaf = plan.leaves[k]
      seq.mu_leaves[i] = stored
      seq.new_p[i] = seq.finished(
          i, step.finish_distributed(i, h, y, leaf.views, a, leaf.placement), p)
    seq.done = leaves


def _ns_stages(step: _MuonStep, seq: _Sequencer, distributed):
  """The batched NS calls of the single-device leaves, in order, as
  ``(members, call)`` (a family's members and one call's batch ranges of
  them); leaves without a spec are finished on the way."""
  groups: dict[tuple, list[tuple[int, int, int]]] = {}
  for i, (g, s) in enumerate(zip(step.g_leaves, step.specs)):
    if s is None:
      stored, h, _ = step.momentum(i, seq.grad_fn(g), step.m_old[i])
      seq.mu_leaves[i], seq.new_p[i] = stored, seq.finish(i, h, seq.p_leaves[i])
    elif i not in distributed:
      dtype = jnp.dtype(step.ns_input_dtype or step.out_dtypes[i])
      for j, shape in enumerate(_piece_shapes(g, s, step.paths[i])):
        groups.setdefault(shape[1:] + (dtype,), []).append((i, j, shape[0]))
  return _stages(groups, step.ns_budget)


def _sequenced_grouped(seq: _Sequencer, distributed):
  """The single-device leaves, one batched NS call at a time: a leaf's
  momentum pass just before its first call, its parameter update right
  after its last."""
  step = seq.step
  stages = _ns_stages(step, seq, distributed)
  first, last = {}, {}
  for st, (members, call) in enumerate(stages):
    for k, _, _ in call:
      i = members[k][0]
      first.setdefault(i, st)
      last[i] = st
  plans, active, parts, held = {}, {}, {}, {}
  run = _replicated_ns(step.config.ns)
  for st, (members, call) in enumerate(stages):
    starting = sorted({members[k][0] for k, _, _ in call if first[members[k][0]] == st})
    for i, (g, m, p) in zip(starting, seq.barrier(starting)):
      held[i] = p
      stored, h, a = step.momentum(i, seq.grad_fn(g), m)
      # Materialise the NS input in the leaf's layout, in the pass that
      # writes the momentum in place: else the compiler splits the pass
      # around the NS orientation's transpose, and the two halves both
      # reading the old momentum cost a copy of it (64 MiB a down projection
      # of the 1.2 B tree). Plain layouts too: with one matrix a call and
      # bf16 momentum, XLA's GPU backend otherwise copied every MLP leaf's
      # old momentum at the start of the step (1.06 GiB of the builder
      # recipe's 1.2 B step, 0.14 GiB with the barrier).
      stored, h = jax.lax.optimization_barrier((stored, h))
      seq.mu_leaves[i], active[i] = stored, a
      plans[i] = matrix_views.split(h, step.specs[i], step.paths[i])
    for key, part in _run_call(members, call, lambda i, j: plans[i][0][j].matrix, run):
      parts.setdefault(key, []).append(part)
    seq.done = []
    for i in sorted({members[k][0] for k, _, _ in call if last[members[k][0]] == st}):
      results = {(i, j): _concat(ps) for (ii, j), ps in parts.items() if ii == i}
      seq.new_p[i] = seq.finished(i, step.finish_grouped(i, plans[i], results, active[i]), held[i])
      seq.done.append(i)
