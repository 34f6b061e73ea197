"""Blockwise (8-bit, 4-bit) Adam moments on 8 CPU devices: codes and scales
shard with their leaf, and a sharded fused step is bitwise the unsharded one
(FSDP on rows or on columns, Explicit and Auto meshes, the reference and the
Triton, Mosaic TPU and Mosaic GPU kernels; a leaf blocked over its trailing
axes, whose column shards split its rows and run gathered)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import fuseopt.optim as fo
from fuseopt.kernels.adam import formats
from fuseopt.kernels.adam import quantized as Q


def _tree(seed):
  k = jax.random.split(jax.random.key(seed), 5)
  return {"w": jax.random.normal(k[0], (16, 512)),        # cols: 64 a shard, blocks straddle
          "stack": jax.random.normal(k[1], (8, 1, 2048)),  # cols: 256 a shard, whole blocks
          "bias": jax.random.normal(k[2], (256,)),
          "odd": jax.random.normal(k[3], (6, 10)),          # bf16 moments (no whole block)
          "q": jax.random.normal(k[4], (16, 8, 64))}        # blocked over (8, 64); cols: gathered


SPECS = {"rows": {"w": P("x"), "stack": P("x"), "bias": P(), "odd": P(), "q": P("x")},
         "cols": {"w": P(None, "x"), "stack": P(None, None, "x"), "bias": P("x"), "odd": P(),
                  "q": P(None, "x")}}


def _run(tx, params, grads_seq, shardings=None, **step_args):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")     # the "odd" leaf's bf16 fallback
    state = tx.init(params)
  update = jax.jit(lambda p, s, g: fo.step(tx, g, s, p, shardings=shardings, **step_args))
  for g in grads_seq:
    params, state = update(params, state, g)
  return params, state


def _fit(spec, shape, mesh):
  """``spec`` without the mesh axes that do not divide ``shape`` (the scales of
  a leaf whose shards hold parts of blocks stay whole on that axis)."""
  entries = tuple(spec) + (None,) * (len(shape) - len(spec))
  size = lambda e: 1 if e is None else mesh.shape[e]
  return P(*(e if d % size(e) == 0 else None for e, d in zip(entries, shape)))


def _place_state(state, mesh, specs):
  """The state sharded as the params: a QuantizedMoment's codes and scales
  both take their leaf's spec (the scales where it divides them)."""
  adam = state[0]

  def put(moments):
    return {k: jax.tree.map(lambda a, s=specs[k]: jax.device_put(
        a, NamedSharding(mesh, _fit(s, a.shape, mesh))), v) for k, v in moments.items()}

  return (adam._replace(mu=put(adam.mu), nu=put(adam.nu)),) + tuple(state[1:])


_KINDS = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}
# The reference and Triton on every placement; the Mosaic kernels, whose
# interpret mode costs 20-30 s a run on the CPU, on a diagonal that still
# takes each mesh kind and each FSDP axis once (rows on one, columns on the
# other, crossed between the two).
_RUNS = ([(impl, False if impl == "xla" else True, case, kind, "int8")
          for impl in ("xla", "triton") for case in ("rows", "cols") for kind in _KINDS]
         + [("mosaic_tpu", True, "rows", "explicit", "int8"),
            ("mosaic_tpu", True, "cols", "auto", "int8"),
            ("mosaic_gpu", True, "cols", "explicit", "int8"),
            ("mosaic_gpu", True, "rows", "auto", "int8"),
            # 4-bit: the reference once (the 24-bit test below runs it on columns), the GPU
            # kernels once each
            ("xla", False, "rows", "auto", "int4"),
            ("triton", True, "cols", "explicit", "int4"),
            ("mosaic_gpu", True, "rows", "auto", "int4")])


# The Triton kernel in interpret mode is its body compiled by XLA:CPU as a
# program of the shard's shape, contracted into FMAs per program: its
# placements compared bit for bit where XLA:CPU has no FMA (the reference
# rounds every product where it stands and holds with FMA on), and through
# the grouped launch, which hides the scalars' origin from XLA's rewrites
# (a per-leaf launch's fp32 parameters differ there in the last bit between a
# leaf and its shards, which no compiled kernel does: tests/sharding/test_elementwise.py).
_MARKS = {"triton": [pytest.mark.fma_off]}
_STEP_ARGS = {"triton": {"group": True}}


@pytest.mark.parametrize("impl,interp,case,kind,fmt", [
    pytest.param(*r[:3], _KINDS[r[3]], r[4], id="-".join((r[3], r[2], r[0], r[4])),
                 marks=_MARKS.get(r[0], []))
    for r in _RUNS])
