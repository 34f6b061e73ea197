"""Adam on 8-bit moments: the format (fuseopt.kernels.adam.quantized), its
stochastic rounding, the kernels against the reference, non-finite values,
bad input."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fuseopt.kernels import adam_update, adam_update_reference, adam_update_tree
from fuseopt.kernels import counter_hash
from fuseopt.kernels.adam import quantized as Q
from tests.kernels import blockwise as bw
from tests.kernels import harness

F32, BF16 = jnp.float32, jnp.bfloat16


CASES = [  # shape, p dtype (None: direction only), g dtype, nesterov
    ((512,), F32, F32, False),
    ((3, 5, 256), BF16, F32, True),
    ((37, 512), F32, BF16, False),   # 74 blocks: a ragged last program
    ((8, 256), None, F32, False),
]


KERNELS = ["triton", "mosaic_tpu", "mosaic_gpu"]


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("shape,p_dtype,g_dtype,nesterov", CASES)
@pytest.mark.fma_off
def test_kernel_matches_reference(request, impl, shape, p_dtype, g_dtype, nesterov):
  """Codes and scales bitwise (the same fp32 operations on the same values,
  one division each, then the same hash); the parameter within the few fp32
  ulps that two programs of Adam's division chain may differ by."""
  k = jax.random.split(harness.fresh_key(request), 3)
  p = jax.random.normal(k[0], shape).astype(p_dtype) if p_dtype else None
  g = jax.random.normal(k[1], shape).astype(g_dtype)
  mu, nu = bw.moments(k[2], shape, "int8")
  got = bw.steps(impl, p, g, mu, nu, nesterov=nesterov)
  want = bw.steps("xla", p, g, mu, nu, nesterov=nesterov)
  for a, b in zip(jax.tree.leaves(got[1:]), jax.tree.leaves(want[1:])):
    bw.same(a, b, f"moments {shape}")
  a, b = np.asarray(got[0], np.float32), np.asarray(want[0], np.float32)
  if got[0].dtype == BF16:
    # one bf16 ulp where an fp32 ulp moved the stochastic rounding's threshold
    assert np.all(np.abs(a - b) <= np.abs(b) * 2.0 ** -7), shape
  else:
    harness.assert_close(a, b, rtol=1e-6, atol=1e-7 * float(np.abs(b).max()), what="params")


def test_tree_mixes_8bit_and_bf16_leaves_like_single_calls():
  k = jax.random.split(jax.random.key(3), 4)
  shapes = [(4, 256), (7,), (2, 512)]
  ps = [jax.random.normal(jax.random.fold_in(k[0], i), s) for i, s in enumerate(shapes)]
  gs = [jax.random.normal(jax.random.fold_in(k[1], i), s) for i, s in enumerate(shapes)]
  mus = [Q.zeros(s, signed=True) if Q.fits(s) else jnp.zeros(s, BF16) for s in shapes]
  nus = [Q.zeros(s, signed=False) if Q.fits(s) else jnp.zeros(s, BF16) for s in shapes]
  hp = {k_: v for k_, v in bw.HYPER.items() if k_ != "leaf_index"}
  for impl in harness.runnable("xla", *KERNELS):
    tree = adam_update_tree(ps, gs, mus, nus, count=1, implementation=impl, interpret=True, **hp)
    for i in range(3):
      one = adam_update(ps[i], gs[i], mus[i], nus[i], count=1, implementation=impl,
                        interpret=True, leaf_index=i, **hp)
      for a, b in zip(jax.tree.leaves([o[i] for o in tree]), jax.tree.leaves(one)):
        bw.same(a, b, f"{impl} leaf {i}")


def _ulps(a, b):
  """Per element, how many fp32 ulps apart ``a`` and ``b`` are (same sign)."""
  a, b = np.asarray(a, np.float32).view(np.int32), np.asarray(b, np.float32).view(np.int32)
  return np.abs(a.astype(np.int64) - b.astype(np.int64))


