"""NorMuon: the per-neuron normalisation of Muon's orthogonalised update."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fuseopt.optim as fo
from fuseopt.optim import MuonDimensionNumbers as MDN

DIMS = {"w": MDN(0, 1), "stack": MDN(1, 2), "t": MDN(1, 0), "b": None}
SHAPES = {"w": (64, 32), "stack": (3, 16, 24), "t": (40, 48), "b": (32,)}


def _tree(seed):
  keys = jax.random.split(jax.random.key(seed), len(SHAPES))
  return {n: jax.random.normal(k, s) for k, (n, s) in zip(keys, sorted(SHAPES.items()))}


def _neuron_axes(name):
  """(reduction axes, output axes) of a leaf."""
  d = DIMS[name]
  return (d.reduction_axis,), (d.output_axis,)


def _reference_normuon(o_steps, b2, eps):
  """The paper's math on each step's orthogonalised matrix (numpy, fp64),
  for one 2-D (rows = fan-in, cols = fan-out) matrix."""
  v = np.zeros(o_steps[0].shape[1])
  out = []
  for o in o_steps:
    o = np.asarray(o, np.float64)
    v = b2 * v + (1 - b2) * np.mean(o * o, axis=0)
    hat = o / (np.sqrt(v) + eps)
    out.append(hat * np.sqrt(min(o.shape)) / np.linalg.norm(hat))
  return out


def test_direction_is_muons_normalised_per_neuron_over_steps():
  """scale_by_normuon's direction equals the paper's normalisation applied to
  scale_by_muon's (same momentum, same NS), step after step."""
  params = {"w": _tree(0)["w"]}
  dims = {"w": MDN(0, 1)}
  muon = fo.scale_by_muon(weight_dimension_numbers=dims,
                          execution=fo.Execution(implementation='xla', newton_schulz=fo.NewtonSchulz(dtype=jnp.float32)))
  nor = fo.scale_by_normuon(weight_dimension_numbers=dims, b2=0.9, execution=fo.Execution(implementation='xla', newton_schulz=fo.NewtonSchulz(dtype=jnp.float32)))
  sm, sn = muon.init(params), nor.init(params)
  os_, got = [], []
  for t in range(4):
    g = {"w": _tree(t + 1)["w"]}
    um, sm = jax.jit(muon.update)(g, sm, params)
    un, sn = jax.jit(nor.update)(g, sn, params)
    os_.append(um["w"])
    got.append(un["w"])
  want = _reference_normuon(os_, 0.9, 1e-8)
  for t, (a, b) in enumerate(zip(got, want)):
    np.testing.assert_allclose(np.asarray(a), b, rtol=2e-5, atol=1e-7, err_msg=f"step {t}")
  assert sn.nu["w"].shape == (32,) and sn.nu["w"].dtype == jnp.float32
  assert int(sn.count) == 4


def test_b2_zero_gives_every_neuron_the_same_rms():
  params, grads = _tree(0), _tree(1)
  tx = fo.scale_by_normuon(weight_dimension_numbers=DIMS, b2=0.0)
  u, _ = tx.update(grads, tx.init(params), params)
  for name in ("w", "stack", "t"):
    red, out = _neuron_axes(name)
    x = np.asarray(u[name], np.float64)
    rms = np.sqrt(np.mean(x * x, axis=red))          # one per neuron (and batch index)
    assert rms.shape == tuple(d for a, d in enumerate(x.shape) if a not in red)
    np.testing.assert_allclose(rms, np.broadcast_to(rms.reshape(-1)[0], rms.shape), rtol=1e-5,
                               err_msg=name)
    # ... and the matrix has an orthogonal matrix's Frobenius norm.
    rows, cols = x.shape[red[0]], x.shape[out[0]]
    np.testing.assert_allclose(rms.reshape(-1)[0], np.sqrt(min(rows, cols) / (rows * cols)),
                               rtol=1e-5, err_msg=name)


def test_state_layout_per_neuron_and_dtypes():
  params = _tree(0)
  state = fo.scale_by_normuon(weight_dimension_numbers=DIMS).init(params)
  assert isinstance(state, fo.NorMuonState)
  assert {n: v.shape for n, v in state.nu.items()} == {
      "w": (32,), "stack": (3, 24), "t": (40,), "b": (0,)}
  assert all(v.dtype == jnp.float32 for v in state.nu.values())
  bf = fo.scale_by_normuon(weight_dimension_numbers=DIMS, nu_dtype=jnp.bfloat16).init(params)
  assert all(v.dtype == jnp.bfloat16 for v in bf.nu.values())
  # In normuon() the AdamW leaves are masked out of the Muon branch's state.
  full = fo.normuon(0.02, muon_weight_dimension_numbers=DIMS).init(params)
  inner = full.inner_states["muon"].inner_state[0]
  assert isinstance(inner, fo.NorMuonState)
  assert isinstance(inner.nu["b"], optax.MaskedNode) and inner.nu["w"].shape == (32,)


