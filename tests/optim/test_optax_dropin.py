"""fuseopt as a drop-in for optax: dtypes the kernels do not cover, eager
mode, inject_hyperparams, apply_updates and the Muon state layout (the
conformance job in tests/conformance runs optax's own tests; these are the
direct checks)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest

import fuseopt.optim as fo

JORDAN = (3.4445, -4.7750, 2.0315)


def _tree(dtype):
  k1, k2 = jax.random.split(jax.random.key(0))
  return {"w": jax.random.normal(k1, (6, 4)).astype(dtype), "b": jax.random.normal(k2, (4,)).astype(dtype)}


def _run(tx, params, steps=3, jit=False):
  state = tx.init(params)
  update = jax.jit(tx.update) if jit else tx.update
  outs = []
  for t in range(steps):
    g = jax.tree.map(lambda p: (jnp.sin(p * (t + 1.5)) * 3).astype(p.dtype), params)
    u, state = update(g, state, params)
    params = optax.apply_updates(params, u)
    outs.append((u, state))
  return params, outs


def _assert_bitwise(a, b, rtol=0.0):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(la, lb):
    assert x.dtype == y.dtype
    if rtol:
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=0)
    else:
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.complex64])
@pytest.mark.parametrize("nesterov", [False, True])
def test_uncovered_dtypes_run_optax_math(dtype, nesterov):
  """float16 and complex leaves keep optax's moment dtypes and its bits,
  whatever moment_dtype says (it applies to float32/bfloat16 leaves)."""
  params = _tree(dtype)
  got = _run(fo.adamw(0.1, nesterov=nesterov), params)
  want = _run(optax.adamw(0.1, nesterov=nesterov), params)
  _assert_bitwise(got, want)


def test_integer_mu_dtype_and_params_behave_as_optax():
  params = {"i": jnp.arange(6, dtype=jnp.int32), "f": jnp.ones(3)}
  got = _run(fo.adam(0.1, moment_dtype=None), params, steps=2)
  want = _run(optax.adam(0.1), params, steps=2)
  # Eagerly optax divides by its bias correction in one small jit over the
  # whole tree, which XLA compiles to within 1 ulp of a per-leaf division.
  _assert_bitwise(got, want, rtol=2e-7)
  p = {"f": jnp.ones(3)}
  got = _run(fo.adam(0.1, mu_dtype=jnp.float16, moment_dtype=None), p, steps=2)
  want = _run(optax.adam(0.1, mu_dtype=jnp.float16), p, steps=2)
  _assert_bitwise(got, want)


def test_mixed_tree_keeps_kernel_seeds_per_leaf_index():
  """A float16 leaf between bf16 leaves does not shift their rounding seeds."""
  mixed = {"a": jnp.ones(5, jnp.bfloat16), "b": jnp.ones(3, jnp.float16), "c": jnp.ones(7, jnp.bfloat16) * 3}
  tx = fo.scale_by_adam(seed=5)
  g = jax.tree.map(lambda x: (x * 0.3001).astype(x.dtype), mixed)
  u_mixed, s_mixed = tx.update(g, tx.init(mixed))
  same = dict(mixed, b=jnp.ones(3, jnp.bfloat16))
  g2 = dict(g, b=g["b"].astype(jnp.bfloat16))
  u_same, s_same = tx.update(g2, tx.init(same))
  for k in "ac":
    np.testing.assert_array_equal(np.asarray(s_mixed.nu[k]), np.asarray(s_same.nu[k]))
    np.testing.assert_array_equal(np.asarray(u_mixed[k]), np.asarray(u_same[k]))
  assert s_mixed.mu["b"].dtype == jnp.float16


@pytest.mark.parametrize("nesterov", [False, True])
def test_fp32_scale_by_adam_is_optax_bitwise_eagerly(nesterov):
  """Not jitted: bias corrections as optax computes them (in a jit; an eager
  ``b ** count`` would take integer_pow and miss by 1e-5 relative)."""
  params = {"w": jax.random.normal(jax.random.key(1), (37, 5))}
  got = _run(fo.scale_by_adam(nesterov=nesterov, moment_dtype=None), params, steps=12)
  want = _run(optax.scale_by_adam(nesterov=nesterov), params, steps=12)
  _assert_bitwise(got, want)


def test_fp32_adam_is_optax_bitwise_jitted():
  params = _tree(jnp.float32)
  _assert_bitwise(_run(fo.adamw(0.01, moment_dtype=None), params, jit=True),
                  _run(optax.adamw(0.01), params, jit=True))


@pytest.mark.parametrize("factory, optax_factory, kwargs, fp32", [
    (fo.adam, optax.adam, {}, {"moment_dtype": None}),
    (fo.adamw, optax.adamw, {"weight_decay": 0.1}, {"moment_dtype": None}),
    (fo.muon, optax.contrib.muon, {"ns_coeffs": JORDAN}, {"ns_dtype": "float32"}),
])
def test_inject_hyperparams_injects_what_optax_injects(factory, optax_factory, kwargs, fp32):
  """fuseopt's extra arguments (moment_dtype, seed, ns_dtype,
  ns_max_elements, implementation) are not injected: the same
  hyperparameters as optax's, and under jit the injected fuseopt follows the
  injected optax as the plain ones follow each other (hyperparameters become
  fp32 arrays, in both)."""
  static = ("ns_steps",) if factory is fo.muon else ()
  params = _tree(jnp.float32)
  g = jax.tree.map(jnp.cos, params)
  for extra in ({}, fp32):
    injected = optax.inject_hyperparams(factory, static_args=static)(
        learning_rate=0.02, **kwargs, **extra)
    reference = optax.inject_hyperparams(optax_factory, static_args=static)(learning_rate=0.02, **kwargs)
    state = jax.jit(injected.init)(params)
    ref_state = jax.jit(reference.init)(params)
    assert set(state.hyperparams) == set(ref_state.hyperparams)
    u, new_state = jax.jit(injected.update)(g, state, params)
    if extra:
      u_ref, ref_new = jax.jit(reference.update)(g, ref_state, params)
      # Muon: fuseopt's NS kernel against optax's iteration, both fp32.
      _assert_bitwise(u, u_ref, rtol=2e-5 if factory is fo.muon else 0.0)
      _assert_bitwise(new_state.inner_state, ref_new.inner_state)
    plain = factory(learning_rate=0.02, **kwargs, **extra)
    u_plain, _ = jax.jit(plain.update)(g, plain.init(params), params)
    for x, y in zip(jax.tree.leaves(u), jax.tree.leaves(u_plain)):
      np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=1e-4)


def test_ns_max_elements_rejects_a_traced_value():
  with pytest.raises(TypeError, match="ns_max_elements.*static_args"):
    fo.scale_by_muon(ns_max_elements=jnp.asarray(4))


def test_apply_updates_without_seed_is_optax():
  params = {"f": jnp.ones(3), "i": jnp.arange(3), "h": jnp.ones(2, jnp.bfloat16), "n": None}
  updates = {"f": jnp.full(3, 0.5), "i": jnp.full(3, 1.7), "h": jnp.full(2, 1e-3, jnp.bfloat16), "n": None}
  _assert_bitwise(fo.apply_updates(params, updates), optax.apply_updates(params, updates))
  assert fo.apply_updates(None, jnp.ones(3)) is None
  assert optax.apply_updates(None, jnp.ones(3)) is None
  # Seeded: integer leaves still add as optax does, None params stay None.
  out = fo.apply_updates(params, updates, seed=1)
  _assert_bitwise(out["i"], optax.apply_updates(params, updates)["i"])
  assert out["n"] is None


@pytest.mark.parametrize("ns_coeffs", [JORDAN, ((4.0, -5.0, 2.0),) * 5, "dion"])
def test_muon_state_is_optax_muon_state(ns_coeffs):
  params = {"w": jnp.ones((4, 6)), "b": jnp.ones(3)}
  ours = fo.scale_by_muon(ns_coeffs=ns_coeffs).init(params)
  optax_coeffs = {"dion": None}.get(ns_coeffs, ns_coeffs) if isinstance(ns_coeffs, str) else ns_coeffs
  assert isinstance(ours, optax.contrib.MuonState)
  assert type(ours) is optax.contrib.MuonState
  if optax_coeffs is not None:
    theirs = optax.contrib.scale_by_muon(ns_coeffs=optax_coeffs).init(params)
    _assert_bitwise(ours, theirs)
  # The hybrid's whole state has optax.contrib.muon's structure and dtypes
  # (fp32 AdamW moments by default), so a checkpoint of one restores into the other.
  if optax_coeffs is not None:
    ours = fo.muon(0.02, ns_coeffs=optax_coeffs, weight_decay=0.1).init(params)
    theirs = optax.contrib.muon(0.02, ns_coeffs=optax_coeffs, weight_decay=0.1).init(params)
    _assert_bitwise(ours, theirs)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.complex64])
def test_muon_uncovered_dtypes_run_optax_iteration(dtype):
  params = {"w": (jax.random.normal(jax.random.key(3), (5, 8)) * (1 + 1j if dtype == jnp.complex64 else 1)).astype(dtype)}
  got = _run(fo.muon(0.02, ns_coeffs=JORDAN), params, steps=2)
  want = _run(optax.contrib.muon(0.02, ns_coeffs=JORDAN), params, steps=2)
  tol = 2e-3 if dtype == jnp.float16 else 1e-5
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert x.dtype == y.dtype
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)
