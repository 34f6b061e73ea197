"""Muon's step as a pipeline: the spec read once a step, one grouping, the
placement a property of the plan, one round structure for both paths."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import fuseopt.optim as fo
from fuseopt.optim import muon_finish
from fuseopt.optim import muon_momentum
from fuseopt.optim import muon_pipeline
from fuseopt.optim import muon_plan
from fuseopt.optim import muon_transforms
from fuseopt.optim import MuonDimensionNumbers as MDN

SHAPES = {"wq": (32, 16), "wk": (32, 16), "mlp": (2, 16, 40), "experts": (3, 16, 40),
          "gate_up": (16, 32), "norm": (16,)}
DIMS = {"wq": MDN(), "wk": MDN(), "mlp": MDN(1, 2), "experts": fo.Experts(MDN(1, 2)),
        "gate_up": fo.MatrixViews(MDN(0, 1), axis=1, sizes=(16, 16)), "norm": None}


def _tree(seed):
  keys = jax.random.split(jax.random.key(seed), len(SHAPES))
  return {n: jax.random.normal(k, s) * 0.1 for k, (n, s) in zip(keys, sorted(SHAPES.items()))}


class Counting:
  """A callable declaration that counts its reads."""

  def __init__(self):
    self.reads = 0

  def __call__(self, tree):
    self.reads += 1
    return DIMS


@pytest.mark.parametrize("make", [
    lambda dims: fo.muon(0.02, weight_decay=0.1, muon_weight_dimension_numbers=dims),
    lambda dims: fo.normuon(0.02, weight_decay=0.1, muon_weight_dimension_numbers=dims),
], ids=["muon", "normuon"])
def test_the_spec_is_read_once_a_step(make):
  """Labels, experts, views and the decay gate (and NorMuon's state) come
  from one read: through ``update`` and through the fused step, whose state
  check's ``init`` is that read."""
  params, grads = _tree(0), _tree(1)
  state = make(Counting()).init(params)

  dims = Counting()
  tx = make(dims)
  jax.make_jaxpr(lambda g, s, p: tx.update(g, s, p))(grads, state, params)
  assert dims.reads == 1

  dims = Counting()
  tx = make(dims)
  jax.make_jaxpr(lambda g, s, p: fo.step(tx, g, s, p))(grads, state, params)
  assert dims.reads == 1

  # Another step of the same tree: the read is the first one's.
  jax.make_jaxpr(lambda g, s, p: fo.step(tx, g, s, p))(grads, state, params)
  jax.make_jaxpr(lambda g, s, p: tx.update(g, s, p))(grads, state, params)
  assert dims.reads == 1


def test_a_reader_reads_once_a_tree_signature():
  reads = []
  reader = muon_plan.SpecReader(lambda tree: reads.append(1) or [MDN()] * len(jax.tree.leaves(tree)))
  a = {"w": jnp.zeros((4, 4))}
  assert reader(a) == (MDN(),)
  assert reader(jax.tree.map(lambda x: x + 1, a)) == (MDN(),)   # the same signature
  assert len(reads) == 1
  assert reader({"w": jnp.zeros((4, 8))}) == (MDN(),)           # another shape: another read
  assert reader({"v": jnp.zeros((4, 4))}) == (MDN(),)           # another path
  assert len(reads) == 3


def _plan(tree, dims=DIMS, **kw):
  leaves, treedef = jax.tree.flatten(tree)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  declared = muon_plan.declared_specs(dims, tree)
  kw = {"ns_input_dtype": None, "shardings": None, "max_elements": None, **kw}
  return muon_plan.plan(declared, leaves, paths, out_dtypes=[x.dtype for x in leaves], **kw)


def test_one_grouping_every_matrix_once():
  """Same-shaped matrices anywhere in the tree (whole leaves, a stack's
  batch, views) share calls; every piece's batch is covered once."""
  plan = _plan(_tree(0))
  batched = [c for c in plan.calls if c.placement == muon_plan.BATCHED]
  shapes = {}
  for c in batched:
    (i, j, _), = {c.family[k] for k, _, _ in c.ranges[:1]}
    shapes.setdefault(plan.leaves[i].pieces[j][1:], []).append(c)
  # (32, 16): wq, wk; (16, 40): mlp and experts; (16, 16): the two views.
  assert sorted(shapes) == [(16, 16), (16, 40), (32, 16)]
  assert all(len(cs) == 1 for cs in shapes.values())
  covered = {}
  for c in batched:
    for k, a, b in c.ranges:
      i, j, batch = c.family[k]
      covered.setdefault((i, j), []).append((a, b, batch))
  for leaf_index, leaf in enumerate(plan.leaves):
    for j, (batch, _, _) in enumerate(leaf.pieces):
      assert covered[(leaf_index, j)] == [(0, batch, batch)]
  assert all(leaf.cut is None for leaf in plan.leaves if not leaf.pieces)


def test_a_budget_splits_a_family_into_calls_the_plan_records():
  """Two (16, 40) matrices a call: mlp's two, then the experts' three (no
  lone matrix in a batched family); each leaf knows its first and last call."""
  plan = _plan(_tree(0), max_elements=2 * 16 * 40)
  family = [c for c in plan.calls if plan.leaves[c.family[0][0]].pieces[0][1:] == (16, 40)]
  assert [sum(b - a for _, a, b in c.ranges) for c in family] == [2, 3]
  for i, leaf in enumerate(plan.leaves):
    taking = [k for k, c in enumerate(plan.calls) if i in c.leaves]
    assert (leaf.first_call, leaf.last_call) == ((taking[0], taking[-1]) if taking else (None, None))
  # One matrix a call: the experts' stack spans three calls.
  plan = _plan(_tree(0), max_elements=16 * 40)
  (experts,) = [leaf for leaf in plan.leaves if leaf.experts is not None]
  assert experts.last_call - experts.first_call == 2


def test_placement_is_a_property_of_the_plan():
  """One device: every call batched. Sharded leaves on a mesh: their
  matrices go all-to-all, in the plan's first calls; the rounds of the
  fused step follow the calls, ``update`` has one."""
  one = _plan(_tree(0))
  assert {leaf.placement for leaf in one.leaves if leaf.cut is not None} == {muon_plan.BATCHED}
  assert one.all_to_all is None

  mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
  specs = {"wq": P("x", None), "wk": P(None, "x"), "mlp": P(None, None, "x"),
           "experts": P(None, "x", None), "gate_up": P("x", None), "norm": P()}
  placed = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), _tree(0), specs)
  plan = _plan(placed)
  for name, leaf in zip(sorted(SHAPES), plan.leaves):
    want = None if DIMS[name] is None else muon_plan.ALL_TO_ALL
    assert leaf.placement == want, name
    assert (leaf.mesh_placement is not None) == (want == muon_plan.ALL_TO_ALL)
  assert plan.calls and all(c.across_mesh for c in plan.calls)

  (every,) = muon_pipeline.rounds(plan, sequenced=False)
  assert every.starting == every.finishing == tuple(range(len(plan.leaves)))
  assert every.calls == tuple(range(len(plan.calls))) and not every.fenced
  fused = muon_pipeline.rounds(plan, sequenced=True)
  assert [r.calls for r in fused if r.calls] == [(k,) for k in range(len(plan.calls))]
  assert all(r.fenced for r in fused if r.calls)


