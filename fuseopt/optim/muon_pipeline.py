"""Muon's step as one loop over typed stages, for ``update`` and the fused step.

.. code-block:: text

  plan (muon_plan) -> momentum (muon_momentum) -> Newton-Schulz calls
  (muon_newton_schulz) -> finish (muon_finish) -> store (muon_store)

:func:`run` plans the step once (:func:`fuseopt.optim.muon_plan.plan`), then
walks its :class:`Round` s: each starts some leaves (their momentum pass, the
Newton-Schulz input cut into matrices), runs some of the plan's calls, and
finishes the leaves whose last call it ran (the finish arithmetic, then the
``store``: nothing in ``update``, the parameter's new value in the fused
step). The two paths differ only in their rounds (:func:`rounds`):

* ``update``: one round, every momentum pass, then every call, then every
  finish, as optax orders them;
* the fused step (``store`` given): one round a call, fenced by an
  ``optimization_barrier`` to the previous round's finished parameters, so
  that a step holds one call's working set at a time, whatever the size of
  the tree (docs/fused_step.md).

The stages hand each other values (the plan, a leaf's
:class:`~fuseopt.optim.muon_momentum.Moved`, a call's results, a
:class:`~fuseopt.optim.muon_finish.PiecesResult` or
:class:`~fuseopt.optim.muon_finish.LeafResult`), never attributes set on a
transform.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from fuseopt.kernels import sharding as kernel_sharding
from fuseopt.optim import mantissa
from fuseopt.optim import matrix_views
from fuseopt.optim import muon_finish
from fuseopt.optim import muon_momentum
from fuseopt.optim import muon_newton_schulz
from fuseopt.optim import muon_plan
from fuseopt.optim import muon_store

__all__ = ["Direction", "Round", "rounds", "run"]


@dataclasses.dataclass(frozen=True)
class Direction:
  """Muon's direction as values: what :func:`~fuseopt.optim.scale_by_muon`'s
  arguments decide, read by :func:`run` (for ``update`` and for the fused
  step alike) and by the transform's ``init``.

  Attributes:
    specs: the leaves' specs (:class:`~fuseopt.optim.muon_plan.SpecReader`).
    matrices_only: every leaf must be 2-D (``weight_dimension_numbers=None``).
    beta, nesterov, adaptive, shape_scaling, consistent_rms: the arithmetic.
    ns_max_elements: the most matrix elements a call (None: the platform's).
    shardings: the parameters' shardings on an Auto mesh, or None.
    ns: Newton-Schulz on a ``(batch, rows, cols)`` stack (the piece's
      wrapper included).
    fused_ns_input_dtype: the fused step's Newton-Schulz input dtype (None:
      each leaf's own).
    mu_dtype: the momentum's dtype (None: the parameter's), or ``"int8"``
      (8-bit codes and block scales where the last axis divides by 256).
    state_coeffs: ``ns_coeffs`` as the state keeps it.
    piece: an :class:`~fuseopt.optim.muon_finish.UpdatePiece`, or None.
  """
  specs: muon_plan.SpecReader
  matrices_only: bool
  beta: Any
  nesterov: bool
  adaptive: bool
  shape_scaling: bool
  consistent_rms: Any
  ns_max_elements: Optional[int]
  shardings: Any
  ns: Callable[[jax.Array], Any]
  fused_ns_input_dtype: Any
  mu_dtype: Any
  state_coeffs: Any
  piece: Optional[muon_finish.UpdatePiece] = None


class Round(NamedTuple):
  """One turn of :func:`run`'s loop.

  Attributes:
    starting: leaves whose momentum pass runs at the round's start.
    calls: the plan's calls it runs (indices into ``MuonPlan.calls``).
    finishing: leaves finished after them.
    fenced: the starting leaves' inputs are tied to the previous round's
      finished parameters by an ``optimization_barrier``.
    pinned: each starting leaf's new momentum and Newton-Schulz input are
      materialised together, in the pass that writes the momentum.
  """
  starting: tuple
  calls: tuple
  finishing: tuple
  fenced: bool = False
  pinned: bool = False


def rounds(plan: muon_plan.MuonPlan, sequenced: bool) -> list[Round]:
  """The rounds of a step: one for ``update``; for the fused step
  (``sequenced``) one per all-to-all call, one for the leaves Muon passes
  through, then one per batched call (a leaf starts at its first call and is
  finished at its last)."""
  leaves = plan.leaves
  if not sequenced:
    every = tuple(range(len(leaves)))
    return [Round(every, tuple(range(len(plan.calls))), every)]
  out = [Round(c.leaves, (k,), c.leaves, fenced=True)
         for k, c in enumerate(plan.calls) if c.across_mesh]
  through = tuple(i for i, leaf in enumerate(leaves) if leaf.cut is None)
  out.append(Round(through, (), through))
  for k, c in enumerate(plan.calls):
    if c.across_mesh:
      continue
    called = sorted(set(c.leaves))
    out.append(Round(tuple(i for i in called if leaves[i].first_call == k), (k,),
                     tuple(i for i in called if leaves[i].last_call == k),
                     fenced=True, pinned=True))
  return out


def run(direction: Direction, updates, state, *, store=None, shardings=None, grad_fn=None,
        params=None):
  """Muon's direction of ``updates`` from the direction's ``state``:
  ``(leaves, treedef, new state)``.

  Without ``store`` (``update``) the leaves are the direction. With
  ``store(i, u, p, leaf)`` (the fused step: leaf ``i``'s update ``u``, its
  parameter ``p`` of ``params``, its :class:`~fuseopt.optim.muon_plan.LeafPlan`
  -> the new parameter) they are the new parameters, each written as its
  last call completes. ``shardings`` (the step's) wins over the direction's;
  ``grad_fn`` maps each gradient leaf before its momentum pass (a clip
  factor). The new state keeps the momentum's stored dtype, a piece's state
  updated with it.
  """
  g_leaves, treedef = jax.tree.flatten(updates)
  sequenced = store is not None
  p_leaves = list(params) if sequenced else [None] * len(g_leaves)
  # The dtype a leaf's direction is finished in: the gradient's (optax's
  # convention for the updates it returns), except for a mantissa-tracked
  # parameter in the fused step, whose master is fp32: there the direction
  # stays fp32, as an fp32 run's would (a bf16 one would round the step
  # before it reaches the master). It lives only inside the fused pass.
  out_dtypes = [jnp.float32 if p is not None and mantissa.is_tracked(p) else g.dtype
                for g, p in zip(g_leaves, p_leaves)]
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(updates)[0]]
  plan = muon_plan.plan(
      direction.specs(updates), g_leaves, paths, out_dtypes=out_dtypes,
      ns_input_dtype=direction.fused_ns_input_dtype if sequenced else None,
      shardings=kernel_sharding.flatten_shardings(
          direction.shardings if shardings is None else shardings,
          muon_store.leaf_shaped(state.mu),
          owner="scale_by_muon", strict=True),
      max_elements=direction.ns_max_elements, matrices_only=direction.matrices_only)
  piece = direction.piece
  walk = _Walk(direction, plan, g_leaves, treedef.flatten_up_to(state.mu), p_leaves,
               None if piece is None else treedef.flatten_up_to(getattr(state, piece.state_field)),
               muon_momentum.bias_correction(direction.beta, state.count), grad_fn, store)
  for rnd in rounds(plan, sequenced):
    walk.start(rnd)
    walk.call(rnd)
    walk.finish(rnd)
  new_state = state._replace(count=walk.correction.count, mu=treedef.unflatten(walk.mu))
  if piece is not None:
    new_state = new_state._replace(**{piece.state_field: treedef.unflatten(walk.piece_state)})
  return walk.out, treedef, new_state


class _Walk:
  """The values in flight through :func:`run`'s rounds: each leaf's momentum
  pass (:class:`~fuseopt.optim.muon_momentum.Moved`), its NS input cut into
  matrices, the calls' results, and what is finished (``out``: updates or new
  parameters; ``mu`` and ``piece_state``: the new state's leaves)."""

  def __init__(self, direction, plan, g_leaves, m_old, p_leaves, piece_old, correction, grad_fn,
               store):
    self.direction, self.plan, self.correction = direction, plan, correction
    self.g_leaves, self.m_old, self.p_leaves, self.piece_old = g_leaves, m_old, p_leaves, piece_old
    self.grad_fn, self.store = grad_fn, store
    self.batched_ns = muon_newton_schulz.replicated(direction.ns)
    n = len(g_leaves)
    self.out, self.mu = [None] * n, [None] * n
    self.piece_state = None if piece_old is None else list(piece_old)
    self.moved, self.held, self.cut, self.parts, self.results = {}, {}, {}, {}, {}
    self.done = []   # the leaves the previous round's calls finished

  def start(self, rnd: Round):
    """The momentum pass of the round's starting leaves, their NS inputs cut."""
    inputs = [(self.g_leaves[i], self.m_old[i], self.p_leaves[i]) for i in rnd.starting]
    if rnd.fenced:
      # Whatever the compiler makes of the inputs (a TPU re-lays out a tall
      # matrix for its transposed NS input) is made within the round; the
      # finished parameters are taken from the barrier too, or the compiler
      # drops that half.
      inputs, finished = jax.lax.optimization_barrier(
          (inputs, [self.out[i] for i in self.done]))
      for i, p in zip(self.done, finished):
        self.out[i] = p
    direction = self.direction
    for i, (g, m, p) in zip(rnd.starting, inputs):
      leaf = self.plan.leaves[i]
      mv = muon_momentum.momentum(
          g if self.grad_fn is None else self.grad_fn(g), m, beta=direction.beta,
          nesterov=direction.nesterov, correction=self.correction, leaf_index=i,
          ns_dtype=leaf.ns_dtype, experts=leaf.experts, slices=leaf.momentum_slices)
      if rnd.pinned:
        # The NS input materialised in the leaf's layout, in the pass that
        # writes the momentum in place: else the compiler splits the pass
        # around the NS orientation's transpose, and both halves reading the
        # old momentum cost a copy of it (docs/fused_step.md).
        stored, h = jax.lax.optimization_barrier((mv.stored, mv.ns_input))
        mv = mv._replace(stored=stored, ns_input=h)
      self.moved[i], self.held[i], self.mu[i] = mv, p, mv.stored
      if rnd.pinned:
        self._cut(i)
    if not rnd.pinned:
      # (unpinned, the inputs are cut after every pass of the round: the
      # order update's program has always had)
      for i in rnd.starting:
        self._cut(i)

  def _cut(self, i):
    leaf = self.plan.leaves[i]
    if leaf.placement == muon_plan.BATCHED:
      self.cut[i] = matrix_views.split(self.moved[i].ns_input, leaf.cut, leaf.path)

  def call(self, rnd: Round):
    """The round's Newton-Schulz calls, where the plan placed them."""
    for k in rnd.calls:
      call = self.plan.calls[k]
      if call.across_mesh:
        ns, ns_input = self.direction.ns, lambda i, j: self.moved[i].ns_input
      else:
        ns, ns_input = self.batched_ns, lambda i, j: self.cut[i][0][j].matrix
      for key, y in muon_newton_schulz.run_call(self.plan, call, ns, ns_input):
        self.parts.setdefault(key, []).append(y)

  def _join(self, finishing):
    """The ``finishing`` leaves' results, each piece's joined from its calls."""
    for key in [key for key in self.parts if key[0] in finishing]:
      self.results[key] = muon_newton_schulz.concat(self.parts.pop(key))

  def finish(self, rnd: Round):
    """The round's finishing leaves: the finish arithmetic, then the store."""
    if not rnd.pinned:
      self._join(set(rnd.finishing))
    direction, store = self.direction, self.store
    for i in rnd.finishing:
      leaf, mv = self.plan.leaves[i], self.moved[i]
      if leaf.cut is None:
        self.out[i] = mv.ns_input if store is None else store(i, mv.ns_input, self.held[i], leaf)
        continue
      if rnd.pinned:
        self._join({i})
      u, new = muon_finish.finish(
          _result(leaf, mv, self.cut.get(i), self.results, i), dtype=leaf.out_dtype,
          active=mv.active, adaptive=direction.adaptive, shape_scaling=direction.shape_scaling,
          consistent_rms=direction.consistent_rms, piece=direction.piece,
          piece_state=None if self.piece_old is None else self.piece_old[i],
          count=self.correction.count, leaf_index=i)
      if self.piece_state is not None:
        self.piece_state[i] = new
      self.out[i] = muon_store.in_leaf_layout(
          u if store is None else store(i, u, self.held[i], leaf), self.plan.platform)
    if rnd.calls:
      self.done = list(rnd.finishing)


def _result(leaf, mv, cut, results, i):
  """Leaf ``i``'s Newton-Schulz result in the layout its calls gave it (a
  call's result is an array, or ``(array, extra)`` where a piece's wrapper
  returns what it reads beside it)."""
  if leaf.placement == muon_plan.ALL_TO_ALL:
    y = results[(i, 0)]
    y, extra = y if isinstance(y, tuple) else (y, None)
    return muon_finish.LeafResult(mv.ns_input, y, leaf.views, leaf.shape, leaf.mesh_placement,
                                  extra)
  pieces, merge = cut
  outputs = [results[(i, j)] for j in range(len(pieces))]
  extras = None
  if isinstance(outputs[0], tuple):
    outputs, extras = [o[0] for o in outputs], [o[1] for o in outputs]
  return muon_finish.PiecesResult(pieces, merge, outputs, leaf.views, leaf.shape, extras)
