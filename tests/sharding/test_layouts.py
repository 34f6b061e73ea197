"""Muon and NorMuon in the layouts real models use, sharded on 8 devices.

Each layout (one leaf per matrix, scan-stacked layers with FSDP on either
matrix axis, MoE experts with expert parallelism and FSDP inside the expert,
packed matrix views, matrices whose side spans several axes, 2-D FSDP x TP
and 3-D data x FSDP x TP meshes) runs two steps of ``fo.muon`` and
``fo.normuon``, through the fused ``fo.step`` and through ``update`` +
``apply_updates``, on Explicit and Auto meshes. The sharded run is bitwise
the one-device run, and its compiled program never all-gathers a whole
Muon leaf.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import fuseopt.optim as fo
from fuseopt.optim import MatrixViews, MuonDimensionNumbers as MDN, matrix_views

D, F, H, HD = 64, 128, 4, 16
VIEW_QKV = MatrixViews(MDN(0, 1), axis=1, sizes=(D, D, D))
VIEW_GATE_UP = MatrixViews(MDN(0, 1), axis=1, sizes=(F, F))
VIEW_KV_B = fo.mla_kv_b_proj_views(H, HD, HD)
VIEW_O_HEADS = MatrixViews(MDN(0, 1), axis=0, sizes=(HD,), groups=H)   # per head, input side

# name: (mesh shape, mesh axes, {leaf: (shape, Muon spec or None, PartitionSpec)})
LAYOUTS = {
    # One leaf per matrix, FSDP on rows or columns; sides spanning several
    # axes (attention heads) with a later axis sharded.
    "per_matrix": ((8,), ("fsdp",), {
        "wq": ((D, D), MDN(0, 1), P("fsdp", None)),
        "wo": ((D, D), MDN(0, 1), P(None, "fsdp")),
        "up": ((D, F), MDN(0, 1), P("fsdp", None)),
        "q_heads": ((D, H, HD), MDN(0, (1, 2)), P(None, None, "fsdp")),
        "o_heads": ((H, HD, D), MDN((0, 1), 2), P(None, "fsdp", None)),
        "norm": ((D,), None, P())}),
    # Scan-stacked (layers, in, out), FSDP on in or on out.
    "stacked": ((8,), ("fsdp",), {
        "up": ((2, D, F), MDN(1, 2), P(None, "fsdp", None)),
        "down": ((2, F, D), MDN(1, 2), P(None, None, "fsdp")),
        "norm": ((2, D), None, P())}),
    "moe_expert_parallel": ((8,), ("expert",), {
        "w_in": ((2, 8, D, F), MDN(2, 3), P(None, "expert", None, None)),
        "w_out": ((2, 8, F, D), MDN(2, 3), P(None, "expert", None, None)),
        "router": ((D, 8), None, P())}),
    "moe_expert_fsdp": ((4, 2), ("expert", "fsdp"), {
        "w_in": ((2, 4, D, F), MDN(2, 3), P(None, "expert", "fsdp", None)),
        "w_out": ((2, 4, F, D), MDN(2, 3), P(None, "expert", None, "fsdp"))}),
    # Packed views, FSDP on rows (each shard cuts its rows of every view).
    "views_fsdp": ((8,), ("fsdp",), {
        "qkv": ((D, 3 * D), VIEW_QKV, P("fsdp", None)),
        "gate_up": ((D, 2 * F), VIEW_GATE_UP, P("fsdp", None)),
        "kv_b": ((2 * HD, H * 2 * HD), VIEW_KV_B, P("fsdp", None)),
        "o_heads": ((H * HD, D), VIEW_O_HEADS, P(None, "fsdp")),
        "wo": ((D, D), MDN(0, 1), P("fsdp", None))}),
    # FSDP x TP: rows on one axis, columns on the other. TP cuts qkv's and
    # the stacked gate/up's views apart (moved whole first); kv_b's heads
    # stay whole on each shard.
    "fsdp_tp": ((4, 2), ("fsdp", "tp"), {
        "wq": ((D, D), MDN(0, 1), P("fsdp", "tp")),
        "down": ((2, F, D), MDN(1, 2), P(None, "tp", "fsdp")),
        "qkv": ((D, 3 * D), VIEW_QKV, P("fsdp", "tp")),
        "gate_up": ((2, D, 2 * F), MatrixViews(MDN(1, 2), axis=2, sizes=(F, F)),
                    P(None, "fsdp", "tp")),
        "kv_b": ((2 * HD, H * 2 * HD), VIEW_KV_B, P("fsdp", "tp")),
        "norm": ((D,), None, P("tp"))}),
    # data x FSDP x TP: replicas on the data axis.
    "data_fsdp_tp": ((2, 2, 2), ("data", "fsdp", "tp"), {
        "qkv": ((D, 3 * D), VIEW_QKV, P("fsdp", "tp")),
        "up": ((2, D, F), MDN(1, 2), P(None, "fsdp", "tp")),
        "wo": ((D, D), MDN(0, 1), P("tp", "fsdp")),
        "norm": ((D,), None, P())}),
}

_STEPS = 2


def _trees(layout, seed):
  leaves = LAYOUTS[layout][2]
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return {n: jax.random.normal(k, leaves[n][0]) * 0.02 for k, n in zip(keys, sorted(leaves))}


def _optimizer(name, layout, shardings=None):
  dims = {n: spec for n, (_, spec, _) in LAYOUTS[layout][2].items()}
  make = fo.muon if name == "muon" else fo.normuon
  return make(1e-2, weight_decay=0.1, muon_weight_dimension_numbers=dims,
              execution=fo.Execution(shardings=shardings))


def _program(tx, path):
  if path == "step":
    return jax.jit(lambda g, s, p: fo.step(tx, g, s, p))

  def update(g, s, p):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s
  return jax.jit(update)


def _replay(tx, path, params, grads):
  run = _program(tx, path)
  state, out = tx.init(params), []
  for g in grads:
    params, state = run(g, state, params)
    out.append(jax.device_get((params, state)))
  return out, run.lower(grads[0], tx.init(params), params).compile()


_reference_cache = {}


def _reference(layout, name, path):
  key = (layout, name, path)
  if key not in _reference_cache:
    params = _trees(layout, 0)
    grads = [_trees(layout, 10 + t) for t in range(_STEPS)]
    _reference_cache[key] = _replay(_optimizer(name, layout), path, params, grads)[0]
  return _reference_cache[key]


_ALL_GATHER = re.compile(r"= (\w+)\[([\d,]*)\][^ ]* all-gather(?:-start)?\(")


def _all_gather_sizes(hlo: str) -> list[int]:
  return [int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
          for _, dims in _ALL_GATHER.findall(hlo)]


# (kind, optimizer, path) pairs run per layout: each optimizer through both
# paths, each path on both mesh kinds.
_RUNS = {AxisType.Explicit: (("muon", "step"), ("normuon", "update")),
         AxisType.Auto: (("normuon", "step"), ("muon", "update"))}


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sharded_layout_is_bitwise_one_device_and_gathers_no_whole_leaf(layout, kind):
  shape, axes, leaves = LAYOUTS[layout]
  mesh = jax.make_mesh(shape, axes, axis_types=(kind,) * len(axes))
  sh = {n: NamedSharding(mesh, spec) for n, (_, _, spec) in leaves.items()}
  put = lambda t: jax.tree.map(jax.device_put, t, sh)
  params = put(_trees(layout, 0))
  grads = [put(_trees(layout, 10 + t)) for t in range(_STEPS)]
  smallest = min(int(np.prod(s)) for s, spec, _ in leaves.values() if spec is not None)
  for name, path in _RUNS[kind]:
    tx = _optimizer(name, layout, None if kind == AxisType.Explicit else sh)
    got, compiled = _replay(tx, path, params, grads)
    want = _reference(layout, name, path)
    for t, (w, g) in enumerate(zip(want, got)):
      for (p, a), b in zip(jax.tree_util.tree_flatten_with_path(w)[0], jax.tree.leaves(g)):
        msg = f"{name} {path} step {t} {jax.tree_util.keystr(p)}"
        if path == "step":
          np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=msg)
        else:   # XLA fuses the unfused update's elementwise tail per program: last-bit differences
          np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-8,
                                     err_msg=msg)
    # No whole Muon leaf is ever gathered (the NS results come back by
    # all_to_all; what is gathered is a replica axis's share or NorMuon's
    # per-neuron statistics).
    sizes = _all_gather_sizes(compiled.as_text())
    assert all(s < smallest for s in sizes), (name, path, sizes, smallest)
    assert "all-to-all" in compiled.as_text() or layout == "moe_expert_parallel", (name, path)


def _scaled(layout, factor):
  """The layout's leaves with every matrix size (>= 16) times ``factor``."""
  grow = lambda d: d * factor if d >= 16 else d
  out = {}
  for n, (shape, spec, pspec) in LAYOUTS[layout][2].items():
    if isinstance(spec, MatrixViews):
      spec = spec._replace(sizes=tuple(grow(s) for s in spec.sizes))
    out[n] = (tuple(grow(d) for d in shape), spec, pspec)
  return out


