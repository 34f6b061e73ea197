"""Properties of newton_schulz.

- scale invariance: NS(s·G) = NS(G) for any positive s with entries from
  1e-30 up and a norm below 2^126 (eps = 0); beyond, NaN, never zeros;
- the kernels (interpret mode) follow the reference on random shapes;
- shape and dtype are kept; a zero matrix gives zeros; bad arguments raise.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuseopt.kernels import newton_schulz
from tests.properties.strategies import FAST, KERNEL, MEDIUM

F32, BF16 = jnp.float32, jnp.bfloat16
MATRICES = st.sampled_from([(1, 1), (3, 5), (40, 16), (2, 8, 24)])


@functools.partial(jax.jit, static_argnames=("implementation", "gram", "eps"))
def _ns(x, implementation="xla", gram=False, eps=0.0):
  return newton_schulz(x, ns_dtype=F32, eps=eps, gram=gram, implementation=implementation,
                       interpret=True)


def _matrix(shape, seed):
  x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
  return x / np.abs(x).max()


@FAST
@given(shape=MATRICES, seed=st.integers(0, 2**32 - 1), exponent=st.floats(-30.0, 38.5),
       gram=st.booleans())
def test_scale_invariant_without_overflow(shape, seed, exponent, gram):
  x = _matrix(shape, seed)
  scaled = x * np.float32(10.0 ** exponent)
  assert np.isfinite(scaled).all()
  a, b = np.asarray(_ns(jnp.asarray(x), gram=gram)), np.asarray(_ns(jnp.asarray(scaled), gram=gram))
  norm = np.linalg.norm(scaled.reshape(-1, *shape[-2:]).astype(np.float64), axis=(-2, -1))
  if norm.max() < 2.0**125:  # the documented exact range (2**126, with a margin)
    assert np.isfinite(b).all()
    np.testing.assert_allclose(b, a, rtol=1e-3, atol=1e-4)
  else:  # beyond it a matrix gives NaN or its exact result, never a silent zero
    for bi, ai in zip(b.reshape(-1, *shape[-2:]), a.reshape(-1, *shape[-2:])):
      assert np.isnan(bi).all() or np.allclose(bi, ai, rtol=1e-3, atol=1e-4)


@KERNEL
@given(shape=st.sampled_from([(3, 5), (2, 8, 24)]), seed=st.integers(0, 2**32 - 1),
       impl=st.sampled_from(["triton", "mosaic_tpu"]), gram=st.booleans())
def test_kernels_follow_the_reference(shape, seed, impl, gram):
  x = jnp.asarray(_matrix(shape, seed) * 1e25)
  np.testing.assert_allclose(np.asarray(_ns(x, impl, gram, 1e-7)), np.asarray(_ns(x, "xla", gram, 1e-7)),
                             rtol=1e-3, atol=1e-4)


@MEDIUM
@given(shape=MATRICES, dtype=st.sampled_from([F32, BF16]), eps=st.sampled_from([0.0, 1e-7]))
def test_zero_matrix_gives_zeros_of_its_shape_and_dtype(shape, dtype, eps):
  out = newton_schulz(jnp.zeros(shape, dtype), eps=eps)
  assert out.shape == shape and out.dtype == dtype
  assert not np.asarray(out, np.float32).any()


@FAST
@given(eps=st.one_of(st.floats(max_value=-1e-30), st.sampled_from([float("nan"), float("inf")])),
       as_array=st.booleans())
def test_bad_eps_names_it(eps, as_array):
  with np.errstate(over="ignore"):  # a huge float becomes -inf: still bad
    eps = np.float32(eps) if as_array else eps
  with pytest.raises(ValueError, match="newton_schulz: eps"):
    newton_schulz(jnp.ones((4, 4)), eps=eps)


@FAST
@given(ndim=st.integers(0, 1))
def test_rank_below_two_names_x(ndim):
  with pytest.raises(ValueError, match="newton_schulz: x must have rank >= 2"):
    newton_schulz(jnp.ones((3,) * ndim))