def test_sharded_blockwise_step_is_bitwise(impl, interp, case, kind, fmt):
  params = _tree(0)
  grads_seq = [_tree(10 + t) for t in range(2)]   # the second reads the first's codes
  tx = fo.adamw(1e-2, weight_decay=0.1, seed=3, moment_dtype=fmt,
                execution=fo.Execution(implementation=impl, interpret=interp))
  step_args = _STEP_ARGS.get(impl, {})
  want_p, want_s = _run(tx, params, grads_seq, **step_args)

  mesh = jax.make_mesh((8,), ("x",), axis_types=(kind,))
  specs = SPECS[case]
  put = lambda tree: {k: jax.device_put(a, NamedSharding(mesh, specs[k])) for k, a in tree.items()}
  shardings = None if kind == AxisType.Explicit else {k: NamedSharding(mesh, s)
                                                     for k, s in specs.items()}
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    state = _place_state(tx.init(params), mesh, specs)
  update = jax.jit(lambda p, s, g: fo.step(tx, g, s, p, shardings=shardings, **step_args))
  got_p = put(params)
  got_s = state
  for g in grads_seq:
    got_p, got_s = update(got_p, got_s, put(g))
  assert formats.of(got_s[0].mu["stack"]).name == fmt
  assert formats.of(got_s[0].mu["q"]).name == fmt
  for a, b in zip(jax.tree.leaves((got_p, got_s)), jax.tree.leaves((want_p, want_s))):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(np.atleast_1d(np.asarray(a)).view(np.uint8),
                                  np.atleast_1d(np.asarray(b)).view(np.uint8))
  for name, s in specs.items():
    assert got_p[name].sharding.is_equivalent_to(NamedSharding(mesh, s), got_p[name].ndim), name
  m = got_s[0].mu["stack"]
  for x in (m.codes, m.scales):
    assert x.sharding.is_equivalent_to(NamedSharding(mesh, specs["stack"]), x.ndim)


@pytest.mark.parametrize("case", ["rows", "cols"])
@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_init_places_8bit_moments_like_their_leaf(case, kind):
  """tx.init on sharded params: each 8-bit moment's codes take the leaf's
  sharding and its scales the leaf's spec where it divides them (eagerly on
  either mesh kind; under jit on an Explicit mesh set with jax.set_mesh),
  so a user's state is sharded without placing it by hand."""
  mesh = jax.make_mesh((8,), ("x",), axis_types=(_KINDS[kind],))
  specs = SPECS[case]
  params = {k: jax.device_put(a, NamedSharding(mesh, specs[k])) for k, a in _tree(0).items()}
  tx = fo.adamw(1e-2, moment_dtype="int8")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")     # the "odd" leaf's bf16 fallback
    states = [tx.init(params)]
    if kind == "explicit":
      jax.jit(tx.init)(params)            # (without the mesh set: runs, placement XLA's)
      with jax.set_mesh(mesh):
        states.append(jax.jit(tx.init)(params))
  for state in states:
    for moments in (state[0].mu, state[0].nu):
      for name in ("w", "stack", "bias"):
        m = moments[name]
        assert isinstance(m, Q.QuantizedMoment)
        for x in (m.codes, m.scales):
          want = NamedSharding(mesh, _fit(specs[name], x.shape, mesh))
          assert x.sharding.is_equivalent_to(want, x.ndim), (name, x.shape, x.sharding)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_sharded_24_bit_masters_on_blockwise_moments_are_bitwise(fmt):
  """Goals A and B sharded: bf16 parameters with a 24-bit master on 8-bit or
  4-bit moments, the fused step on an 8-device Explicit mesh (columns split,
  a leaf gathered where its shards split rows), bitwise the unsharded step."""
  params = {k: v.astype(jnp.bfloat16) for k, v in _tree(0).items()}
  grads_seq = [{k: v.astype(jnp.bfloat16) for k, v in _tree(10 + t).items()} for t in range(2)]
  tx = fo.track_mantissa(fo.adamw(1e-2, weight_decay=0.1, seed=3, moment_dtype=fmt),
                         master_bits=24)
  want_p, want_s = _run(tx, params, grads_seq)
  mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
  specs = SPECS["cols"]
  put = lambda tree: {k: jax.device_put(a, NamedSharding(mesh, specs[k])) for k, a in tree.items()}
  got_p, got_s = _run(tx, put(params), [put(g) for g in grads_seq])
  assert formats.of(got_s.inner_state[0].mu["q"]).name == fmt
  for a, b in zip(jax.tree.leaves((got_p, got_s)), jax.tree.leaves((want_p, want_s))):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(np.atleast_1d(np.asarray(a)).view(np.uint8),
                                  np.atleast_1d(np.asarray(b)).view(np.uint8))
