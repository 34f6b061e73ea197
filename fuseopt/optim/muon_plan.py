"""The plan stage of Muon's step: every decision about a leaf, made once.

A Muon step reads each leaf's spec once (:class:`SpecReader`: the labels
that send it to Muon or AdamW, whether it is a stack of experts, how it is
cut into matrices), reads the leaves' placement once (the shardings), and
decides from shapes alone how its Newton-Schulz runs. The result is a value,
:class:`MuonPlan`: one :class:`LeafPlan` a leaf and the Newton-Schulz calls
in the order they run (:class:`NSCall`), each with its placement:

* ``BATCHED``: same-shaped matrices from anywhere in the tree joined along a
  batch axis on one device (at most ``max_elements`` matrix elements a call,
  :func:`call_plan`); a leaf on a mesh whose layout the all-to-all cannot
  take is gathered whole onto every device for it (with a warning);
* ``ALL_TO_ALL``: sharded leaves' matrices traded across the mesh so that each
  device orthogonalises whole matrices
  (:class:`fuseopt.kernels.newton_schulz.distributed.Plan`, one round a call).

The stages after it (momentum, the calls, the finish, the store) read the
plan and decide nothing of their own.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from fuseopt import kernels
from fuseopt.kernels import sharding as kernel_sharding
from fuseopt.kernels.adam import blocks
from fuseopt.kernels.newton_schulz import distributed as distributed_ns
from fuseopt.kernels.newton_schulz import layout as ns_layout
from fuseopt.optim import groups as groups_lib
from fuseopt.optim import matrix_views
from fuseopt.optim.matrix_views import (DIMENSION_NUMBER_TYPES, Experts, MatrixViews,
                                       MuonDimensionNumbers, unwrap_experts)

__all__ = ["ALL_TO_ALL", "BATCHED", "DEFAULT_NS_MAX_ELEMENTS", "LeafPlan", "MuonPlan", "NSCall",
           "SpecReader", "broadcast_specs", "call_plan", "cuts", "declared_specs",
           "default_ns_max_elements", "expert_cuts", "is_spec", "is_spec_or_none",
           "momentum_slices", "plan"]

# Where a Newton-Schulz call runs (NSCall.placement).
BATCHED = "batched"
ALL_TO_ALL = "all_to_all"

# Most matrix elements per Newton-Schulz call, by the platform the step runs
# on: the fused step holds one call's working set at a time, so the budget
# bounds its temporary memory. On a GPU or a TPU 2^23 (16 MiB of bf16 input:
# two 2048 x 2048 matrices a call; a larger matrix runs alone); a TPU at 2^25
# held several fp32 products of the iteration live at once, and smaller calls
# there need the new parameter's layout pinned (muon_store.in_leaf_layout).
# Elsewhere (the CPU) 2^25. docs/fused_step.md has the measurements.
DEFAULT_NS_MAX_ELEMENTS = {"gpu": 1 << 23, "cuda": 1 << 23, "rocm": 1 << 23, "tpu": 1 << 23}
DEFAULT_NS_MAX_ELEMENTS_ELSEWHERE = 1 << 25


def default_ns_max_elements(platform: str) -> int:
  """The default ``NewtonSchulz.max_elements`` for a step running on ``platform``."""
  return DEFAULT_NS_MAX_ELEMENTS.get(platform, DEFAULT_NS_MAX_ELEMENTS_ELSEWHERE)


# ---------------------------------------------------------------- specs --
def is_spec(x) -> bool:
  """A leaf's spec: dimension numbers (optax's or fuseopt's), views, experts."""
  return isinstance(x, DIMENSION_NUMBER_TYPES + (MatrixViews, Experts))


def is_spec_or_none(x) -> bool:
  """A node of a spec tree: a spec, None (not a Muon leaf), or a leaf of
  another partition (optax.MaskedNode)."""
  return x is None or is_spec(x) or groups_lib.is_masked(x)


def broadcast_specs(specs, tree):
  """Spreads a spec tree that may be a prefix of ``tree`` over its leaves
  (``tree``'s containers kept: an nnx ``Variable`` holding a leaf another
  partition masked stays one, with no leaf)."""
  return jax.tree.map(lambda spec, sub: jax.tree.map(lambda _: spec, sub), specs, tree,
                      is_leaf=is_spec_or_none)