class DoubledState(NamedTuple):
  count: jax.Array
  mu: Any
  steps: Any        # the piece's own: how many times each leaf was doubled
  ns_coeffs: jax.Array


class Doubling:
  """An update piece: twice the orthogonalised update, through the one hook
  in either layout, counting its steps a leaf in its own state."""
  state_field = "steps"

  def init_state(self, count, mu, ns_coeffs, params, cuts):
    del cuts
    return DoubledState(count, mu, jax.tree.map(lambda _: jnp.zeros((), jnp.int32), params),
                        ns_coeffs)

  def wrap_ns(self, ns):
    return ns

  def finish(self, result, state, *, active, count, leaf_index):
    del active, count, leaf_index
    return [2 * y.astype(jnp.float32) for y in result.parts], state + 1


def test_an_update_piece_implements_one_hook():
  from fuseopt.optim.normuon_transforms import NeuronNorm
  assert callable(NeuronNorm.finish)
  assert not [n for n in dir(NeuronNorm) if n.startswith("finish_")]
  params, grads = _tree(0), _tree(1)
  args = muon_transforms.bind_arguments("t", muon_transforms.scale_by_muon, (),
                                        {"weight_dimension_numbers": DIMS,
                                         "execution": fo.Execution(
                                             newton_schulz=fo.NewtonSchulz(dtype=jnp.float32))})
  plain = muon_transforms.direction_transform(muon_transforms.muon_direction(args))
  doubled = muon_transforms.direction_transform(muon_transforms.muon_direction(args, Doubling()))
  u, _ = jax.jit(plain.update)(grads, plain.init(params), params)
  v, state = jax.jit(doubled.update)(grads, doubled.init(params), params)
  for name in SHAPES:
    want = np.asarray(u[name]) * (1 if DIMS[name] is None else 2)
    np.testing.assert_array_equal(np.asarray(v[name]), want, err_msg=name)
    assert int(state.steps[name]) == (DIMS[name] is not None), name


