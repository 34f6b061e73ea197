"""fuseopt.optim.muon against optax.contrib.muon, and its own guarantees."""


import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fuseopt.optim.muon_transforms import MuonDimensionNumbers as MDN
from fuseopt.optim.muon_transforms import muon, scale_by_muon
from fuseopt.optim.execution import Execution
from fuseopt.optim.muon_settings import NewtonSchulz
from tests.optim import _muon_trees as T

JORDAN = (3.4445, -4.7750, 2.0315)
import fuseopt.kernels
from fuseopt.kernels.newton_schulz import api as ns_kernel


def _rel(a, b):
  return float(jnp.linalg.norm((a - b).ravel()) / jnp.maximum(jnp.linalg.norm(a.ravel()), 1e-30))


def _run_both(ref, mine, steps=2, params=None):
  p = T.llama_tree(jax.random.key(0)) if params is None else params
  sr, sm = ref.init(p), mine.init(p)
  pr = pm = p
  ref_up, mine_up = jax.jit(ref.update), jax.jit(mine.update)
  worst = 0.0
  for t in range(steps):
    g = T.llama_tree(jax.random.key(t + 1))
    ur, sr = ref_up(g, sr, pr)
    um, sm = mine_up(g, sm, pm)
    assert jax.tree.structure(ur) == jax.tree.structure(um)
    for a, b in zip(jax.tree.leaves(ur), jax.tree.leaves(um)):
      assert a.shape == b.shape and a.dtype == b.dtype
      worst = max(worst, _rel(a, b))
    pr, pm = optax.apply_updates(pr, ur), optax.apply_updates(pm, um)
  return worst, sr, sm


@pytest.mark.parametrize("variant", ["default", "options"])
def test_matches_optax_fp32_jordan(variant):
  dims = T.llama_dims(None)
  kw = dict(learning_rate=0.02, weight_decay=0.1, ns_coeffs=JORDAN,
            weight_decay_mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p))
  if variant == "options":
    kw.update(nesterov=False, consistent_rms=0.2, beta=0.9,
              adam_b1=0.8, adam_b2=0.99, adam_eps_root=1e-9, adam_weight_decay=0.01,
              adam_learning_rate=optax.linear_schedule(0.01, 0.001, 5))
  ref = optax.contrib.muon(muon_weight_dimension_numbers=T.optax_dims(dims), **kw)
  if variant == "default":  # a callable returning optax's own MuonDimensionNumbers
    mine_dims = lambda p: T.optax_dims(T.llama_dims(p))
  else:
    mine_dims = dims
  # (optax's moment dtypes on the AdamW side: moment_dtype=None)
  mine = muon(muon_weight_dimension_numbers=mine_dims, **kw, moment_dtype=None,
              execution=Execution(implementation='xla', newton_schulz=NewtonSchulz(dtype=jnp.float32)))
  worst, sr, sm = _run_both(ref, mine)
  assert worst < 1e-4
  # Same state layout as optax: one momentum leaf per Muon parameter.
  assert jax.tree.structure(sr.inner_states["muon"].inner_state[0].mu) == \
      jax.tree.structure(sm.inner_states["muon"].inner_state[0].mu)


def test_default_2d_rule_matches_optax():
  """No dimension numbers: every 2-D leaf is Muon, the rest AdamW."""
  k = jax.random.split(jax.random.key(3), 3)
  p = {"w1": jax.random.normal(k[0], (24, 40)), "w2": jax.random.normal(k[1], (40, 24)),
       "b": jax.random.normal(k[2], (40,))}
  ref = optax.contrib.muon(learning_rate=0.1)
  mine = muon(learning_rate=0.1, ns_coeffs="jordan", moment_dtype=None,
              execution=Execution(newton_schulz=NewtonSchulz(dtype=jnp.float32)))
  sr, sm = ref.init(p), mine.init(p)
  ref_up, mine_up = jax.jit(ref.update), jax.jit(mine.update)
  for t in range(2):
    g = jax.tree.map(lambda x, t=t: jnp.sin(x * (t + 2.0)), p)
    ur, sr = ref_up(g, sr, p)
    um, sm = mine_up(g, sm, p)
    for a, b in zip(jax.tree.leaves(ur), jax.tree.leaves(um)):
      assert _rel(a, b) < 1e-4