@pytest.mark.fma_off
def test_grouped_8bit_launch_matches_one_launch_a_leaf():
  """The Triton grouped launch (what ``fo.step`` runs by default) over 8-bit
  leaves of two dtype signatures, ragged row counts and a bf16-moment leaf
  beside them, at the heuristic and at a small config (two leaves a launch):
  parameters and codes bitwise the per-leaf launches', scales within one
  fp32 ulp. In interpret mode XLA:CPU contracts ``a * b + c`` into a fused
  multiply-add in some fusions and not in others (docs/adam.md), here the
  second moment feeding a block's absmax; the compiled kernel computes each
  element once."""
  from fuseopt.kernels.adam.triton import TritonGroupConfig
  shapes = [(4, 256), (7,), (2, 512), (37, 512), (3, 5, 256), (37, 512), (256,)]
  k = jax.random.split(jax.random.key(11), 2)
  ps = [jax.random.normal(jax.random.fold_in(k[0], i), s).astype(BF16 if i == 4 else F32)
        for i, s in enumerate(shapes)]
  gs = [jax.random.normal(jax.random.fold_in(k[1], i), s) for i, s in enumerate(shapes)]
  mus = [Q.zeros(s, signed=True) if Q.fits(s) else jnp.zeros(s, BF16) for s in shapes]
  nus = [Q.zeros(s, signed=False) if Q.fits(s) else jnp.zeros(s, BF16) for s in shapes]

  def run(**kw):
    # (the hyperparameters traced, as a step's are: constants would let
    # XLA:CPU fold them into one interpret-mode program and not the other)
    f = jax.jit(lambda p, g, m, v, c, h: adam_update_tree(
        p, g, m, v, count=c, learning_rate=h[0], b1=h[1], b2=h[2], eps=h[3],
        weight_decay=h[4], seed=17, implementation="triton", interpret=True, **kw))
    h = jnp.array([3e-3, 0.9, 0.999, 1e-8, 0.1])
    p, m, v = ps, mus, nus
    for c in (1, 2, 3):
      p, m, v = f(p, [g * c for g in gs], m, v, c, h)
    return p, m, v

  def launches(**kw):
    jaxpr = jax.make_jaxpr(lambda: adam_update_tree(ps, gs, mus, nus, count=1, seed=17,
                                                    implementation="triton", interpret=True,
                                                    **kw))()
    return str(jaxpr).count("pallas_call[")

  # 8-bit leaves: one launch per dtype signature (fp32 and bf16 params), or
  # per two leaves; the bf16-moment leaf its own.
  assert (launches(group=False), launches(group=True),
          launches(config=TritonGroupConfig(512, 4, 2))) == (7, 3, 5)
  want = run(group=False)
  for kw in (dict(group=True), dict(config=TritonGroupConfig(512, 4, 2))):
    got = run(**kw)
    for i in range(len(shapes)):
      bw.same(got[0][i], want[0][i], f"{kw} param {i}")
      for j in (1, 2):
        a, b = got[j][i], want[j][i]
        if Q.is_quantized(a):
          bw.same(a.codes, b.codes, f"{kw} codes {i}")
          assert _ulps(a.scales, b.scales).max() <= 1, f"{kw} scales {i}"
        else:
          bw.same(a, b, f"{kw} bf16 moment {i}")


# Hoeffding: the mean of N draws of a variable in an interval of width w is
# within t*w of its expectation except with probability 2 exp(-2 N t^2).
# N = 2048, t = 0.09: below 1e-14 per element, so no seed will ever fail.
N_DRAWS, T_HOEFFDING = 2048, 0.09


def _draws(fn, x):
  """``fn(x, bits)`` for N_DRAWS independent seeds of the counter hash."""
  idx = jnp.arange(x.size, dtype=jnp.uint32).reshape(x.shape)
  seeds = counter_hash.derive_seed(jnp.arange(N_DRAWS, dtype=jnp.uint32), 1, 0,
                                   counter_hash.STREAM_MU)
  return jax.jit(jax.vmap(lambda s: fn(x, counter_hash.hash_bits(idx, s))))(seeds)


