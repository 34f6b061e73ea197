"""Muon on a multi-device mesh: whole matrices per device by all-to-all."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import (AbstractDevice, AbstractMesh, AxisType, NamedSharding,
                          PartitionSpec as P, use_abstract_mesh)

import fuseopt.optim as fo
from fuseopt.benchmarks import user_step
from fuseopt.kernels import newton_schulz
from fuseopt.kernels import sharding as sharding_lib
from fuseopt.kernels.newton_schulz import distributed

DIMS = {"layers": fo.MuonDimensionNumbers(1, 2), "head": fo.MuonDimensionNumbers(0, 1),
        "bias": None}
SPECS = {  # FSDP: rows of the stacked layers, columns of the head
    "layers": P(None, "x", None), "head": P(None, "x"), "bias": P()}


def _tree(seed, shapes):
  k = jax.random.split(jax.random.key(seed), len(shapes))
  return {n: jax.random.normal(kk, s) * 0.02 for kk, (n, s) in zip(k, sorted(shapes.items()))}


SHAPES = {"layers": (16, 64, 128), "head": (64, 128), "bias": (128,)}


def _steps(tx, params, grads, n=2):
  def run(p, g):
    s = tx.init(p)
    for _ in range(n):
      u, s = tx.update(g, s, p)
      p = jax.tree.map(jnp.add, p, u)
    return p, s
  return jax.jit(run)(params, grads), jax.jit(run).lower(params, grads).compile()


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_sharded_muon_matches_unsharded_and_splits_the_work(kind):
  params, grads = _tree(0, SHAPES), _tree(1, SHAPES)
  lr = 1e-2
  tx = fo.muon(lr, muon_weight_dimension_numbers=DIMS, execution=fo.Execution(implementation='xla'))
  (want, _), single = _steps(tx, params, grads)

  mesh = jax.make_mesh((8,), ("x",), axis_types=(kind,))
  sh = jax.tree.map(lambda s: NamedSharding(mesh, s), SPECS)
  tx = fo.muon(lr, muon_weight_dimension_numbers=DIMS, execution=fo.Execution(
      implementation='xla', shardings=None if kind == AxisType.Explicit else sh))
  put = lambda t: jax.tree.map(jax.device_put, t, sh)
  (got, _), sharded = _steps(tx, put(params), put(grads))
  # The NS runs in bf16: two steps of lr * scale * O, O's entries equal up to
  # bf16 rounding of differently batched products (bound: 2 steps x lr x
  # sqrt(2) x 2^-6).
  for name in SHAPES:
    err = float(jnp.max(jnp.abs(got[name] - want[name])))
    assert err <= 2 * lr * np.sqrt(2) * 2.0**-6, (name, err)
    assert got[name].sharding.is_equivalent_to(sh[name], got[name].ndim), name
  text = sharded.as_text()
  assert "all-to-all(" in text
  assert "all-gather(" not in text   # no whole stack is ever gathered
  ratio = sharded.cost_analysis()["flops"] / single.cost_analysis()["flops"]
  assert ratio <= 0.35, ratio


def test_distributed_ns_places_each_matrix_on_one_device():
  """Single matrices of several shapes, replicated and sharded leaves: each
  equals its own NS (padding devices orthogonalise zero slots, which never reach a leaf)."""
  mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
  cases = [((64, 32), P("x", None)), ((64, 32), P(None, ("x", "y"))), ((64, 32), P("x", "y")),
           ((4, 64, 32), P("x", None, "y")), ((8, 16, 32), P(("x", "y"))), ((16, 32), P()),
           ((3, 32, 64), P(None, "y", None))]
  ns = lambda x: newton_schulz(x, implementation="xla", ns_dtype=jnp.float32)
  leaves = [jax.random.normal(jax.random.key(i), s) for i, (s, _) in enumerate(cases)]
  axes = [((x.ndim - 2,), (x.ndim - 1,)) for x in leaves]
  want = [ns(x.reshape((-1,) + x.shape[-2:])).reshape(x.shape) for x in leaves]
  placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, (_, s) in zip(leaves, cases)]

  def run(*xs):
    where = [sharding_lib.placement_of(x) for x in xs]
    assert all(distributed.supported(x.shape, w, a) for x, w, a in zip(xs, where, axes))
    return distributed.orthogonalize_sharded(xs, where, axes, ns)

  got = jax.jit(run)(*placed)
  for g, w, x, (shape, spec) in zip(got, want, placed, cases):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, err_msg=str(spec))
    assert g.sharding.is_equivalent_to(x.sharding, x.ndim)


def test_one_whole_matrix_a_device_moves_as_rows_of_a_2d_array():
  """A device holding one slot of a row-sharded family exchanges rows of a
  2-D array: no all-to-all operand has the size-1 slot axis that libtpu
  re-laid out and tile-padded to twice the matrix (docs/scaling.md); the
  result is the matrix's own NS, laid back as it was sharded."""
  mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
  ns = lambda x: newton_schulz(x, implementation="xla", ns_dtype=jnp.float32)
  x = jax.random.normal(jax.random.key(3), (64, 32))
  placed = jax.device_put(x, NamedSharding(mesh, P("x", None)))

  def run(x):
    return distributed.orthogonalize_sharded([x], [sharding_lib.placement_of(x)], [((0,), (1,))],
                                             ns)[0]
  text = str(jax.make_jaxpr(run)(placed))
  ops = re.findall(r"all_to_all\[[^\]]*\]", text)
  assert len(ops) == 2, text   # there and back
  assert all("split_axis=0" in o and "concat_axis=0" in o for o in ops), ops
  got = jax.jit(run)(placed)
  np.testing.assert_allclose(np.asarray(got), np.asarray(ns(x)), atol=1e-5)
  assert got.sharding.is_equivalent_to(placed.sharding, 2)