def test_scale_by_muon_matches_optax_adaptive():
  p = {"a": jax.random.normal(jax.random.key(1), (3, 16, 24)),
       "b": jax.random.normal(jax.random.key(2), (24, 16))}
  dims = {"a": MDN(1, 2), "b": MDN(0, 1)}
  odims = {"a": optax.contrib.MuonDimensionNumbers(1, 2), "b": optax.contrib.MuonDimensionNumbers()}
  ref = optax.contrib.scale_by_muon(adaptive=True, weight_dimension_numbers=odims, mu_dtype=jnp.bfloat16)
  mine = scale_by_muon(adaptive=True, weight_dimension_numbers=dims, mu_dtype=jnp.bfloat16, execution=Execution(newton_schulz=NewtonSchulz(dtype=jnp.float32)))
  sr, sm = ref.init(p), mine.init(p)
  ref_up, mine_up = jax.jit(ref.update), jax.jit(mine.update)
  for t in range(2):
    g = jax.tree.map(lambda x, t=t: jnp.cos(x + t), p)
    ur, sr = ref_up(g, sr)
    um, sm = mine_up(g, sm)
    # Step 1 from zero momentum agrees to fp32 rounding. fuseopt stores the bf16
    # momentum stochastically rounded, optax to nearest: from step 2 on the
    # two differ at the bf16 rounding level (2**-9 relative an element).
    for a, b in zip(jax.tree.leaves(ur), jax.tree.leaves(um)):
      assert _rel(a, b) < (1e-4 if t == 0 else 4e-3)
  assert sm.mu["a"].dtype == jnp.bfloat16


def test_one_batched_ns_call_per_shape(monkeypatch):
  """Same-shaped matrices of the whole tree (stacked or not) share one NS call."""
  calls = []
  real = ns_kernel.newton_schulz

  def spy(x, **kw):
    calls.append(x.shape)
    return real(x, **kw)
  monkeypatch.setattr(fuseopt.kernels, "newton_schulz", spy)
  p = T.llama_tree(jax.random.key(0))
  tx = muon(learning_rate=0.1, muon_weight_dimension_numbers=T.llama_dims)
  jax.eval_shape(tx.update, p, tx.init(p), p)  # tracing is enough to see the calls
  # (D, FF): layers.gate (L), layers.up (L), extra_mlp.gate (1); (FF, D): down x (L + 1);
  # (D, H*HD): wq, wk; (H*HD, D): wo.
  assert sorted(calls) == sorted([(2 * T.L + 1, T.D, T.FF), (T.L + 1, T.FF, T.D),
                                  (2 * T.L, T.D, T.H * T.HD), (T.L, T.H * T.HD, T.D)])


@pytest.mark.parametrize("coeffs", ["jordan", "polar_express"])
def test_bf16_singular_values_in_band(coeffs):
  g = jax.random.normal(jax.random.key(7), (2, 48, 96))
  tx = scale_by_muon(ns_coeffs=coeffs, weight_dimension_numbers=MDN(1, 2), execution=Execution(newton_schulz=NewtonSchulz(dtype=jnp.bfloat16)))
  u, _ = tx.update(g, tx.init(g))
  assert u.dtype == jnp.float32
  s = np.linalg.svd(np.asarray(u), compute_uv=False)
  lo, hi = ns_kernel.singular_value_band(coeffs, 5)
  # Band of the exact polynomials (Jordan about [0.68, 1.12] here), widened for bf16 rounding.
  assert lo - 0.1 <= s.min() and s.max() <= hi + 0.1, (s.min(), s.max(), lo, hi)
  assert s.min() > 0.3 and s.max() < 1.5


def _small_tree():
  return {"w": jax.random.normal(jax.random.key(4), (2, 16, 24)),
          "b": jax.random.normal(jax.random.key(5), (16,))}


_SMALL_DIMS = {"w": MDN(1, 2), "b": None}