def test_stochastic_codes_are_unbiased(request):
  """E[dequantised code] = the fp32 value: mu's linear codes, and nu's codes
  rounded in nu's own domain (between (k s)^2 and ((k+1) s)^2)."""
  k = jax.random.split(harness.fresh_key(request), 2)
  x = jax.random.normal(k[0], (2, Q.BLOCK)) * jnp.array([[1e-3], [10.0]])
  codes, scale = _draws(Q.quantize_mu, x)
  assert bool(jnp.all(scale == scale[0]))          # absmax: not random
  mean = np.asarray(jnp.mean(Q.dequantize_mu(codes, scale), axis=0), np.float64)
  width = np.asarray(scale[0], np.float64)          # two neighbouring codes
  err = np.abs(mean - np.asarray(x, np.float64))
  assert np.all(err <= T_HOEFFDING * width + 1e-6 * np.abs(np.asarray(x))), err.max() / width.max()

  v = jax.random.uniform(k[1], (2, Q.BLOCK)) ** 2 * jnp.array([[1e-8], [3.0]])
  codes, scale = _draws(Q.quantize_nu, v)
  mean = np.asarray(jnp.mean(Q.dequantize_nu(codes, scale), axis=0), np.float64)
  s = np.asarray(scale[0], np.float64)
  kf = np.floor(np.minimum(np.sqrt(np.asarray(v, np.float64)) / s, 254))
  width = ((kf + 1) * s) ** 2 - (kf * s) ** 2
  above_floor = np.asarray(v) >= s ** 2      # below the first code, the floor of 1 lifts nu
  err = np.abs(mean - np.asarray(v, np.float64))
  ok = err <= T_HOEFFDING * width + 1e-5 * np.asarray(v)
  assert np.all(ok[above_floor]), (err / width)[above_floor].max()
  assert np.all(mean[~above_floor] >= np.asarray(v, np.float64)[~above_floor])


def test_nu_never_zero_where_fp32_nu_is_positive():
  """Blocks whose largest nu spans 1e-24 .. 1e30, each with elements 12
  decades below it (all normal fp32: XLA and the GPUs flush subnormals to
  zero): every stored nu > 0 where the fp32 one is (and 0 where it is 0)."""
  v, bits = bw.wide_nu(Q.BLOCK)
  codes, scale = Q.quantize_nu(v, bits)
  back = np.asarray(Q.dequantize_nu(codes, scale))
  assert np.all((back > 0) == (np.asarray(v) > 0))
  assert np.all(np.asarray(codes)[np.asarray(v) > 0] >= 1)
  # Through the kernel: a gradient of tiny values after a large one.
  g = jnp.asarray(np.concatenate([[1e3], np.full(Q.BLOCK - 1, 1e-9)]), F32)
  mu, nu = Q.zeros((Q.BLOCK,), signed=True), Q.zeros((Q.BLOCK,), signed=False)
  for impl in harness.runnable("xla", *KERNELS):
    _, _, new_nu = adam_update(None, g, mu, nu, count=1, implementation=impl, interpret=True)
    assert np.all(np.asarray(Q.dequantize(new_nu, signed=False)) > 0), impl


@pytest.mark.parametrize("impl", ["xla", *KERNELS])
def test_nonfinite_gradient_poisons_its_block_only(impl):
  shape = (2, 512)                       # four blocks
  k = jax.random.split(jax.random.key(11), 2)
  p = jax.random.normal(k[0], shape)
  g = jax.random.normal(k[1], shape)
  mu, nu = Q.zeros(shape, signed=True), Q.zeros(shape, signed=False)
  clean = bw.steps(impl, p, g, mu, nu, n=1)
  bad = bw.steps(impl, p, g.at[0, 3].set(jnp.nan).at[1, 300].set(jnp.inf), mu, nu, n=1)
  pb = np.asarray(bad[0])
  assert np.isnan(pb[0, 3]) and np.isnan(pb[1, 300])
  others = np.ones(shape, bool)
  others[0, 3] = others[1, 300] = False
  np.testing.assert_array_equal(pb[others], np.asarray(clean[0])[others])
  # mu: both blocks poisoned (NaN, and an Inf beside finite values); nu: the
  # NaN's block poisoned, the Inf kept as +Inf beside its block's finite values
  for new, old, signed in ((bad[1], clean[1], True), (bad[2], clean[2], False)):
    s, s0 = np.asarray(new.scales), np.asarray(old.scales)
    poisoned = np.zeros(s.shape, bool)
    poisoned[0, 0] = True
    poisoned[1, 1] = signed
    assert not np.any(np.isfinite(s[poisoned])) and np.all(np.isfinite(s[~poisoned]))
    touched = poisoned.copy()
    touched[1, 1] = True
    np.testing.assert_array_equal(s[~touched], s0[~touched])
    back = np.asarray(Q.dequantize(new, signed=signed))
    assert np.all(np.isnan(back[0, :256])) and np.all(np.isfinite(back[0, 256:]))
    assert np.all(np.isfinite(back[1, :256]))
    if signed:
      assert np.all(np.isnan(back[1, 256:]))
    else:
      assert s[1, 1] < 0 and np.isposinf(back[1, 300])
      assert np.sum(np.isfinite(back[1, 256:])) == 255