def test_supported_takes_any_sharded_side_axis_and_refuses_uneven_shards():
  mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
  where = sharding_lib.Placement(mesh, P(None, None, "x"))
  # output axes (1, 2) with the second one sharded: a segment of its own
  assert distributed.supported((4, 16, 64), where, ((0,), (1, 2)))
  assert distributed.supported((4, 16, 64), where, ((0,), (2, 1)))
  why = distributed.why_not((4, 16, 60), where, ((0,), (1, 2)))
  assert why is not None and "evenly" in why


_SIG = re.compile(r"custom_call @(?:tpu_custom_call|__gpu\$xla\.gpu\.triton)\(.*\} : \((.*)\) ->")


@pytest.mark.parametrize("target", [("gpu", "NVIDIA H200", "cuda", 132),
                                    ("tpu", "TPU v5 lite", "tpu", 1)], ids=["h200", "tpu_v5e"])
@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_lowering_for_8_devices_gives_kernels_local_operands(target, kind):
  """Every kernel call sees local shapes: the Adam kernel a 1/8 shard, the NS
  kernel at most ceil(16/8) = 2 whole matrices of the 16-matrix family."""
  platform, device_kind, lowering, cores = target
  mesh = AbstractMesh((8,), ("x",), axis_types=(kind,), abstract_device=AbstractDevice(
      device_kind=device_kind, num_cores=cores, platform=platform))
  shapes = {"layers": (16, 512, 1024), "head": (512, 1024), "bias": (1024,),
            "embed": (4096, 512)}
  specs = dict(SPECS, embed=P("x"))
  dims = dict(DIMS, embed=None)
  avals = {n: jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, specs[n]))
           for n, s in shapes.items()}
  sh = None if kind == AxisType.Explicit else jax.tree.map(lambda s: NamedSharding(mesh, s),
                                                           specs)
  tx = fo.muon(1e-2, muon_weight_dimension_numbers=dims, execution=fo.Execution(shardings=sh))
  with use_abstract_mesh(mesh):
    state = jax.eval_shape(tx.init, avals)
    text = jax.jit(lambda p, s, g: fo.step(tx, g, s, p)).trace(avals, state, avals).lower(
        lowering_platforms=(lowering,)).as_text()
  sigs = [m.group(1) for m in map(_SIG.search, text.splitlines()) if m]
  assert sigs, "no kernel in the lowering"
  elements = 0
  for sig in sigs:
    for dims_ in re.findall(r"tensor<((?:\d+x)+)[a-z]", sig):
      shape = tuple(int(d) for d in dims_.rstrip("x").split("x"))
      if len(shape) == 3:          # an NS kernel: (batch, rows, cols), whole matrices
        assert shape[0] <= 2 and 512 in shape[1:], sig
      elements = max(elements, int(np.prod(shape)))
  # The largest operand is a local shard: the 4096x512 embedding / 8 (the
  # whole leaf would be 2,097,152 elements), or two whole 512x1024 matrices.
  assert elements <= 2 * 512 * 1024, sigs