_CUSTOM_CALL = re.compile(r"= \w+\[([\d,]*)\][^ ]* custom-call\(.*custom_call_target=\"tpu_custom_call\"")


@pytest.mark.parametrize("layout,kind", [("views_fsdp", AxisType.Auto),
                                         ("fsdp_tp", AxisType.Explicit)],
                         ids=["views_fsdp-auto", "fsdp_tp-explicit"])
def test_views_compile_for_tpu_with_shard_local_kernels(layout, kind):
  """libtpu compiles the fused Muon step of packed views on 8 x v5e (a Pallas
  kernel handed a sharded operand does not compile there: "Mosaic kernels
  cannot be automatically partitioned"); every Newton-Schulz kernel gets
  at most two views of a whole view's size (not the family's stack), and
  no whole leaf is all-gathered."""
  from fuseopt import targets
  why = targets.missing("v5e")
  if why:
    pytest.skip(why)
  t = targets.get("v5e")
  shape, axes, _ = LAYOUTS[layout]
  leaves = _scaled(layout, 4)
  mesh = targets.mesh(t, shape, axes, axis_types=(kind,) * len(axes))
  sh = {n: NamedSharding(mesh, spec) for n, (_, _, spec) in leaves.items()}
  avals = {n: jax.ShapeDtypeStruct(s, jnp.float32, sharding=sh[n])
           for n, (s, _, _) in leaves.items()}
  dims = {n: spec for n, (_, spec, _) in leaves.items()}
  # (the Mosaic kernels named: a TPU's default runs Newton-Schulz as XLA's matmuls)
  tx = fo.muon(1e-2, muon_weight_dimension_numbers=dims, execution=fo.Execution(
      implementation="mosaic_tpu", shardings=None if kind == AxisType.Explicit else sh))
  rep = NamedSharding(mesh, P())
  with targets.lowering_for(t, mesh):
    state = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if isinstance(
            x.sharding, NamedSharding) else rep), jax.eval_shape(tx.init, avals))
    lowered = jax.jit(lambda p, s, g: fo.step(tx, g, s, p), donate_argnums=(0, 1)).trace(
        avals, state, avals).lower(lowering_platforms=("tpu",))
  hlo = lowered.compile().as_text()
  # The whole views (and plain matrices) of the layout, either orientation.
  whole = set()
  for n, (s, spec, _) in leaves.items():
    if spec is not None:
      views = matrix_views.geometry(spec, s, n)
      red, out = views.piece_axes()
      for p in views.piece_shapes(s):
        m = (int(np.prod([p[a] for a in red])), int(np.prod([p[a] for a in out])))
        whole |= {m, m[::-1]}
  kernels = [tuple(int(d) for d in dims.split(",")) for dims in _CUSTOM_CALL.findall(hlo)]
  ns = [k for k in kernels if len(k) == 3]
  assert ns, kernels
  for k in ns:   # (the fused kernel pads a matrix to whole 128-lane tiles)
    assert k[0] <= 2 and any(r <= k[1] < r + 128 and o <= k[2] < o + 128 for r, o in whole), (
        k, whole)
  smallest = min(int(np.prod(s)) for s, spec, _ in leaves.values() if spec is not None)
  assert all(s < smallest for s in _all_gather_sizes(hlo)), _all_gather_sizes(hlo)