def test_zero_grads_give_zero_update():
  p = _small_tree()
  tx = muon(learning_rate=0.1, weight_decay=0.0, muon_weight_dimension_numbers=_SMALL_DIMS)
  g = jax.tree.map(jnp.zeros_like, p)
  u, s = jax.jit(tx.update)(g, tx.init(p), p)
  for leaf in jax.tree.leaves(u):
    assert bool(jnp.all(leaf == 0))
  for leaf in jax.tree.leaves(s):
    assert bool(jnp.all(jnp.isfinite(leaf)))


def test_nan_grad_gives_nan_not_crash():
  g = {"w": jnp.full((8, 16), jnp.nan)}
  tx = scale_by_muon()
  u, _ = tx.update(g, tx.init(g))
  assert bool(jnp.all(jnp.isnan(u["w"])))


def test_adam_side_bf16_moments_by_default():
  """The AdamW side keeps bf16 moments by default, as fo.adamw does (one
  default for one setting); Muon's momentum keeps mu_dtype's."""
  p = _small_tree()
  tx = muon(learning_rate=0.1, muon_weight_dimension_numbers=_SMALL_DIMS)
  u, s = jax.jit(tx.update)(p, tx.init(p), p)
  adam_state = s.inner_states["adam"].inner_state[0]
  assert adam_state.mu["b"].dtype == jnp.bfloat16 and adam_state.nu["b"].dtype == jnp.bfloat16
  assert s.inner_states["muon"].inner_state[0].mu["w"].dtype == jnp.float32
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(u))


def test_bad_inputs_raise_clear_errors():
  g = {"layers": {"norm": jnp.ones((4,))}}
  tx = scale_by_muon(weight_dimension_numbers={"layers": {"norm": MDN(0, 1)}})
  with pytest.raises(ValueError, match=r"\['layers'\]\['norm'\].*rank 1"):
    tx.update(g, tx.init(g))
  g = {"w": jnp.ones((4, 5, 6))}
  tx = scale_by_muon(weight_dimension_numbers={"w": MDN((0, 1), 1)})
  with pytest.raises(ValueError, match="distinct"):
    tx.update(g, tx.init(g))
  with pytest.raises(ValueError, match="preconditioning"):
    scale_by_muon(preconditioning="bogus")
  with pytest.raises(ValueError, match="coeffs"):
    scale_by_muon(ns_coeffs="newton")


def _ns_calls(fn, *args) -> list[int]:
  """The batch size of every Newton-Schulz call in ``fn``'s jaxpr (the NS
  runs as a jitted call, traced once per distinct shape)."""
  out = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name in ("jit", "pjit") and eqn.params.get("name") == "newton_schulz_stack":
        out.append(eqn.invars[0].aval.shape[0])
        continue
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)
  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return out


def test_ns_max_elements_splits_calls_without_changing_results():
  g = {"a": jax.random.normal(jax.random.key(8), (3, 8, 12)),
       "b": jax.random.normal(jax.random.key(9), (8, 12)),
       "c": jax.random.normal(jax.random.key(10), (2, 8, 12))}
  dims = {"a": MDN(1, 2), "b": MDN(), "c": MDN(1, 2)}
  outs = {}
  # 5 a call would leave one matrix alone in the last call: [4, 2] instead.
  expected = {None: [6], 2 * 8 * 12: [2, 2, 2], 5 * 8 * 12: [4, 2]}
  for cap, want in expected.items():
    tx = scale_by_muon(weight_dimension_numbers=dims, execution=Execution(newton_schulz=NewtonSchulz(max_elements=cap, dtype=jnp.float32)))
    outs[cap], _ = jax.jit(tx.update)(g, tx.init(g))
    assert _ns_calls(tx.update, g, tx.init(g)) == want, cap
  for cap in expected:
    for a, b in zip(jax.tree.leaves(outs[None]), jax.tree.leaves(outs[cap])):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_pallas_backends_in_interpret_mode_match_xla():
  """The transform drives the Pallas NS kernels (interpret mode on the CPU)
  and gets the reference's result."""
  g = {"w": jax.random.normal(jax.random.key(0), (2, 16, 32)),
       "v": jax.random.normal(jax.random.key(1), (32, 16))}
  dims = {"w": MDN(1, 2), "v": MDN()}
  out = {}
  for impl in ("xla", "triton", "mosaic_tpu"):
    tx = scale_by_muon(weight_dimension_numbers=dims, ns_coeffs="polar_express",
                       execution=Execution(implementation=impl, interpret=impl != "xla"))
    out[impl], _ = tx.update(g, tx.init(g))
  for impl in ("triton", "mosaic_tpu"):
    for a, b in zip(jax.tree.leaves(out[impl]), jax.tree.leaves(out["xla"])):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2e-2)


