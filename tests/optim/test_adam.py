"""fuseopt.optim.adam / adamw / scale_by_adam: optax parity, bf16 moment numerics."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fuseopt.optim as fo
from tests.kernels import harness

F32, BF16 = jnp.float32, jnp.bfloat16


def _tree(seed):
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), F32)
  return {
      "embed": normal(50, 24),
      "layers": [{"w": normal(24, 36) * 0.1, "b": normal(36)}, {"w": normal(3, 4, 5)}],
      "scale": jnp.float32(1.5),
      "empty": jnp.zeros((0, 4), F32),
  }


def _grad_steps(params, steps):
  """Gradients of every step, stacked (drawn outside the scanned loop, which
  keeps the compile small)."""
  rng = np.random.default_rng(9)
  return jax.tree.map(lambda p: jnp.asarray(rng.standard_normal((steps,) + p.shape), p.dtype),
                      params)


def _run(tx, params, grads, fused=False):
  def body(carry, g):
    p, s = carry
    if fused:
      p, s = fo.step(tx, g, s, p)
    else:
      u, s = tx.update(g, s, p)
      p = optax.apply_updates(p, u)
    return (p, s), None
  (p, s), _ = jax.lax.scan(body, (params, tx.init(params)), grads)
  return p, s


MASK = {"embed": False, "layers": [{"w": True, "b": False}, {"w": True}], "scale": False,
        "empty": True}
CONFIGS = {
    "adam": lambda f, **kw: f(1e-2, **kw),
    "adam_nesterov_eps_root": lambda f, **kw: f(3e-3, b1=0.8, eps_root=1e-10, nesterov=True, **kw),
    "adamw_mask_schedule": lambda f, **kw: f(optax.cosine_decay_schedule(1e-2, 100), b2=0.99,
                                             weight_decay=0.3, mask=MASK, **kw),
    "adamw_nesterov_callable_mask": lambda f, **kw: f(
        1e-2, weight_decay=optax.linear_schedule(0.1, 0.0, 80), nesterov=True,
        mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p), **kw),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_fp32_moments_match_optax_over_100_steps(name):
  """Both the drop-in (update + apply_updates) and the fused step."""
  optax_fn = optax.adamw if "adamw" in name else optax.adam
  fo_fn = fo.adamw if "adamw" in name else fo.adam
  params = _tree(0)
  grads = _grad_steps(params, 100)
  ref_tx = CONFIGS[name](optax_fn)
  tx = CONFIGS[name](fo_fn, moment_dtype=F32)
  want, drop_in, fused = jax.jit(lambda p, g: (
      _run(ref_tx, p, g), _run(tx, p, g), _run(tx, p, g, fused=True)))(params, grads)
  for label, got in (("update_apply", drop_in), ("step", fused)):
    assert jax.tree.structure(got) == jax.tree.structure(want), label
    # fp32 rounding: XLA may contract or reorder an op differently in the
    # fused expression, and Adam carries such ulps along 100 steps.
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert g.dtype == w.dtype
      harness.assert_close(g, w, rtol=1e-5, atol=1e-6, what=f"{name} {label}")


def test_state_is_optax_layout_with_bf16_moments():
  params = _tree(1)
  params["half"] = jnp.ones((8,), BF16)
  state = fo.adamw(1e-3, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)).init(params)
  ref = optax.adamw(1e-3, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)).init(params)
  assert jax.tree.structure(state) == jax.tree.structure(ref)
  assert isinstance(state[0], optax.ScaleByAdamState)
  assert state[0].count.dtype == jnp.int32
  assert {x.dtype for x in jax.tree.leaves(state[0].mu)} == {jnp.dtype(BF16)}
  assert {x.dtype for x in jax.tree.leaves(state[0].nu)} == {jnp.dtype(BF16)}
  s = fo.scale_by_adam(mu_dtype=F32).init(params)
  assert {x.dtype for x in jax.tree.leaves(s.mu)} == {jnp.dtype(F32)}
  assert {x.dtype for x in jax.tree.leaves(s.nu)} == {jnp.dtype(BF16)}
  s = fo.scale_by_adam(moment_dtype=None).init(params)
  assert s.nu["half"].dtype == BF16 and s.nu["embed"].dtype == F32


def test_nu_keeps_decaying_in_bf16():
  """b2 = 0.999 over 1000 zero-gradient steps: nu must reach 0.999**1000.

  A round-to-nearest bf16 store of 0.999 * 1.0 gives back 1.0 (the step is a
  quarter of an ulp), so nu stalls; the stochastic store decays it in
  expectation."""
  n = 4096
  tx = fo.scale_by_adam(b1=0.9, b2=0.999)
  params = jnp.zeros((n,), F32)
  state = tx.init(params)._replace(nu=jnp.ones((n,), BF16))

  def body(s, _):
    _, s = tx.update(jnp.zeros((n,), F32), s)
    return s, None

  state, _ = jax.jit(lambda s: jax.lax.scan(body, s, None, length=1000))(state)
  nu = np.asarray(state.nu, np.float64)
  want = 0.999 ** 1000
  assert abs(nu.mean() / want - 1) < 0.02, nu.mean()
  rtn = jnp.ones((n,), BF16)
  for _ in range(10):
    rtn = (0.999 * rtn.astype(F32)).astype(BF16)
  assert float(rtn.min()) == 1.0  # the stall the stochastic store avoids


def test_least_squares_bf16_trajectory_stays_close_to_fp32():
  """1000 Adam steps on min ||A x - y||^2: bf16 moments end within 2% of the
  fp32 run's loss and within 2e-2 (max abs) of its solution."""
  ka, kx, ky = jax.random.split(jax.random.key(2), 3)
  a = jax.random.normal(ka, (128, 32), F32)
  y = a @ jax.random.normal(kx, (32,), F32) + 0.1 * jax.random.normal(ky, (128,), F32)
  loss = lambda x: jnp.mean((a @ x - y) ** 2)

  def train(moment_dtype):
    tx = fo.adam(optax.exponential_decay(3e-2, 1000, 0.1), moment_dtype=moment_dtype)
    x = jnp.zeros((32,), F32)

    def body(c, _):
      x, s = c
      x, s = fo.step(tx, jax.grad(loss)(x), s, x)
      return (x, s), loss(x)
    (x, _), losses = jax.lax.scan(body, (x, tx.init(x)), None, length=1000)
    return x, losses

  x32, l32 = jax.jit(lambda: train(F32))()
  x16, l16 = jax.jit(lambda: train(BF16))()
  assert float(l32[-1]) < 0.05 * float(l32[0])   # it did converge
  assert abs(float(l16[-1]) / float(l32[-1]) - 1) < 0.02, (l16[-1], l32[-1])
  assert float(jnp.max(jnp.abs(x16 - x32))) < 2e-2


