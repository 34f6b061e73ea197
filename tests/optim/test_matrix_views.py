"""Matrix views, tied parameters and inactive (unrouted) expert slices."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fuseopt.optim as fo
from fuseopt.optim.matrix_views import MatrixViews, mla_kv_b_proj_views
from fuseopt.optim.muon_transforms import MuonDimensionNumbers as MDN
from fuseopt.optim.execution import Execution
from fuseopt.optim.muon_settings import NewtonSchulz
from fuseopt.optim.muon_transforms import muon, scale_by_muon
from fuseopt.optim.normuon_transforms import normuon

F32 = dict(execution=Execution(implementation="xla", newton_schulz=NewtonSchulz(dtype=jnp.float32)),
           ns_coeffs="jordan")


def _muon_update(params, grads, dims, **kw):
  tx = muon(learning_rate=1.0, muon_weight_dimension_numbers=dims, **F32, **kw)
  u, state = jax.jit(tx.update)(grads, tx.init(params), params)
  return u, state


def _close(a, b, tol=1e-5):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def test_packed_batch_axis_equals_separate_halves():
  """gate/up packed as (2, rows, cols): the leading axis is a batch axis."""
  g = jax.random.normal(jax.random.key(0), (2, 16, 40))
  u, state = _muon_update({"gu": g}, {"gu": g}, {"gu": MDN(1, 2)})
  sep, _ = _muon_update({"gate": g[0], "up": g[1]}, {"gate": g[0], "up": g[1]},
                        {"gate": MDN(), "up": MDN()})
  _close(u["gu"][0], sep["gate"])
  _close(u["gu"][1], sep["up"])
  assert state.inner_states["muon"].inner_state[0].mu["gu"].shape == (2, 16, 40)


def test_concatenated_views_equal_separate_matrices():
  """[gate | up] concatenated along the output axis, unequal widths too."""
  g = jax.random.normal(jax.random.key(1), (16, 24 + 40))
  spec = MatrixViews(MDN(0, 1), axis=1, sizes=(24, 40))
  u, state = _muon_update({"w": g}, {"w": g}, {"w": spec})
  sep, _ = _muon_update({"a": g[:, :24], "b": g[:, 24:]}, {"a": g[:, :24], "b": g[:, 24:]},
                        {"a": MDN(), "b": MDN()})
  _close(u["w"], jnp.concatenate([sep["a"], sep["b"]], axis=1))
  # One stored tensor, one momentum leaf of its shape.
  assert state.inner_states["muon"].inner_state[0].mu["w"].shape == g.shape
  # Whole-matrix Muon differs: the views really are orthogonalised apart.
  whole, _ = _muon_update({"w": g}, {"w": g}, {"w": MDN()})
  assert float(jnp.max(jnp.abs(whole["w"] - u["w"]))) > 1e-2


def test_mla_kv_b_proj_per_head_key_and_value_views():
  heads, dk, dv, lora = 3, 8, 12, 16
  g = jax.random.normal(jax.random.key(2), (lora, heads * (dk + dv)))
  params = {"kv_b_proj": g, "kv_a_proj": jax.random.normal(jax.random.key(3), (32, lora))}
  dims = {"kv_b_proj": mla_kv_b_proj_views(heads, dk, dv), "kv_a_proj": MDN()}
  u, _ = _muon_update(params, params, dims)
  blocks = g.reshape(lora, heads, dk + dv)
  sep_p = {f"k{h}": blocks[:, h, :dk] for h in range(heads)}
  sep_p.update({f"v{h}": blocks[:, h, dk:] for h in range(heads)})
  sep_p["kv_a_proj"] = params["kv_a_proj"]
  sep, _ = _muon_update(sep_p, sep_p, jax.tree.map(lambda _: MDN(), sep_p))
  want = jnp.stack([jnp.concatenate([sep[f"k{h}"], sep[f"v{h}"]], axis=1) for h in range(heads)], axis=1)
  _close(u["kv_b_proj"], want.reshape(lora, -1))
  _close(u["kv_a_proj"], sep["kv_a_proj"])  # the shared latent projection stays whole


def test_views_on_a_stacked_multi_axis_leaf():
  """Views compose with batch axes and multi-axis sides: (layers, d, heads, k+v)."""
  L, d, heads, dk, dv = 2, 16, 2, 4, 6
  g = jax.random.normal(jax.random.key(4), (L, d, heads * (dk + dv)))
  spec = MatrixViews(MDN(1, 2), axis=2, sizes=(dk, dv), groups=heads)
  tx = scale_by_muon(weight_dimension_numbers={"w": spec}, **F32)
  u, _ = tx.update({"w": g}, tx.init({"w": g}))
  blocks = g.reshape(L, d, heads, dk + dv)
  ref = scale_by_muon(weight_dimension_numbers=MDN(1, 2), **F32)
  for part in (slice(0, dk), slice(dk, dk + dv)):
    x = jnp.moveaxis(blocks[..., part], 2, 0)  # (heads, L, d, size)
    want, _ = ref.update(x.reshape(heads * L, d, -1), ref.init(x.reshape(heads * L, d, -1)))
    got = jnp.moveaxis(u["w"].reshape(L, d, heads, dk + dv)[..., part], 2, 0)
    _close(got.reshape(heads * L, d, -1), want)


def _normuon_steps(params, grads, dims, n=2):
  tx = normuon(learning_rate=1.0, muon_weight_dimension_numbers=dims, **F32)
  state = tx.init(params)
  for _ in range(n):
    u, state = jax.jit(tx.update)(grads, state, params)
  return u, state.inner_states["muon"].inner_state[0].nu


@pytest.mark.parametrize("side", ["output", "reduction"])
def test_normuon_views_are_separate_matrices_with_their_own_second_moments(side):
  """NorMuon on a packed leaf: each view is normalised as the matrix it is,
  with one second moment per output neuron of each view. Views cut the
  output axis: ``nu`` has the leaf's columns (each belongs to one view);
  views cut the reduction axis: ``nu`` keeps that axis, one entry per view."""
  axis = 1 if side == "output" else 0
  g = jax.random.normal(jax.random.key(7), (24 + 40, 48) if axis == 0 else (48, 24 + 40))
  a, b = jnp.split(g, [24], axis=axis)
  spec = MatrixViews(MDN(0, 1), axis=axis, sizes=(24, 40))
  u, nu = _normuon_steps({"w": g}, {"w": g}, {"w": spec})
  sep, sep_nu = _normuon_steps({"a": a, "b": b}, {"a": a, "b": b}, {"a": MDN(), "b": MDN()})
  _close(u["w"], jnp.concatenate([sep["a"], sep["b"]], axis=axis))
  if side == "output":
    assert nu["w"].shape == (64,)
    _close(nu["w"], jnp.concatenate([sep_nu["a"], sep_nu["b"]]))
  else:
    assert nu["w"].shape == (2, 48)
    _close(nu["w"], jnp.stack([sep_nu["a"], sep_nu["b"]]))
  # The whole leaf as one matrix gives another update: the views really are apart.
  whole, _ = _normuon_steps({"w": g}, {"w": g}, {"w": MDN()})
  assert float(jnp.max(jnp.abs(whole["w"] - u["w"]))) > 1e-2


def test_bad_views_raise():
  g = {"w": jnp.ones((8, 10))}
  tx = scale_by_muon(weight_dimension_numbers={"w": MatrixViews(MDN(), axis=1, sizes=(4, 4))})
  with pytest.raises(ValueError, match=r"\['w'\].*groups\*sum\(sizes\)"):
    tx.update(g, tx.init(g))
  tx = scale_by_muon(weight_dimension_numbers={"w": MatrixViews(MDN((0,), (1,)), axis=2, sizes=(5, 5))})
  with pytest.raises(ValueError, match="axis"):
    tx.update(g, tx.init(g))


def test_tied_embedding_is_one_parameter_with_one_state():
  """Tying = one leaf used twice; its gradient sums both uses, one state."""
  V, D = 24, 16
  k = jax.random.split(jax.random.key(5), 3)
  params = {"embed": jax.random.normal(k[0], (V, D)) * 0.1,
            "mlp": jax.random.normal(k[1], (D, D)) * 0.1}
  tokens = jax.random.randint(k[2], (10,), 0, V)

  def loss(p):
    h = jnp.tanh(p["embed"][tokens] @ p["mlp"])
    logits = h @ p["embed"].T  # the LM head is the embedding
    return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[jnp.arange(10), tokens])

  grads = jax.grad(loss)(params)
  dims = {"embed": None, "mlp": MDN()}
  tx = muon(learning_rate=0.1, muon_weight_dimension_numbers=dims, **F32)
  state = tx.init(params)
  adam_state = state.inner_states["adam"].inner_state[0]
  assert len(jax.tree.leaves(adam_state.mu)) == 1 and adam_state.mu["embed"].shape == (V, D)
  u, _ = jax.jit(tx.update)(grads, state, params)
  ref = optax.contrib.muon(learning_rate=0.1, ns_coeffs=(3.4445, -4.7750, 2.0315),
                           muon_weight_dimension_numbers={"embed": None, "mlp": optax.contrib.MuonDimensionNumbers()})
  ur, _ = jax.jit(ref.update)(grads, ref.init(params), params)
  _close(u["embed"], ur["embed"])
  _close(u["mlp"], ur["mlp"], tol=1e-4)


def test_inactive_expert_keeps_momentum_and_gets_no_decay():
  E, D, F = 4, 16, 24
  k = jax.random.split(jax.random.key(6), 4)
  params = {"experts": {"w_in": jax.random.normal(k[0], (E, D, F))},  # axes ('exp', 'embed', 'mlp')
            "router": jax.random.normal(k[1], (D, E))}
  dims = {"experts": {"w_in": MDN(1, 2)}, "router": None}
  kw = dict(learning_rate=0.1, weight_decay=0.5, muon_weight_dimension_numbers=dims, **F32)
  g1 = {"experts": {"w_in": jax.random.normal(k[2], (E, D, F))}, "router": jnp.ones((D, E))}
  g2 = {"experts": {"w_in": jax.random.normal(k[3], (E, D, F)).at[1].set(0.0)},
        "router": jnp.ones((D, E))}

  def run(skip):
    tx = muon(**kw) if not skip else muon(**{**kw, "muon_weight_dimension_numbers": {
        "experts": {"w_in": fo.Experts(MDN(1, 2))}, "router": None}})
    up = jax.jit(tx.update)
    s = tx.init(params)
    _, s1 = up(g1, s, params)
    u2, s2 = up(g2, s1, params)
    mu = lambda s: s.inner_states["muon"].inner_state[0].mu["experts"]["w_in"]
    return u2["experts"]["w_in"], mu(s1), mu(s2)

  u, mu1, mu2 = run(True)
  u_all, _, mu2_all = run(False)
  assert bool(jnp.all(u[1] == 0))                 # no update, no weight decay
  assert bool(jnp.all(mu2[1] == mu1[1]))          # momentum untouched
  assert float(jnp.max(jnp.abs(mu2_all[1] - mu1[1]))) > 0  # (optax's rule decays it)
  assert float(jnp.max(jnp.abs(u_all[1]))) > 0
  for e in (0, 2, 3):                             # active experts: the plain rule, decay included
    _close(u[e], u_all[e])
    _close(mu2[e], mu2_all[e])


@pytest.mark.parametrize("declared", ["tree", "callable"])
def test_experts_fused_step_freezes_the_inactive_expert_and_keeps_optaxs_state(declared):
  """fo.Experts on one leaf, given as a tree or by a callable: the fused step
  leaves the unrouted expert's weight and momentum bitwise as they were, is
  update + apply_updates elsewhere, and the state has optax's structure."""
  E, D, F = 4, 16, 24
  k = jax.random.split(jax.random.key(7), 4)
  params = {"experts": jax.random.normal(k[0], (E, D, F)), "dense": jax.random.normal(k[1], (D, F)),
            "norm": jnp.ones((F,))}
  specs = {"experts": fo.Experts(MDN(1, 2)), "dense": MDN(0, 1), "norm": None}
  dims = specs if declared == "tree" else (lambda p: specs)
  tx = muon(learning_rate=0.1, weight_decay=0.5, muon_weight_dimension_numbers=dims, **F32)
  plain = optax.contrib.muon(0.1, weight_decay=0.5,
                             muon_weight_dimension_numbers={"experts": MDN(1, 2), "dense": MDN(0, 1),
                                                            "norm": None})
  assert jax.tree.structure(tx.init(params)) == jax.tree.structure(plain.init(params))
  g = {"experts": jax.random.normal(k[2], (E, D, F)).at[2].set(0.0),
       "dense": jax.random.normal(k[3], (D, F)), "norm": jnp.ones((F,))}
  state = tx.init(params)
  new, s_new = jax.jit(lambda g, s, p: fo.step(tx, g, s, p))(g, state, params)
  np.testing.assert_array_equal(np.asarray(new["experts"][2]), np.asarray(params["experts"][2]))
  mu = lambda s: s.inner_states["muon"].inner_state[0].mu["experts"]
  np.testing.assert_array_equal(np.asarray(mu(s_new)[2]), np.asarray(mu(state)[2]))
  u, _ = jax.jit(tx.update)(g, state, params)
  ref = optax.apply_updates(params, u)
  for name in ("experts", "dense"):
    _close(new[name], ref[name], tol=1e-5)
  assert float(jnp.max(jnp.abs(new["experts"][0] - params["experts"][0]))) > 0
