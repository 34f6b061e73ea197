"""Newton–Schulz: every kernel against its reference (interpret mode), the
whole op against the reference, the singular-value band the coefficients
promise, edge cases, and every search-space config lowered for an H200 and
TPU v5e/v6e."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fuseopt.kernels import dispatch as _backend
from fuseopt.kernels.newton_schulz import fused
from fuseopt.kernels.newton_schulz import gemm as update
from fuseopt.kernels.newton_schulz import sym as gram
from fuseopt.kernels.newton_schulz import sym as poly
from tests.kernels import harness

from fuseopt.kernels.newton_schulz import api as ns  # noqa: E402
S = jax.ShapeDtypeStruct
BACKENDS = ("triton", "mosaic_tpu")


def _interp(impl):
  return _backend.interpret_arg(impl, True)


def _assert_tile_close(got, want, what=""):
  """Equal up to the order of fp32 accumulation: about one bf16 ulp of each
  element plus a small fraction of the largest element (cancellation)."""
  got = np.asarray(got, np.float32)
  want = np.asarray(want, np.float32)
  assert got.shape == want.shape, f"{what}: {got.shape} != {want.shape}"
  assert np.isfinite(got).all(), f"{what}: non-finite output"
  scale = np.abs(want).max()
  np.testing.assert_allclose(got, want, rtol=1e-2, atol=8e-3 * scale, err_msg=what)


def _rel_err(got, want):
  got = np.asarray(got, np.float64)
  want = np.asarray(want, np.float64)
  return np.linalg.norm(got - want) / np.linalg.norm(want)


def _randn(key, shape, dtype=jnp.bfloat16):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _well_conditioned(key, m, n, lo=0.05):
  """U diag(s) Vᵀ with s spread in [lo, 1]: normalised singular values stay
  above the 1e-3 the coefficient bands assume."""
  k1, k2, k3 = jax.random.split(key, 3)
  r = min(m, n)
  u, _ = jnp.linalg.qr(jax.random.normal(k1, (m, r)))
  v, _ = jnp.linalg.qr(jax.random.normal(k2, (n, r)))
  s = jnp.exp(jax.random.uniform(k3, (r,), minval=np.log(lo), maxval=0.0))
  return (u * s) @ v.T


# ------------------------------------------------------------ coefficients --
def test_coefficient_tables():
  table, s = ns.coefficient_table("jordan")
  assert table == ((3.4445, -4.7750, 2.0315),) * 5 and s == 1.0
  table, s = ns.coefficient_table("polar_express")
  assert len(table) == 5 and s == 1.01
  np.testing.assert_allclose(table[0], (8.28721201814563 / 1.01, -23.595886519098837 / 1.01**3,
                                        17.300387312530933 / 1.01**5))
  table, _ = ns.coefficient_table("polar_express", 10)
  assert table[7:] == ((1.875, -1.25, 0.375),) * 3  # the last row repeats, no safety factor
  table, _ = ns.coefficient_table(np.ones((4, 3)))
  assert len(table) == 4
  assert len(ns.coefficient_table((1.5, -0.5, 0.0), 3)[0]) == 3
  with pytest.raises(ValueError, match="coeffs"):
    ns.coefficient_table("newton")
  with pytest.raises(ValueError, match=r"\(steps, 3\)"):
    ns.coefficient_table(np.ones((4, 2)))
  with pytest.raises(ValueError, match="steps"):
    ns.coefficient_table(np.ones((4, 3)), 5)
  with pytest.raises(ValueError, match="steps"):
    ns.coefficient_table("jordan", 0)


def test_flop_counts():
  assert ns.ns_flops(2048, 8192) == 5 * (4 * 2048**2 * 8192 + 2 * 2048**3)
  assert ns.ns_flops(8192, 2048) == ns.ns_flops(2048, 8192)
  assert ns.ns_flops(2048, 8192, symmetric=True) == 5 * (3 * 2048**2 * 8192 + 2048**3)
  # Gram NS saves FLOPs on a wide matrix and not on a square one.
  assert ns.ns_flops(2048, 8192, gram=True) < 0.8 * ns.ns_flops(2048, 8192)
  assert ns.ns_flops(4096, 4096, gram=True) > ns.ns_flops(4096, 4096)


# --------------------------------------------------------------- reference --
def test_reference_matches_optax_fp32(request):
  """fp32, Jordan's coefficients, eps as optax: the same math as optax.contrib."""
  key = harness.fresh_key(request)
  for shape in ((96, 40),):
    key, sub = jax.random.split(key)
    x = jax.random.normal(sub, shape, jnp.float32)
    got = ns.newton_schulz_reference(x, coeffs="jordan", ns_dtype=jnp.float32, eps=1e-8)
    want = optax.contrib._muon.orthogonalize_via_newton_schulz(
        x, jnp.asarray(ns.JORDAN), ns_steps=5, eps=1e-8)
    assert _rel_err(got, want) < 1e-4, shape