def test_nu_block_with_inf_keeps_its_finite_values():
  """A block of nu holding +Inf beside finite values (a square that
  overflowed fp32): the Inf reads back as +Inf, the finite values within the
  format's resolution (codes up to 254), zeros as zeros; a block of Infs
  reads all +Inf; a NaN still makes its block NaN."""
  rel = np.concatenate([[0.0], 10.0 ** -np.linspace(0, 6, Q.BLOCK - 1)])
  v = np.stack([rel * 3e7, rel * 3e7, np.full(Q.BLOCK, np.inf), rel])
  v[0, 5] = v[0, 9] = np.inf
  v[3, 7] = np.nan
  v = jnp.asarray(v, F32)
  bits = counter_hash.hash_bits(jnp.arange(v.size, dtype=jnp.uint32).reshape(v.shape),
                                jnp.uint32(3))
  codes, scale = Q.quantize_nu(v, bits)
  back, v = np.asarray(Q.dequantize_nu(codes, scale)), np.asarray(v)
  inf = np.isinf(v)
  assert np.all(np.isposinf(back[inf])) and np.all(np.isfinite(back[:3][~inf[:3]]))
  assert np.all(np.asarray(codes)[0][~inf[0]] <= 254)
  assert np.all((back[:3] > 0) == (v[:3] > 0))
  # the finite values of the marked block within a code of the unmarked one's
  width = 2 * np.sqrt(back[1].max()) / 254
  assert np.all(np.abs(np.sqrt(back[0][~inf[0]]) - np.sqrt(v[0][~inf[0]])) <= width)
  assert np.all(np.isnan(back[3]))


@pytest.mark.parametrize("impl", ["xla", *KERNELS])
def test_huge_finite_gradient_keeps_the_parameters_finite(impl):
  """A finite gradient element whose square overflows fp32 (2e19): as in
  optax, its nu is +Inf and its step 0 (only the weight decay) from then on;
  its block's other parameters stay finite, and the other blocks run as if
  it were not there."""
  shape = (2, 512)                       # four blocks
  k = jax.random.split(jax.random.key(12), 2)
  p = jax.random.normal(k[0], shape)
  g = jax.random.normal(k[1], shape)
  mu, nu = Q.zeros(shape, signed=True), Q.zeros(shape, signed=False)
  clean = bw.steps(impl, p, g, mu, nu, n=3)
  bad = bw.steps(impl, p, g.at[0, 3].set(2e19), mu, nu, n=3)
  pb, pc = np.asarray(bad[0]), np.asarray(clean[0])
  assert np.all(np.isfinite(pb))
  decayed = np.float32(p[0, 3]) * (1 - np.float32(bw.HYPER["learning_rate"] * bw.HYPER["weight_decay"])) ** 3
  np.testing.assert_allclose(pb[0, 3], decayed, rtol=1e-6)
  others = np.ones(shape, bool)
  others[0, :256] = False
  np.testing.assert_array_equal(pb[others], pc[others])
  back = np.asarray(Q.dequantize(bad[2], signed=False))
  assert np.isposinf(back[0, 3])
  assert np.sum(~np.isfinite(back)) == 1 and np.all(back[0, :256][np.arange(256) != 3] > 0)
  for new, old in ((bad[1], clean[1]), (bad[2], clean[2])):
    np.testing.assert_array_equal(np.asarray(new.scales)[others[:, ::256]],
                                  np.asarray(old.scales)[others[:, ::256]])


