"""The mosaic_gpu backend of the elementwise ops (stochastic rounding, Adam).

Interpret mode on the CPU (``plgpu.InterpretGPUParams()``, through the ops'
``interpret=True``) against the references, every config of the search
spaces, composition (jit, vmap, donation, shard_map on the 8 CPU devices,
``fo.step``), the dispatch (never the default) and the refusal on GPUs that
are not sm_90, checked at trace time: nothing is ever compiled for sm_89 here
(that aborts the process, docs/pallas_notes.md).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import fuseopt.optim as fo
from fuseopt import kernels
from fuseopt import targets
from fuseopt.kernels import dispatch as _backend
from fuseopt.kernels import adam as A
from fuseopt.kernels.adam import mosaic_gpu as adam_mosaic_gpu
from fuseopt.kernels import adam_update, adam_update_reference, adam_update_tree
from fuseopt.kernels import counter_hash
from fuseopt.kernels import stochastic_round as sr
from fuseopt.kernels import stochastic_round_bf16
from fuseopt.kernels.stochastic_round import mosaic_gpu as sr_mgpu
from fuseopt.kernels.elementwise_tiling import MosaicGPUConfig
from tests.kernels import harness
from tests.kernels.test_adam_kernel import CASES, HYPER, _case_id, _compare, _inputs
from tests.kernels.test_stochastic_round import SPECIALS, _from_bits

MGPU = "mosaic_gpu"
F32, BF16 = jnp.float32, jnp.bfloat16


def _sr(x, seed, **kw):
  return stochastic_round_bf16(x, seed, implementation=MGPU, interpret=True, **kw)


# ------------------------------------------------------ stochastic rounding --
@pytest.mark.parametrize("shape", [(), (1,), (7,), (130,), (1000, 37), (3, 5, 129), (4096,)],
                         ids=str)
def test_sr_matches_reference(request, shape):
  key = harness.fresh_key(request)
  x = jax.random.normal(key, shape, F32) * 10.0
  seed = jax.random.randint(jax.random.fold_in(key, 1), (), 0, 2**31 - 1).astype(jnp.uint32)
  harness.check_against_reference(lambda x, s: _sr(x, s, offset=11),
                                  lambda x, s: sr.stochastic_round_reference(x, s, offset=11),
                                  (x, seed), what=f"mosaic_gpu{shape}")


@pytest.mark.parametrize("config", sr_mgpu.SEARCH_SPACE, ids=str)
def test_sr_every_config_bitwise(request, config):
  # ragged: neither a multiple of the block nor of 128; <= 40 programs
  x = jax.random.normal(harness.fresh_key(request), (10_037,), F32)
  harness.assert_bitwise_equal(_sr(x, 5, config=config), sr.stochastic_round_reference(x, 5),
                               str(config))


def test_sr_special_values_as_the_reference():
  x = jnp.tile(_from_bits(SPECIALS), 64)
  harness.assert_bitwise_equal(_sr(x, 1234), sr.stochastic_round_reference(x, 1234))


def test_sr_slices_vmap_and_traced_scalars():
  x = jax.random.normal(jax.random.key(6), (4, 1000), F32)
  whole = sr.stochastic_round_reference(x, 8)
  rows = jax.vmap(lambda r, o: _sr(r, 8, offset=o))(x, jnp.arange(4) * 1000)
  harness.assert_bitwise_equal(rows, whole, "vmap")
  flat = x.reshape(-1)
  cuts = [0, 129, 1000, 2999, 4000]
  parts = [_sr(flat[a:b], 8, offset=a) for a, b in zip(cuts[:-1], cuts[1:])]
  harness.assert_bitwise_equal(jnp.concatenate(parts), whole.reshape(-1), "slices")
  f = jax.jit(lambda x, s, o: _sr(x, s, offset=o))
  harness.assert_bitwise_equal(f(flat, jnp.uint32(3), jnp.uint32(5)),
                               sr.stochastic_round_reference(flat, 3, offset=5), "jit")


@pytest.mark.parametrize("spec", [P("x"), P(None, None, "x"), P(None, "x")],
                         ids=["rows", "last", "middle"])
@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_sr_sharded_on_8_devices_is_bitwise(spec, kind):
  x = jax.random.normal(jax.random.key(1), (8, 16, 32)) * 3
  want = sr.stochastic_round_reference(x, 123457, offset=7)
  mesh = jax.make_mesh((8,), ("x",), axis_types=(kind,))
  sh = NamedSharding(mesh, spec)
  kw = {} if kind == AxisType.Explicit else {"sharding": sh}
  got = jax.jit(lambda a: _sr(a, jnp.uint32(123457), offset=7, **kw))(jax.device_put(x, sh))
  harness.assert_bitwise_equal(got, want, str(spec))
  assert got.sharding.is_equivalent_to(sh, 3)


def test_sr_sharded_sizes_not_powers_of_two():
  """A shard cut along a later axis of a size that is not a power of two:
  the kernel rebuilds the global index with an integer division (Mosaic GPU
  has one, unlike Mosaic TPU)."""
  x = jax.random.normal(jax.random.key(2), (3, 24, 40))
  mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
  got = jax.jit(lambda a: _sr(a, 99))(jax.device_put(x, NamedSharding(mesh, P(None, "x"))))
  harness.assert_bitwise_equal(got, sr.stochastic_round_reference(x, 99))


# -------------------------------------------------------------------- adam --
def _adam_both(p, g, mu, nu, count, **kw):
  f = lambda p, g, mu, nu, c: adam_update(p, g, mu, nu, count=c, implementation=MGPU,
                                          interpret=True, **kw)
  r = lambda p, g, mu, nu, c: adam_update_reference(p, g, mu, nu, count=c, **kw)
  return jax.jit(f)(p, g, mu, nu, count), jax.jit(r)(p, g, mu, nu, count)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_adam_matches_reference(request, case):
  shape, p_dtype, g_dtype, m_dtype, nesterov = case
  p, g, mu, nu = _inputs(harness.fresh_key(request), shape, p_dtype, g_dtype, m_dtype)
  got, want = _adam_both(p, g, mu, nu, jnp.int32(7), nesterov=nesterov, **HYPER)
  _compare(got, want, f"mosaic_gpu{case}")
  assert got[0].dtype == (p_dtype or g_dtype)
  assert got[1].dtype == m_dtype and got[2].dtype == m_dtype


@pytest.mark.parametrize("signature", [(F32, F32, BF16), (F32, BF16, F32), (BF16, F32, BF16),
                                       (BF16, BF16, F32)], ids=str)
def test_adam_dtype_signatures_ragged(request, signature):
  p, g, mu, nu = _inputs(harness.fresh_key(request), (5, 301), *signature)  # 1505: a tail of 97
  got, want = _adam_both(p, g, mu, nu, jnp.int32(3), **HYPER)
  _compare(got, want, str(signature))


@pytest.mark.parametrize("config", adam_mosaic_gpu.SEARCH_SPACE, ids=str)
def test_adam_every_config(request, config):
  p, g, mu, nu = _inputs(harness.fresh_key(request), (10_037,), F32, F32, BF16)
  run = lambda c: jax.jit(lambda *a: adam_update(*a, count=3, implementation=MGPU,
                                                 interpret=True, config=c, **HYPER))(p, g, mu, nu)
  got = run(config)
  _compare(got, jax.jit(lambda *a: adam_update_reference(*a, count=3, **HYPER))(p, g, mu, nu),
           str(config))
  for a, b in zip(got, run(MosaicGPUConfig(128))):   # the block never changes the bits
    harness.assert_bitwise_equal(a, b, str(config))


def test_adam_moments_are_the_stochastic_rounding_of_fp32_moments():
  p, g, mu, nu = _inputs(jax.random.key(4), (3, 1000), F32, F32, BF16)
  count, seed, leaf = 11, 123, 4
  _, mu_new, nu_new = jax.jit(lambda *a: adam_update(
      *a, count=count, seed=seed, leaf_index=leaf, implementation=MGPU,
      interpret=True))(p, g, mu, nu)

  @jax.jit
  def expected(g, mu, nu):
    mu32 = 0.1 * g + 0.9 * mu.astype(F32)
    nu32 = (1 - 0.999) * (g * g) + 0.999 * nu.astype(F32)
    s_mu = counter_hash.derive_seed(seed, count, leaf, counter_hash.STREAM_MU)
    # (nu: the high 16 bits of mu's hash, docs/numerics.md "Seeds")
    high = counter_hash.hash_bits(jax.lax.iota(jnp.uint32, mu32.size).reshape(mu32.shape),
                                  s_mu) >> 16
    return stochastic_round_bf16(mu32, s_mu), counter_hash.round_with_bits(nu32, high)

  want_mu, want_nu = expected(g, mu, nu)
  harness.assert_bitwise_equal(mu_new, want_mu, "mu")
  harness.assert_bitwise_equal(nu_new, want_nu, "nu")


def test_adam_grad_scale_apply_flag_and_nonfinite():
  p, g, mu, nu = _inputs(jax.random.key(8), (32, 129), BF16, F32, BF16)
  g = g.at[0, 3].set(jnp.nan).at[1, 10].set(jnp.inf)
  run = jax.jit(lambda p, g, mu, nu, s, a: adam_update(
      p, g, mu, nu, count=3, grad_scale=s, apply=a, implementation=MGPU, interpret=True,
      **HYPER))
  scale = jnp.float32(0.37)
  got = run(p, g, mu, nu, scale, jnp.bool_(True))
  for a, b in zip(got, run(p, g * scale, mu, nu, jnp.float32(1.0), jnp.bool_(True))):
    harness.assert_bitwise_equal(a, b, "grad_scale")
  new_p, mu_n, nu_n = (np.asarray(x, np.float32).reshape(-1) for x in got)
  assert np.isnan(mu_n[3]) and np.isnan(nu_n[3]) and np.isnan(new_p[3])
  assert mu_n[129 + 10] == np.inf and nu_n[129 + 10] == np.inf and np.isnan(new_p[129 + 10])
  for a, b in zip(run(p, g, mu, nu, scale, jnp.bool_(False)), (p, mu, nu)):
    harness.assert_bitwise_equal(a, b, "apply=False")
  u, _, _ = adam_update(None, g, mu, nu, count=3, apply=False, implementation=MGPU,
                        interpret=True)
  assert not np.asarray(u).any()


def test_adam_in_place_with_donation():
  p, g, mu, nu = _inputs(jax.random.key(9), (64, 256), F32, F32, BF16)
  f = jax.jit(lambda p, g, mu, nu: adam_update(p, g, mu, nu, count=1, learning_rate=1e-3,
                                               implementation=MGPU, interpret=True),
              donate_argnums=(0, 2, 3))
  want = jax.jit(lambda *a: adam_update_reference(*a, count=1, learning_rate=1e-3))(p, g, mu, nu)
  ptrs = [a.unsafe_buffer_pointer() for a in (p, mu, nu)]
  got = f(p, g, mu, nu)
  assert [a.unsafe_buffer_pointer() for a in got] == ptrs
  _compare(got, want, "donated")


def test_adam_vmap_and_no_derivative():
  p, g, mu, nu = _inputs(jax.random.key(10), (2, 512), F32, F32, BF16)
  f = lambda p, g, mu, nu: adam_update(p, g, mu, nu, count=2, implementation=MGPU,
                                       interpret=True, **HYPER)
  got = jax.jit(jax.vmap(f))(p, g, mu, nu)
  for i in range(2):
    for a, b in zip(got, jax.jit(f)(p[i], g[i], mu[i], nu[i])):
      harness.assert_bitwise_equal(a[i], b, f"vmap row {i}")
  with pytest.raises(TypeError, match="no derivative"):
    jax.grad(lambda g: f(p[0], g, mu[0], nu[0])[0].sum())(g[0])


def test_adam_tree_runs_per_leaf_bitwise():
  leaves = [_inputs(jax.random.key(20 + i), s, F32, F32, BF16)
            for i, s in enumerate([(16, 64), (300,), (5,)])]
  ps, gs, mus, nus = (list(x) for x in zip(*leaves))
  got = adam_update_tree(ps, gs, mus, nus, count=2, learning_rate=1e-3, implementation=MGPU,
                         interpret=True, group=False)
  for i in range(3):
    one = adam_update(ps[i], gs[i], mus[i], nus[i], count=2, learning_rate=1e-3, leaf_index=i,
                      implementation=MGPU, interpret=True)
    for a, b in zip((o[i] for o in got), one):
      harness.assert_bitwise_equal(a, b, f"leaf {i}")


@pytest.mark.parametrize("config", [adam_mosaic_gpu.MosaicGPUGroupConfig(128, 2),
                                    adam_mosaic_gpu.MosaicGPUGroupConfig(1024, 8)], ids=str)
@pytest.mark.parametrize("direction", [False, True], ids=["params", "direction"])
def test_adam_grouped_launch_is_the_per_leaf_kernels_bits(config, direction):
  """Leaves of one dtype signature in one launch (a leaf under 128 elements
  per leaf, in the reference), each with its own flat index: bitwise the
  per-leaf kernels, for every leaf, with a ragged tail or not."""
  shapes = [(16, 64), (300,), (5,), (3, 129), (2048,)]
  leaves = [_inputs(jax.random.key(30 + i), s, F32, F32, BF16) for i, s in enumerate(shapes)]
  ps, gs, mus, nus = (list(x) for x in zip(*leaves))
  kw = dict(count=2, learning_rate=1e-3, weight_decay=0.1, implementation=MGPU, interpret=True)
  ps = None if direction else ps
  got = jax.jit(lambda *a: adam_update_tree(*a, config=config, **kw))(ps, gs, mus, nus)
  want = jax.jit(lambda *a: adam_update_tree(*a, group=False, **kw))(ps, gs, mus, nus)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    harness.assert_bitwise_equal(a, b, "grouped")


def test_adam_group_configs():
  with pytest.raises(ValueError, match="max_leaves_per_launch"):
    adam_mosaic_gpu.MosaicGPUGroupConfig(1024, 0)
  x = [jnp.ones((256,))]
  # Another backend's config is named; a MosaicGPUGroupConfig asks for grouped launches itself.
  with pytest.raises(TypeError, match="GroupConfig"):
    adam_update_tree(x, x, x, x, count=1, implementation=MGPU, interpret=True,
                     config=A.TritonGroupConfig(), group=True)
  # a per-leaf config runs per leaf, grouped or not
  adam_update_tree(x, x, x, x, count=1, implementation=MGPU, interpret=True,
                   config=MosaicGPUConfig(256))
  assert all(c.max_leaves_per_launch <= 8 for c in adam_mosaic_gpu.GROUP_SEARCH_SPACE)


def _tree(seed, dtype):
  k = jax.random.split(jax.random.key(seed), 4)
  return {"w": jax.random.normal(k[0], (16, 64)).astype(dtype),
          "stack": jax.random.normal(k[1], (8, 8, 32)).astype(dtype),
          "bias": jax.random.normal(k[2], (64,)).astype(dtype),
          "odd": jax.random.normal(k[3], (6, 10)).astype(dtype)}


def _steps(tx, params, grads, shardings=None):
  state = tx.init(params)
  update = jax.jit(lambda p, s, g: fo.step(tx, g, s, p, shardings=shardings))
  for g in grads:
    params, state = update(params, state, g)
  return params, state


def test_fused_step_with_the_environment_override(monkeypatch):
  params = _tree(0, BF16)
  grads = [_tree(10 + t, BF16) for t in range(2)]
  want = _steps(fo.adamw(1e-2, weight_decay=0.1, seed=3, execution=fo.Execution(implementation="xla")), params, grads)
  monkeypatch.setenv("FUSEOPT_IMPLEMENTATION", MGPU)
  got = _steps(fo.adamw(1e-2, weight_decay=0.1, seed=3, execution=fo.Execution(interpret=True)), params, grads)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    _compare((a,), (b,), "fo.step")


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_fused_step_sharded_on_8_devices_is_bitwise(kind):
  params = _tree(0, BF16)
  grads = [_tree(10 + t, BF16) for t in range(2)]
  tx = fo.adamw(1e-2, weight_decay=0.1, seed=3, execution=fo.Execution(implementation=MGPU, interpret=True))
  want = _steps(tx, params, grads)
  mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(kind,) * 2)
  specs = {"w": P("x", "y"), "stack": P("y", "x"), "bias": P(("x", "y")), "odd": P(None, "y")}
  put = lambda tree: jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)),
                                  tree, specs)
  shardings = None if kind == AxisType.Explicit else jax.tree.map(
      lambda s: NamedSharding(mesh, s), specs)
  got = _steps(tx, put(params), [put(g) for g in grads], shardings)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    harness.assert_bitwise_equal(a, b, "sharded step")


# ---------------------------------------------------------------- dispatch --
def _gpu_mesh(kind, cores=1):
  return AbstractMesh((), (), abstract_device=AbstractDevice(device_kind=kind, num_cores=cores,
                                                             platform="gpu"))


def test_never_the_default_but_selectable(monkeypatch):
  with jax.sharding.use_abstract_mesh(_gpu_mesh("NVIDIA H200", 132)):
    assert _backend.resolve_implementation("adam_update", None,
                                           available=_backend.IMPLEMENTATIONS) == "triton"
  monkeypatch.setenv("FUSEOPT_IMPLEMENTATION_ADAM_UPDATE", MGPU)
  assert _backend.resolve_implementation("adam_update", None,
                                         available=_backend.IMPLEMENTATIONS) == MGPU
  # every op has a Mosaic GPU backend now (Newton-Schulz too); a name that is
  # no backend of the op is refused rather than guessed
  from fuseopt.kernels.newton_schulz.backends import BACKENDS as NS_BACKENDS
  assert _backend.resolve_implementation("newton_schulz", MGPU, available=NS_BACKENDS) == MGPU
  with pytest.raises(ValueError, match="not available"):
    _backend.resolve_implementation("newton_schulz", MGPU + "_sm80", available=NS_BACKENDS)
  assert isinstance(_backend.interpret_arg(MGPU, True),
                    __import__("jax.experimental.pallas.mosaic_gpu",
                               fromlist=["x"]).InterpretGPUParams)


@pytest.mark.mosaic_gpu_refusal
def test_compute_capabilities():
  assert _backend.compute_capability("NVIDIA H200") == (9, 0)
  assert _backend.compute_capability("NVIDIA H100 80GB HBM3") == (9, 0)
  assert _backend.compute_capability("NVIDIA L4") == (8, 9)
  assert _backend.compute_capability("NVIDIA GeForce RTX 4090") == (8, 9)
  assert _backend.compute_capability("NVIDIA L40S") is None
  for t in targets.TARGETS.values():
    if t.platform == "gpu":
      assert _backend.compute_capability(t.device_kind) == t.compute_capability, t.name


def _sr_call(x):
  return stochastic_round_bf16(x, 1, implementation=MGPU)


def _adam_call(x):
  return adam_update(x, x, x, x, count=1, implementation=MGPU)


def _step_call(x):
  tx = fo.adamw(1e-3, execution=fo.Execution(implementation=MGPU))
  return fo.step(tx, {"w": x}, tx.init({"w": x}), {"w": x})


@pytest.mark.mosaic_gpu_refusal
@pytest.mark.parametrize("call", [_sr_call, _adam_call, _step_call], ids=["sr", "adam", "step"])
@pytest.mark.parametrize("kind", ["NVIDIA L4", "NVIDIA GeForce RTX 4090"])
def test_refused_on_sm89_before_lowering(call, kind):
  """Traced (never lowered) under an sm_89 device: a clear error naming the
  device and its compute capability."""
  x = jax.ShapeDtypeStruct((1024,), F32)
  with jax.sharding.use_abstract_mesh(_gpu_mesh(kind)):
    with pytest.raises(ValueError, match=rf"{kind}.*compute capability 8\.9 \(sm_89\)"):
      jax.jit(call).trace(x)


def test_refused_without_a_gpu_and_unknown_kinds_allowed_in_interpret_mode():
  x = jnp.ones((256,), F32)
  with pytest.raises(ValueError, match="cpu device.*interpret=True"):
    stochastic_round_bf16(x, 1, implementation=MGPU)
  with jax.sharding.use_abstract_mesh(_gpu_mesh("NVIDIA L40S")):
    with pytest.raises(ValueError, match="unknown compute capability"):
      jax.jit(_sr_call).trace(x)
    # interpret mode is allowed on any device (traced only here)
    jax.jit(lambda x: stochastic_round_bf16(x, 1, implementation=MGPU, interpret=True)).trace(x)


def test_config_types():
  with pytest.raises(ValueError, match="power of two >= 128"):
    MosaicGPUConfig(64)
  with pytest.raises(TypeError, match="MosaicGPUConfig"):
    _sr(jnp.ones((256,)), 1, config=sr.TritonConfig())
  x = jnp.ones((256,))
  with pytest.raises(TypeError, match="MosaicGPUConfig"):
    adam_update(x, x, x, x, count=1, implementation=MGPU, interpret=True,
                config=A.TritonConfig())
  assert kernels.ElementwiseMosaicGPUConfig is MosaicGPUConfig


@pytest.mark.skipif(targets.missing("h200") is not None, reason="the CUDA plugin is not installed")
def test_lowers_for_h200_in_place():
  s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt)
  mesh = _gpu_mesh("NVIDIA H200", 132)
  fn = lambda p, g, mu, nu: adam_update(p, g, mu, nu, count=3, implementation=MGPU)
  with jax.sharding.use_abstract_mesh(mesh):
    text = jax.jit(fn, donate_argnums=(0, 2, 3)).trace(
        s((512, 1024), F32), s((512, 1024), F32), s((512, 1024), BF16),
        s((512, 1024), BF16)).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text and "output_operand_aliases" in text


@pytest.mark.skipif(targets.missing("h200") is not None, reason="the CUDA plugin is not installed")
def test_device_script_times_mosaic_gpu_beside_triton():
  """On an sm_90 GPU the config checks add the Mosaic GPU families, which
  lower for an H200 with a Mosaic GPU kernel in them."""
  import importlib.util
  import pathlib
  import sys
  root = pathlib.Path(__file__).resolve().parents[2]
  spec = importlib.util.spec_from_file_location("config_checks", root / "bench" / "config_checks.py")
  cc = sys.modules.get("config_checks") or importlib.util.module_from_spec(spec)
  if "config_checks" not in sys.modules:
    sys.modules["config_checks"] = cc
    spec.loader.exec_module(cc)
  st = cc.Settings("triton", False, dict(d=32, ff=64, layers=0, vocab=64), ((13, 7),), (1, 64, 128),
                   (2, 32, 64), 1, None, mosaic_gpu=True)
  fams = {f.name: f for f in cc.families(st)}
  assert {"stochastic_round", "adam", "stochastic_round_mosaic_gpu", "adam_mosaic_gpu",
          "adam_group_mosaic_gpu", "adam_int8_mosaic_gpu"} <= set(fams)
  assert "adam_mosaic_gpu" not in {f.name for f in cc.families(
      cc.Settings("triton", False, dict(d=32, ff=64, layers=0, vocab=64), ((13, 7),), (1, 64, 128),
                  (2, 32, 64), 1, None))}
  for name in ("stochastic_round_mosaic_gpu", "adam_mosaic_gpu", "adam_group_mosaic_gpu",
               "adam_int8_mosaic_gpu"):
    fam = fams[name]
    call = fam.run(fam.setup(), fam.space[-1])
    structs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), call.args)
    with jax.sharding.use_abstract_mesh(_gpu_mesh("NVIDIA H200", 132)):
      text = call.jitted.trace(*structs).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text, name
