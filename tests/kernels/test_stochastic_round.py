"""stochastic_round_bf16: kernels vs reference, the rounding contract, determinism."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from fuseopt.kernels import stochastic_round as sr
from fuseopt.kernels import stochastic_round_bf16
from tests.kernels import harness

BACKENDS = ("triton", "mosaic_tpu")
SHAPES = [(), (0,), (1,), (7,), (130,), (1000, 37), (3, 5, 129)]


def _from_bits(pattern_list):
  return jnp.asarray(np.array(pattern_list, dtype=np.uint32).view(np.float32))


def _neighbours(x):
  """The bf16 patterns just below and above |x| (truncation and one ulp up)."""
  b = harness.bits(x).astype(np.uint64)
  lo = (b >> 16)
  return lo, lo + 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_matches_reference(request, backend, shape):
  key = harness.fresh_key(request)
  x = jax.random.normal(key, shape, jnp.float32) * 10.0
  seed = jax.random.randint(jax.random.fold_in(key, 1), (), 0, 2**31 - 1).astype(jnp.uint32)
  harness.check_against_reference(
      lambda x, s: stochastic_round_bf16(x, s, offset=11, implementation=backend, interpret=True),
      lambda x, s: sr.stochastic_round_reference(x, s, offset=11),
      (x, seed), what=f"{backend}{shape}")


@pytest.mark.parametrize("config", sr.triton.SEARCH_SPACE[::3] + sr.triton.SEARCH_SPACE[-1:], ids=str)
def test_triton_configs_bitwise_equal(config):
  x = jax.random.normal(jax.random.key(3), (50_001,), jnp.float32)
  got = stochastic_round_bf16(x, 5, implementation="triton", interpret=True, config=config)
  harness.assert_bitwise_equal(got, sr.stochastic_round_reference(x, 5), str(config))


@pytest.mark.parametrize("config", sr.mosaic_tpu.SEARCH_SPACE, ids=str)
def test_mosaic_configs_bitwise_equal(config):
  x = jax.random.normal(jax.random.key(4), (300, 129), jnp.float32)  # 38700: a ragged tail
  got = stochastic_round_bf16(x, 9, implementation="mosaic_tpu", interpret=True, config=config)
  harness.assert_bitwise_equal(got, sr.stochastic_round_reference(x, 9), str(config))


@pytest.mark.parametrize("target", harness.TARGETS, ids=harness.TARGET_IDS)
def test_every_config_lowers(target):
  space = sr.triton.SEARCH_SPACE if target.implementation == "triton" else sr.mosaic_tpu.SEARCH_SPACE
  avals = (jax.ShapeDtypeStruct((1024, 1000), jnp.float32), jax.ShapeDtypeStruct((), jnp.uint32))
  for config in space:
    harness.lower_for(target, functools.partial(
        stochastic_round_bf16, implementation=target.implementation, config=config), *avals)
  # and implementation=None on that platform: the reference (no kernel) on a
  # GPU and a TPU (backends.ORDER)
  harness.lower_for(target, stochastic_round_bf16, *avals, expect_kernel=False)


SPECIALS = [
    0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0xFF800123, 0xFFC00001,  # NaNs, various payloads
    0x7F800000, 0xFF800000,                                      # ±Inf
    0x00000000, 0x80000000,                                      # ±0
    0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000,                          # near the largest finite
    0x00000001, 0x807FFFFF, 0x00008000, 0x0000FFFF,              # subnormals
    0x3F800001, 0xBF80FFFF,                                      # ±1 with a discarded part
]


@pytest.mark.parametrize("implementation", ("xla",) + BACKENDS)
def test_special_values(implementation):
  x = jnp.tile(_from_bits(SPECIALS), 64)  # many indices, so many random draws
  out = stochastic_round_bf16(x, 1234, implementation=implementation, interpret=True)
  xb = harness.bits(x)
  ob = harness.bits(out).astype(np.uint32)
  xf = np.asarray(x)
  nan = np.isnan(xf)
  assert np.isnan(np.asarray(out, np.float32)[nan]).all(), "a NaN must stay a NaN"
  assert ((ob[nan] >> 15) == (xb[nan] >> 31)).all(), "a NaN keeps its sign"
  inf = np.isinf(xf)
  np.testing.assert_array_equal(np.asarray(out, np.float32)[inf], xf[inf])
  finite = np.isfinite(xf)
  assert np.isfinite(np.asarray(out, np.float32)[finite]).all(), "no finite value may become Inf"
  assert ((ob[finite] >> 15) == (xb[finite] >> 31)).all(), "the sign never changes"
  zero = xf == 0
  np.testing.assert_array_equal(ob[zero], xb[zero] >> 16)  # ±0 stays ±0, sign included
  big = (xb & 0x7FFFFFFF) == 0x7F7FFFFF
  np.testing.assert_array_equal(ob[big] & 0x7FFF, 0x7F7F)  # clamped, never Inf
  lo, hi = _neighbours(x)
  assert np.isin(ob[finite], np.stack([lo[finite], hi[finite]])).all()
  # a subnormal with a discarded part rounds up sometimes, like any value
  sub = (xb & 0x7FFFFFFF) == 0x00008000  # discarded fraction 1/2
  assert (ob[sub] == 1).any() and (ob[sub] == 0).any()


def test_only_the_two_bf16_neighbours_appear():
  x = jax.random.normal(jax.random.key(0), (1 << 16,), jnp.float32) * jnp.exp(
      jax.random.uniform(jax.random.key(1), (1 << 16,), minval=-60, maxval=60))
  out = harness.bits(stochastic_round_bf16(x, 77)).astype(np.uint64)
  lo, hi = _neighbours(x)
  assert ((out == lo) | (out == hi)).all()
  assert (out == hi).mean() > 0.3  # both neighbours do occur


def test_probability_of_rounding_up_is_the_discarded_fraction():
  fractions = np.array([1, 0x1000, 0x4000, 0x8000, 0xC000, 0xFFFF], np.uint32)
  n = 1 << 16
  base = np.uint32(0x3F800000)
  for f in fractions:
    x = _from_bits(np.full(n, base | f, np.uint32))
    up = (harness.bits(stochastic_round_bf16(x, 99)) == 0x3F81).mean()
    p = f / 65536
    # binomial standard deviation over n draws; 6 sigma (and at least 2/n)
    assert abs(up - p) <= 6 * np.sqrt(p * (1 - p) / n) + 2 / n, (hex(f), up, p)


def test_unbiased_where_round_to_nearest_is_not():
  x0 = 1.0 + 2.0**-10  # 1/8 of a bf16 ulp above 1.0: round-to-nearest gives 1.0
  n_seeds, n = 64, 4096
  x = jnp.full((n,), x0, jnp.float32)
  means = [float(jnp.mean(stochastic_round_bf16(x, s).astype(jnp.float32))) for s in range(n_seeds)]
  mean = np.mean(means)
  bound = 2.0**-7 * 0.5 / np.sqrt(n_seeds * n) * 6  # 6 sigma of the Bernoulli mean
  assert abs(mean - x0) < bound, (mean, x0, bound)
  rtn = float(jnp.mean(x.astype(jnp.bfloat16).astype(jnp.float32)))
  assert abs(rtn - x0) > bound  # the bound is tight enough to reject round-to-nearest


def test_same_seed_same_bits_other_seed_other_bits():
  x = jax.random.normal(jax.random.key(5), (4096,), jnp.float32)
  a, b = stochastic_round_bf16(x, 1), stochastic_round_bf16(x, 1)
  harness.assert_bitwise_equal(a, b)
  c = stochastic_round_bf16(x, 2)
  assert (harness.bits(a) != harness.bits(c)).any()


@pytest.mark.parametrize("implementation", ("xla",) + BACKENDS)
def test_slices_with_offset_equal_the_whole(implementation):
  x = jax.random.normal(jax.random.key(6), (3000,), jnp.float32)
  whole = stochastic_round_bf16(x, 42, implementation=implementation, interpret=True)
  cuts = [0, 1, 129, 1000, 2999, 3000]
  parts = [stochastic_round_bf16(x[a:b], 42, offset=a, implementation=implementation, interpret=True)
           for a, b in zip(cuts[:-1], cuts[1:])]
  harness.assert_bitwise_equal(jnp.concatenate(parts), whole)


@pytest.mark.parametrize("implementation", ("xla", "triton"))
def test_vmap_with_offsets_equals_the_whole(implementation):
  x = jax.random.normal(jax.random.key(7), (4, 1000), jnp.float32)
  whole = stochastic_round_bf16(x, 8)
  rows = jax.vmap(lambda r, o: stochastic_round_bf16(r, 8, offset=o, implementation=implementation,
                                                     interpret=True))(x, jnp.arange(4) * 1000)
  harness.assert_bitwise_equal(rows, whole)


@pytest.mark.parametrize("implementation", ("xla", "triton", "mosaic_tpu"))
def test_sharded_over_8_devices_equals_unsharded(implementation):
  assert jax.device_count() >= 8
  mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
  x = jax.random.normal(jax.random.key(8), (8 * 1024,), jnp.float32)
  whole = stochastic_round_bf16(x, 31)
  local = x.shape[0] // 8

  def body(xs):
    offset = jax.lax.axis_index("x").astype(jnp.uint32) * jnp.uint32(local)
    return stochastic_round_bf16(xs, 31, offset=offset, implementation=implementation, interpret=True)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
  xs = jax.device_put(x, NamedSharding(mesh, P("x")))
  harness.assert_bitwise_equal(f(xs), whole)


def test_bf16_passthrough_and_dtype_errors():
  y = jnp.ones((3,), jnp.bfloat16)
  assert stochastic_round_bf16(y, 0) is y
  for dtype in (jnp.float16, jnp.int32):
    with pytest.raises(TypeError, match="float32"):
      stochastic_round_bf16(jnp.ones((3,), dtype), 0)
  with pytest.raises(TypeError, match="seed"):
    stochastic_round_bf16(jnp.ones((3,)), 0.5)
  with pytest.raises(ValueError, match="implementation"):
    stochastic_round_bf16(jnp.ones((3,)), 0, implementation="cuda")


def test_config_validation():
  with pytest.raises(ValueError, match="power of two"):
    sr.TritonConfig(block=1000)
  with pytest.raises(ValueError, match="multiple of 16"):
    sr.MosaicTPUConfig(block_rows=24)


def test_under_jit_with_traced_seed_and_offset():
  x = jax.random.normal(jax.random.key(9), (777,), jnp.float32)
  f = jax.jit(lambda x, s, o: stochastic_round_bf16(x, s, offset=o, implementation="triton", interpret=True))
  harness.assert_bitwise_equal(f(x, jnp.uint32(3), jnp.uint32(5)),
                               sr.stochastic_round_reference(x, 3, offset=5))