@pytest.mark.parametrize("impl", ["xla", *KERNELS])
def test_a_skipped_step_keeps_codes_and_scales(impl):
  """``apply=False`` (a skipped step): the parameters, the codes and the
  scales come back bit for bit -- requantising the stored moments would move
  a scale by an ulp and redraw codes."""
  shape = (3, 512)
  k = jax.random.split(jax.random.key(5), 3)
  p = jax.random.normal(k[0], shape)
  g = jax.random.normal(k[1], shape)
  mu, nu = bw.moments(k[2], shape, "int8")
  got = adam_update(p, g, mu, nu, count=2, implementation=impl, interpret=True,
                    apply=jnp.asarray(False), **bw.HYPER)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves((p, mu, nu))):
    bw.same(a, b, impl)


def test_reference_is_the_specification():
  shape = (2, 256)
  g = jnp.ones(shape)
  mu, nu = Q.zeros(shape, signed=True), Q.zeros(shape, signed=False)
  a = adam_update_reference(None, g, mu, nu, count=1)
  b = adam_update(None, g, mu, nu, count=1, implementation="xla")
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    bw.same(x, y)
  # all-equal gradients: every code at the block's maximum, the scale exact
  assert np.all(np.asarray(a[1].codes) == 127) and np.all(np.asarray(a[2].codes) == 255)


def test_bad_input_is_named():
  g = jnp.ones((2, 256))
  mu, nu = Q.zeros((2, 256), signed=True), Q.zeros((2, 256), signed=False)
  with pytest.raises(TypeError, match="nu must be a QuantizedMoment"):
    adam_update(None, g, mu, jnp.zeros((2, 256)), count=1)
  with pytest.raises(TypeError, match=r"mu.codes must be int8"):
    adam_update(None, g, nu, nu, count=1)
  with pytest.raises(TypeError, match=r"nu.scales must be float32"):
    adam_update(None, g, mu, Q.QuantizedMoment(nu.codes, nu.scales.astype(BF16)), count=1)
  with pytest.raises(ValueError, match=r"mu.codes has shape"):
    adam_update(None, g, Q.zeros((4, 256), signed=True), nu, count=1)
  with pytest.raises(ValueError, match=r"mu.scales has shape"):
    adam_update(None, g, Q.QuantizedMoment(mu.codes, jnp.zeros((2, 2))), nu, count=1)
  bad = Q.QuantizedMoment(jnp.zeros((2, 100), jnp.int8), jnp.zeros((2, 1)))
  with pytest.raises(ValueError, match="divides by 256"):
    adam_update(None, jnp.ones((2, 100)), bad,
                Q.QuantizedMoment(jnp.zeros((2, 100), jnp.uint8), jnp.zeros((2, 1))), count=1)
  with pytest.raises(ValueError, match="divides by 256"):
    Q.zeros((3,), signed=True)
  # (a companion on 8-bit moments is taken; a bad one is named)
  with pytest.raises(TypeError, match="params_lo must be int16 .* or int8"):
    adam_update(jnp.ones((2, 256), BF16), g, mu, nu, count=1,
                params_lo=jnp.zeros((2, 256), jnp.uint16))


def _dynamic_tree_unsigned():
  """bitsandbytes' unsigned 8-bit dynamic map (Dettmers et al. 2022, "8-bit
  Optimizers via Block-wise Quantization"): 2**(i+1) linear steps in decade
  i of [1e-6, 1], plus 0 and 1."""
  vals = [0.0, 1.0]
  for i in range(7):
    b = np.linspace(0.1, 1, 2 ** (i + 1) + 1)
    vals += list(10.0 ** (i - 6) * (b[:-1] + b[1:]) / 2)
  return np.sort(np.asarray(vals))