@pytest.mark.parametrize("shape,spec,dims,why", [
    ((60, 64), P("fsdp", None), MDN(0, 1), "does not divide evenly"),
    # [a | b | c] cut 8 ways on its columns, and 6 rows cannot take the 8 devices
    ((6, 24), P(None, "fsdp"), MatrixViews(MDN(0, 1), axis=1, sizes=(8, 8, 8)), "cuts views apart"),
])
def test_a_layout_the_plan_cannot_take_is_replicated_with_a_warning_naming_the_leaf(
    shape, spec, dims, why):
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
  name = f"odd_{shape[0]}x{shape[1]}"
  params = {name: jax.random.normal(jax.random.key(0), shape)}
  tx = fo.muon(1e-2, muon_weight_dimension_numbers={name: dims}, execution=fo.Execution(shardings={name: NamedSharding(mesh, spec)}))
  with pytest.warns(UserWarning, match=rf"{name}.*gathered whole.*{why}"):
    u, _ = jax.jit(tx.update)(params, tx.init(params), params)
  one = fo.muon(1e-2, muon_weight_dimension_numbers={name: dims})
  want, _ = jax.jit(one.update)(params, one.init(params), params)
  np.testing.assert_allclose(np.asarray(u[name]), np.asarray(want[name]), rtol=1e-6, atol=1e-7)
