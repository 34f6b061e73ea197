"""Adam on 4-bit moments (fuseopt.kernels.adam.int4) on the Triton kernels, in
interpret mode: the per-leaf kernel against the reference, the grouped
launch against one launch a leaf, a skipped step."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fuseopt.kernels import adam_update, adam_update_tree
from fuseopt.kernels import counter_hash
from fuseopt.kernels.adam import int4
from tests.kernels import blockwise as bw
from tests.kernels import harness

F32, BF16 = jnp.float32, jnp.bfloat16


CASES = [  # shape, p dtype (None: direction only), g dtype, nesterov
    ((512,), F32, F32, False),
    ((3, 5, 256), BF16, F32, True),
    ((37, 512), F32, BF16, False),   # 74 rows, 4 a program: a ragged last program
    ((8, 256), None, F32, False),
    ((4, 8, 64), F32, F32, False),   # nnx-shaped: blocked over the trailing 8 * 64
]


@pytest.mark.parametrize("shape,p_dtype,g_dtype,nesterov", CASES)
@pytest.mark.fma_off
def test_triton_matches_reference(request, shape, p_dtype, g_dtype, nesterov):
  """Codes and scales bitwise the reference's (the same fp32 operations on
  the same values, then the same hash); the parameter within the few fp32
  ulps that two programs of Adam's division chain may differ by. (With FMA
  on, XLA:CPU may contract a product into the subtraction after it in the
  interpret-mode kernel body, which the reference fences: a code can round
  the other way.)"""
  k = jax.random.split(harness.fresh_key(request), 3)
  p = jax.random.normal(k[0], shape).astype(p_dtype) if p_dtype else None
  g = jax.random.normal(k[1], shape).astype(g_dtype)
  mu, nu = bw.moments(k[2], shape, "int4")
  got = bw.steps("triton", p, g, mu, nu, nesterov=nesterov)
  want = bw.steps("xla", p, g, mu, nu, nesterov=nesterov)
  for a, b in zip(jax.tree.leaves(got[1:]), jax.tree.leaves(want[1:])):
    bw.same(a, b, f"moments {shape}")
  a, b = np.asarray(got[0], np.float32), np.asarray(want[0], np.float32)
  if got[0].dtype == BF16:
    # one bf16 ulp where an fp32 ulp moved the stochastic rounding's threshold
    assert np.all(np.abs(a - b) <= np.abs(b) * 2.0 ** -7), shape
  else:
    harness.assert_close(a, b, rtol=1e-6, atol=1e-7 * float(np.abs(b).max()), what="params")


def _kernel_names(fn):
  import re
  return re.findall(r"name=(fuseopt_\w+)", str(jax.make_jaxpr(fn)()))


@pytest.mark.fma_off
def test_grouped_launch_matches_one_launch_a_leaf():
  """The grouped 4-bit launch over leaves with ragged row counts (fp32 and
  bf16 params: two dtype signatures), at the heuristic and at a small config
  (two rows a program, two leaves a launch), bitwise the per-leaf launches."""
  from fuseopt.kernels.adam.triton import TritonGroupConfig
  shapes = [(4, 256), (37, 256), (3, 5, 256), (4, 8, 64), (512,)]
  k = jax.random.split(jax.random.key(11), 3)
  ps = [jax.random.normal(jax.random.fold_in(k[0], i), s).astype(BF16 if i == 2 else F32)
        for i, s in enumerate(shapes)]
  gs = [jax.random.normal(jax.random.fold_in(k[1], i), s) for i, s in enumerate(shapes)]
  mus, nus = zip(*[bw.moments(jax.random.fold_in(k[2], i), s, "int4") for i, s in enumerate(shapes)])
  small = TritonGroupConfig(512, 4, 2)

  def run(**kw):
    # (the hyperparameters traced, as a step's are)
    f = jax.jit(lambda p, g, m, v, c, h: adam_update_tree(
        p, g, m, v, count=c, learning_rate=h[0], b1=h[1], b2=h[2], eps=h[3],
        weight_decay=h[4], seed=17, implementation="triton", interpret=True, **kw))
    h = jnp.array([3e-3, 0.9, 0.999, 1e-8, 0.1])
    p, m, v = ps, list(mus), list(nus)
    for c in (1, 2):
      p, m, v = f(p, [g * c for g in gs], m, v, c, h)
    return p, m, v

  launches = lambda **kw: _kernel_names(lambda: adam_update_tree(
      ps, gs, list(mus), list(nus), count=1, seed=17, implementation="triton", interpret=True,
      **kw))
  assert launches(group=False) == ["fuseopt_adam_update_int4"] * 5
  assert launches(group=True) == ["fuseopt_adam_update_int4_group"] * 2
  assert launches(config=small) == ["fuseopt_adam_update_int4_group"] * 3
  want = run(group=False)
  for kw in (dict(group=True), dict(config=small)):
    got = run(**kw)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      bw.same(a, b, str(kw))


def test_a_skipped_step_keeps_codes_and_scales():
  """``apply=False``: the parameters, the codes and the scales come back bit
  for bit (requantising the stored moments would redraw the codes), per leaf
  and grouped."""
  shape = (3, 512)
  k = jax.random.split(jax.random.key(5), 3)
  p = jax.random.normal(k[0], shape)
  g = jax.random.normal(k[1], shape)
  mu, nu = bw.moments(k[2], shape, "int4")
  skip = jnp.asarray(False)
  one = adam_update(p, g, mu, nu, count=2, implementation="triton", interpret=True, apply=skip,
                    **bw.HYPER)
  hp = {k_: v for k_, v in bw.HYPER.items() if k_ != "leaf_index"}
  tree = adam_update_tree([p], [g], [mu], [nu], count=2, implementation="triton",
                          interpret=True, group=True, apply=skip, **hp)
  for got in (one, tuple(t[0] for t in tree)):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves((p, mu, nu))):
      bw.same(a, b, "skipped step")


@pytest.mark.parametrize("moments", ["int8", "int4"])
@pytest.mark.parametrize("companion", [jnp.int16, jnp.int8], ids=["int16", "int8"])
@pytest.mark.fma_off
def test_triton_with_a_companion_is_the_reference(request, moments, companion):
  """A bf16 leaf with a companion (an fp32 or 24-bit master) on 8-bit or
  4-bit moments: the per-leaf Triton kernel (not a fallback) gives the
  reference's p, lo, codes and scales bit for bit over two steps (the same
  master read, the same fp32 step, the same split)."""
  from fuseopt.kernels import mantissa
  from fuseopt.kernels.adam import quantized
  shape = (8, 512)
  k = jax.random.split(harness.fresh_key(request), 2)
  hi, lo = mantissa.split(jax.random.normal(k[0], shape), companion)
  g = jax.random.normal(k[1], shape)
  if moments == "int4":
    mu, nu = int4.zeros(shape), int4.zeros(shape)
  else:
    mu, nu = quantized.zeros(shape, signed=True), quantized.zeros(shape, signed=False)

  def step(impl, p, g, mu, nu, lo, c):
    return adam_update(p, g, mu, nu, count=c, implementation=impl, interpret=True,
                       params_lo=lo, **bw.HYPER)

  assert _kernel_names(lambda: step("triton", hi, g, mu, nu, lo, 1)) == [
      f"fuseopt_adam_update_{moments}"]
  got, want = [], []
  for impl, res in (("triton", got), ("xla", want)):
    f = jax.jit(functools.partial(step, impl))
    state = (hi, mu, nu, lo)
    for c in (1, 2):
      state = f(state[0], g * c, *state[1:], c)
    res += jax.tree.leaves(state)
  assert got[0].dtype == BF16 and got[-1].dtype == companion
  for a, b in zip(got, want):
    bw.same(a, b, f"{moments} moments, {jnp.dtype(companion)} companion")


# ------------------------------------------------------ the format's codes --
N_DRAWS = 2048


def _nu_draws(v):
  """``quantize_nu(v, bits)`` for N_DRAWS independent seeds of the nu stream."""
  idx = jnp.arange(v.size, dtype=jnp.uint32).reshape(v.shape)
  seeds = counter_hash.derive_seed(jnp.arange(N_DRAWS, dtype=jnp.uint32), 1, 0,
                                   counter_hash.STREAM_NU)
  return jax.jit(jax.vmap(lambda s: int4.quantize_nu(v, counter_hash.hash_bits(idx, s))))(seeds)


def test_nu_codes_are_unbiased_in_sqrt_nu():
  """E[sqrt(dequantised nu)] = sqrt(fp32 nu) above the first level (rounded
  in sqrt(nu)'s domain, between k s and (k+1) s); below it, never less."""
  v = jax.random.uniform(jax.random.key(3), (2, int4.BLOCK)) ** 3 * jnp.array([[1e-8], [3.0]])
  codes, scale = _nu_draws(v)
  assert bool(jnp.all(scale == scale[0]))        # the block's max: not random
  mean = np.asarray(jnp.mean(jnp.sqrt(int4.dequantize_nu(codes, scale)), axis=0), np.float64)
  s, x = np.asarray(scale[0], np.float64), np.sqrt(np.asarray(v, np.float64))
  above = x >= s
  err = np.abs(mean - x)
  # 2048 draws: the mean's std is at most s / 90; rounded unbiased in nu, the
  # error reaches 0.09 s between the lowest levels
  assert np.all((err <= 0.06 * s + 1e-5 * x)[above]), (err / s)[above].max()
  assert np.all(mean[~above] >= x[~above])
  # and so not unbiased in nu: between levels the stored nu exceeds the fp32
  # one by s^2 f (1 - f) on average (f: the position between the levels),
  # about s^2 / 6 over the block; rounded unbiased in nu it would be 0
  mean_nu = np.asarray(jnp.mean(int4.dequantize_nu(codes, scale), axis=0), np.float64)
  excess = (mean_nu - np.asarray(v, np.float64))[above] / (s ** 2 * np.ones_like(x))[above]
  assert excess.mean() > 0.05, excess.mean()


def test_mu_codes_are_the_nearest_level_whatever_the_bits():
  """mu rounds to nearest: the stored value is the level nearest the fp32
  one (within fp32 rounding of the level arithmetic), the same for any hash
  bits, the sign kept, 0 stored only where 0 is the nearest level."""
  x = jax.random.normal(jax.random.key(4), (4, int4.BLOCK)) * jnp.array([[1e-6], [1e-2], [1.0], [50.0]])
  x = x * 10.0 ** jax.random.uniform(jax.random.key(5), x.shape, minval=-2.0, maxval=0.0)
  idx = jnp.arange(x.size, dtype=jnp.uint32).reshape(x.shape)
  got = [int4.quantize_mu(x, counter_hash.hash_bits(idx, jnp.uint32(seed))) for seed in (1, 2)]
  np.testing.assert_array_equal(np.asarray(got[0][0]), np.asarray(got[1][0]))
  codes, scale = got[0]
  back = np.asarray(int4.dequantize_mu(codes, scale), np.float64)
  xs, s = np.asarray(x, np.float64), np.asarray(scale, np.float64)
  levels = (np.arange(int4.MU_LEVELS + 1) / int4.MU_LEVELS) ** 2        # of |x| / s
  nearest = np.abs(np.abs(xs / s)[..., None] - levels).min(axis=-1) * s
  assert np.all(np.abs(np.abs(back) - np.abs(xs)) <= nearest * (1 + 1e-5) + 1e-6 * s)
  assert np.all((np.sign(back) == np.sign(xs)) | (back == 0))
  assert np.all(np.abs(back).max(axis=-1) == s[:, 0])     # the largest value is a level


def test_nu_never_zero_where_fp32_nu_is_positive():
  """Blocks whose largest nu spans 1e-24 .. 1e30, each with elements 12
  decades below it (normal fp32): every stored nu > 0 where the fp32 one is,
  0 where it is 0 only in an all-zero block; and through the kernels, a
  gradient of tiny values after a large one."""
  v, bits = bw.wide_nu(int4.BLOCK)
  codes, scale = int4.quantize_nu(v, bits)
  assert np.all(np.asarray(int4.dequantize_nu(codes, scale)) > 0)
  zero, _ = int4.quantize_nu(jnp.zeros((1, int4.BLOCK), F32), bits[:1])
  assert np.all(np.asarray(int4.dequantize_nu(zero, jnp.zeros((1, 1), F32))) == 0)
  g = jnp.asarray(np.concatenate([[1e3], np.full(int4.ROW - 1, 1e-9)]), F32)
  for impl in harness.runnable("xla", "triton", "mosaic_tpu", "mosaic_gpu"):
    _, _, new_nu = adam_update(None, g, int4.zeros(g.shape), int4.zeros(g.shape), count=1,
                               implementation=impl, interpret=True)
    assert np.all(np.asarray(int4.dequantize(new_nu, signed=False)) > 0), impl


@pytest.mark.parametrize("impl", ("xla", "triton", "mosaic_tpu", "mosaic_gpu"))
def test_nu_never_zero_down_to_the_smallest_normal_maxima(impl):
  """Blocks whose largest nu lies between the smallest normal fp32 (2**-126)
  and 1e-30, elements down to 2**-126: no stored nu reads 0 (a first level
  of max/256 would be subnormal, flushed to zero by XLA); and through each
  backend, a gradient whose nu is that small, with ``eps=0``, leaves the
  parameters finite."""
  v, bits = bw.tiny_nu(int4.BLOCK)
  codes, scale = int4.quantize_nu(v, bits)
  assert np.all(np.asarray(int4.dequantize_nu(codes, scale)) > 0)
  # nu = (1 - b2) g^2 from 3e-36 down to 2e-38: every level of the block normal
  g = jnp.asarray(5.5e-17 * 10.0 ** -np.linspace(0, 1.1, int4.ROW), F32)
  g = jnp.stack([g, -g])
  p = jnp.ones(g.shape, F32)
  hyper = dict(bw.HYPER, eps=0.0)
  f = jax.jit(lambda p, g, mu, nu, c: adam_update(
      p, g, mu, nu, count=c, implementation=impl, interpret=True, **hyper))
  state = (p, int4.zeros(g.shape), int4.zeros(g.shape))
  for c in (1, 2):
    state = f(state[0], g, state[1], state[2], c)
    assert np.all(np.asarray(int4.dequantize(state[2], signed=False)) > 0), c
  assert np.all(np.isfinite(np.asarray(state[0]))), impl