def _map_errors(nu, kind):
  """Per-element relative error of sqrt(nu) after round-to-nearest into an
  8-bit map (NaN where a positive nu became 0)."""
  m = nu.max(axis=-1, keepdims=True)
  if kind == "linear":
    q = np.round(nu / m * 255) / 255 * m
  elif kind == "sqrt":
    q = (np.round(np.sqrt(nu / m) * 255) / 255) ** 2 * m
  else:
    table = _dynamic_tree_unsigned()
    x = nu / m
    i = np.clip(np.searchsorted(table, x), 1, len(table) - 1)
    q = np.where(x - table[i - 1] < table[i] - x, table[i - 1], table[i]) * m
  q = np.where((nu > 0) & (q == 0), np.nan, q)
  return np.abs(np.sqrt(q) - np.sqrt(nu)) / np.sqrt(nu)


def test_nu_map_errors():
  """The figures of docs/adam.md ("Why square-root companding"): fixed draws."""
  rng = np.random.default_rng(0)
  table = {0.25: {"linear": (0.010, 0.061, 0.009), "sqrt": (0.0044, 0.013, 0.0),
                  "dynamic": (0.0046, 0.013, 0.0)},
           0.5: {"linear": (0.039, 0.23, 0.54), "sqrt": (0.020, 0.12, 0.008),
                 "dynamic": (0.012, 0.045, 0.0001)}}
  assert len(_dynamic_tree_unsigned()) == 256
  for sigma, rows in table.items():
    nu = (10.0 ** rng.normal(0, sigma, (4096, Q.BLOCK))) ** 2
    for kind, (median, p90, zeroed) in rows.items():
      r = _map_errors(nu, kind)
      got = (np.nanmedian(r), np.nanpercentile(r, 90), np.isnan(r).mean())
      np.testing.assert_allclose(got[:2], (median, p90), rtol=0.06, err_msg=f"{sigma} {kind}")
      assert abs(got[2] - zeroed) <= 0.06 * zeroed + 2e-4, (sigma, kind, got)


def test_mosaic_gpu_runs_its_8bit_kernel(caplog):
  """No fallback: the Mosaic GPU kernel itself (in interpret mode) runs, and
  gives the reference's codes and scales."""
  shape = (2, 256)
  g = jax.random.normal(jax.random.key(4), shape)
  mu, nu = Q.zeros(shape, signed=True), Q.zeros(shape, signed=False)
  fn = lambda g, mu, nu: adam_update(None, g, mu, nu, count=1, implementation="mosaic_gpu",
                                     interpret=True)
  with caplog.at_level("DEBUG", logger="fuseopt"):
    got = fn(g, mu, nu)
  assert "reference" not in caplog.text
  assert "fuseopt_adam_update_int8" in str(jax.make_jaxpr(fn)(g, mu, nu))
  want = adam_update_reference(None, g, mu, nu, count=1)
  for a, b in zip(jax.tree.leaves(got[1:]), jax.tree.leaves(want[1:])):
    bw.same(a, b)


def test_mosaic_gpu_8bit_every_config_same_bits(request):
  """Every block config of the Mosaic GPU space (a ragged last program at
  each: 74 quantisation blocks) writes the same codes, scales and params."""
  from fuseopt.kernels.adam import mosaic_gpu
  shape = (37, 512)
  k = jax.random.split(harness.fresh_key(request), 3)
  p, g = jax.random.normal(k[0], shape), jax.random.normal(k[1], shape)
  mu, nu = bw.moments(k[2], shape, "int8")
  outs = [bw.steps("mosaic_gpu", p, g, mu, nu, config=cfg) for cfg in mosaic_gpu.SEARCH_SPACE]
  for cfg, out in zip(mosaic_gpu.SEARCH_SPACE[1:], outs[1:]):
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(outs[0])):
      bw.same(a, b, str(cfg))


@pytest.mark.skipif(__import__("fuseopt.targets", fromlist=["missing"]).missing("h200") is not None,
                    reason="the CUDA plugin is not installed")
