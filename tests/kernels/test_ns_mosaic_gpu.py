"""The mosaic_gpu backend of Newton–Schulz (fuseopt/kernels/newton_schulz/*/mosaic_gpu.py).

Interpret mode on the CPU (``plgpu.InterpretGPUParams()``, through the ops'
``interpret=True``) against the references on fresh random inputs: the
symmetric product (Gram, polynomial, ``a·I + b·R + c·R²``) and the
``a·X + B X`` GEMM for every config of their search spaces on ragged shapes
(zero padding), the whole ``newton_schulz`` inside the coefficients'
singular-value band (standard and Gram NS), jit and vmap; the dispatch (never
the default, selectable by name and environment) and the refusal on GPUs that
are not sm_90, checked at trace time: nothing is ever compiled for sm_89 here.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from fuseopt import targets
from fuseopt.kernels import dispatch as _backend
from fuseopt.kernels.newton_schulz import fused
from fuseopt.kernels.newton_schulz import gemm as update
from fuseopt.kernels.newton_schulz import mosaic_gpu_common
from fuseopt.kernels.newton_schulz import sym as gram
from fuseopt.kernels.newton_schulz import sym as poly
from fuseopt.kernels.newton_schulz import api as ns
from fuseopt.kernels.newton_schulz.fused import mosaic_gpu as fused_mg
from fuseopt.kernels.newton_schulz.gemm import mosaic_gpu as gemm_mg
from fuseopt.kernels.newton_schulz.sym import mosaic_gpu as sym_mg
from tests.kernels import harness
from tests.kernels.test_newton_schulz import _assert_tile_close, _randn, _rel_err, _well_conditioned

MGPU = "mosaic_gpu"
S = jax.ShapeDtypeStruct


def _interp():
  return _backend.interpret_arg(MGPU, True)


# ------------------------------------------------------------------ kernels --
@pytest.mark.parametrize("config", sym_mg.SEARCH_SPACE, ids=str)
def test_sym_every_config(request, config):
  """Gram X Xᵀ of a ragged wide batch (m and k padded to the blocks), and
  ``alpha·R R + beta·R + gamma·I`` of a ragged symmetric R: several tile pairs,
  so the mirrored tiles and the diagonal's tiles are both exercised."""
  k1, k2 = jax.random.split(harness.fresh_key(request))
  x = _randn(k1, (2, 150, 200))
  got = gram.sym(x, implementation=MGPU, interpret=_interp(), config=config)
  want = gram.sym_reference(x)
  assert got.shape == want.shape == (2, 150, 150) and got.dtype == jnp.bfloat16
  _assert_tile_close(got, want, f"gram {config}")
  harness.assert_bitwise_equal(got, jnp.swapaxes(got, 1, 2), "the mirror is the transpose")
  r = gram.sym_reference(_randn(k2, (1, 140, 90))) * 0.1
  kw = dict(alpha=0.5, beta=-2.0, gamma=3.0)
  got = gram.sym(r, implementation=MGPU, interpret=_interp(), config=config, **kw)
  _assert_tile_close(got, gram.sym_reference(r, **kw), f"z {config}")
  harness.assert_bitwise_equal(got, jnp.swapaxes(got, 1, 2), "the mirror is the transpose (z)")


@pytest.mark.parametrize("config", gemm_mg.SEARCH_SPACE, ids=str)
def test_update_every_config(request, config):
  k1, k2 = jax.random.split(harness.fresh_key(request))
  b = _randn(k1, (2, 100, 100))
  x = _randn(k2, (2, 100, 200))
  got = update.matmul(b, x, a=3.4445, implementation=MGPU, interpret=_interp(), config=config)
  assert got.shape == x.shape and got.dtype == x.dtype
  _assert_tile_close(got, update.gemm_reference(b, x, a=3.4445), str(config))


def test_poly_and_update_without_epilogue_terms(request):
  k1, k2, k3 = jax.random.split(harness.fresh_key(request), 3)
  a = gram.sym_reference(_randn(k1, (1, 80, 120)))
  got = poly.poly(a, b=-4.775, c=2.0315, implementation=MGPU, interpret=_interp())
  _assert_tile_close(got, poly.poly_reference(a, b=-4.775, c=2.0315), "poly")
  b, x = _randn(k2, (1, 64, 64)), _randn(k3, (1, 64, 192))   # no padding, a = 0
  got = update.matmul(b, x, implementation=MGPU, interpret=_interp())
  _assert_tile_close(got, update.gemm_reference(b, x), "B X")


