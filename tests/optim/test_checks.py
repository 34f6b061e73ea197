"""Bad hyperparameters raise errors that name the parameter."""

import jax.numpy as jnp
import optax
import pytest

import fuseopt.optim as fo


@pytest.mark.parametrize("make,match", [
    (lambda: fo.adam(-1e-3), "adam: learning_rate must be a finite number >= 0"),
    (lambda: fo.adamw(float("nan")), "adamw: learning_rate"),
    (lambda: fo.adamw(1e-3, weight_decay=-0.1), "adamw: weight_decay"),
    (lambda: fo.adamw(1e-3, b1=1.0), "b1 must be in \\[0, 1\\)"),
    (lambda: fo.scale_by_adam(eps_root=-1.0), "eps_root must be >= 0"),
    (lambda: fo.muon(-0.02), "muon: learning_rate"),
    (lambda: fo.muon(0.02, adam_learning_rate=-1.0), "muon: adam_learning_rate"),
    (lambda: fo.muon(0.02, weight_decay=-1.0), "muon: weight_decay"),
    (lambda: fo.muon(0.02, beta=1.5), "muon: beta must be in \\[0, 1\\)"),
    (lambda: fo.muon(0.02, adam_b2=-0.1), "muon: adam_b2"),
])
def test_bad_hyperparameters_raise(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_schedules_and_zero_rates_are_accepted():
  fo.adamw(optax.linear_schedule(0.0, 1e-3, 10), weight_decay=0.0)
  fo.muon(optax.cosine_decay_schedule(0.02, 100), weight_decay=optax.constant_schedule(0.1))
  tx = fo.adam(0.0)
  params = {"w": jnp.ones((2, 2))}
  updates, _ = tx.update(params, tx.init(params), params)
  assert float(jnp.abs(updates["w"]).max()) == 0.0