def test_mixed_dtype_tree_runs_and_keeps_dtypes():
  params = {"w": jnp.ones((16, 8), BF16), "b": jnp.zeros((8,), F32), "s": jnp.float32(2.0)}
  grads = {"w": jnp.full((16, 8), 0.5, BF16), "b": jnp.ones((8,), F32), "s": jnp.float32(1.0)}
  tx = fo.adamw(1e-2, weight_decay=0.0)
  state = tx.init(params)
  u, state2 = jax.jit(tx.update)(grads, state, params)
  assert u["w"].dtype == BF16 and u["b"].dtype == F32
  # First Adam step: the direction is sign(g) (|m_hat| / sqrt(v_hat) = 1).
  np.testing.assert_allclose(np.asarray(u["b"]), -1e-2, rtol=1e-5)
  p2, s3 = jax.jit(fo.step, static_argnums=0)(tx, grads, state, params)
  assert jax.tree.map(lambda x: x.dtype, p2) == jax.tree.map(lambda x: x.dtype, params)
  assert int(s3[0].count) == 1


def test_public_names_resolve_to_the_functions():
  import fuseopt.optim.adam_transforms  # noqa: F401  (the module's name must not shadow the function)
  params = {"w": jnp.ones((4,), F32)}
  tx = fo.adam(1e-3)
  assert callable(fo.adam) and fo.adam.__module__ == "fuseopt.optim.adam_transforms"
  assert hasattr(tx, "fuseopt_adam") and tx.init(params)[0].mu["w"].dtype == BF16
  assert isinstance(fo.bf16_moments(), optax.GradientTransformation)


def test_bad_arguments_are_named():
  with pytest.raises(ValueError, match="moment_dtype"):
    fo.scale_by_adam(moment_dtype=jnp.float16)
  with pytest.raises(ValueError, match="b2 must be in"):
    fo.adamw(1e-3, b2=1.5)
  with pytest.raises(ValueError, match="eps must be"):
    fo.adam(1e-3, eps=-1.0)