def test_the_finish_is_one_arithmetic_for_both_layouts():
  """A leaf's finish from its batched pieces and from the leaf's layout:
  the same update, bit for bit."""
  from fuseopt.optim import matrix_views
  h = jax.random.normal(jax.random.key(0), (2, 8, 24))
  views = matrix_views.geometry(MDN(1, 2), h.shape)
  pieces, merge = matrix_views.split(h, MDN(1, 2))
  kw = dict(dtype=jnp.float32, active=None, adaptive=True, shape_scaling=True)
  u_pieces, _ = muon_finish.finish(
      muon_finish.PiecesResult(pieces, merge, [jnp.tanh(pieces[0].matrix)], views, h.shape), **kw)
  u_leaf, _ = muon_finish.finish(muon_finish.LeafResult(h, jnp.tanh(h), views, h.shape, None),
                                 **kw)
  np.testing.assert_array_equal(np.asarray(u_pieces), np.asarray(u_leaf))


def test_an_8bit_momentum_pass_over_slices_is_the_pass_over_the_leaf(monkeypatch):
  """A leaf over the Newton-Schulz call budget, on one device, has its
  momentum pass planned in slices of its leading axis (fp32 held a slice at
  a time); the stored codes, scales and parameters are the same bits as one
  pass over the leaf, in update and in the fused step."""
  shape = (6, 16, 512)
  budget = 2 * 16 * 512
  g = jnp.zeros(shape, jnp.bfloat16)
  assert muon_plan.momentum_slices(g, None, budget) == 2
  assert muon_plan.momentum_slices(g, None, 4 * 16 * 512) == 3  # the largest divisor within
  assert muon_plan.momentum_slices(g, None, 6 * 16 * 512) is None  # within the budget: whole
  assert muon_plan.momentum_slices(jnp.zeros((6, 16, 8)), None, 64) is None  # blocks span rows
  assert muon_plan.momentum_slices(jnp.zeros((96, 512)), None, 2 * 512) is None  # one matrix
  mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Explicit,))
  sharded = jax.device_put(g, NamedSharding(mesh, P(None, "x")))
  assert muon_plan.momentum_slices(sharded, None, budget) is None

  params = {"w": (jax.random.normal(jax.random.key(0), shape) * 0.1).astype(jnp.bfloat16),
            "b": jnp.ones((512,), jnp.bfloat16)}
  dims = {"w": MDN(1, 2), "b": None}
  tx = fo.muon(1e-2, mu_dtype="int8", moment_dtype="int8", muon_weight_dimension_numbers=dims,
               execution=fo.Execution(newton_schulz=fo.NewtonSchulz(max_elements=budget)))

  def run(fused):
    p, s = params, tx.init(params)
    for i in range(3):
      gr = jax.tree.map(lambda a: (0.1 * jax.random.normal(jax.random.key(i + 1), a.shape)
                                   ).astype(a.dtype), p)
      if fused:
        p, s = jax.jit(lambda g, s, p: fo.step(tx, g, s, p))(gr, s, p)
      else:
        u, s = jax.jit(tx.update)(gr, s, p)
        p = jax.tree.map(lambda a, b: (a + b).astype(a.dtype), p, u)
    return jax.tree.leaves((p, s))

  def bits(leaves):
    return [np.atleast_1d(np.asarray(x)).view(np.uint8) for x in leaves]

  calls = []
  real = muon_momentum._sliced

  def counting(*a, **k):
    calls.append(a[2])
    return real(*a, **k)

  monkeypatch.setattr(muon_momentum, "_sliced", counting)
  for fused in (False, True):
    calls.clear()
    sliced = bits(run(fused))
    assert calls and set(calls) == {2}
    with monkeypatch.context() as mp:
      mp.setattr(muon_plan, "momentum_slices", lambda *a: None)
      whole = bits(run(fused))
    assert all(np.array_equal(a, b) for a, b in zip(sliced, whole)), fused