def test_gram_reference_matches_standard_fp32(request):
  x = jax.random.normal(harness.fresh_key(request), (3, 40, 160), jnp.float32)
  for coeffs in ("jordan", "polar_express"):
    std = ns.newton_schulz_reference(x, coeffs=coeffs, ns_dtype=jnp.float32)
    for restarts in (True, (2,), (1, 3)):
      grm = ns.newton_schulz_reference(x, coeffs=coeffs, ns_dtype=jnp.float32, gram=restarts)
      assert _rel_err(grm, std) < 1e-3, (coeffs, restarts)


@pytest.mark.parametrize("coeffs,band", [("jordan", (0.45, 1.25)), ("polar_express", (0.8, 1.17))])
@pytest.mark.parametrize("gram_ns", [False, True])
def test_singular_value_band_bf16(request, coeffs, band, gram_ns):
  """bf16 iteration: singular values inside the band the coefficients promise
  (exact arithmetic: Jordan [0.471, 1.202], Polar Express [0.846, 1.124] for
  normalised singular values in [1e-3, 1]; the test allows bf16 slack)."""
  lo, hi = ns.singular_value_band(coeffs)
  assert band[0] <= lo and hi <= band[1]
  x = _well_conditioned(harness.fresh_key(request), 64, 256)
  y = ns.newton_schulz(x.astype(jnp.bfloat16), coeffs=coeffs, gram=gram_ns, implementation="xla")
  assert y.dtype == jnp.bfloat16 and y.shape == (64, 256)
  s = np.linalg.svd(np.asarray(y, np.float64), compute_uv=False)
  assert band[0] <= s.min() and s.max() <= band[1], (s.min(), s.max())


@pytest.mark.parametrize("impl", ("triton",))
def test_singular_value_band_kernel(request, impl):
  """The same band through a kernel path (the fused kernel, interpret mode)."""
  x = _well_conditioned(harness.fresh_key(request), 64, 256).T   # tall: transposed in and out
  y = ns.newton_schulz(x.astype(jnp.bfloat16), implementation=impl, interpret=True)
  assert y.shape == (256, 64) and y.dtype == jnp.bfloat16
  s = np.linalg.svd(np.asarray(y, np.float64), compute_uv=False)
  assert 0.8 <= s.min() and s.max() <= 1.17, (s.min(), s.max())


# -------------------------------------------------------- kernels vs refs --
SYM_CASES = {
    "triton": [((2, 100, 200), {}, gram.TritonConfig(64, 64, 4, 3)),       # ragged, wide
               ((1, 96, 40), {}, gram.TritonConfig(64, 32, 4, 3)),         # tall (K < m)
               ((1, 100, 100), dict(alpha=0.5, beta=-2.0, gamma=3.0), gram.TritonConfig(64, 32, 4, 3))],
    "mosaic_tpu": [((2, 100, 200), {}, gram.MosaicTPUConfig(128, 128)),
                   ((1, 200, 200), dict(alpha=0.5, beta=-2.0, gamma=3.0), gram.MosaicTPUConfig(128, 128))],
}


@pytest.mark.parametrize("impl", BACKENDS)
def test_sym_kernel(request, impl):
  key = harness.fresh_key(request)
  for shape, kw, cfg in SYM_CASES[impl]:
    key, sub = jax.random.split(key)
    x = _randn(sub, shape)
    if kw:  # the beta term is mirrored too, so it needs a symmetric input (A)
      x = gram.sym_reference(x) * 0.1
    got = gram.sym(x, implementation=impl, interpret=_interp(impl), config=cfg, **kw)
    want = gram.sym_reference(x, **kw)
    assert got.dtype == want.dtype
    _assert_tile_close(got, want, f"{impl} {shape} {kw}")
    # Exactly symmetric by construction, whatever the input: the off-diagonal
    # tiles are written with their transpose, a diagonal tile is mirrored
    # within itself.
    harness.assert_bitwise_equal(got, jnp.swapaxes(got, 1, 2), "symmetry")


@pytest.mark.parametrize("impl", BACKENDS)
def test_poly_kernel(request, impl):
  x = _randn(harness.fresh_key(request), (1, 80, 120))
  a = gram.sym_reference(x)
  cfg = gram.TritonConfig(32, 32, 4, 3) if impl == "triton" else gram.MosaicTPUConfig(128, 128)
  got = poly.poly(a, b=-4.775, c=2.0315, implementation=impl, interpret=_interp(impl), config=cfg)
  _assert_tile_close(got, poly.poly_reference(a, b=-4.775, c=2.0315), impl)