# Two same-shaped matrices (a family of two), a singleton of another shape,
# one with a row per device, and an AdamW leaf.
FAMILY_SHAPES = {"fc2a": (512, 128), "fc2b": (512, 128), "wq": (128, 128), "emb": (64, 128),
                 "bias": (128,)}
_FAMILY_STEPS = 5


def _replay(tx, params, grads):
  """``jit(fo.step)`` over the same gradients; every step's (params, state)."""
  run = jax.jit(lambda g, s, p: fo.step(tx, g, s, p))
  state, out = tx.init(params), []
  for g in grads:
    params, state = run(g, state, params)
    out.append(jax.device_get((params, state)))
  return out


@pytest.fixture(scope="module")
def family_run():
  params = _tree(0, FAMILY_SHAPES)
  grads = [_tree(10 + t, FAMILY_SHAPES) for t in range(_FAMILY_STEPS)]
  return params, grads, _replay(fo.muon(1e-2), params, grads)


@pytest.mark.parametrize("axis", [0, 1], ids=["rows", "cols"])
@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_sharded_muon_step_is_bitwise_the_unsharded_step(family_run, kind, axis):
  """bf16 Newton-Schulz, FSDP on either matrix axis: every step's params and
  state equal the one-device step's bit for bit (the 512x128 pair used to
  differ from the fourth step on: a device ran one of them alone, the
  unsharded step runs both in one batch)."""
  params, grads, want = family_run
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(kind,))
  matrix = P("fsdp", None) if axis == 0 else P(None, "fsdp")
  sh = {n: NamedSharding(mesh, matrix if len(s) == 2 else P()) for n, s in FAMILY_SHAPES.items()}
  put = lambda t: jax.tree.map(jax.device_put, t, sh)
  tx = fo.muon(1e-2, execution=fo.Execution(shardings=None if kind == AxisType.Explicit else sh))
  got = _replay(tx, put(params), [put(g) for g in grads])
  for t, (w, g) in enumerate(zip(want, got)):
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(w)[0], jax.tree.leaves(g)):
      np.testing.assert_array_equal(np.asarray(b), np.asarray(a),
                                    err_msg=f"step {t} {jax.tree_util.keystr(path)}")


def test_rounds_bound_each_devices_share_and_a_lone_matrix_still_runs_batched():
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Explicit,))
  where = sharding_lib.Placement(mesh, P("fsdp", None))
  leaves = [jax.ShapeDtypeStruct((64, 32), jnp.float32)] * 33
  axes = [((0,), (1,))] * 33
  # Two matrices a device: rounds of 16; 33 = 16 + 16 + 1.
  plan = distributed.Plan(leaves, [where] * 33, axes, max_elements=2 * 64 * 32)
  got = plan.rounds()
  assert [len(r) for r in got] == [16, 16, 1] and sum(got, []) == list(range(33))
  # The last round's lone matrix gets a padding slot: its device runs a
  # batch of two, as the unsharded step runs the family batched.
  key, = plan.families
  assert plan.min_batch(key) == 2
  # A budget of one matrix gives every device one a round, as the unsharded
  # step runs one a call; nothing is merged into the round before.
  assert [len(r) for r in distributed.rounds(leaves, [where] * 33, axes, 64 * 32)] == [8] * 4 + [1]
  assert [len(r) for r in distributed.rounds(leaves[:32], [where] * 32, axes, 64 * 32 - 1)] == [8] * 4
  assert distributed.rounds(leaves, [where] * 33, axes, None) == [list(range(33))]


def test_sharded_muon_step_with_one_matrix_a_call_is_bitwise_the_unsharded_step():
  """A budget of one matrix a call (the GPU default for the 1.2 B tree's MLP
  matrices): the unsharded step runs the 512x128 pair one a call, the sharded
  step one a device a round; both unbatched, bitwise the same."""
  params = _tree(0, FAMILY_SHAPES)
  grads = [_tree(10 + t, FAMILY_SHAPES) for t in range(3)]
  budget = 512 * 128
  want = _replay(fo.muon(1e-2, execution=fo.Execution(newton_schulz=fo.NewtonSchulz(max_elements=budget))), params, grads)
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Explicit,))
  sh = {n: NamedSharding(mesh, P("fsdp", None) if len(s) == 2 else P())
        for n, s in FAMILY_SHAPES.items()}
  put = lambda t: jax.tree.map(jax.device_put, t, sh)
  got = _replay(fo.muon(1e-2, execution=fo.Execution(newton_schulz=fo.NewtonSchulz(max_elements=budget))), put(params), [put(g) for g in grads])
  for t, (w, g) in enumerate(zip(want, got)):
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(w)[0], jax.tree.leaves(g)):
      np.testing.assert_array_equal(np.asarray(b), np.asarray(a),
                                    err_msg=f"step {t} {jax.tree_util.keystr(path)}")