def declared_specs(declaration, tree) -> list:
  """Each leaf's spec as ``declaration`` gives it (``scale_by_muon``'s
  ``weight_dimension_numbers``: None, a spec, a tree or prefix of specs, or
  a callable of the tree returning one), :class:`Experts` kept; None where
  Muon passes the leaf through."""
  treedef = jax.tree.structure(tree)
  if declaration is None:
    return [MuonDimensionNumbers()] * treedef.num_leaves
  specs = declaration(tree) if callable(declaration) else declaration
  if is_spec(specs):
    return [specs] * treedef.num_leaves
  return treedef.flatten_up_to(broadcast_specs(specs, tree))


def _signature(tree):
  """What a spec can depend on under ``jit``: the tree's structure (its
  paths) and its leaves' shapes and dtypes; None where it is not hashable."""
  leaves, treedef = jax.tree.flatten(tree)
  try:
    key = (treedef, tuple((jnp.shape(x), jnp.result_type(x)) for x in leaves))
    hash(key)
  except (TypeError, ValueError):
    return None
  return key


class SpecReader:
  """The leaves' specs of a Muon declaration, read once for each tree
  signature.

  ``read`` maps a tree to its leaves' declared specs (one a leaf, None
  where Muon passes it through). Under ``jit`` a spec can depend on nothing
  but the tree's structure and its leaves' shapes and dtypes, so a read is
  remembered by them: the labels of ``muon``'s partition, the Muon side's
  plan, its experts' decay gate and NorMuon's state all take the one read of
  a step (:meth:`remember` records what the Muon side of a partition will
  see, read off the whole tree).
  """

  _KEEP = 16   # signatures remembered (a step sees one or two)

  def __init__(self, read: Callable[[Any], list]):
    self._read = read
    self._memo: dict = {}

  def __call__(self, tree) -> tuple:
    key = _signature(tree)
    if key is None:
      return tuple(self._read(tree))
    if key not in self._memo:
      self._keep(key, tuple(self._read(tree)))
    return self._memo[key]

  def remember(self, tree, specs) -> None:
    """Records ``specs`` as the read of ``tree``."""
    key = _signature(tree)
    if key is not None:
      self._keep(key, tuple(specs))

  def _keep(self, key, specs):
    if len(self._memo) >= self._KEEP:
      self._memo.pop(next(iter(self._memo)))
    self._memo[key] = specs


def cuts(declared) -> list:
  """Each leaf's cut into matrices (its declared spec, :class:`Experts`
  unwrapped), None where Muon passes it through."""
  return [unwrap_experts(s)[0] for s in declared]


def expert_cuts(declared) -> list:
  """Each leaf's cut where it is declared :class:`Experts`, else None."""
  return [s if experts else None for s, experts in map(unwrap_experts, declared)]


# ------------------------------------------------------------- the plan --
class LeafPlan(NamedTuple):
  """What a step does with one leaf.

  Attributes:
    path: the leaf's key path, for messages.
    shape: the leaf's shape.
    cut: its dimension numbers or views; None: Muon passes it through.
    experts: ``cut`` where the leaf is a stack of :class:`Experts`, else None.
    views: the geometry of ``cut`` (:func:`matrix_views.geometry`), or None.
    pieces: the ``(batch, rows, cols)`` matrix families ``cut`` makes.
    out_dtype: the dtype its direction is finished in.
    ns_dtype: the dtype of its Newton-Schulz input.
    placement: where its Newton-Schulz runs (``BATCHED``, ``ALL_TO_ALL``),
      None for a leaf passed through.
    slot: its position in the all-to-all plan, or None.
    mesh_placement: where an all-to-all leaf lives on the mesh, else None.
    first_call, last_call: the first and last of the plan's calls it takes
      part in (None for a leaf passed through).
    momentum_slices: how many slices of its leading axis an 8-bit momentum
      pass takes at a time (None: the whole leaf at once), see
      :func:`momentum_slices`.
  """
  path: str
  shape: tuple
  cut: Any
  experts: Any
  views: Any
  pieces: tuple
  out_dtype: Any
  ns_dtype: Any
  placement: Optional[str]
  slot: Optional[int]
  mesh_placement: Any
  first_call: Optional[int]
  last_call: Optional[int]
  momentum_slices: Optional[int] = None


class NSCall(NamedTuple):
  """One Newton-Schulz call of a step.

  Attributes:
    placement: ``BATCHED`` or ``ALL_TO_ALL``.
    leaves: the leaves whose matrices it takes, in its order.
    slots: (all-to-all) those leaves' positions in the all-to-all plan.
    family: (batched) the same-shaped family it draws from, ``(leaf,
      piece, batch)`` a member.
    ranges: (batched) the ``(member, start, stop)`` batch ranges of the
      family it takes, joined along the batch in this order.
  """
  placement: str
  leaves: tuple
  slots: tuple = ()
  family: tuple = ()
  ranges: tuple = ()

  @property
  def across_mesh(self) -> bool:
    """Whether the call trades matrices across the mesh (all-to-all)."""
    return self.placement == ALL_TO_ALL