def test_call_plan_never_leaves_a_batched_family_a_lone_matrix():
  from fuseopt.optim.muon_plan import call_plan
  sizes = lambda batches, cap: [sum(b - a for _, a, b in call) for call in call_plan(batches, 1, cap)]
  assert sizes([3, 3], 5) == [4, 2]         # not [5, 1]
  assert sizes([3], 2) == [3]               # not [2, 1]: two a call can only take three
  assert sizes([2, 2], 2) == [2, 2]
  assert sizes([3], 1) == [1, 1, 1]         # one a call: every call is a lone matrix anyway
  assert sizes([4, 1], None) == [5]
  # Ranges cover every member's batch once, in order.
  assert call_plan([3, 3], 1, 5) == [[(0, 0, 3), (1, 0, 1)], [(1, 1, 3)]]


@pytest.mark.parametrize("impl", ["triton", "mosaic_tpu"])
def test_ns_matmul_pallas_runs_the_update_kernel_and_matches(impl, monkeypatch):
  """ns_matmul="pallas": the tiled NS's a·X + B·X by the Pallas update kernel
  (interpret mode), the same function as XLA's dot path."""
  from jax.experimental import pallas as pl
  monkeypatch.setenv("FUSEOPT_NS_PATH", "tiled")   # a matrix this small fits the fused kernel
  names, real = [], pl.pallas_call
  monkeypatch.setattr(pl, "pallas_call", lambda *a, **k: names.append(k.get("name")) or real(*a, **k))
  g = {"w": jax.random.normal(jax.random.key(3), (2, 256, 512))}
  dims = {"w": MDN(1, 2)}
  outs = {}
  for mm in ("xla", "pallas"):
    names.clear()
    tx = scale_by_muon(weight_dimension_numbers=dims, ns_coeffs="jordan",
                       execution=Execution(implementation=impl, interpret=True,
                                           newton_schulz=NewtonSchulz(matmul=mm)))
    outs[mm], _ = jax.jit(tx.update)(g, tx.init(g))
    assert ("fuseopt_ns_update" in names) == (mm == "pallas"), (mm, names)
  np.testing.assert_allclose(np.asarray(outs["pallas"]["w"]), np.asarray(outs["xla"]["w"]),
                             rtol=0, atol=2e-2)
  with pytest.raises(ValueError, match="matmul must be one of"):
    scale_by_muon(execution=Execution(newton_schulz=NewtonSchulz(matmul="cublas")))


@pytest.mark.parametrize("ns_dtype", [jnp.bfloat16, jnp.float32])
def test_spectral_preconditioning_runs_in_every_ns_dtype(ns_dtype):
  """The spectral norm's SVD takes no bf16: it is taken in fp32, so the
  default bf16 iteration runs (it raised inside jnp.linalg before)."""
  import fuseopt.optim as fo
  params = {"w": jnp.ones((24, 16)) + jnp.eye(24, 16)}
  tx = fo.muon(0.02, preconditioning="spectral", ns_coeffs=(3.4445, -4.775, 2.0315), execution=fo.Execution(newton_schulz=fo.NewtonSchulz(dtype=ns_dtype)))
  grads = jax.tree.map(lambda x: jnp.sin(jnp.arange(x.size, dtype=jnp.float32)).reshape(x.shape),
                       params)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  assert bool(jnp.all(jnp.isfinite(updates["w"]))) and float(jnp.abs(updates["w"]).max()) > 0