@pytest.mark.parametrize("nu_dtype", [None, jnp.bfloat16])
def test_fused_step_matches_update_and_apply_updates(nu_dtype):
  params = _tree(0)
  tx = fo.normuon(0.02, muon_weight_dimension_numbers=DIMS, weight_decay=0.1, nu_dtype=nu_dtype, execution=fo.Execution(newton_schulz=fo.NewtonSchulz(dtype=jnp.float32)))
  s_ref = s_fused = tx.init(params)
  p_ref = p_fused = params
  step = jax.jit(lambda g, s, p: fo.step(tx, g, s, p))
  for t in range(3):
    g = _tree(t + 1)
    u, s_ref = jax.jit(tx.update)(g, s_ref, p_ref)
    p_ref = optax.apply_updates(p_ref, u)
    p_fused, s_fused = step(g, s_fused, p_fused)
  for a, b in zip(jax.tree.leaves(p_ref), jax.tree.leaves(p_fused)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5)
  nu_ref = s_ref.inner_states["muon"].inner_state[0].nu
  nu_fused = s_fused.inner_states["muon"].inner_state[0].nu
  for a, b in zip(jax.tree.leaves(nu_ref), jax.tree.leaves(nu_fused)):
    assert a.dtype == b.dtype
    np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray(a, np.float32),
                               rtol=2e-2 if nu_dtype else 1e-4)


def test_experts_keep_a_frozen_matrix_second_moment():
  params = {"e": jax.random.normal(jax.random.key(0), (4, 16, 8))}
  dims = {"e": fo.Experts(MDN(1, 2))}
  tx = fo.scale_by_normuon(weight_dimension_numbers=dims)
  state = tx.init(params)
  g = {"e": jax.random.normal(jax.random.key(1), (4, 16, 8))}
  _, state = tx.update(g, state, params)
  g2 = {"e": g["e"].at[2].set(0.0)}   # expert 2 got no token
  u, state2 = tx.update(g2, state, params)
  np.testing.assert_array_equal(np.asarray(state2.nu["e"][2]), np.asarray(state.nu["e"][2]))
  assert not np.array_equal(np.asarray(state2.nu["e"][0]), np.asarray(state.nu["e"][0]))
  assert float(jnp.max(jnp.abs(u["e"][2]))) == 0.0


@pytest.mark.parametrize("kwargs, match", [
    (dict(b2=1.0), "b2 must be in \\[0, 1\\)"),
    (dict(b2=-0.1), "b2 must be in \\[0, 1\\)"),
    (dict(normuon_eps=-1e-8), "normuon_eps must be >= 0"),
    (dict(nu_dtype=jnp.float16), "nu_dtype must be float32, bfloat16 or None"),
])
def test_bad_hyperparameters_are_refused_by_name(kwargs, match):
  with pytest.raises(ValueError, match=match):
    fo.normuon(0.02, **kwargs)
  with pytest.raises(ValueError, match=match):
    fo.scale_by_normuon(**kwargs)


def test_builder_normuon_from_yaml():
  cfg = fo.OptimConfig.from_yaml("""
optimizer: normuon
learning_rate: 0.02
weight_decay: 0.1
normuon_b2: 0.9
cautious_weight_decay: true
muon_patterns: ["w", "stack"]
""")
  assert cfg.normuon_b2 == 0.9
  assert fo.OptimConfig.from_yaml(cfg.to_yaml()) == cfg
  params = _tree(0)
  tx = fo.build_optimizer(cfg, steps=10)
  state = tx.init(params)
  new, state = jax.jit(lambda g, s, p: fo.step(tx, g, s, p))(_tree(1), state, params)
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(new))
  nus = [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, fo.NorMuonState))
         if isinstance(s, fo.NorMuonState)]
  assert len(nus) == 1 and nus[0].nu["w"].shape == (32,)
  with pytest.raises(ValueError, match="normuon_b2: only for optimizer 'normuon'"):
    fo.OptimConfig(optimizer="muon", learning_rate=0.1, normuon_b2=0.9)
  with pytest.raises(ValueError, match="normuon_b2 must be a number in \\[0, 1\\)"):
    fo.OptimConfig(optimizer="normuon", learning_rate=0.1, normuon_b2=1.5)
