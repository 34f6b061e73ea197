"""Integer leaves (a step counter, a token table kept in the params) get no
update and keep their state's dtypes, step after step: in the fused step and
through ``tx.update`` + ``optax.apply_updates``, for every moment format, with
masters (``track_mantissa``) and on Muon's AdamW side."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fuseopt.optim as fo

FORMATS = ("float32", "bfloat16", "int8", "int4")
# Large values: an integer leaf routed through float32 would lose them.
INTS = np.array([0, 0, 1, 2, 2**30 + 1, -7, 123456789, 3], np.int32)


def _params(dtype=jnp.float32):
  k = jax.random.split(jax.random.key(0), 2)
  return {"w": jax.random.normal(k[0], (8, 256)).astype(dtype),
          "b": jax.random.normal(k[1], (256,)).astype(dtype),
          "i": jnp.asarray(INTS)}


def _grads(params, t):
  return {k: (v * 0.1 * (t + 1) if jnp.issubdtype(v.dtype, jnp.floating) else jnp.zeros_like(v))
          for k, v in params.items()}


def _dtypes(tree):
  return jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), tree)


def _run(tx, params, fused, steps=3):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")   # blockwise formats: the leaves without whole blocks
    state = tx.init(params)
  want = _dtypes(state)
  if fused:
    step = jax.jit(lambda p, s, g: fo.step(tx, g, s, p))
  else:
    def step(p, s, g):
      u, s = jax.jit(tx.update)(g, s, p)
      return optax.apply_updates(p, u), s
  for t in range(steps):
    params, state = step(params, state, _grads(params, t))
    assert _dtypes(state) == want, f"step {t}: the state's dtypes changed"
  return params, state


def _check_untouched(params):
  assert params["i"].dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(params["i"]), INTS)


@pytest.mark.parametrize("fused", [True, False], ids=["step", "update"])
@pytest.mark.parametrize("moment_dtype", FORMATS)
def test_int_leaf_adamw_every_format(moment_dtype, fused):
  tx = fo.adamw(1e-2, weight_decay=0.1, moment_dtype=moment_dtype)
  params, _ = _run(tx, _params(), fused)
  _check_untouched(params)
  assert not np.allclose(np.asarray(params["w"]), np.asarray(_params()["w"]))


@pytest.mark.parametrize("fused", [True, False], ids=["step", "update"])
@pytest.mark.parametrize("master_bits", [32, 24])
@pytest.mark.parametrize("moment_dtype", ("bfloat16", "int8"))
def test_int_leaf_with_masters(moment_dtype, master_bits, fused):
  tx = fo.track_mantissa(fo.adamw(1e-2, weight_decay=0.1, moment_dtype=moment_dtype),
                         master_bits=master_bits)
  params, state = _run(tx, _params(jnp.bfloat16), fused)
  _check_untouched(params)
  masters = fo.master_params(params, state)
  assert masters["i"].dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(masters["i"]), INTS)
  assert masters["w"].dtype == jnp.float32


def test_master_params_passes_an_int_leaf_through_untouched():
  params = _params(jnp.bfloat16)
  state = fo.track_mantissa(fo.adamw(1e-2)).init(params)
  masters = fo.master_params(params, state)
  assert masters["i"].dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(masters["i"]), INTS)


@pytest.mark.parametrize("fused", [True, False], ids=["step", "update"])
@pytest.mark.parametrize("mu_dtype,moment_dtype", [(None, "bfloat16"), (jnp.float32, "float32"),
                                                   ("int8", "int8"), ("int8", "int4")])
def test_int_leaf_muon(mu_dtype, moment_dtype, fused):
  params = dict(_params(), m=jnp.arange(64, dtype=jnp.int32).reshape(8, 8))   # a 2-D int leaf
  tx = fo.muon(2e-2, weight_decay=0.1, adam_weight_decay=0.1, mu_dtype=mu_dtype,
               moment_dtype=moment_dtype)
  out, _ = _run(tx, params, fused)
  _check_untouched(out)
  np.testing.assert_array_equal(np.asarray(out["m"]), np.arange(64).reshape(8, 8))


def test_int_leaf_muon_with_masters():
  params = dict(_params(jnp.bfloat16), m=jnp.arange(64, dtype=jnp.int32).reshape(8, 8))
  tx = fo.track_mantissa(fo.muon(2e-2, mu_dtype="int8", moment_dtype="int4"), master_bits=24)
  for fused in (True, False):
    out, _ = _run(tx, params, fused)
    _check_untouched(out)


def test_muon_refuses_an_int_leaf_declared_a_matrix():
  params = {"w": jnp.ones((8, 8)), "m": jnp.ones((8, 8), jnp.int32)}
  dims = {"w": fo.MuonDimensionNumbers(), "m": fo.MuonDimensionNumbers()}
  tx = fo.muon(2e-2, muon_weight_dimension_numbers=dims)
  with pytest.raises(ValueError, match=r"muon: muon_weight_dimension_numbers declares the leaf at \['m'\] a Muon matrix, but it is int32"):
    tx.init(params)


@pytest.mark.parametrize("fused", [True, False], ids=["step", "update"])
def test_int_leaf_with_the_float0_gradient_of_jax_grad(fused):
  """jax.grad(..., allow_int=True) gives an integer leaf a float0 gradient:
  the leaf passes through all the same (optax's Adam raises on it)."""
  params = _params()
  grads = jax.grad(lambda p: jnp.sum(p["w"] ** 2) + jnp.sum(p["b"]), allow_int=True)(params)
  assert grads["i"].dtype == jax.dtypes.float0
  tx = fo.adamw(1e-2, weight_decay=0.1)
  state = tx.init(params)
  if fused:
    params, state = fo.step(tx, grads, state, params)
  else:
    u, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, u)
  _check_untouched(params)
  assert state[0].mu["i"].dtype == jnp.int32
