"""scale_by_qk_clip (MuonClip) against hand-computed MHA, GQA and MLA cases."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fuseopt import optim
from fuseopt.optim.qk_clip import (PROJECTION_ROLES, QK_PROJECTIONS, MLAHeadDims, muonclip,
                                   scale_by_qk_clip)

R = np.sqrt  # readability of the hand-computed scales


def _arr(rng, *shape):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _clip(params, updates, qk_stats, **kw):
  tx = scale_by_qk_clip(**kw)
  out, _ = tx.update(updates, tx.init(params), params, qk_stats=qk_stats)
  return out


def _assert_scaled(params, updates, out, path, column_scale):
  """params + out == column_scale * (params + updates) along the last axis,
  and unscaled columns keep their update bit for bit."""
  w, u, v = (np.asarray(t[path[0]][path[1]]) for t in (params, updates, out))
  s = np.asarray(column_scale, np.float32)
  np.testing.assert_allclose(w + v, s * (w + u), rtol=1e-6, atol=1e-6)
  keep = s == 1
  np.testing.assert_array_equal(v[..., keep], u[..., keep])


def _mha(rng, embed=3, heads=2, kv_heads=2, d=2):
  names = ("q_proj", "k_proj", "v_proj", "o_proj")
  shapes = ((embed, heads * d), (embed, kv_heads * d), (embed, kv_heads * d), (heads * d, embed))
  params = {"attn": {n: _arr(rng, *s) for n, s in zip(names, shapes)}}
  updates = {"attn": {n: _arr(rng, *s) for n, s in zip(names, shapes)}}
  return params, updates


def test_constants_and_exports():
  assert QK_PROJECTIONS == frozenset({"q_proj", "q_b_proj", "k_proj", "kv_b_proj"})
  assert set(PROJECTION_ROLES) == QK_PROJECTIONS
  assert optim.scale_by_qk_clip is scale_by_qk_clip
  assert optim.muonclip is muonclip
  assert optim.QK_PROJECTIONS is QK_PROJECTIONS


def test_mha_hand_computed():
  rng = np.random.default_rng(0)
  params, updates = _mha(rng)
  out = _clip(params, updates, {"attn": jnp.array([200.0, 50.0])}, tau=100.0)
  # gamma = [0.5, 1]: head 0's two q and two k columns by sqrt(0.5)
  col = [R(0.5), R(0.5), 1, 1]
  _assert_scaled(params, updates, out, ("attn", "q_proj"), col)
  _assert_scaled(params, updates, out, ("attn", "k_proj"), col)
  for n in ("v_proj", "o_proj"):
    assert out["attn"][n] is updates["attn"][n]


def _logits(q, k):
  """(heads, T, T) logits of q (T, H, d) against k (T, G, d), repeat_kv order."""
  k = jnp.repeat(k, q.shape[1] // k.shape[1], axis=1)
  return jnp.einsum("thd,shd->hts", q, k)


def test_mha_gqa_logits_end_at_or_below_tau():
  """The guarantee itself: with the step's own logits, every head ends <= tau
  and the worst head of each group ends at tau."""
  rng = np.random.default_rng(1)
  for heads, kv_heads in ((4, 4), (4, 2), (6, 2), (4, 1)):
    d, embed, t = 3, 5, 7
    params, _ = _mha(rng, embed, heads, kv_heads, d)
    x = _arr(rng, t, embed)
    a = params["attn"]
    s = _logits((x @ a["q_proj"]).reshape(t, heads, d),
                (x @ a["k_proj"]).reshape(t, kv_heads, d)).max(axis=(1, 2))
    tau = float(jnp.median(s))
    zeros = jax.tree.map(jnp.zeros_like, params)
    out = _clip(params, zeros, {"attn": s}, tau=tau)
    new = optax.apply_updates(params, out)["attn"]
    s_new = _logits((x @ new["q_proj"]).reshape(t, heads, d),
                    (x @ new["k_proj"]).reshape(t, kv_heads, d)).max(axis=(1, 2))
    assert np.all(np.asarray(s_new) <= tau * (1 + 1e-5)), (heads, kv_heads)
    gamma = np.minimum(1, tau / np.asarray(s))
    worst = gamma.reshape(kv_heads, -1).argmin(axis=1) + np.arange(kv_heads) * (heads // kv_heads)
    clipped = worst[gamma[worst] < 1]
    np.testing.assert_allclose(np.asarray(s_new)[clipped], tau, rtol=1e-5)
    if kv_heads == heads:  # MHA: every head's logits scale by exactly gamma_h
      np.testing.assert_allclose(s_new, np.asarray(s) * gamma, rtol=1e-5)


def test_gqa_hand_computed():
  rng = np.random.default_rng(2)
  params, updates = _mha(rng, embed=3, heads=4, kv_heads=2, d=2)
  # gamma = [0.25, 1 | 1, 1]: group 0's key by sqrt(0.25) = 0.5, its worst
  # query by min(1, 0.25 / 0.5) = 0.5, its other query by min(1, 1 / 0.5) = 1
  out = _clip(params, updates, {"attn": jnp.array([400.0, 100.0, 50.0, 25.0])})
  _assert_scaled(params, updates, out, ("attn", "q_proj"), [.5, .5, 1, 1, 1, 1, 1, 1])
  _assert_scaled(params, updates, out, ("attn", "k_proj"), [.5, .5, 1, 1])
  # gamma = [0.25, 0.16 | 1, 1]: m = 0.16, key 0.4, queries 0.625 and 0.4:
  # both clipped heads get exactly their gamma (0.625*0.4 = 0.25, 0.4*0.4 = 0.16)
  out = _clip(params, updates, {"attn": jnp.array([400.0, 625.0, 100.0, 0.0])})
  _assert_scaled(params, updates, out, ("attn", "q_proj"), [.625, .625, .4, .4, 1, 1, 1, 1])
  _assert_scaled(params, updates, out, ("attn", "k_proj"), [.4, .4, 1, 1])
  # MQA (one key head for all four queries): m = 0.25, key 0.5, queries
  # [0.5, 1, 1, 1]
  params, updates = _mha(rng, embed=3, heads=4, kv_heads=1, d=2)
  out = _clip(params, updates, {"attn": jnp.array([400.0, 100.0, 50.0, 25.0])})
  _assert_scaled(params, updates, out, ("attn", "q_proj"), [.5, .5, 1, 1, 1, 1, 1, 1])
  _assert_scaled(params, updates, out, ("attn", "k_proj"), [.5, .5])


MLA = MLAHeadDims(qk_nope_head_dim=2, qk_rope_head_dim=1)


def _mla(rng, embed=4, heads=2, q_lora=3, kv_lora=4, dn=2, dr=1, dv=3):
  shapes = {
      "q_a_proj": (embed, q_lora),
      "q_b_proj": (q_lora, heads * (dn + dr)),
      "kv_a_proj_with_mqa": (embed, kv_lora + dr),
      "kv_b_proj": (kv_lora, heads * (dn + dv)),
      "o_proj": (heads * dv, embed),
  }
  params = {"attn": {n: _arr(rng, *s) for n, s in shapes.items()}}
  updates = {"attn": {n: _arr(rng, *s) for n, s in shapes.items()}}
  return params, updates


def test_mla_hand_computed():
  rng = np.random.default_rng(3)
  params, updates = _mla(rng)
  out = _clip(params, updates, {"attn": jnp.array([300.0, 10.0])}, mla=MLA)
  g = 1 / 3
  # per head: q = [q_nope, q_nope, q_rope], kv_b rows = [k_nope, k_nope, v, v, v]
  _assert_scaled(params, updates, out, ("attn", "q_b_proj"), [R(g), R(g), g, 1, 1, 1])
  _assert_scaled(params, updates, out, ("attn", "kv_b_proj"), [R(g), R(g), 1, 1, 1] + [1] * 5)
  for n in ("q_a_proj", "kv_a_proj_with_mqa", "o_proj"):
    assert out["attn"][n] is updates["attn"][n]


def test_mla_logits_scale_by_gamma():
  rng = np.random.default_rng(4)
  embed, heads, kv_lora, dn, dr, dv, t = 4, 3, 4, 2, 1, 3, 6
  params, _ = _mla(rng, embed, heads, 3, kv_lora, dn, dr, dv)
  x = _arr(rng, t, embed)

  def logits(a):
    q = ((x @ a["q_a_proj"]) @ a["q_b_proj"]).reshape(t, heads, dn + dr)
    ckv = x @ a["kv_a_proj_with_mqa"]
    k_rope = ckv[:, kv_lora:]                                   # shared by the heads
    k_nope = (ckv[:, :kv_lora] @ a["kv_b_proj"]).reshape(t, heads, dn + dv)[..., :dn]
    return (jnp.einsum("thd,shd->hts", q[..., :dn], k_nope)
            + jnp.einsum("thd,sd->hts", q[..., dn:], k_rope)).max(axis=(1, 2))

  s = logits(params["attn"])
  tau = float(jnp.min(s) + 0.5 * (jnp.max(s) - jnp.min(s)))
  out = _clip(params, jax.tree.map(jnp.zeros_like, params), {"attn": s}, tau=tau,
              mla=MLAHeadDims(dn, dr))
  s_new = logits(optax.apply_updates(params, out)["attn"])
  np.testing.assert_allclose(s_new, np.minimum(s, tau), rtol=1e-5)


def test_q_proj_without_latent_and_custom_roles():
  """MLA without a query latent (DeepSeek-V2-Lite) and custom projection names."""
  rng = np.random.default_rng(5)
  params, updates = _mla(rng)
  for tree in (params, updates):
    tree["attn"]["q_proj"] = tree["attn"].pop("q_b_proj")
  out = _clip(params, updates, {"attn": jnp.array([300.0, 10.0])}, mla=MLA)
  g = 1 / 3
  _assert_scaled(params, updates, out, ("attn", "q_proj"), [R(g), R(g), g, 1, 1, 1])

  params, updates = _mha(rng)
  for tree in (params, updates):
    tree["attn"]["wq"] = tree["attn"].pop("q_proj")
    tree["attn"]["wk"] = tree["attn"].pop("k_proj")
  stats = {"attn": jnp.array([200.0, 50.0])}
  out = _clip(params, updates, stats, projections={"wq": "q", "wk": "k"})
  _assert_scaled(params, updates, out, ("attn", "wq"), [R(.5), R(.5), 1, 1])
  _assert_scaled(params, updates, out, ("attn", "wk"), [R(.5), R(.5), 1, 1])
  # a subset of the default names: only the query is rescaled
  params, updates = _mha(rng)
  out = _clip(params, updates, stats, projections={"q_proj"})
  _assert_scaled(params, updates, out, ("attn", "q_proj"), [R(.5), R(.5), 1, 1])
  assert out["attn"]["k_proj"] is updates["attn"]["k_proj"]


def test_layouts_bias_and_layer_stack():
  rng = np.random.default_rng(6)
  layers, embed, heads, d = 2, 3, 2, 2
  w = {"attn": {"q_proj": {"kernel": _arr(rng, layers, embed, heads, d),
                           "bias": _arr(rng, layers, heads, d)},
                "k_proj": {"kernel": _arr(rng, layers, embed, heads * d)}}}
  u = jax.tree.map(lambda x: _arr(rng, *x.shape), w)
  stats = {"attn": jnp.array([[200.0, 50.0], [100.0, 400.0]])}
  out = _clip(w, u, stats)
  col = np.array([[R(.5), R(.5), 1, 1], [1, 1, .5, .5]], np.float32)
  q = lambda t, n: np.asarray(t["attn"]["q_proj"][n]).reshape(layers, -1, heads * d)
  np.testing.assert_allclose(q(w, "kernel") + q(out, "kernel"),
                             col[:, None] * (q(w, "kernel") + q(u, "kernel")), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(q(w, "bias") + q(out, "bias"),
                             col[:, None] * (q(w, "bias") + q(u, "bias")), rtol=1e-6, atol=1e-6)
  k = lambda t: np.asarray(t["attn"]["k_proj"]["kernel"])
  np.testing.assert_allclose(k(w) + k(out), col[:, None] * (k(w) + k(u)), rtol=1e-6, atol=1e-6)
  assert out["attn"]["q_proj"]["kernel"].shape == (layers, embed, heads, d)


def test_stats_formats_agree():
  rng = np.random.default_rng(7)
  p0, u0 = _mha(rng)
  params, updates = {"layers_0": p0}, {"layers_0": u0}
  s = jnp.array([200.0, 50.0])
  ref = _clip(params, updates, {"layers_0": {"attn": s}})
  for stats in ({"layers_0/attn": s},                           # flat
                {"layers_0": {"attn": {"max_logits": (s,)}}}):  # sow-style
    out = _clip(params, updates, stats)
    jax.tree.map(np.testing.assert_array_equal, out, ref)
  assert not np.array_equal(ref["layers_0"]["attn"]["q_proj"], u0["attn"]["q_proj"])


def test_passthrough():
  rng = np.random.default_rng(8)
  params, updates = _mha(rng)
  tx = scale_by_qk_clip()
  state = tx.init(params)
  assert tx.update(updates, state, params)[0] is updates
  assert tx.update(updates, state, None, qk_stats={"attn": jnp.array([1e4, 1e4])})[0] is updates
  # at or below tau, <= 0, non-finite, or absent: every update bit for bit
  for s in ([100.0, -5.0], [0.0, 50.0], [np.nan, np.inf]):
    out = tx.update(updates, state, params, qk_stats={"attn": jnp.array(s)})[0]
    jax.tree.map(np.testing.assert_array_equal, out, updates)
  assert tx.update(updates, state, params, qk_stats={})[0] is updates


@pytest.mark.parametrize("tau", [0.0, -1.0, float("nan")])
def test_tau_must_be_positive(tau):
  with pytest.raises(ValueError, match="tau"):
    scale_by_qk_clip(tau)


def test_errors():
  rng = np.random.default_rng(9)
  with pytest.raises(ValueError, match=r"\['wq'\].*mapping"):
    scale_by_qk_clip(projections={"wq", "k_proj"})
  with pytest.raises(ValueError, match="projections\\['wq'\\]"):
    scale_by_qk_clip(projections={"wq": "query"})
  params, updates = _mla(rng)
  with pytest.raises(ValueError, match="attn.*mla=MLAHeadDims"):
    _clip(params, updates, {"attn": jnp.array([300.0, 10.0])})
  with pytest.raises(ValueError, match="query projection of 'attn' has width 6"):
    _clip(params, updates, {"attn": jnp.array([300.0, 10.0])}, mla=MLAHeadDims(2, 2))
  params, updates = _mha(rng)
  with pytest.raises(ValueError, match="mlp.*none of the projections"):
    _clip({"attn": params["attn"], "mlp": {"w": params["attn"]["o_proj"]}}, updates,
          {"mlp": jnp.array([300.0, 10.0])})
  with pytest.raises(ValueError, match="not a multiple of the 3 heads"):
    _clip(params, updates, {"attn": jnp.array([300.0, 10.0, 1.0])})
  params, updates = _mha(rng, heads=4, kv_heads=2, d=2)
  for tree in (params, updates):  # 3 key heads of width 2 cannot serve 4 query heads
    tree["attn"]["k_proj"] = jnp.zeros((3, 6))
  with pytest.raises(ValueError, match="key projection of 'attn' has width 6"):
    _clip(params, updates, {"attn": jnp.array([300.0, 10.0, 1.0, 1.0])})


def _flat_mha_tree(rng):
  p, _ = _mha(rng, embed=8, heads=2, kv_heads=2, d=4)
  p["attn"]["norm"] = _arr(rng, 8)
  return p


def test_chain_after_optax_muon_and_jit():
  rng = np.random.default_rng(10)
  params = _flat_mha_tree(rng)
  grads = jax.tree.map(lambda x: _arr(rng, *x.shape), params)
  stats = {"attn": jnp.array([400.0, 20.0])}
  muon = optax.contrib.muon(0.1, ns_steps=2)
  tx = optax.chain(muon, scale_by_qk_clip(100.0))
  state = tx.init(params)
  update = jax.jit(tx.update)
  u, _ = update(grads, state, params, qk_stats=stats)
  u_muon, _ = jax.jit(muon.update)(grads, muon.init(params), params)
  col = [.5] * 4 + [1] * 4
  for n in ("q_proj", "k_proj"):
    _assert_scaled(params, u_muon, u, ("attn", n), col)
  for n in ("v_proj", "o_proj", "norm"):
    np.testing.assert_array_equal(u["attn"][n], u_muon["attn"][n])
  # W + u' = gamma * (W + u) through optax.apply_updates
  new = optax.apply_updates(params, u)["attn"]["q_proj"]
  ref = optax.apply_updates(params, u_muon)["attn"]["q_proj"] * np.array(col, np.float32)
  np.testing.assert_allclose(new, ref, rtol=1e-6, atol=1e-7)


def test_muonclip_helper():
  rng = np.random.default_rng(11)
  params = _flat_mha_tree(rng)
  grads = jax.tree.map(lambda x: _arr(rng, *x.shape), params)
  tx = muonclip(0.1, tau=100.0, ns_steps=2)
  assert isinstance(tx, optax.GradientTransformationExtraArgs)
  state = tx.init(params)
  update = jax.jit(tx.update)
  stats = {"attn": jnp.array([20.0, 400.0])}
  u, _ = update(grads, state, params, qk_stats=stats)
  u_plain, _ = update(grads, state, params, qk_stats={"attn": jnp.zeros(2)})
  col = [1] * 4 + [.5] * 4
  for n in ("q_proj", "k_proj"):
    _assert_scaled(params, u_plain, u, ("attn", n), col)
  with pytest.raises(ValueError, match="tau"):
    muonclip(0.1, tau=0.0)


def test_inside_parameter_groups():
  """Under optax.partition each group's clip sees only its own leaves (the
  others are masked) and gets the whole qk_stats."""
  rng = np.random.default_rng(12)
  params = _flat_mha_tree(rng)
  params["embed"] = _arr(rng, 10, 8)
  grads = jax.tree.map(lambda x: _arr(rng, *x.shape), params)
  labels = jax.tree.map(lambda _: "a", params)
  labels["attn"]["k_proj"] = labels["embed"] = "b"
  clip = lambda: optax.chain(optax.sgd(0.1), scale_by_qk_clip(100.0))
  tx = optax.partition({"a": clip(), "b": clip()}, labels)
  stats = {"attn": jnp.array([400.0, 20.0])}
  u, _ = tx.update(grads, tx.init(params), params, qk_stats=stats)
  plain = jax.tree.map(lambda g: -0.1 * g, grads)
  col = [.5] * 4 + [1] * 4
  for n in ("q_proj", "k_proj"):
    _assert_scaled(params, plain, u, ("attn", n), col)
  np.testing.assert_allclose(u["embed"], plain["embed"], rtol=1e-6)