def test_traced_coefficients(request):
  """The coefficients are runtime scalars: traced ones work, and one kernel
  serves every value."""
  x = _randn(harness.fresh_key(request), (1, 64, 64))
  r = gram.sym_reference(x) * 0.1
  f = jax.jit(lambda r, c: gram.sym(r, alpha=c, beta=-c, gamma=2 * c, implementation=MGPU,
                                    interpret=_interp()))
  for c in (0.5, -1.25):
    _assert_tile_close(f(r, jnp.float32(c)), gram.sym_reference(r, alpha=c, beta=-c, gamma=2 * c),
                       f"c={c}")


@pytest.mark.parametrize("config", fused_mg.SEARCH_SPACE, ids=str)
def test_fused_every_config(request, config):
  """The single kernel on a ragged batch (m padded to 64, n to the chunk):
  every step of Polar Express against the iteration's reference."""
  x = _randn(harness.fresh_key(request), (2, 40, 150)) * 0.01
  table = ns.coefficient_table("polar_express")[0]
  got = fused.newton_schulz_fused(x, table, implementation=MGPU, interpret=_interp(),
                                  config=config)
  assert got.shape == x.shape and got.dtype == x.dtype
  assert _rel_err(got, fused.ns_fused_reference(x, table)) < 2e-2


@pytest.mark.mosaic_gpu_refusal
def test_fused_path_choice():
  assert fused.fits(MGPU, 128, 512) and fused.fits(MGPU, 64, 1536)
  assert not fused.fits(MGPU, 129, 256) and not fused.fits(MGPU, 128, 1024)
  assert ns._pick_path(MGPU, 100, 300, 4, None, False) == "fused"
  assert ns._pick_path(MGPU, 1024, 1024, 1, None, False) == "tiled"
  assert ns._pick_path(MGPU, 100, 300, 4, None, True) == "tiled"          # Gram NS
  assert ns._pick_path(MGPU, 1024, 1024, 1, fused_mg.MosaicGPUConfig(), False) == "fused"


# ------------------------------------------------------------------ the op --
@pytest.mark.parametrize("gram_ns,path", [(False, "fused"), (False, "tiled"), (True, "tiled")],
                         ids=["fused", "tiled", "gram"])
def test_singular_value_band(request, monkeypatch, gram_ns, path):
  """A tall well-conditioned matrix (transposed in and out, 72 rows padded to
  128): the singular values land in Polar Express's band (exact arithmetic
  [0.846, 1.124]; bf16 slack as the other backends' tests) and the result is
  the reference's up to accumulation order; the single kernel and the tiled
  kernels."""
  monkeypatch.setenv("FUSEOPT_NS_PATH", path)
  x = _well_conditioned(harness.fresh_key(request), 72, 200).T
  y = ns.newton_schulz(x.astype(jnp.bfloat16), implementation=MGPU, interpret=True, gram=gram_ns)
  assert y.shape == (200, 72) and y.dtype == jnp.bfloat16
  s = np.linalg.svd(np.asarray(y, np.float64), compute_uv=False)
  assert 0.8 <= s.min() and s.max() <= 1.17, (s.min(), s.max())
  want = ns.newton_schulz_reference(x.astype(jnp.bfloat16), gram=gram_ns)
  assert _rel_err(y, want) < 3e-2


@pytest.mark.parametrize("path", ["fused", "tiled"])
def test_jit_vmap_and_batch(request, monkeypatch, path):
  """A leading batch runs as the kernels' batch axis; vmap adds a grid axis
  (plgpu.kernel's batching rule); both under jit, both the reference's."""
  monkeypatch.setenv("FUSEOPT_NS_PATH", path)
  x = jax.random.normal(harness.fresh_key(request), (2, 40, 72), jnp.float32)
  kw = dict(steps=2, coeffs="jordan")
  want = ns.newton_schulz_reference(x, **kw)
  f = jax.jit(lambda v: ns.newton_schulz(v, implementation=MGPU, interpret=True, **kw))
  assert _rel_err(f(x), want) < 3e-2
  g = jax.jit(jax.vmap(lambda v: ns.newton_schulz(v, implementation=MGPU, interpret=True, **kw)))
  got = g(x)
  assert got.shape == x.shape and got.dtype == x.dtype
  assert _rel_err(got, want) < 3e-2