# ------------------------------------------------------- 8-bit momentum --
def _int8_tree():
  """Two Muon matrices whose last axis is whole blocks of 256, one that is
  not (keeps bf16 momentum), one AdamW leaf."""
  k = jax.random.split(jax.random.key(7), 4)
  return {"w": jax.random.normal(k[0], (64, 512)), "u": jax.random.normal(k[1], (32, 256)),
          "v": jax.random.normal(k[2], (48, 100)), "b": jax.random.normal(k[3], (256,))}


def _int8_grads(t, tree):
  keys = jax.random.split(jax.random.key(100 + t), len(tree))
  return {n: jax.random.normal(kk, x.shape) for kk, (n, x) in zip(keys, sorted(tree.items()))}


def _muon_mu(state):
  return state.inner_states["muon"].inner_state[0].mu


def test_int8_momentum_bytes_and_within_one_code_of_fp32():
  """mu_dtype='int8': Adam's 8-bit mu format (1 + 4/256 B a parameter), a
  warning naming the leaf that keeps bf16; each step's decoded momentum is
  within one code step (its block's scale) of the fp32 momentum computed from
  the previous decoded one; the AdamW side keeps its bf16 moments."""
  from fuseopt.kernels.adam import quantized
  params = _int8_tree()
  tx = muon(learning_rate=0.02, weight_decay=0.1, mu_dtype="int8")
  with pytest.warns(UserWarning, match=r"mu_dtype='int8'.*\['v'\]"):
    state = tx.init(params)
  mu = _muon_mu(state)
  assert mu["v"].dtype == jnp.bfloat16
  assert state.inner_states["adam"].inner_state[0].mu["b"].dtype == jnp.bfloat16
  for n in ("w", "u"):
    assert mu[n].codes.dtype == jnp.int8 and mu[n].scales.dtype == jnp.float32
    assert quantized.nbytes(mu[n]) / params[n].size == 1 + 4 / 256
  update = jax.jit(tx.update)
  beta = 0.95
  for t in range(3):
    g = _int8_grads(t, params)
    prev = {n: quantized.dequantize(_muon_mu(state)[n], signed=True) for n in ("w", "u")}
    _, state = update(g, state, params)
    for n in ("w", "u"):
      m = _muon_mu(state)[n]
      want = (1 - beta) * g[n] + beta * prev[n]
      step = np.repeat(np.asarray(m.scales), 256, axis=-1)
      err = np.abs(np.asarray(quantized.dequantize(m, signed=True)) - np.asarray(want))
      assert np.all(err <= step * (1 + 1e-5) + 1e-30), (t, n, float(err.max()))
      assert np.abs(np.asarray(m.codes)).max() == 127


def test_int8_momentum_update_equals_fused_step():
  """update + apply and the fused step: the 8-bit momentum (codes, scales)
  bitwise, the parameters to fp32 rounding; NorMuon takes it too."""
  import fuseopt.optim as fo
  import warnings
  params = _int8_tree()
  for make in (muon, fo.normuon):
    tx = make(learning_rate=0.02, weight_decay=0.1, mu_dtype=jnp.int8,
              execution=Execution(newton_schulz=NewtonSchulz(dtype=jnp.float32)))
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      s1 = s2 = tx.init(params)

    @jax.jit
    def reference(g, s, p):
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s

    fused = jax.jit(lambda g, s, p: fo.step(tx, g, s, p))
    p1 = p2 = params
    for t in range(3):
      g = _int8_grads(t, params)
      p1, s1 = reference(g, s1, p1)
      p2, s2 = fused(g, s2, p2)
    for a, b in zip(jax.tree.leaves(_muon_mu(s1)), jax.tree.leaves(_muon_mu(s2))):
      np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
      np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)


def test_mu_dtype_errors_list_every_accepted_value():
  for bad, err in (("uint8", ValueError), ("bool", ValueError), (8, TypeError)):
    for make in (lambda d: muon(0.1, mu_dtype=d), lambda d: scale_by_muon(mu_dtype=d)):
      with pytest.raises(err, match=r"floating dtype.*'int8' \(8-bit codes, a scale per block of "
                                    r"256\) or None"):
        make(bad)
