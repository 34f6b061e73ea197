"""Properties of adam_update and the Adam transforms.

- the kernels equal the reference (interpret mode) on random shapes, storage
  dtypes, specials and seeds over the whole uint32 range;
- with fp32 moments, fuseopt's adam/adamw follow optax.adam/adamw;
- a non-finite gradient element touches only its own outputs;
- a bad scalar raises naming it.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import fuseopt.optim as fo
from fuseopt.kernels import adam_update
from tests.kernels.test_adam_kernel import _compare
from tests.properties.strategies import FAST, KERNEL, MEDIUM, SHAPE_BUCKETS, UINT32, fp32_arrays

F32, BF16 = jnp.float32, jnp.bfloat16
DTYPES = st.sampled_from([F32, BF16])
HYPER = dict(b1=st.floats(0.0, 0.99), b2=st.floats(0.0, 0.9999), eps=st.floats(1e-12, 1e-3),
             learning_rate=st.floats(0.0, 0.1), weight_decay=st.floats(0.0, 0.5))


@functools.partial(jax.jit, static_argnames=("implementation", "nesterov", "direction"))
def _adam(p, g, mu, nu, count, seed, hp, implementation="xla", nesterov=False, direction=False):
  return adam_update(None if direction else p, g, mu, nu, count=count, seed=seed,
                     implementation=implementation, interpret=True, nesterov=nesterov, **hp)


@st.composite
def _leaf(draw, shape):
  g = draw(fp32_arrays(shape=shape, specials=False))
  g = np.where(np.isfinite(g), np.clip(g, -1e6, 1e6), 0).astype(np.float32)
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  p = rng.standard_normal(shape).astype(np.float32)
  mu = (0.1 * rng.standard_normal(shape)).astype(np.float32)
  nu = (0.1 * rng.random(shape)).astype(np.float32)
  dt = [draw(DTYPES) for _ in range(3)]
  return (jnp.asarray(p, dt[0]), jnp.asarray(g, dt[1]), jnp.asarray(mu, dt[2]),
          jnp.asarray(nu, dt[2]))


@KERNEL
@given(data=st.data(), shape=st.sampled_from(SHAPE_BUCKETS[3:]), count=st.integers(1, 2**31 - 1),
       seed=UINT32, nesterov=st.booleans(), direction=st.booleans(),
       impl=st.sampled_from(["triton", "mosaic_tpu"]))
def test_kernels_equal_the_reference(data, shape, count, seed, nesterov, direction, impl):
  p, g, mu, nu = data.draw(_leaf(shape))
  hp = {k: jnp.float32(data.draw(v)) for k, v in HYPER.items()}
  args = (p, g, mu, nu, jnp.int32(count), jnp.uint32(seed), hp)
  got = _adam(*args, implementation=impl, nesterov=nesterov, direction=direction)
  want = _adam(*args, nesterov=nesterov, direction=direction)
  _compare(got, want, f"{impl}{shape}")


@FAST
@given(g=fp32_arrays(shape=(256,), specials=True), seed=UINT32)
def test_a_non_finite_gradient_touches_only_its_elements(g, seed):
  finite = np.isfinite(g)
  assume(not finite.all())
  clean = np.where(finite, g, 0).astype(np.float32)
  p = jnp.ones((256,), F32)
  mu = jnp.zeros((256,), BF16)
  hp = {k: jnp.float32(v) for k, v in dict(b1=0.9, b2=0.999, eps=1e-8, learning_rate=1e-3,
                                            weight_decay=0.0).items()}
  a = _adam(p, g, mu, mu, jnp.int32(3), jnp.uint32(seed), hp)
  b = _adam(p, clean, mu, mu, jnp.int32(3), jnp.uint32(seed), hp)
  for x, y in zip(a, b):
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    np.testing.assert_array_equal(x[finite], y[finite])
    assert not np.isfinite(x[~finite]).all()


@st.composite
def _tree(draw):
  shapes = draw(st.lists(st.sampled_from([(), (0,), (5,), (3, 7), (2, 3, 4)]), min_size=1, max_size=4))
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  return {f"l{i}": jnp.asarray(rng.standard_normal(s), F32) for i, s in enumerate(shapes)}


@MEDIUM
@given(params=_tree(), b1=st.floats(0.0, 0.99), b2=st.floats(0.5, 0.9999),
       eps=st.floats(1e-10, 1e-3), lr=st.floats(1e-5, 1e-1), wd=st.floats(0.0, 0.3),
       nesterov=st.booleans())
def test_fp32_moments_follow_optax(params, b1, b2, eps, lr, wd, nesterov):
  grads = jax.tree.map(lambda p: jnp.cos(3.0 * p) + 0.1, params)
  kw = dict(b1=b1, b2=b2, eps=eps, nesterov=nesterov)
  mine = fo.adamw(lr, weight_decay=wd, moment_dtype=jnp.float32, **kw)
  ref = optax.adamw(lr, weight_decay=wd, **kw)
  sm, sr, pm, pr = mine.init(params), ref.init(params), params, params
  for _ in range(2):
    um, sm = mine.update(grads, sm, pm)
    ur, sr = ref.update(grads, sr, pr)
    pm, pr = optax.apply_updates(pm, um), optax.apply_updates(pr, ur)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5,
                                                       atol=1e-6), pm, pr)
  assert jax.tree.structure(sm) == jax.tree.structure(sr)


BAD = {
    "b1": st.one_of(st.floats(min_value=1.0), st.floats(max_value=-1e-9), st.just(float("nan"))),
    "b2": st.one_of(st.floats(min_value=1.0), st.floats(max_value=-1e-9), st.just(float("nan"))),
    "eps": st.one_of(st.floats(max_value=-1e-30), st.just(float("inf")), st.just(float("nan"))),
    "learning_rate": st.sampled_from([float("nan"), float("inf"), -float("inf")]),
    "count": st.one_of(st.integers(max_value=0), st.integers(min_value=2**31)),
}


@FAST
@given(data=st.data(), name=st.sampled_from(sorted(BAD)), as_array=st.booleans())
def test_bad_scalars_name_the_argument(data, name, as_array):
  value = data.draw(BAD[name])
  if as_array:  # an array-valued hyperparameter is checked as well
    assume(name != "count" or -2**31 <= value < 2**31)  # an int32 array holds it
    with np.errstate(over="ignore"):  # a huge float becomes inf: still bad
      value = np.asarray(value, np.int32 if name == "count" else np.float32)
  kw = {"count": 1, name: value}
  x = jnp.ones((4,), F32)
  with pytest.raises(ValueError, match=f"adam_update: {name}"):
    adam_update(x, x, x, x, **kw)