def test_xla_update_and_derivative(request):
  """``TiledConfig(matmul="xla")`` keeps XLA's dot for the update; the
  derivative is the reference's."""
  x = jax.random.normal(harness.fresh_key(request), (48, 64), jnp.float32)
  cfg = ns.TiledConfig(sym=sym_mg.MosaicGPUConfig(64, 64, 2), matmul="xla")
  got = ns.newton_schulz(x, steps=1, implementation=MGPU, interpret=True, config=cfg)
  assert _rel_err(got, ns.newton_schulz_reference(x, steps=1)) < 3e-2
  t = jnp.ones_like(x)
  _, dy = jax.jvp(lambda v: ns.newton_schulz(v, steps=1, implementation=MGPU, interpret=True),
                  (x,), (t,))
  _, dref = jax.jvp(lambda v: ns.newton_schulz_reference(v, steps=1), (x,), (t,))
  np.testing.assert_allclose(np.asarray(dy), np.asarray(dref), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------- dispatch --
def _gpu_mesh(kind, cores=1):
  return AbstractMesh((), (), abstract_device=AbstractDevice(device_kind=kind, num_cores=cores,
                                                             platform="gpu"))


def _ns_call(x):
  return ns.newton_schulz(x, implementation=MGPU)


@pytest.mark.mosaic_gpu_refusal
@pytest.mark.parametrize("kind", ["NVIDIA L4", "NVIDIA GeForce RTX 4090"])
def test_refused_on_sm89_before_lowering(kind):
  """Traced (never lowered) under an sm_89 device: a clear error naming the
  device and its compute capability."""
  with jax.sharding.use_abstract_mesh(_gpu_mesh(kind)):
    with pytest.raises(ValueError, match=rf"{kind}.*compute capability 8\.9 \(sm_89\)"):
      jax.jit(_ns_call).trace(S((256, 512), jnp.float32))


def test_refused_without_a_gpu_and_for_fp32_iterates():
  x = jnp.ones((64, 64), jnp.float32)
  with pytest.raises(ValueError, match="cpu device.*interpret=True"):
    _ns_call(x)
  with pytest.raises(ValueError, match="bf16 or f16"):
    ns.newton_schulz(x, implementation=MGPU, interpret=True, ns_dtype=jnp.float32)
  with pytest.raises(ValueError, match="bf16 or f16"):
    gemm_mg.gemm(x[None], x[None], jnp.zeros((4,)), has_a=False, config=gemm_mg.MosaicGPUConfig(),
              interpret=_interp())


@pytest.mark.mosaic_gpu_refusal
def test_never_the_default_but_selectable(monkeypatch):
  """``None`` stays Triton on every GPU (an L4 traces: no Mosaic GPU is
  attempted); the environment override selects Mosaic GPU (and so the L4
  refuses)."""
  x = S((256, 512), jnp.float32)
  default = lambda v: ns.newton_schulz(v)
  with jax.sharding.use_abstract_mesh(_gpu_mesh("NVIDIA H200", 132)):
    assert _backend.resolve_implementation(ns.OP_NAME, None,
                                           available=_backend.IMPLEMENTATIONS) == "triton"
  with jax.sharding.use_abstract_mesh(_gpu_mesh("NVIDIA L4")):
    jax.jit(default).trace(x)
  monkeypatch.setenv("FUSEOPT_IMPLEMENTATION_NEWTON_SCHULZ", MGPU)
  with jax.sharding.use_abstract_mesh(_gpu_mesh("NVIDIA L4")):
    with pytest.raises(ValueError, match="sm_89"):   # a fresh function: not jit's cached trace
      jax.jit(lambda v: ns.newton_schulz(v)).trace(x)


def test_configs():
  with pytest.raises(ValueError, match="multiple of 64"):
    sym_mg.MosaicGPUConfig(bm=96)
  with pytest.raises(ValueError, match="64 or 128"):
    sym_mg.MosaicGPUConfig(bm=256)
  with pytest.raises(ValueError, match="128 × 128"):
    gemm_mg.MosaicGPUConfig(bm=128, bn=256)
  with pytest.raises(ValueError, match="64 or 128"):
    fused_mg.MosaicGPUConfig(bn=256)
  with pytest.raises(TypeError, match="SymMosaicGPUConfig"):
    gram.sym(_randn(jax.random.key(0), (1, 64, 64)), implementation=MGPU, interpret=_interp(),
             config=gram.TritonConfig())
  for c in sym_mg.SEARCH_SPACE:
    assert sym_mg.shared_memory_bytes(c) <= mosaic_gpu_common.SHARED_MEMORY_BYTES
  for c in gemm_mg.SEARCH_SPACE:
    assert gemm_mg.shared_memory_bytes(c) <= mosaic_gpu_common.SHARED_MEMORY_BYTES
  # the heuristics pick from the search spaces
  for shape in ((1, 1024, 1024), (1, 2048, 8192), (16, 2048, 2048), (1, 1000, 2900)):
    assert sym_mg.heuristic(*shape) in sym_mg.SEARCH_SPACE
    assert gemm_mg.heuristic(*shape) in gemm_mg.SEARCH_SPACE
  assert gram.heuristic(MGPU, 1, 1024, 1024) == sym_mg.heuristic(1, 1024, 1024)
  assert update.heuristic(MGPU, 1, 1024, 1024) == gemm_mg.heuristic(1, 1024, 1024)


@pytest.mark.skipif(targets.missing("h200") is not None, reason="the CUDA plugin is not installed")
def test_lowers_for_h200():
  """Lowered for an H200 (the compile tier compiles it: kernel/newton_schulz/mosaic_gpu/...):
  three Mosaic GPU kernels a step."""
  with jax.sharding.use_abstract_mesh(_gpu_mesh("NVIDIA H200", 132)):
    text = jax.jit(lambda v: ns.newton_schulz(v, steps=1, implementation=MGPU)).trace(
        S((256, 512), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("mosaic_gpu") >= 3


@pytest.mark.skipif(targets.missing("h200") is not None, reason="the CUDA plugin is not installed")
def test_device_script_times_mosaic_gpu_beside_triton():
  """On an sm_90 GPU the device script's config checks add the NS Mosaic GPU
  families beside Triton's; their steps lower for an H200 with a Mosaic GPU
  kernel in them."""
  import importlib.util
  import pathlib
  import sys
  root = pathlib.Path(__file__).resolve().parents[2]
  cc = sys.modules.get("config_checks")
  if cc is None:
    spec = importlib.util.spec_from_file_location("config_checks", root / "bench" / "config_checks.py")
    cc = importlib.util.module_from_spec(spec)
    sys.modules["config_checks"] = cc
    spec.loader.exec_module(cc)
  st = cc.Settings("triton", False, dict(d=32, ff=64, layers=0, vocab=64), ((13, 7),), (1, 64, 128),
                   (2, 32, 64), 1, None, mosaic_gpu=True)
  fams = {f.name: f for f in cc.families(st)}
  names = ("ns_poly_mosaic_gpu", "ns_gram_mosaic_gpu", "ns_update_mosaic_gpu",
           "ns_fused_mosaic_gpu")
  assert {"ns_poly", "ns_gram", "ns_update", *names} <= set(fams)
  assert fams["ns_update_mosaic_gpu"].space == gemm_mg.SEARCH_SPACE
  assert fams["ns_gram_mosaic_gpu"].space == sym_mg.SEARCH_SPACE
  assert fams["ns_fused_mosaic_gpu"].space == fused_mg.SEARCH_SPACE
  for name in names:
    fam = fams[name]
    call = fam.run(fam.setup(), fam.space[-1])
    structs = jax.tree.map(lambda a: S(a.shape, a.dtype), call.args)
    with jax.sharding.use_abstract_mesh(_gpu_mesh("NVIDIA H200", 132)):
      text = call.jitted.trace(*structs).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text, name


@pytest.mark.skipif(targets.missing("h200") is not None, reason="the CUDA plugin is not installed")
def test_benchmark_times_mosaic_gpu_beside_triton_on_sm90():
  """The benchmark's NS case adds ``fuseopt[mosaic_gpu]`` on an sm_90 GPU only;
  it lowers for an H200 with Mosaic GPU kernels."""
  from fuseopt.benchmarks.cases import newton_schulz as ns_cases
  shape = (16, 128, 256)
  with jax.sharding.use_abstract_mesh(_gpu_mesh("NVIDIA L4")):
    assert "fuseopt[mosaic_gpu]" not in ns_cases.variant_fns(shape, "gpu")
  with jax.sharding.use_abstract_mesh(_gpu_mesh("NVIDIA H200", 132)):
    fns = ns_cases.variant_fns(shape, "gpu")
    assert {"fuseopt[triton]", "fuseopt[mosaic_gpu]"} <= set(fns)
    text = jax.jit(fns["fuseopt[mosaic_gpu]"]).trace(S(shape, jnp.bfloat16)).lower(
        lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def test_muon_step_on_mosaic_gpu(request):
  """``fo.muon(implementation="mosaic_gpu")`` through ``fo.step``: the matrix
  update runs the NS kernels (interpret mode) and equals the reference
  recipe's up to bf16 accumulation order."""
  import fuseopt.optim as fo
  k1, k2, k3 = jax.random.split(harness.fresh_key(request), 3)
  params = {"w": jax.random.normal(k1, (64, 96), jnp.float32) * 0.02,
            "b": jax.random.normal(k2, (96,), jnp.float32) * 0.02}
  grads = jax.tree.map(lambda p, k: jax.random.normal(k, p.shape, jnp.float32),
                       params, {"w": k3, "b": jax.random.fold_in(k3, 1)})

  def one(impl):
    tx = fo.muon(0.02, weight_decay=0.1, execution=fo.Execution(implementation=impl, interpret=impl != 'xla'))
    new, _ = jax.jit(lambda p, s, g: fo.step(tx, g, s, p))(params, tx.init(params), grads)
    return jax.tree.map(lambda a, b: a - b, new, params)

  got, want = one(MGPU), one("xla")
  assert _rel_err(got["w"], want["w"]) < 3e-2
  np.testing.assert_allclose(np.asarray(got["b"]), np.asarray(want["b"]), rtol=1e-5, atol=1e-7)