# Muon matrices with 8-bit momentum: last axes of whole blocks of 256, whole
# blocks on each shard of the cols split (2048 / 8); an AdamW leaf.
INT8_SHAPES = {"a": (512, 256), "b": (512, 256), "c": (64, 2048), "bias": (256,)}


@pytest.mark.parametrize("kind,axis", [(AxisType.Explicit, 1), (AxisType.Auto, 0)],
                         ids=["explicit-cols", "auto-rows"])
def test_sharded_int8_momentum_step_is_bitwise_the_unsharded_step(kind, axis):
  """mu_dtype='int8': the codes and scales shard with the leaf (scales on the
  same spec) and every step's params and state equal the one-device step's."""
  params = _tree(0, INT8_SHAPES)
  grads = [_tree(10 + t, INT8_SHAPES) for t in range(3)]
  want = _replay(fo.muon(1e-2, mu_dtype="int8"), params, grads)
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(kind,))
  matrix = P("fsdp", None) if axis == 0 else P(None, "fsdp")
  sh = {n: NamedSharding(mesh, matrix if len(s) == 2 else P()) for n, s in INT8_SHAPES.items()}
  put = lambda t: jax.tree.map(jax.device_put, t, sh)
  tx = fo.muon(1e-2, mu_dtype="int8",
               execution=fo.Execution(shardings=None if kind == AxisType.Explicit else sh))
  mu = tx.init(put(params)).inner_states["muon"].inner_state[0].mu
  assert mu["c"].codes.sharding.spec == matrix and mu["c"].scales.sharding.spec == matrix
  got = _replay(tx, put(params), [put(g) for g in grads])
  for t, (w, g) in enumerate(zip(want, got)):
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(w)[0], jax.tree.leaves(g)):
      np.testing.assert_array_equal(np.asarray(b), np.asarray(a),
                                    err_msg=f"step {t} {jax.tree_util.keystr(path)}")


# Every Explicit placement of a (64, 512) leaf: name -> (mesh shape, axes, spec).
# "columns" and "both" split its blocks of 256 (64 and 128 columns a device).
INT8_PLACEMENTS = {"rows": ((8,), ("x",), P("x")), "columns": ((8,), ("x",), P(None, "x")),
                   "both": ((4, 2), ("x", "y"), P("y", "x")), "replicated": ((8,), ("x",), P())}


@pytest.mark.parametrize("path", ["step", "update"])
@pytest.mark.parametrize("placement", sorted(INT8_PLACEMENTS))
def test_int8_momentum_on_every_explicit_placement_is_bitwise(placement, path):
  """mu_dtype='int8' on an Explicit mesh, the leaf placed on rows, on columns
  below a block a device (the blocked axis gathered for the momentum pass and
  put back), on both or replicated: two steps, fused and through ``update``,
  bitwise the one-device steps, the momentum's codes placed as the leaf."""
  import optax
  shapes = {"w": (64, 512)}
  params = _tree(0, shapes)
  grads = [_tree(10 + t, shapes) for t in range(2)]
  tx = fo.muon(1e-2, mu_dtype="int8", weight_decay=0.1)

  def run(params):
    state = tx.init(params)
    update = jax.jit(user_step.step_fn(tx, path == "step"))
    for g in grads:
      params, state = update(params, state, put(g))
    return params, state

  put = lambda t: t
  want = run(params)
  mesh_shape, names, spec = INT8_PLACEMENTS[placement]
  mesh = jax.make_mesh(mesh_shape, names, axis_types=(AxisType.Explicit,) * len(names))
  put = lambda t: {n: jax.device_put(a, NamedSharding(mesh, spec)) for n, a in t.items()}
  got = run(put(params))
  for (where, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                  err_msg=f"{placement} {path} {jax.tree_util.keystr(where)}")
  mu = got[1].inner_states["muon"].inner_state[0].mu["w"]
  assert mu.codes.sharding.is_equivalent_to(NamedSharding(mesh, spec), 2)
  assert got[0]["w"].sharding.is_equivalent_to(NamedSharding(mesh, spec), 2)
