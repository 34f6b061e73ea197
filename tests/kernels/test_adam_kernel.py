"""adam_update: kernels vs reference, rounding seeds, NaN/Inf rule, lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fuseopt.kernels import adam as A
from fuseopt.kernels import adam_update, adam_update_reference, stochastic_round_bf16
from fuseopt.kernels import counter_hash
from tests.kernels import harness

F32, BF16 = jnp.float32, jnp.bfloat16
HYPER = dict(learning_rate=3e-3, b1=0.9, b2=0.999, eps=1e-8, eps_root=1e-12,
             weight_decay=0.1, seed=17, leaf_index=5)


def _inputs(key, shape, p_dtype, g_dtype, m_dtype):
  k = jax.random.split(key, 4)
  p = jax.random.normal(k[0], shape, F32).astype(p_dtype) if p_dtype else None
  g = jax.random.normal(k[1], shape, F32).astype(g_dtype)
  mu = (0.1 * jax.random.normal(k[2], shape, F32)).astype(m_dtype)
  nu = (0.1 * jax.random.uniform(k[3], shape, F32)).astype(m_dtype)
  return p, g, mu, nu


def _compare(got, want, what):
  """fp32 outputs within a few ulp; bf16 outputs bitwise, but for the rare
  element whose fp32 value differs across compilers (division, sqrt, FMA
  contraction) before rounding: at most 1 in 500, by one bf16 ulp plus the
  fp32 error of the leaf's magnitude (where ``b1 mu + (1 - b1) g`` cancels,
  an fp32 ulp of the operands is several bf16 ulps of the small result)."""
  for i, (a, b) in enumerate(zip(got, want)):
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}[{i}]"
    if a.dtype == F32:
      # Nesterov's two terms can cancel, so the error bound scales with the
      # leaf's magnitude, not each element's.
      atol = 1e-7 * float(np.max(np.abs(np.asarray(b)), initial=0.0))
      harness.assert_close(a, b, rtol=1e-6, atol=atol, what=f"{what}[{i}]")
    else:
      ab = harness.bits(a).astype(np.int32).reshape(-1)
      bb = harness.bits(b).astype(np.int32).reshape(-1)
      diff = np.abs(ab - bb)
      a32 = np.asarray(a, np.float32).reshape(-1)
      b32 = np.asarray(b, np.float32).reshape(-1)
      ulp = np.abs(np.spacing(b32.astype(jnp.bfloat16).astype(np.float32), dtype=np.float32))
      ulp = np.maximum(ulp, np.abs(b32) * 2.0 ** -7)       # one bf16 ulp of the reference
      bound = ulp + 1e-6 * float(np.max(np.abs(b32), initial=0.0))
      far = (diff > 1) & ~(np.abs(a32 - b32) <= bound)
      assert not far.any(), (f"{what}[{i}]: bf16 differs by {diff.max()} ulp, beyond one ulp "
                             f"plus the leaf's fp32 error at {np.flatnonzero(far)[:5]}")
      assert (diff != 0).sum() <= max(1, a.size // 500), f"{what}[{i}]: {(diff != 0).sum()} differ"


def _run_both(backend, p, g, mu, nu, count, **kw):
  f = lambda p, g, mu, nu, c: adam_update(p, g, mu, nu, count=c, implementation=backend,
                                          interpret=True, **kw)
  r = lambda p, g, mu, nu, c: adam_update_reference(p, g, mu, nu, count=c, **kw)
  # Traced count: the scalars are runtime values in both, as in a training loop.
  return jax.jit(f)(p, g, mu, nu, count), jax.jit(r)(p, g, mu, nu, count)


CASES = [  # shape, p dtype (None: direction only), g dtype, moment dtype, nesterov
    ((), F32, F32, BF16, False),
    ((0,), F32, F32, BF16, False),
    ((7,), BF16, BF16, BF16, True),
    ((37, 129), F32, F32, BF16, False),
    ((3, 5, 128), BF16, F32, F32, False),
    ((4096,), None, F32, BF16, True),
    ((2, 1000), F32, BF16, BF16, True),
]


def _case_id(c):
  name = lambda d: d and jnp.dtype(d).name
  return f"{c[0]}-{name(c[1])}-{name(c[2])}-{name(c[3])}-nest{int(c[4])}"


# Triton interpret mode costs seconds a call: the cases that differ for it
# (the empty leaf never reaches a kernel).
@pytest.mark.parametrize("backend,case", [("mosaic_tpu", c) for c in CASES] +
                         [("triton", c) for i, c in enumerate(CASES) if i in (0, 2, 3, 5)],
                         ids=lambda x: _case_id(x) if isinstance(x, tuple) else x)
def test_kernel_matches_reference(request, backend, case):
  shape, p_dtype, g_dtype, m_dtype, nesterov = case
  key = harness.fresh_key(request)
  p, g, mu, nu = _inputs(key, shape, p_dtype, g_dtype, m_dtype)
  got, want = _run_both(backend, p, g, mu, nu, jnp.int32(7), nesterov=nesterov, **HYPER)
  _compare(got, want, f"{backend}{case}")
  assert got[0].dtype == (p_dtype or g_dtype)
  assert got[1].dtype == m_dtype and got[2].dtype == m_dtype


@pytest.mark.parametrize("backend,configs", [
    ("triton", (A.TritonConfig(256, 4), A.TritonConfig(2048, 8))),
    ("mosaic_tpu", (A.MosaicTPUConfig(16), A.MosaicTPUConfig(32)))])
def test_block_size_does_not_change_bits(backend, configs):
  p, g, mu, nu = _inputs(jax.random.key(3), (64, 128), F32, F32, BF16)
  outs = [adam_update(p, g, mu, nu, count=3, implementation=backend, interpret=True,
                      config=c, **HYPER) for c in configs]
  for a, b in zip(*outs):
    harness.assert_bitwise_equal(a, b, f"{backend} {configs}")


@pytest.mark.parametrize("backend", ("xla", "triton"))
def test_moments_are_the_stochastic_rounding_of_fp32_moments(backend):
  """The kernel's bf16 mu is bitwise stochastic_round_bf16(mu_fp32, seed_mu),
  its nu the fp32 nu rounded with the high 16 bits of the same hash: same
  per-leaf flat index, documented seed."""
  p, g, mu, nu = _inputs(jax.random.key(4), (3, 1000), F32, F32, BF16)
  count, seed, leaf = 11, 123, 4
  _, mu_new, nu_new = jax.jit(lambda *a: adam_update(
      *a, count=count, seed=seed, leaf_index=leaf, implementation=backend,
      interpret=True))(p, g, mu, nu)

  @jax.jit
  def expected(g, mu, nu):
    mu32 = 0.1 * g + 0.9 * mu.astype(F32)
    nu32 = (1 - 0.999) * (g * g) + 0.999 * nu.astype(F32)
    s_mu = counter_hash.derive_seed(seed, count, leaf, counter_hash.STREAM_MU)
    index = jax.lax.iota(jnp.uint32, mu32.size).reshape(mu32.shape)
    high = counter_hash.hash_bits(index, s_mu) >> 16
    return (stochastic_round_bf16(mu32, s_mu), counter_hash.round_with_bits(nu32, high),
            counter_hash.round_with_bits(mu32, high))

  want_mu, want_nu, mu_with_high_bits = expected(g, mu, nu)
  harness.assert_bitwise_equal(mu_new, want_mu, "mu")
  harness.assert_bitwise_equal(nu_new, want_nu, "nu")
  # The halves are independent draws: the same values would round differently.
  assert not np.array_equal(harness.bits(mu_with_high_bits), harness.bits(mu_new))


def test_bf16_params_are_rounded_with_the_param_stream():
  p, g, mu, nu = _inputs(jax.random.key(5), (2048,), BF16, F32, BF16)
  @jax.jit
  def both(p, g, mu, nu):
    new_p, _, _ = adam_update_reference(p, g, mu, nu, count=2, seed=9, leaf_index=1,
                                        learning_rate=1e-3, weight_decay=0.0)
    u, _, _ = adam_update_reference(None, g, mu, nu, count=2)
    return new_p, stochastic_round_bf16(
        p.astype(F32) + (-1e-3) * u, counter_hash.derive_seed(9, 2, 1, counter_hash.STREAM_PARAM))

  new_p, want = both(p, g, mu, nu)
  _compare((new_p,), (want,), "bf16 params")


@pytest.mark.parametrize("backend", ("xla", "triton"))
def test_nonfinite_gradients_follow_the_documented_rule(backend):
  p, g, mu, nu = _inputs(jax.random.key(6), (256,), F32, F32, BF16)
  g = g.at[3].set(jnp.nan).at[10].set(jnp.inf).at[20].set(-jnp.inf)
  new_p, mu_n, nu_n = jax.jit(lambda *a: adam_update(
      *a, count=1, implementation=backend, interpret=True, **HYPER))(p, g, mu, nu)
  mu_n, nu_n, new_p = (np.asarray(x, np.float32) for x in (mu_n, nu_n, new_p))
  assert np.isnan(mu_n[3]) and np.isnan(nu_n[3]) and np.isnan(new_p[3])
  assert mu_n[10] == np.inf and nu_n[10] == np.inf and np.isnan(new_p[10])
  assert mu_n[20] == -np.inf and nu_n[20] == np.inf and np.isnan(new_p[20])
  rest = np.setdiff1d(np.arange(256), [3, 10, 20])
  assert np.isfinite(mu_n[rest]).all() and np.isfinite(nu_n[rest]).all()
  assert np.isfinite(new_p[rest]).all()


@pytest.mark.parametrize("backend", ("xla", "triton", "mosaic_tpu"))
def test_grad_scale_and_apply_flag(backend):
  """grad_scale multiplies g as it is read (a clip factor: same bits as a
  pre-scaled gradient); apply=False returns p, mu, nu bit for bit, NaN
  gradients included (a skipped step)."""
  p, g, mu, nu = _inputs(jax.random.key(8), (32, 128), BF16, F32, BF16)
  g = g.at[0, 3].set(jnp.nan)
  run = jax.jit(lambda p, g, mu, nu, s, a: adam_update(
      p, g, mu, nu, count=3, grad_scale=s, apply=a, implementation=backend, interpret=True,
      **HYPER))
  scale = jnp.float32(0.37)
  got = run(p, g, mu, nu, scale, jnp.bool_(True))
  want = run(p, g * scale, mu, nu, jnp.float32(1.0), jnp.bool_(True))
  for a, b in zip(got, want):
    harness.assert_bitwise_equal(a, b, f"{backend} grad_scale")
  kept = run(p, g, mu, nu, scale, jnp.bool_(False))
  for a, b in zip(kept, (p, mu, nu)):
    harness.assert_bitwise_equal(a, b, f"{backend} apply=False")
  u, _, _ = adam_update(None, g, mu, nu, count=3, apply=False, implementation=backend,
                        interpret=True)
  assert not np.asarray(u).any()


@pytest.mark.fma_off
def test_fp32_moments_match_optax_bitwise_on_cpu():
  import optax
  p, g, mu, nu = _inputs(jax.random.key(7), (300,), F32, F32, F32)
  tx = optax.adamw(1e-3, weight_decay=0.1, nesterov=True, eps_root=1e-9)
  state = (optax.ScaleByAdamState(jnp.int32(4), mu, nu),) + tx.init(p)[1:]

  @jax.jit
  def ref(g, state, p):
    u, s = tx.update(g, state, p)
    return optax.apply_updates(p, u), s[0].mu, s[0].nu

  want = ref(g, state, p)
  got = jax.jit(lambda p, g, mu, nu: adam_update_reference(
      p, g, mu, nu, count=jnp.int32(5), learning_rate=1e-3, weight_decay=0.1, nesterov=True,
      eps_root=1e-9))(p, g, mu, nu)
  for a, b in zip(got, want):
    harness.assert_close(a, b, rtol=2.5e-7, atol=0)


def test_errors_name_the_parameter():
  p, g, mu, nu = _inputs(jax.random.key(8), (8,), F32, F32, BF16)
  with pytest.raises(ValueError, match="mu has shape"):
    adam_update(p, g, mu[:4], nu, count=1)
  with pytest.raises(TypeError, match="grads must be float32 or bfloat16"):
    adam_update(p, g.astype(jnp.float16), mu, nu, count=1)
  with pytest.raises(TypeError, match="count must be an integer scalar"):
    adam_update(p, g, mu, nu, count=1.0)
  with pytest.raises(TypeError, match="config must be a TritonConfig"):
    adam_update(p, g, mu, nu, count=1, implementation="triton", interpret=True,
                config=A.MosaicTPUConfig())
  with pytest.raises(ValueError, match="power of two"):
    A.TritonConfig(block=1000)
  with pytest.raises(ValueError, match="implementation='cuda'"):
    adam_update(p, g, mu, nu, count=1, implementation="cuda")


def test_heuristics_stay_in_the_safe_range():
  # Block 4096 failed inside a CUDA graph on the H200: never the default.
  for n in (1, 100, 4096, 1 << 20, 1 << 28):
    c = A.triton.heuristic(n)
    assert c.block <= 1024 and c.block & (c.block - 1) == 0
    assert A.mosaic_tpu.heuristic(n).block_rows % 16 == 0
  assert A.TritonConfig(1024, 8) in A.triton.SEARCH_SPACE
  assert A.TritonConfig(4096, 8) in A.triton.SEARCH_SPACE


@pytest.mark.parametrize("target", harness.TARGETS, ids=harness.TARGET_IDS)
def test_every_config_lowers(target):
  space = A.triton.SEARCH_SPACE if target.implementation == "triton" else A.mosaic_tpu.SEARCH_SPACE
  s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt)
  shape = (512, 1024)
  for i, config in enumerate(space):
    # Alternate storage dtypes so every combination is lowered somewhere.
    p_dt, g_dt = (F32, F32) if i % 2 == 0 else (BF16, BF16)
    avals = (s(shape, p_dt), s(shape, g_dt), s(shape, BF16), s(shape, BF16), s((), jnp.int32),
             s((), F32))
    fn = lambda p, g, mu, nu, c, lr, config=config: adam_update(
        p, g, mu, nu, count=c, learning_rate=lr, weight_decay=0.1,
        implementation=target.implementation, config=config)
    text = harness.lower_for(target, fn, *avals)
    assert "output_operand_aliases" in text or "input_output_alias" in text, config
  # Direction-only mode and nesterov lower too.
  fn = lambda g, mu, nu: adam_update(None, g, mu, nu, count=3, nesterov=True,
                                     implementation=target.implementation)
  harness.lower_for(target, fn, s((300, 128), F32), s((300, 128), F32), s((300, 128), F32))