class MuonPlan(NamedTuple):
  """A Muon step's decisions: per leaf, and the Newton-Schulz calls in the
  order they run (the all-to-all rounds first, then the batched calls).

  Attributes:
    leaves: one :class:`LeafPlan` a leaf of the updates.
    calls: the :class:`NSCall` s.
    all_to_all: the placement of the sharded leaves' matrices
      (:class:`fuseopt.kernels.newton_schulz.distributed.Plan`), or None.
    platform: the platform the step runs on.
    max_elements: the most matrix elements one call takes.
  """
  leaves: tuple
  calls: tuple
  all_to_all: Any
  platform: str
  max_elements: int


def call_plan(batches, matrix_elements, max_elements):
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


def _matrices(shape, views) -> tuple:
  """The ``(batch, rows, cols)`` shape of each matrix family
  (:func:`matrix_views.split`'s pieces) of a leaf of ``shape``."""
  red, out = views.piece_axes()
  size = lambda p, axes: math.prod(p[a] for a in axes)
  return tuple((size(p, ns_layout.batch_axes(len(p), red, out)), size(p, red), size(p, out))
               for p in views.piece_shapes(shape))


def plan(declared, leaves, paths, *, out_dtypes, ns_input_dtype, shardings, max_elements,
         matrices_only: bool = False) -> MuonPlan:
  """The plan of one step over the gradient ``leaves``.

  Args:
    declared: each leaf's spec (a :class:`SpecReader`'s read).
    leaves, paths: the gradient leaves (only shapes, dtypes and placements
      are read) and their key paths.
    out_dtypes: the dtype each leaf's direction is finished in.
    ns_input_dtype: the Newton-Schulz input's dtype, or None for each leaf's
      ``out_dtype``.
    shardings: each leaf's sharding where the mesh axes are Auto, or None.
    max_elements: the most matrix elements a call (None: the platform's).
    matrices_only: every leaf must be a 2-D matrix (``scale_by_muon``'s
      ``weight_dimension_numbers=None``).
  """
  if matrices_only:
    _check_matrices(paths, leaves)
  platform = kernels.current_platform(leaves)
  budget = max_elements if max_elements is not None else default_ns_max_elements(platform)
  cut_of, experts_of = cuts(declared), expert_cuts(declared)
  views = [None if c is None else matrix_views.geometry(c, jnp.shape(g), p)
           for c, g, p in zip(cut_of, leaves, paths)]
  ns_dtypes = [jnp.dtype(ns_input_dtype if c is not None and ns_input_dtype else d)
               for c, d in zip(cut_of, out_dtypes)]
  mesh_plan, slots = _all_to_all(leaves, paths, views, ns_dtypes, shardings, budget)

  calls, first, last = [], {}, {}
  if mesh_plan is not None:
    leaf_of = {k: i for i, k in slots.items()}
    for members in mesh_plan.rounds():
      called = tuple(leaf_of[k] for k in members)
      for i in called:
        first[i] = last[i] = len(calls)
      calls.append(NSCall(ALL_TO_ALL, called, slots=tuple(members)))
  families: dict[tuple, list[tuple[int, int, int]]] = {}
  for i, (g, v) in enumerate(zip(leaves, views)):
    if v is None or i in slots:
      continue
    for j, (batch, rows, cols) in enumerate(_matrices(jnp.shape(g), v)):
      families.setdefault((rows, cols, ns_dtypes[i]), []).append((i, j, batch))
  for (rows, cols, _), members in families.items():
    for ranges in call_plan([b for _, _, b in members], rows * cols, budget):
      called = tuple(members[k][0] for k, _, _ in ranges)
      for i in called:
        first.setdefault(i, len(calls))
        last[i] = len(calls)
      calls.append(NSCall(BATCHED, called, family=tuple(members), ranges=tuple(ranges)))

  leaf_plans = tuple(
      LeafPlan(path=p, shape=tuple(jnp.shape(g)), cut=c, experts=e, views=v,
               pieces=() if v is None else _matrices(jnp.shape(g), v), out_dtype=d, ns_dtype=n,
               placement=None if c is None else ALL_TO_ALL if i in slots else BATCHED,
               slot=slots.get(i),
               mesh_placement=None if i not in slots else mesh_plan.leaves[slots[i]].placement,
               first_call=first.get(i), last_call=last.get(i),
               momentum_slices=None if c is None or e is not None or i in slots else
               momentum_slices(g, shardings[i] if shardings else None, budget))
      for i, (g, p, c, e, v, d, n) in enumerate(zip(leaves, paths, cut_of, experts_of, views,
                                                    out_dtypes, ns_dtypes)))
  return MuonPlan(leaf_plans, tuple(calls), mesh_plan, platform, budget)


