"""Bad input and edge cases of the public kernels: no silent wrong numbers, clear errors.

Each test names the defect it guards (issue numbering in the commit log):
NaN bits on every backend, float and uint32-range seeds/offsets, vmap over the
Mosaic kernels, Newton-Schulz normalisation without overflow, scalar checks,
the Adam direction's rounding seed, derivatives.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fuseopt.kernels import adam_update, newton_schulz, newton_schulz_reference
from fuseopt.kernels import stochastic_round as sr
from fuseopt.kernels import stochastic_round_bf16
from fuseopt.kernels.elementwise_tiling import MosaicTPUConfig, TritonConfig
from tests.kernels import harness
from tests.kernels.test_adam_kernel import _compare

F32, BF16 = jnp.float32, jnp.bfloat16
ALL = ("xla", "triton", "mosaic_tpu")


def _from_bits(patterns):
  return jnp.asarray(np.array(patterns, dtype=np.uint32).view(np.float32))


# ------------------------------------------------ NaN payloads (Mosaic path) --
NANS = [0xFFFFFFFF, 0x7FFFFFFF, 0x7F800001, 0xFF800123, 0x7FC00000, 0xFFC00001, 0x7FBFFFFF]


@pytest.mark.parametrize("implementation", ALL)
def test_nan_bits_are_the_same_on_every_backend(implementation):
  # 256 elements: the Mosaic kernel (not only its <128 tail) sees them.
  x = jnp.tile(_from_bits(NANS), 40)[:256]
  got = stochastic_round_bf16(x, 5, implementation=implementation, interpret=True)
  # the upper half-word with the quiet bit set (a payload held only in the
  # low bits would otherwise truncate to an Inf)
  want = (np.asarray(harness.bits(x)) >> 16) | 0x40
  np.testing.assert_array_equal(harness.bits(got), want.astype(np.uint16))


def test_adam_mosaic_keeps_nan_bits_of_bf16_outputs():
  g = jnp.full((256,), jnp.nan, F32)
  p = jnp.ones((256,), BF16)
  mu = jnp.zeros((256,), BF16)
  outs = [adam_update(p, g, mu, mu, count=1, learning_rate=0.1, implementation=impl,
                      interpret=True) for impl in ALL]
  for o in outs[1:]:
    for a, b in zip(o, outs[0]):
      harness.assert_bitwise_equal(a, b)


# ------------------------------------------------------ seeds and offsets ----
@pytest.mark.parametrize("implementation", ALL)
def test_uint32_seeds_and_offsets_as_python_ints(implementation):
  x = jax.random.normal(jax.random.key(0), (300,), F32)
  for seed, offset in ((2**31, 0), (2**32 - 1, 2**31), (7, 2**32 - 300)):
    got = stochastic_round_bf16(x, seed, offset=offset, implementation=implementation,
                                interpret=True)
    want = sr.stochastic_round_reference(x, jnp.uint32(seed), offset=jnp.uint32(offset))
    harness.assert_bitwise_equal(got, want, f"seed={seed} offset={offset}")
  # the high seed is not the low one with the top bit dropped
  a = stochastic_round_bf16(x, 2**31 + 3, implementation=implementation, interpret=True)
  b = stochastic_round_bf16(x, 3, implementation=implementation, interpret=True)
  assert (harness.bits(a) != harness.bits(b)).any()


def test_uint32_seed_for_adam_and_apply_updates():
  import fuseopt.optim as fo
  x = jnp.ones((8,), F32)
  adam_update(x, x, x, x, count=1, seed=2**31)
  adam_update(x, x, x, x, count=1, seed=2**32 - 1, leaf_index=2**31)
  out = fo.apply_updates({"w": x.astype(BF16)}, {"w": x * 1e-3}, seed=2**31)
  assert out["w"].dtype == BF16


@pytest.mark.parametrize("kw,err,match", [
    (dict(offset=1.5), TypeError, "offset"),
    (dict(offset=np.float32(2.0)), TypeError, "offset"),
    (dict(offset=-1), ValueError, "offset"),
    (dict(offset=2**32), ValueError, "offset"),
    (dict(offset=jnp.float32(3.0)), TypeError, "offset"),
    (dict(offset=jnp.int32(-2)), ValueError, "offset"),
    (dict(offset=True), TypeError, "offset"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(seed=2**32), ValueError, "seed"),
    (dict(seed=0.5), TypeError, "seed"),
    (dict(seed=jnp.zeros((2,), jnp.uint32)), TypeError, "seed"),
])
def test_bad_seed_or_offset_raises_naming_it(kw, err, match):
  args = dict(seed=1, offset=0)
  args.update(kw)
  with pytest.raises(err, match=f"stochastic_round_bf16: {match}"):
    stochastic_round_bf16(jnp.ones((4,), F32), args["seed"], offset=args["offset"])


def test_traced_offset_and_seed_still_work():
  x = jax.random.normal(jax.random.key(1), (200,), F32)
  f = jax.jit(lambda x, s, o: stochastic_round_bf16(x, s, offset=o))
  harness.assert_bitwise_equal(f(x, jnp.uint32(2**31 + 1), jnp.uint32(2**32 - 5)),
                               stochastic_round_bf16(x, 2**31 + 1, offset=2**32 - 5))


# ------------------------------------------------------- vmap over Mosaic ----
def test_vmap_over_mosaic_stochastic_round():
  x = jax.random.normal(jax.random.key(2), (3, 256), F32)
  rows = jax.vmap(lambda r, o: stochastic_round_bf16(
      r, 8, offset=o, implementation="mosaic_tpu", interpret=True))(x, jnp.arange(3) * 256)
  harness.assert_bitwise_equal(rows, stochastic_round_bf16(x, 8))


def test_vmap_over_mosaic_adam_update():
  k = jax.random.split(jax.random.key(3), 3)
  g = jax.random.normal(k[0], (2, 256), F32)
  p = jax.random.normal(k[1], (2, 256), F32)
  mu = jnp.zeros((2, 256), BF16)
  run = lambda impl: jax.vmap(lambda p, g, m, v: adam_update(
      p, g, m, v, count=1, learning_rate=0.1, implementation=impl, interpret=True))(p, g, mu, mu)
  # fp32 params within an ulp, bf16 moments bitwise but for rare ulps: the
  # kernel-vs-reference tolerance of test_adam_kernel
  _compare(run("mosaic_tpu"), run("xla"), "vmap mosaic")


def test_vmap_over_mosaic_newton_schulz():
  x = jax.random.normal(jax.random.key(7), (2, 8, 32), F32)
  got = jax.vmap(lambda m: newton_schulz(m, ns_dtype=F32, implementation="mosaic_tpu",
                                         interpret=True))(x)
  harness.assert_close(got, newton_schulz_reference(x, ns_dtype=F32), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("target", harness.targets_for("mosaic_tpu")[:1], ids=lambda t: t.name)
def test_vmap_over_mosaic_kernels_lowers_for_tpu(target):
  s = jax.ShapeDtypeStruct((2, 2048), F32)
  harness.lower_for(target, jax.vmap(lambda r: stochastic_round_bf16(r, 3, implementation="mosaic_tpu")), s)
  harness.lower_for(target, jax.vmap(lambda p, g, m, v: adam_update(
      p, g, m, v, count=1, implementation="mosaic_tpu")), s, s, s, s)


# ---------------------------------------------- Newton-Schulz normalisation --
@pytest.mark.parametrize("implementation,gram", [("xla", False), ("xla", True),
                                                 ("triton", False), ("mosaic_tpu", False),
                                                 ("triton", True)])
def test_newton_schulz_huge_entries_do_not_overflow(implementation, gram):
  x = jax.random.normal(jax.random.key(4), (16, 48), F32)
  x = x / jnp.max(jnp.abs(x))  # entries up to 1: x * scale stays finite
  want = newton_schulz(x, implementation=implementation, interpret=True, gram=gram)
  for scale in (1e20, 1e30, 1e36):  # ||x||^2 overflows fp32 from ~1.8e19
    got = newton_schulz(x * scale, implementation=implementation, interpret=True, gram=gram)
    assert np.isfinite(np.asarray(got)).all(), scale
    harness.assert_close(got, want, rtol=2e-2, atol=2e-2, what=f"scale {scale}")
  # a norm beyond 2**126 (entries near the fp32 maximum): NaN, never zeros
  got = newton_schulz(x * 3e38, implementation=implementation, interpret=True, gram=gram)
  assert np.isnan(np.asarray(got)).all()
  # ||x||^2 underflows for entries below ~1e-23; with eps = 0 (eps would
  # otherwise dominate such a norm, as defined) a tiny matrix is normalised too
  tiny = newton_schulz(x * 1e-30, eps=0.0, implementation=implementation, interpret=True,
                       gram=gram)
  harness.assert_close(tiny, want, rtol=2e-2, atol=2e-2, what="tiny")


@pytest.mark.parametrize("implementation", ALL)
def test_newton_schulz_zero_matrix_gives_zeros(implementation):
  for eps in (1e-7, 0.0):
    out = newton_schulz(jnp.zeros((2, 16, 32), F32), eps=eps, implementation=implementation,
                        interpret=True)
    np.testing.assert_array_equal(np.asarray(out), 0.0)


def test_newton_schulz_nonfinite_input_gives_nonfinite_output():
  x = jnp.ones((8, 16), F32).at[0, 0].set(jnp.inf)
  assert not np.isfinite(np.asarray(newton_schulz_reference(x))).all()
  x = x.at[0, 0].set(jnp.nan)
  assert np.isnan(np.asarray(newton_schulz_reference(x))).any()


@pytest.mark.parametrize("eps", [-1.0, float("nan"), float("inf"), jnp.float32(-1.0)])
def test_newton_schulz_bad_eps_raises(eps):
  with pytest.raises(ValueError, match="newton_schulz: eps"):
    newton_schulz(jnp.ones((4, 4)), eps=eps)


# ---------------------------------------------------------- Adam scalars ----
@pytest.mark.parametrize("kw,err,match", [
    (dict(count=0), ValueError, "count must be >= 1"),
    (dict(count=-1), ValueError, "count must be >= 1"),
    (dict(count=jnp.int32(0)), ValueError, "count must be >= 1"),
    (dict(count=1.0), TypeError, "count"),
    (dict(b1=1.0), ValueError, "b1"),
    (dict(b1=jnp.float32(1.0)), ValueError, "b1"),
    (dict(b2=-0.1), ValueError, "b2"),
    (dict(b2=float("nan")), ValueError, "b2"),
    (dict(eps=-1e-8), ValueError, "eps"),
    (dict(eps=np.float32(np.inf)), ValueError, "eps"),
    (dict(eps_root=-1.0), ValueError, "eps_root"),
    (dict(learning_rate=float("nan")), ValueError, "learning_rate"),
    (dict(learning_rate=jnp.array(jnp.inf)), ValueError, "learning_rate"),
    (dict(weight_decay=float("inf")), ValueError, "weight_decay"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(seed=1.5), TypeError, "seed"),
    (dict(leaf_index=-3), ValueError, "leaf_index"),
])
def test_adam_update_bad_scalars_raise_naming_them(kw, err, match):
  x = jnp.ones((4,), F32)
  args = dict(count=1)
  args.update(kw)
  with pytest.raises(err, match=f"adam_update: {match}"):
    adam_update(x, x, x, x, **args)


def test_adam_update_traced_scalars_are_used_unchecked():
  x = jnp.ones((4,), F32)
  f = jax.jit(lambda c, b1: adam_update(x, x, x, x, count=c, b1=b1, learning_rate=0.1))
  out = f(jnp.int32(3), jnp.float32(0.5))
  assert np.isfinite(np.asarray(out[0])).all()


@pytest.mark.parametrize("implementation,config", [
    ("triton", MosaicTPUConfig(256)), ("mosaic_tpu", TritonConfig(512))])
def test_wrong_backend_config_is_a_type_error(implementation, config):
  x = jnp.ones((4096,), F32)
  with pytest.raises(TypeError, match="adam_update: config must be"):
    adam_update(x, x, x, x, count=1, implementation=implementation, interpret=True, config=config)
  with pytest.raises(TypeError, match="stochastic_round_bf16: config must be"):
    stochastic_round_bf16(x, 1, implementation=implementation, interpret=True, config=config)


# ------------------------------------------- Adam direction rounding seed ----
@pytest.mark.parametrize("implementation", ("triton", "mosaic_tpu"))
def test_adam_direction_with_bf16_grads_rounds_like_the_kernels(implementation):
  k = jax.random.split(jax.random.key(5), 3)
  g = jax.random.normal(k[0], (2048,), F32).astype(BF16)
  mu = (0.1 * jax.random.normal(k[1], (2048,), F32)).astype(BF16)
  nu = (0.1 * jax.random.uniform(k[2], (2048,), F32)).astype(BF16)
  run = lambda impl, count, leaf: adam_update(None, g, mu, nu, count=count, seed=3, leaf_index=leaf,
                                              implementation=impl, interpret=True)
  for a, b in zip(run(implementation, 2, 1), run("xla", 2, 1)):
    harness.assert_bitwise_equal(a, b, implementation)
  # and the xla rounding changes with the step and the leaf
  u = [harness.bits(run("xla", c, leaf)[0]) for c, leaf in ((2, 1), (3, 1), (2, 4))]
  assert (u[0] != u[1]).any() and (u[0] != u[2]).any()


# ---------------------------------------------------------------- derivatives --
@pytest.mark.parametrize("implementation", ALL)
def test_stochastic_round_derivative_is_the_identity(implementation):
  x = jnp.linspace(-3.0, 3.0, 256, dtype=F32)
  g = jax.grad(lambda x: jnp.sum(stochastic_round_bf16(
      x, 1, implementation=implementation, interpret=True).astype(F32) * x))(x)
  # d/dx [sr(x) * x] with d sr/dx = 1: x + sr(x), where the first term is
  # the cotangent of a bf16 value, so itself in bf16
  want = x.astype(BF16).astype(F32) + stochastic_round_bf16(x, 1).astype(F32)
  harness.assert_close(g, want, rtol=1e-6, atol=0, what=implementation)


@pytest.mark.parametrize("implementation", ALL)
def test_newton_schulz_derivative_is_the_references(implementation):
  x = jax.random.normal(jax.random.key(6), (8, 16), F32)
  f = lambda impl: jax.grad(lambda x: jnp.sum(newton_schulz(
      x, ns_dtype=F32, implementation=impl, interpret=True) ** 3))(x)
  # the cotangent 3·NS(x)² comes from the kernel's own (fp32-close) output
  harness.assert_close(f(implementation), f("xla"), rtol=1e-3, atol=1e-5, what=implementation)


@pytest.mark.parametrize("implementation", ("triton", "mosaic_tpu"))
def test_adam_kernels_refuse_derivatives_clearly(implementation):
  x = jnp.linspace(-1.0, 1.0, 256, dtype=F32)
  f = lambda g: jnp.sum(adam_update(x, g, x, x * x, count=1, learning_rate=0.1,
                                    implementation=implementation, interpret=True)[0])
  with pytest.raises(TypeError, match="has no derivative.*implementation='xla'"):
    jax.grad(f)(x)
  g = jax.grad(lambda g: jnp.sum(adam_update(x, g, x, x * x, count=1, learning_rate=0.1,
                                             implementation="xla")[0]))(x)
  assert np.isfinite(np.asarray(g)).all()
