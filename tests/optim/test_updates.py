"""fuseopt.optim.apply_updates: stochastic rounding for bf16 params."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fuseopt
from fuseopt.kernels import counter_hash


def test_fp32_leaves_get_a_plain_add_like_optax():
  params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
  updates = jax.tree.map(lambda p: 0.1 * jnp.ones_like(p), params)
  got = fuseopt.optim.apply_updates(params, updates, seed=0)
  want = optax.apply_updates(params, updates)
  jax.tree.map(np.testing.assert_array_equal, got, want)


def test_bf16_leaves_round_stochastically_and_keep_dtype():
  p = jnp.ones((4096,), jnp.bfloat16)
  u = jnp.full((4096,), 2.0**-10, jnp.float32)  # 1/8 ulp: round-to-nearest never moves p
  assert (optax.apply_updates(p, u.astype(jnp.bfloat16)) == 1.0).all()
  out = fuseopt.optim.apply_updates({"p": p}, {"p": u}, seed=3)["p"]
  assert out.dtype == jnp.bfloat16
  moved = float(jnp.mean(out.astype(jnp.float32) == 1.0078125))
  assert 0.08 < moved < 0.17  # P(up) = 1/8
  # the bits are those of stochastic_round_bf16 with leaf 0's derived seed
  seed = counter_hash.derive_seed(3, 0, 0, counter_hash.STREAM_PARAM)
  want = fuseopt.kernels.stochastic_round_bf16(p.astype(jnp.float32) + u, seed)
  np.testing.assert_array_equal(np.asarray(out.view(jnp.uint16)), np.asarray(want.view(jnp.uint16)))


def test_expected_trajectory_follows_tiny_updates():
  p = jnp.zeros((8192,), jnp.bfloat16) + 1.0
  step = jax.jit(lambda p, s: fuseopt.optim.apply_updates(p, jnp.full(p.shape, 1e-4), seed=s))
  for s in range(100):
    p = step(p, s)
  mean = float(jnp.mean(p.astype(jnp.float32)))
  assert abs(mean - 1.01) < 1e-3, mean  # round-to-nearest would stay at 1.0


def test_errors_and_none_updates():
  params = {"a": jnp.ones(3), "b": jnp.ones(2)}
  out = fuseopt.optim.apply_updates(params, {"a": None, "b": jnp.ones(2)}, seed=0)
  assert (out["a"] == 1).all() and (out["b"] == 2).all()
  with pytest.raises(ValueError, match="shape"):
    fuseopt.optim.apply_updates(params, {"a": jnp.ones(4), "b": jnp.ones(2)}, seed=0)
  with pytest.raises(TypeError, match="seed"):
    fuseopt.optim.apply_updates(params, params, seed=0.5)
