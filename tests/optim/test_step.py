"""fuseopt.optim.step: fused path vs update+apply, fallback, donation, sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fuseopt.optim as fo
from fuseopt.kernels import counter_hash, stochastic_round_bf16
from tests.kernels import harness

F32, BF16 = jnp.float32, jnp.bfloat16


def _tree(seed, dtype=F32):
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
  return {"a": normal(64, 48), "b": normal(16, 8, 24), "c": normal(40), "d": normal()}


def _step_jit(donate=False):
  return jax.jit(fo.step, static_argnums=0, donate_argnums=(2, 3) if donate else ())


def test_fused_step_equals_update_then_apply():
  """Same moment bits (same rounding seeds), params equal to fp32 rounding."""
  params, grads = _tree(0), _tree(1)
  tx = fo.adamw(optax.linear_schedule(1e-2, 1e-3, 10), weight_decay=0.05,
                mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p), seed=3)
  s0 = tx.init(params)

  @jax.jit
  def drop_in(g, s, p):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  p1, s1 = params, s0
  p2, s2 = params, s0
  for _ in range(3):
    p1, s1 = drop_in(grads, s1, p1)
    p2, s2 = _step_jit()(tx, grads, s2, p2)
  assert jax.tree.structure(s1) == jax.tree.structure(s2)
  for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2)):
    harness.assert_bitwise_equal(a, b, "state")
  for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
    harness.assert_close(a, b, rtol=1e-6, atol=1e-7, what="params")


@pytest.mark.parametrize("make_tx", [
    lambda: optax.sgd(0.1, momentum=0.9),
    lambda: optax.adamw(1e-3),
    lambda: optax.chain(optax.clip_by_global_norm(1.0), fo.adamw(1e-3)),
], ids=("sgd", "optax_adamw", "chained_fuseopt_adamw"))
def test_other_transforms_fall_back_to_update_and_apply(make_tx):
  tx = make_tx()
  params, grads = _tree(2), _tree(3)
  state = tx.init(params)

  @jax.jit
  def manual(g, s, p):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  want_p, want_s = manual(grads, state, params)
  got_p, got_s = _step_jit()(tx, grads, state, params)
  for a, b in zip(jax.tree.leaves((got_p, got_s)), jax.tree.leaves((want_p, want_s))):
    harness.assert_bitwise_equal(a, b)


def test_donated_step_updates_in_place_and_advances_schedules():
  params, grads = _tree(4), _tree(5)
  tx = fo.adamw(optax.constant_schedule(1e-3), weight_decay=optax.constant_schedule(0.1),
                mask={"a": True, "b": True, "c": False, "d": False})
  state = tx.init(params)
  ref_p, ref_s = _step_jit()(tx, grads, state, params)
  ptr = params["a"].unsafe_buffer_pointer()
  new_p, new_s = _step_jit(donate=True)(tx, grads, state, params)
  assert params["a"].is_deleted()
  assert new_p["a"].unsafe_buffer_pointer() == ptr
  for a, b in zip(jax.tree.leaves((new_p, new_s)), jax.tree.leaves((ref_p, ref_s))):
    harness.assert_bitwise_equal(a, b)
  counts = [x for x in jax.tree.leaves(new_s) if x.dtype == jnp.int32]
  assert [int(c) for c in counts] == [1] * len(counts) and len(counts) == 3


def test_bf16_params_and_grads_step_rounds_params_stochastically():
  """14 B/param path: bf16 p and g. The new p is the stochastic rounding of
  the fp32 update with the param stream's seed, so updates far below half a
  bf16 ulp still move the parameters on average."""
  n = 1 << 14
  params = {"w": jnp.ones((n,), BF16)}
  grads = {"w": jnp.ones((n,), BF16)}
  lr = 2 ** -12  # a quarter of the bf16 ulp at 1.0 (2**-7 above 1, 2**-8 below)
  tx = fo.adam(lr, seed=5)
  new_p, new_s = jax.jit(fo.step, static_argnums=0)(tx, grads, tx.init(params), params)
  assert new_p["w"].dtype == BF16 and new_s[0].mu["w"].dtype == BF16
  # First step: direction exactly sign(g)=1 up to eps, so p32 = 1 - lr.
  want = stochastic_round_bf16(jnp.full((n,), 1.0, F32) - lr * (1 / (1 + 1e-8)),
                               counter_hash.derive_seed(5, 1, 0, counter_hash.STREAM_PARAM))
  harness.assert_bitwise_equal(new_p["w"], want)
  mean = float(jnp.mean(new_p["w"].astype(F32)))
  # p(round down) = 1/16 a element: the mean's std is 0.03 lr; 5 sigma.
  assert abs(mean - (1 - lr)) < 0.15 * lr, mean
  rtn = (jnp.ones((n,), F32) - lr).astype(BF16)
  assert float(rtn.min()) == 1.0  # round-to-nearest would not move at all


@pytest.mark.parametrize("moment_dtype", (BF16, F32))
def test_sharded_step_is_bitwise_the_unsharded_step(moment_dtype):
  """params and state sharded over 8 CPU devices (several layouts): the xla
  path builds each rounding's counter from the global per-leaf index, so the
  result is bitwise the single-device one."""
  assert jax.device_count() >= 8
  mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  specs = {"a": P("x", "y"), "b": P(None, "y", "x"), "c": P(("x", "y")), "d": P()}
  params, grads = _tree(6), _tree(7)
  tx = fo.adamw(1e-2, weight_decay=0.1, moment_dtype=moment_dtype, seed=11)
  state = tx.init(params)
  step = _step_jit()
  p1, s1 = step(tx, grads, state, params)
  p1, s1 = step(tx, grads, s1, p1)

  def shard(tree):
    return {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in tree.items()}

  sp, sg = shard(params), shard(grads)
  ss = jax.tree.map(lambda x: x, tx.init(sp))
  ss = (ss[0]._replace(mu=shard(ss[0].mu), nu=shard(ss[0].nu)),) + tuple(ss[1:])
  p2, s2 = step(tx, sg, ss, sp)
  p2, s2 = step(tx, sg, s2, p2)
  assert len(p2["a"].sharding.device_set) == 8
  for a, b in zip(jax.tree.leaves((p1, s1)), jax.tree.leaves((p2, s2))):
    harness.assert_bitwise_equal(a, b, "sharded vs unsharded")


def test_step_rejects_a_traced_mask():
  params, grads = _tree(8), _tree(9)
  tx = fo.adamw(1e-3, mask=lambda p: jax.tree.map(lambda x: jnp.asarray(x.ndim > 1), p))
  state = tx.init(params)
  with pytest.raises(TypeError, match="mask must hold Python bools"):
    jax.jit(fo.step, static_argnums=0)(tx, grads, state, params)


@pytest.mark.parametrize("target", harness.TARGETS, ids=harness.TARGET_IDS)
@pytest.mark.parametrize("group", (True, False))
def test_step_lowers_to_in_place_kernels_on_accelerators(target, group):
  """On a GPU/TPU the fused step calls the Pallas kernel, writing in place."""
  s = lambda *shape, dt=F32: jax.ShapeDtypeStruct(shape, dt)
  params = {"a": s(256, 384), "b": s(1024, dt=BF16), "c": s(37)}
  tx = fo.adamw(optax.linear_schedule(1e-3, 0.0, 100), weight_decay=0.1, nesterov=True)
  state = jax.eval_shape(tx.init, params)
  grads = jax.tree.map(lambda x: s(*x.shape, dt=BF16), params)
  text = harness.lower_for(target, lambda p, st, g: fo.step(tx, g, st, p, group=group),
                           params, state, grads)
  calls = text.count("tpu_custom_call") if target.platform == "tpu" else text.count("__gpu$xla.gpu.triton")
  # TPU: one kernel per leaf, grouped or not; the 37-element leaf is not a
  # multiple of 128 and runs the reference. GPU: grouped, the two fp32 leaves
  # share a launch and the bf16 one has its own; else one launch per leaf.
  assert calls == (2 if target.platform == "tpu" or group else 3), calls
  assert "output_operand_aliases" in text