@pytest.mark.parametrize("impl", BACKENDS)
def test_update_kernel(request, impl):
  k1, k2 = jax.random.split(harness.fresh_key(request))
  b = _randn(k1, (2, 100, 100))
  x = _randn(k2, (2, 100, 200))
  cfg = (update.TritonConfig(32, 32, 32, 4, 3) if impl == "triton"
         else update.MosaicTPUConfig(128, 128, 128))
  for a in (3.4445, 0.0):
    got = update.matmul(b, x, a=a, implementation=impl, interpret=_interp(impl), config=cfg)
    _assert_tile_close(got, update.gemm_reference(b, x, a=a), f"{impl} a={a}")


@pytest.mark.parametrize("impl", BACKENDS)
def test_fused_kernel(request, impl):
  x = _randn(harness.fresh_key(request), (3, 40, 100)) * 0.05
  table = ns.coefficient_table("polar_express")[0]
  got = fused.newton_schulz_fused(x, table, implementation=impl, interpret=_interp(impl))
  want = fused.ns_fused_reference(x, table)
  assert got.shape == x.shape and got.dtype == x.dtype
  assert _rel_err(got, want) < 2e-2


# ------------------------------------------------------ whole op vs refs --
def _tiled(impl, pallas_update):
  if impl == "triton":
    return ns.TiledConfig(sym=gram.TritonConfig(32, 32, 4, 3),
                          matmul=update.TritonConfig(32, 32, 32, 4, 3) if pallas_update else None)
  return ns.TiledConfig(sym=gram.MosaicTPUConfig(128, 128),
                        matmul=update.MosaicTPUConfig(128, 128, 128) if pallas_update else None)


OP_CASES = [
    # (shape, kwargs, config builder or None for the default dispatch)
    ("triton", (2, 3, 24, 40), {}, None),                                  # leading batch dims, fused
    ("mosaic_tpu", (200, 72), dict(coeffs="jordan"), None),               # tall, fused
    ("triton", (150, 60), dict(gram=True, steps=3), lambda i: _tiled(i, False)),   # tall ragged Gram NS
    ("mosaic_tpu", (100, 200), dict(steps=2), lambda i: _tiled(i, True)),        # wide ragged, Pallas update
    ("triton", (2, 40, 72), dict(steps=1, coeffs="jordan"), lambda i: _tiled(i, True)),  # batched
    ("mosaic_tpu", (48, 100), dict(steps=2, ns_dtype=jnp.float32), None),   # fp32 iterates
]


@pytest.mark.parametrize("impl,shape,kw,cfg", OP_CASES,
                         ids=[f"{c[0]}-{'x'.join(map(str, c[1]))}" for c in OP_CASES])
def test_op_matches_reference(request, impl, shape, kw, cfg):
  x = jax.random.normal(harness.fresh_key(request), shape, jnp.float32)
  got = jax.jit(lambda v: ns.newton_schulz(v, implementation=impl, interpret=True,
                                           config=cfg(impl) if cfg else None, **kw))(x)
  want = ns.newton_schulz_reference(x, **kw)
  assert got.shape == x.shape and got.dtype == x.dtype
  # bf16: accumulation order shows after rounding; fp32: true fp32 products.
  assert _rel_err(got, want) < (1e-5 if kw.get("ns_dtype") == jnp.float32 else 3e-2)


def test_path_choice():
  # GPU: one CTA per matrix only for small ones; TPU: whole matrix in VMEM up
  # to about 1024².
  assert ns._pick_path("triton", 64, 256, 1, None, False) == "fused"
  assert ns._pick_path("triton", 1024, 1024, 1, None, False) == "tiled"
  assert ns._pick_path("mosaic_tpu", 1024, 1024, 1, None, False) == "fused"
  assert ns._pick_path("mosaic_tpu", 4096, 4096, 1, None, False) == "tiled"
  assert ns._pick_path("mosaic_tpu", 64, 256, 1, None, True) == "tiled"
  assert ns._pick_path("mosaic_tpu", 64, 64, 1, ns.TiledConfig(), False) == "tiled"


# -------------------------------------------------------------- edge cases --
@pytest.mark.parametrize("impl", ("xla",) + BACKENDS)
def test_zero_nan_and_rank(impl):
  kw = dict(implementation=impl, interpret=impl != "xla")
  run = jax.jit(lambda v: ns.newton_schulz(v, **kw))  # one compile for both inputs
  x = jnp.zeros((2, 8, 16), jnp.bfloat16)
  out = np.asarray(run(x), np.float32)
  assert (out == 0).all()                       # zero in, zero out (no NaN)
  out = np.asarray(run(x.at[1, 3, 5].set(jnp.nan)), np.float32)
  assert (out[0] == 0).all() and np.isnan(out[1]).all()   # NaN stays in its matrix
  with pytest.raises(ValueError, match="rank >= 2"):
    ns.newton_schulz(jnp.ones((16,)), **kw)


