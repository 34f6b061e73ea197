"""Cautious weight decay: decay only where the update and the parameter agree
in sign; a piece of the decay rate (``weight_decay=fo.cautious(rate)``)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fuseopt.optim as fo
from fuseopt.optim import MuonDimensionNumbers as MDN

SHAPES = {"w": (32, 16), "b": (16,)}
DIMS = {"w": MDN(0, 1), "b": None}


def _tree(seed, scale=1.0):
  keys = jax.random.split(jax.random.key(seed), len(SHAPES))
  return {n: scale * jax.random.normal(k, s) for k, (n, s) in zip(keys, sorted(SHAPES.items()))}


def test_piece_decays_only_where_signs_agree_and_keeps_optaxs_state():
  u = {"x": jnp.array([1.0, -1.0, 1.0, -1.0, 0.0, 2.0])}
  p = {"x": jnp.array([2.0, 2.0, -2.0, -2.0, 3.0, 0.0])}
  tx = fo.add_cautious_decayed_weights(0.5)
  out, _ = tx.update(u, tx.init(p), p)
  # u*p: 2 (decay), -2, -2 (no decay), 2 (decay), 0 and 0 (>= 0: decay)
  np.testing.assert_array_equal(np.asarray(out["x"]), [2.0, -1.0, 1.0, -2.0, 1.5, 2.0])
  sched = optax.linear_schedule(0.1, 0.0, 10)
  for wd in (0.1, sched):
    mine, plain = fo.add_cautious_decayed_weights(wd), optax.add_decayed_weights(wd)
    assert jax.tree.structure(mine.init(p)) == jax.tree.structure(plain.init(p))
  s = fo.add_cautious_decayed_weights(sched).init(p)
  _, s = fo.add_cautious_decayed_weights(sched).update(u, s, p)
  assert int(s.count) == 1


def test_adamw_cautious_unfused_is_the_formula():
  params, grads = _tree(0), _tree(1)
  lr, wd = 1e-2, 0.5
  plain = fo.adamw(lr, weight_decay=wd, moment_dtype=jnp.float32, execution=fo.Execution(implementation="xla"))
  cautious = fo.adamw(lr, weight_decay=fo.cautious(wd), moment_dtype=jnp.float32, execution=fo.Execution(implementation="xla"))
  adam = fo.adam(lr, moment_dtype=jnp.float32, execution=fo.Execution(implementation="xla"))
  ua, _ = adam.update(grads, adam.init(params), params)
  uc, _ = cautious.update(grads, cautious.init(params), params)
  up, _ = plain.update(grads, plain.init(params), params)
  for n in SHAPES:
    direction = -np.asarray(ua[n]) / lr               # Adam's u
    p = np.asarray(params[n])
    mask = direction * p >= 0
    want = -lr * (direction + wd * np.where(mask, p, 0.0))
    np.testing.assert_allclose(np.asarray(uc[n]), want, rtol=1e-5, atol=1e-8)
    assert 0 < mask.mean() < 1   # both cases occur
    # Where the mask holds, cautious and plain agree.
    np.testing.assert_array_equal(np.asarray(uc[n])[mask], np.asarray(up[n])[mask])
  # The state has adamw's structure.
  assert jax.tree.structure(cautious.init(params)) == jax.tree.structure(plain.init(params))


def _rate(c, rate=0.5):
  return fo.cautious(rate) if c else rate


@pytest.mark.parametrize("make", [
    lambda c: fo.adamw(1e-2, weight_decay=_rate(c)),
    lambda c: fo.muon(1e-2, weight_decay=_rate(c), adam_weight_decay=_rate(c),
                      muon_weight_dimension_numbers=DIMS, execution=fo.Execution(newton_schulz=fo.NewtonSchulz(dtype=jnp.float32))),
    lambda c: fo.normuon(1e-2, weight_decay=_rate(c), adam_weight_decay=_rate(c),
                         muon_weight_dimension_numbers=DIMS, execution=fo.Execution(newton_schulz=fo.NewtonSchulz(dtype=jnp.float32))),
], ids=["adamw", "muon", "normuon"])
def test_fused_step_matches_update_and_differs_from_plain_decay(make):
  params, grads = _tree(0), _tree(1)
  tx = make(True)
  step = jax.jit(lambda g, s, p: fo.step(tx, g, s, p))
  new, _ = step(grads, tx.init(params), params)
  u, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  ref = optax.apply_updates(params, u)
  plain = make(False)
  plain_new, _ = jax.jit(lambda g, s, p: fo.step(plain, g, s, p))(grads, plain.init(params), params)
  for n in SHAPES:
    # fp32 Newton-Schulz: the fused pass and update() differ by fp32
    # rounding; where the update is that close to zero, its sign (hence the
    # decay's mask) may differ too.
    close = np.isclose(np.asarray(new[n]), np.asarray(ref[n]), rtol=1e-5, atol=1e-6)
    assert close.mean() >= 0.99, (n, close.mean())
    assert not np.array_equal(np.asarray(new[n]), np.asarray(plain_new[n])), n


@pytest.mark.parametrize("cautious_side", ["muon", "adam"])
def test_each_side_takes_its_own_piece(cautious_side):
  """A cautious rate on one side of the Muon family changes that side only:
  the other side's leaves are bitwise the plain decay's, fused and unfused."""
  params, grads = _tree(0), _tree(1)
  kw = dict(muon_weight_dimension_numbers=DIMS)
  plain = fo.muon(1e-2, weight_decay=0.5, adam_weight_decay=0.5, **kw)
  mixed = fo.muon(1e-2, weight_decay=_rate(cautious_side == "muon"),
                  adam_weight_decay=_rate(cautious_side == "adam"), **kw)
  assert jax.tree.structure(mixed.init(params)) == jax.tree.structure(plain.init(params))
  changed, kept = ("w", "b") if cautious_side == "muon" else ("b", "w")
  for run in (lambda tx: jax.jit(lambda g, s, p: fo.step(tx, g, s, p))(grads, tx.init(params), params)[0],
              lambda tx: optax.apply_updates(params, jax.jit(tx.update)(grads, tx.init(params), params)[0])):
    a, b = run(plain), run(mixed)
    np.testing.assert_array_equal(np.asarray(a[kept]), np.asarray(b[kept]))
    assert not np.array_equal(np.asarray(a[changed]), np.asarray(b[changed]))


def test_inject_hyperparams_keeps_the_piece_static():
  params, grads = _tree(0), _tree(1)
  tx = optax.inject_hyperparams(fo.muon)(learning_rate=1e-2, weight_decay=fo.cautious(0.5),
                                         muon_weight_dimension_numbers=DIMS)
  state = jax.jit(tx.init)(params)
  assert "weight_decay" not in state.hyperparams and "learning_rate" in state.hyperparams
  u, _ = jax.jit(tx.update)(grads, state, params)
  plain = fo.muon(1e-2, weight_decay=fo.cautious(0.5), muon_weight_dimension_numbers=DIMS)
  want, _ = jax.jit(plain.update)(grads, plain.init(params), params)
  plain_decay = fo.muon(1e-2, weight_decay=0.5, muon_weight_dimension_numbers=DIMS)
  other, _ = jax.jit(plain_decay.update)(grads, plain_decay.init(params), params)
  for n in SHAPES:
    # (traced hyperparameters against constants: fp32 rounding apart)
    np.testing.assert_allclose(np.asarray(u[n]), np.asarray(want[n]), rtol=1e-4)
  # The Muon side decays (the AdamW side has adam_weight_decay=0): cautiously.
  assert float(jnp.max(jnp.abs(u["w"] - other["w"]))) > 1e-3


@pytest.mark.parametrize("factory", [fo.adamw, fo.muon, fo.normuon])
def test_a_bad_rate_inside_the_piece_is_refused_by_name(factory):
  with pytest.raises((TypeError, ValueError), match="weight_decay"):
    factory(1e-2, weight_decay=fo.cautious("yes"))
  with pytest.raises(TypeError, match="cautious already"):
    fo.cautious(fo.cautious(0.1))


def test_config_refuses_it_where_there_is_no_decay():
  with pytest.raises(ValueError, match="cautious_weight_decay: optimizer 'adam'"):
    fo.OptimConfig(optimizer="adam", learning_rate=0.1, cautious_weight_decay=True)
  with pytest.raises(ValueError, match="cautious_weight_decay must be a bool"):
    fo.OptimConfig(optimizer="adamw", learning_rate=0.1, cautious_weight_decay=1)


@pytest.mark.parametrize("make", [
    lambda wd: fo.adamw(1e-2, weight_decay=wd),
    lambda wd: fo.muon(1e-2, weight_decay=wd, adam_weight_decay=wd, muon_weight_dimension_numbers=DIMS),
    lambda wd: fo.normuon(1e-2, weight_decay=wd, adam_weight_decay=wd,
                          muon_weight_dimension_numbers=DIMS),
], ids=["adamw", "muon", "normuon"])
def test_a_cautious_zero_rate_is_bitwise_no_decay(make):
  """``cautious(0.0)`` decays nothing: the fused step and ``tx.update`` give
  the plain ``weight_decay=0.0`` run's bits (its kernel variant's select, and
  the products around it, round as the plain step's do)."""
  params = _tree(0)

  def three_steps(tx):
    @jax.jit
    def update(g, s, p):
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s

    out = []
    for run in (jax.jit(lambda g, s, p: fo.step(tx, g, s, p)), update):
      p, s = params, tx.init(params)
      for t in range(3):
        p, s = run(_tree(1 + t), s, p)
        out.append((p, s))
    return jax.device_get(out)

  plain, cautious = three_steps(make(0.0)), three_steps(make(fo.cautious(0.0)))
  for t, (a, b) in enumerate(zip(plain, cautious)):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"run {t}")
