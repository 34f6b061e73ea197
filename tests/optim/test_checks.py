"""Bad hyperparameters raise errors that name the parameter."""

import jax
import jax.numpy as jnp
import numpy as np
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


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("make,error,match", [
    # consistent_rms: a negative value flipped the update's sign, NaN/inf made it non-finite.
    (lambda: fo.normuon(0.02, consistent_rms=-0.2), ValueError, "normuon: consistent_rms must be a finite number > 0"),
    (lambda: fo.normuon(0.02, consistent_rms=NAN), ValueError, "normuon: consistent_rms"),
    (lambda: fo.normuon(0.02, consistent_rms=INF), ValueError, "normuon: consistent_rms"),
    (lambda: fo.muon(0.02, consistent_rms=-0.2), ValueError, "muon: consistent_rms"),
    (lambda: fo.muon(0.02, consistent_rms=0.0), ValueError, "muon: consistent_rms"),
    (lambda: fo.scale_by_muon(consistent_rms=INF), ValueError, "scale_by_muon: consistent_rms"),
    (lambda: fo.muonclip(0.02, consistent_rms=-1.0), ValueError, "muonclip: consistent_rms"),
    (lambda: fo.muon(0.02, adam_eps_root=-1.0), ValueError, "muon: adam_eps_root"),
    # bools: b2=True was taken as 1 and NorMuon did nothing.
    (lambda: fo.normuon(0.02, b2=True), TypeError, "normuon: b2 must be a number, got the bool True"),
    (lambda: fo.adamw(1e-3, b1=True), TypeError, "adamw: b1 must be a number"),
    (lambda: fo.adam(1e-3, eps=False), TypeError, "adam: eps must be a number"),
    (lambda: fo.muon(True), TypeError, "muon: learning_rate must be a number or a schedule"),
    # strings failed at the first update with a TypeError naming nothing.
    (lambda: fo.normuon(0.02, b2="0.5"), TypeError, "normuon: b2 must be a number, got '0.5'"),
    (lambda: fo.normuon(0.02, normuon_eps="1e-8"), TypeError, "normuon: normuon_eps"),
    (lambda: fo.normuon(0.02, consistent_rms="0.2"), TypeError, "normuon: consistent_rms must be a number or None"),
    (lambda: fo.adam("1e-3"), TypeError, "adam: learning_rate"),
    (lambda: fo.adamw(1e-3, weight_decay="0.1"), TypeError, "adamw: weight_decay"),
    (lambda: fo.muon(0.02, beta="0.9"), TypeError, "muon: beta"),
    (lambda: fo.muonclip(0.02, tau="5"), TypeError, "scale_by_qk_clip: tau must be a number"),
    (lambda: fo.muonclip(0.02, tau=True), TypeError, "scale_by_qk_clip: tau"),
    (lambda: fo.adamw(1e-3, b2=jnp.ones(3)), TypeError, "adamw: b2 must be a number"),
    # dtypes: numpy's message named no argument.
    (lambda: fo.normuon(0.02, nu_dtype="bogus"), TypeError, "normuon: nu_dtype must be a dtype"),
    (lambda: fo.normuon(0.02, nu_dtype=jnp.float16), ValueError, "normuon: nu_dtype must be float32, bfloat16 or None"),
    (lambda: fo.adam(1e-3, moment_dtype="bogus"), TypeError, "adam: moment_dtype must be a dtype"),
    (lambda: fo.adamw(1e-3, b2=1.0), ValueError, "adamw: b2 must be in"),
])
def test_every_argument_is_checked_at_construction(make, error, match):
  with pytest.raises(error, match=match):
    make()


def test_schedules_traced_values_and_none_still_pass():
  fo.muon(optax.constant_schedule(0.02), adam_learning_rate=None, consistent_rms=None)
  fo.normuon(0.02, consistent_rms=0.2, b2=np.float32(0.5), nu_dtype="bfloat16")
  fo.adamw(jnp.asarray(1e-3), b1=np.float64(0.9))
  tx = optax.inject_hyperparams(fo.normuon)(learning_rate=0.02, b2=0.9, consistent_rms=0.2)
  params = {"w": jnp.ones((4, 6)), "b": jnp.ones((6,))}
  grads = jax.tree.map(lambda p: p * 0.1, params)
  u, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(u))
