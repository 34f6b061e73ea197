"""Properties of stochastic_round_bf16 (docs: the rounding contract).

- only the two bf16 neighbours of a finite value appear, sign kept, never Inf;
  NaN keeps its sign and payload (quiet bit set), +-Inf, +-0 pass through;
- the bits depend on (seed, offset + flat index) only: bitwise the same on
  every backend (interpret mode), block config and slicing with offsets;
- unbiased: the mean of many roundings of x is x;
- a bad seed or offset raises naming it.

Seeds and offsets reach the jitted functions as traced uint32 values, so a
property compiles once per shape, not once per example.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuseopt.kernels import stochastic_round as sr
from fuseopt.kernels import stochastic_round_bf16
from tests.properties.strategies import (FAST, KERNEL, SHAPE_BUCKETS, UINT32, bf16_neighbours,
                                         bits16, fp32_arrays, shapes)


@functools.partial(jax.jit, static_argnames=("implementation", "config"))
def _round(x, seed, offset, implementation="xla", config=None):
  return stochastic_round_bf16(x, seed, offset=offset, implementation=implementation,
                               interpret=True, config=config)


def _u32(v):
  return jnp.asarray(np.uint32(v))


def _expected_nan_bits(x):
  b = x.view(np.uint32)
  return (((b >> 16) | 0x40) & 0xFFFF).astype(np.uint16)


@FAST
@given(x=fp32_arrays(shape=(1024,)), seed=UINT32, offset=UINT32)
def test_only_neighbours_and_specials_pass_through(x, seed, offset):
  out = bits16(_round(x, _u32(seed), _u32(offset)))
  nan = np.isnan(x)
  np.testing.assert_array_equal(out[nan], _expected_nan_bits(x[nan]))
  inf = np.isinf(x)
  np.testing.assert_array_equal(out[inf], (x[inf].view(np.uint32) >> 16).astype(np.uint16))
  fin = np.isfinite(x)
  lo, hi = bf16_neighbours(x[fin])
  got = out[fin]
  assert ((got == lo) | (got == hi)).all()
  assert ((got >> 15) == (x[fin].view(np.uint32) >> 31)).all()  # sign kept, -0 stays -0
  assert ((got & 0x7FFF) <= 0x7F7F).all()                         # never Inf


@FAST
@given(x=fp32_arrays(shape=st.sampled_from(SHAPE_BUCKETS)), seed=UINT32, offset=UINT32)
def test_any_shape_rounds_as_its_flat_row_major_view(x, seed, offset):
  out = _round(x, _u32(seed), _u32(offset))
  assert out.shape == x.shape and out.dtype == jnp.bfloat16
  flat = _round(x.reshape(-1), _u32(seed), _u32(offset))
  np.testing.assert_array_equal(bits16(out).reshape(-1), bits16(flat))


@KERNEL
@given(x=fp32_arrays(shape=st.sampled_from(SHAPE_BUCKETS[3:])), seed=UINT32, offset=UINT32,
       data=st.data())
def test_bitwise_across_backends_and_blocks(x, seed, offset, data):
  want = bits16(_round(x, _u32(seed), _u32(offset)))
  triton = data.draw(st.sampled_from(sr.triton.SEARCH_SPACE[:2] + (None,)))
  mosaic = data.draw(st.sampled_from(sr.mosaic_tpu.SEARCH_SPACE[:1] + (None,)))
  for impl, config in (("triton", triton), ("mosaic_tpu", mosaic)):
    got = _round(x, _u32(seed), _u32(offset), implementation=impl, config=config)
    np.testing.assert_array_equal(bits16(got), want, err_msg=f"{impl} {config}")


@FAST
@given(x=fp32_arrays(shape=(600,)), seed=UINT32, base=UINT32, cut=st.integers(0, 600))
def test_slices_with_offsets_equal_the_whole(x, seed, base, cut):
  whole = bits16(_round(x, _u32(seed), _u32(base)))
  # offsets wrap modulo 2**32, like the index they add to; the slices are
  # padded to the whole length so the property compiles once
  second = np.concatenate([x[cut:], np.zeros(cut, np.float32)])
  parts = np.concatenate([bits16(_round(x, _u32(seed), _u32(base)))[:cut],
                          bits16(_round(second, _u32(seed), _u32((base + cut) % 2**32)))[:600 - cut]])
  np.testing.assert_array_equal(parts, whole)


@FAST
@given(mantissa=st.integers(1, 2**16 - 1), exponent=st.integers(-126, 126), sign=st.booleans(),
       seed=UINT32)
def test_unbiased(mantissa, exponent, sign, seed):
  n = 4096
  bits = (np.float32(2.0 ** exponent).view(np.uint32) | np.uint32(mantissa)
          | np.uint32(0x80000000 * sign))
  x0 = np.full(n, bits, np.uint32).view(np.float32)
  out = bits16(_round(x0, _u32(seed), _u32(0)))
  lo, hi = bf16_neighbours(x0[:1])
  up = (out == hi[0]).mean()
  assert ((out == lo[0]) | (out == hi[0])).all()
  p = mantissa / 65536
  # 6 sigma of a Bernoulli(p) mean over n draws
  assert abs(up - p) <= 6 * np.sqrt(p * (1 - p) / n) + 2 / n


BAD_INDEX = st.one_of(st.integers(max_value=-1), st.integers(min_value=2**32),
                      st.floats(allow_nan=True, allow_infinity=True), st.booleans())


@FAST
@given(bad=BAD_INDEX, which=st.sampled_from(["seed", "offset"]))
def test_bad_seed_or_offset_names_the_argument(bad, which):
  kw = {"seed": 1, "offset": 0, which: bad}
  with pytest.raises((TypeError, ValueError), match=f"stochastic_round_bf16: {which}"):
    stochastic_round_bf16(np.ones(3, np.float32), kw["seed"], offset=kw["offset"])


@FAST
@given(shape=shapes(), dtype=st.sampled_from([np.float16, np.int32, np.uint8, np.bool_]))
def test_other_dtypes_raise_naming_x(shape, dtype):
  with pytest.raises(TypeError, match="stochastic_round_bf16: x must be float32"):
    stochastic_round_bf16(np.zeros(shape, dtype), 0)