def momentum_slices(g, sharding, budget) -> Optional[int]:
  """The slices of ``g``'s leading axis one momentum pass takes at a time
  where the leaf is a stack (3 or more axes) of more than ``budget``
  elements (the Newton-Schulz call budget), lives on one device, and its
  quantisation blocks lie within a slice; else None (the whole leaf in one
  pass).

  An 8-bit momentum's pass holds the values it quantises in fp32, whole,
  before their blocks' absmax is known: a stack of 34 layers' (2048, 8192)
  matrices would hold 2.3 GB of fp32 at once. A pass over slices of the
  layers holds one slice's. The slices divide the axis evenly (the largest
  divisor of its length within the budget), and each slice's counter-hash
  indices are its elements' indices in the whole leaf, so the codes are
  the same bits as one pass over the leaf. A leaf of one matrix is passed
  whole: its fp32 is one matrix's, as its Newton-Schulz call's working set
  is, and a loop over its rows cost a v6e's fused hybrid step on the 1.2 B
  tree of 2-D leaves 1.8 GB of temp where the whole passes took 0.26.
  """
  shape = tuple(jnp.shape(g))
  size = math.prod(shape)
  if (len(shape) < 3 or size <= budget or not blocks.fits(shape)
      or blocks.trailing_axes(shape) >= len(shape)):
    return None
  if kernel_sharding.placement_of(g, sharding) is not kernel_sharding.UNSHARDED:
    return None
  fit = max(1, budget // (size // shape[0]))
  return max(k for k in range(1, min(fit, shape[0]) + 1) if shape[0] % k == 0)


def _all_to_all(leaves, paths, views, ns_dtypes, shardings, budget):
  """Which Muon leaves take the distributed (all-to-all) Newton-Schulz:
  ``(plan, {leaf: position in the plan})``, or ``(None, {})``.

  Every Muon leaf on a multi-device mesh whose placement is known (plain
  matrices and matrix views alike) is in it. The others run batched: one
  device, or an Auto mesh without ``shardings`` (XLA partitions it, with a
  warning), or a layout the plan cannot take (uneven shards: gathered whole,
  with a warning naming the leaf).
  """
  taken, placements, geometries, structs = {}, [], [], []
  for i, (g, v) in enumerate(zip(leaves, views)):
    if v is None:
      continue
    where = kernel_sharding.placement_of(
        g, shardings[i] if shardings else None,
        what=f"scale_by_muon: shardings of the leaf at {paths[i]!r}")
    if where is kernel_sharding.UNKNOWN:
      kernel_sharding.warn_unknown("scale_by_muon", "shardings=")
      continue
    if not isinstance(where, kernel_sharding.Placement):
      continue
    why = distributed_ns.why_not(jnp.shape(g), where, v)
    if why is not None:
      _warn_replicated(paths[i], why)
      continue
    taken[i] = len(placements)
    placements.append(where)
    geometries.append(v)
    structs.append(jax.ShapeDtypeStruct(jnp.shape(g), ns_dtypes[i]))
  if not taken:
    return None, {}
  return distributed_ns.Plan(structs, placements, geometries, budget), taken


_warned_replicated: set[str] = set()


def _warn_replicated(path, why):
  """Once per leaf: its Newton-Schulz runs replicated (gathered whole on
  every device), and why."""
  if path in _warned_replicated:
    return
  _warned_replicated.add(path)
  warnings.warn(f"scale_by_muon: the Muon leaf at {path or '<root>'} is gathered whole onto every "
                f"device for its Newton-Schulz: {why}", stacklevel=4)


def _check_matrices(paths, leaves):
  """``weight_dimension_numbers=None`` promises 2-D leaves; the default
  dimension numbers would read a 3-D leaf as a batch of matrices over its
  last axis."""
  for path, g in zip(paths, leaves):
    if jnp.ndim(g) != 2:
      raise ValueError(
          f"scale_by_muon: leaf {path or '<root>'} has shape {jnp.shape(g)}, but "
          "weight_dimension_numbers=None means every leaf is a 2-D matrix; pass "
          "weight_dimension_numbers (e.g. MuonDimensionNumbers(reduction_axis=1, "
          "output_axis=2) for a stack of matrices, None for a leaf Muon should not touch)")