def test_mosaic_gpu_8bit_lowers_for_h200_in_place():
  """Lowered for an H200 on the CPU: a Mosaic GPU kernel, the parameter and
  the codes and scales aliased to the outputs (in place)."""
  s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt)
  shape = (64, 512)
  moment = lambda dt: Q.QuantizedMoment(s(shape, dt), s(Q.scales_shape(shape), F32))
  mesh = jax.sharding.AbstractMesh((), (), abstract_device=jax.sharding.AbstractDevice(
      device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
  fn = lambda p, g, mu, nu: adam_update(p, g, mu, nu, count=3, implementation="mosaic_gpu")
  with jax.sharding.use_abstract_mesh(mesh):
    text = jax.jit(fn, donate_argnums=(0, 2, 3)).trace(
        s(shape, F32), s(shape, BF16), moment(jnp.int8), moment(jnp.uint8)).lower(
            lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text and "fuseopt_adam_update_int8" in text
  assert text.count("tf.aliasing_output") + text.count("output_operand_aliases") >= 1


@pytest.mark.parametrize("shape,config,grid", [
    ((384, 256), None, (3, 1)),        # 128-row steps (the budget: 256 rows), scales (1, 128)
    ((512, 256), 128, (4, 1)),         # 128-row steps: four, scales blocks (1, 128)
    ((128, 6144), None, (1, 3)),       # 24 row groups: three column steps of 8
    ((16, 32, 64), None, (1, 1)),      # nnx-shaped: blocked over (32, 64), a (16, 2048) view
    ((4, 8, 64), None, (1, 1)),        # blocked over (8, 64), a (4, 512) view
])
@pytest.mark.fma_off
def test_mosaic_tpu_8bit_grids_match_reference(request, shape, config, grid):
  """The Mosaic TPU kernel's 2-D grid (row blocks, column blocks of at most
  eight row groups): every grid writes the reference's codes and scales
  bitwise, and the state keeps its (M, L / 256) scales."""
  from fuseopt.kernels.adam import mosaic_tpu
  from fuseopt.kernels.elementwise_tiling import MosaicTPUConfig
  cfg = None if config is None else MosaicTPUConfig(block_rows=config)
  view = mosaic_tpu.quantized_view(shape)
  tiling = mosaic_tpu.quantized_tiling(view, cfg or mosaic_tpu.heuristic(math.prod(shape)),
                                       ragged=False)
  assert tiling.grid == grid
  k = jax.random.split(harness.fresh_key(request), 3)
  p, g = jax.random.normal(k[0], shape), jax.random.normal(k[1], shape)
  mu, nu = bw.moments(k[2], shape, "int8")
  got = bw.steps("mosaic_tpu", p, g, mu, nu, config=cfg)
  want = bw.steps("xla", p, g, mu, nu)
  assert got[1].scales.shape == want[1].scales.shape == mu.scales.shape
  for a, b in zip(jax.tree.leaves(got[1:]), jax.tree.leaves(want[1:])):
    bw.same(a, b, f"moments {shape}")


@pytest.mark.parametrize("impl", ("xla", *KERNELS))
def test_nu_never_zero_down_to_the_smallest_normal_maxima(impl):
  """Blocks whose largest nu lies between the smallest normal fp32 (2**-126)
  and 1e-30, elements down to 2**-126: no stored nu reads 0 (code 1 of a
  block below 7.6e-34 would be subnormal, flushed to zero by XLA); and
  through each backend, a gradient whose nu is that small, with ``eps=0``,
  leaves the parameters finite."""
  v, bits = bw.tiny_nu(Q.BLOCK)
  codes, scale = Q.quantize_nu(v, bits)
  assert np.all(np.asarray(Q.dequantize_nu(codes, scale)) > 0)
  # nu = (1 - b2) g^2 from 3e-36 down to 1.2e-38
  g = jnp.asarray(5.5e-17 * 10.0 ** -np.linspace(0, 1.2, Q.BLOCK), F32)
  g = jnp.stack([g, -g])
  p = jnp.ones(g.shape, F32)
  hyper = dict(bw.HYPER, eps=0.0)
  f = jax.jit(lambda p, g, mu, nu, c: adam_update(
      p, g, mu, nu, count=c, implementation=impl, interpret=True, **hyper))
  state = (p, Q.zeros(g.shape, signed=True), Q.zeros(g.shape, signed=False))
  for c in (1, 2):
    state = f(state[0], g, state[1], state[2], c)
    assert np.all(np.asarray(Q.dequantize(state[2], signed=False)) > 0), c
  assert np.all(np.isfinite(np.asarray(state[0]))), impl