def test_bad_arguments():
  x = jnp.ones((8, 16))
  with pytest.raises(ValueError, match="gram"):
    ns.newton_schulz(x, gram="yes", implementation="xla")
  with pytest.raises(ValueError, match="gram"):
    ns.newton_schulz(x, gram=(0, 2), implementation="xla")
  with pytest.raises(ValueError, match="ns_dtype"):
    ns.newton_schulz(x, ns_dtype=jnp.int8)
  with pytest.raises(TypeError, match="floating"):
    ns.newton_schulz(jnp.ones((8, 16), jnp.int32))
  with pytest.raises(ValueError, match="implementation"):
    ns.newton_schulz(x, implementation="cuda")


def test_jit_and_vmap():
  x = jax.random.normal(jax.random.key(0), (3, 16, 32))
  want = ns.newton_schulz(x, implementation="xla")
  got = jax.jit(lambda v: ns.newton_schulz(v, implementation="xla"))(x)
  assert _rel_err(got, want) < 1e-2  # XLA may fuse the bf16 roundings differently
  got = jax.vmap(lambda v: ns.newton_schulz(v, implementation="triton", interpret=True))(x)
  assert _rel_err(got, want) < 3e-2


@pytest.mark.parametrize("impl", ("triton",))
def test_sharded_batch_equals_unsharded(impl):
  """A stack sharded over 8 devices (shard_map): each device orthogonalises its
  own matrices, bitwise as the unsharded call (per-matrix normalisation)."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
  x = jax.random.normal(jax.random.key(5), (8, 16, 40), jnp.float32)
  run = lambda v: ns.newton_schulz(v, implementation=impl, interpret=True)  # noqa: E731
  whole = jax.jit(run)(x)
  f = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
  harness.assert_bitwise_equal(f(jax.device_put(x, NamedSharding(mesh, P("x")))), whole)


# ---------------------------------------------------------------- lowering --
LOWER_CASES = [
    ("sym", gram.triton.SEARCH_SPACE, gram.mosaic_tpu.SEARCH_SPACE),
    ("update", update.triton.SEARCH_SPACE, update.mosaic_tpu.SEARCH_SPACE),
    ("fused", fused.triton.SEARCH_SPACE, fused.mosaic_tpu.SEARCH_SPACE),
]


def _lower_fn(kind, impl, cfg):
  if kind == "sym":  # the epilogue variant (beta, gamma) covers the plain one's code
    return (lambda x: gram.sym(x, alpha=2.0, beta=1.0, gamma=1.0, implementation=impl, config=cfg),
            (S((2, 1024, 1024), jnp.bfloat16),))
  if kind == "update":
    return (lambda b, x: update.matmul(b, x, a=2.0, implementation=impl, config=cfg),
            (S((2, 1024, 1024), jnp.bfloat16), S((2, 1024, 2048), jnp.bfloat16)))
  table = ns.coefficient_table("polar_express")[0]
  shape = (4, 64, 256) if impl == "triton" else (2, 1024, 1024)
  return (lambda x: fused.newton_schulz_fused(x, table, implementation=impl, config=cfg),
          (S(shape, jnp.bfloat16),))


@pytest.mark.parametrize("target", harness.TARGETS, ids=harness.TARGET_IDS)
@pytest.mark.parametrize("kind,triton_space,mosaic_space", LOWER_CASES, ids=[c[0] for c in LOWER_CASES])
def test_every_config_lowers(target, kind, triton_space, mosaic_space):
  space = triton_space if target.implementation == "triton" else mosaic_space
  for cfg in space:
    fn, avals = _lower_fn(kind, target.implementation, cfg)
    harness.lower_for(target, fn, *avals)


@pytest.mark.parametrize("target", harness.TARGETS, ids=harness.TARGET_IDS)
def test_op_lowers_on_anchor_shapes(target):
  """The default dispatch lowers on the benchmark's shapes: XLA's matmuls for
  the standard iteration on a GPU and a TPU (backends.STANDARD_ORDER), and
  for the Gram iteration on a TPU (GRAM_ORDER); the Triton kernels for a
  GPU's Gram iterations."""
  gpu = target.implementation == "triton"
  for shape, g in (((4096, 4096), False), ((16, 2048, 2048), False), ((2048, 8192), "auto")):
    harness.lower_for(target, lambda x: ns.newton_schulz(x, gram=g), S(shape, jnp.bfloat16),
                      expect_kernel=gpu and g == "auto")
  # the default call (gram=None): Gram for the wide matrix
  for shape in ((2048, 8192), (4096, 4096)):
    harness.lower_for(target, ns.newton_schulz, S(shape, jnp.bfloat16),
                      expect_kernel=gpu and shape == (2048, 8192))
