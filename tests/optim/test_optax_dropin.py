"""fuseopt as a drop-in for optax: dtypes the kernels do not cover, eager
mode, inject_hyperparams, apply_updates and the Muon state layout (the
conformance job in tests/conformance runs optax's own tests; these are the
direct checks)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest

import fuseopt.optim as fo

JORDAN = (3.4445, -4.7750, 2.0315)


def _tree(dtype):
  k1, k2 = jax.random.split(jax.random.key(0))
  return {"w": jax.random.normal(k1, (6, 4)).astype(dtype), "b": jax.random.normal(k2, (4,)).astype(dtype)}


def _run(tx, params, steps=3, jit=False):
  state = tx.init(params)
  update = jax.jit(tx.update) if jit else tx.update
  outs = []
  for t in range(steps):
    g = jax.tree.map(lambda p: (jnp.sin(p * (t + 1.5)) * 3).astype(p.dtype), params)
    u, state = update(g, state, params)
    params = optax.apply_updates(params, u)
    outs.append((u, state))
  return params, outs


def _assert_bitwise(a, b, rtol=0.0, *, of_largest=False):
  """Bitwise, or within ``rtol`` of each element (``of_largest``: of each
  leaf's largest element, for results whose rounding error is relative to
  the whole matrix, as Newton-Schulz's is)."""
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(la, lb):
    assert x.dtype == y.dtype
    if rtol:
      atol = rtol * float(np.abs(np.asarray(y)).max()) if of_largest else 0
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)
    else:
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.complex64])
@pytest.mark.parametrize("nesterov", [False, True])
def test_uncovered_dtypes_run_optax_math(dtype, nesterov):
  """float16 and complex leaves keep optax's moment dtypes and its bits,
  whatever moment_dtype says (it applies to float32/bfloat16 leaves)."""
  params = _tree(dtype)
  got = _run(fo.adamw(0.1, nesterov=nesterov), params)
  want = _run(optax.adamw(0.1, nesterov=nesterov), params)
  _assert_bitwise(got, want)


def test_integer_params_pass_through_and_float_leaves_behave_as_optax():
  """An integer leaf gets no update and keeps init's moments, even with
  integer gradients (optax 0.2.8 runs Adam on it in integers: its nu
  overflows and the leaf [0..5] came back [0, -9473681, 2, 2, 4, 3]); the
  float leaves beside it are optax's."""
  params = {"i": jnp.arange(6, dtype=jnp.int32), "f": jnp.ones(3)}
  got_p, got = _run(fo.adam(0.1, moment_dtype=None), params, steps=2)
  want_p, want = _run(optax.adam(0.1), params, steps=2)
  np.testing.assert_array_equal(np.asarray(got_p["i"]), np.arange(6))
  assert got_p["i"].dtype == jnp.int32
  for (u, s), (wu, ws) in zip(got, want):
    assert not np.any(np.asarray(u["i"])) and u["i"].dtype == jnp.int32
    assert s[0].mu["i"].dtype == s[0].nu["i"].dtype == jnp.int32
    assert not np.any(np.asarray(s[0].mu["i"])) and not np.any(np.asarray(s[0].nu["i"]))
    # Eagerly optax divides by its bias correction in one small jit over the
    # whole tree, which XLA compiles to within 1 ulp of a per-leaf division.
    _assert_bitwise((u["f"], s[0].mu["f"], s[0].nu["f"]), (wu["f"], ws[0].mu["f"], ws[0].nu["f"]),
                    rtol=2e-7)
  _assert_bitwise(got_p["f"], want_p["f"], rtol=2e-7)
  p = {"f": jnp.ones(3)}
  got = _run(fo.adam(0.1, mu_dtype=jnp.float16, moment_dtype=None), p, steps=2)
  want = _run(optax.adam(0.1, mu_dtype=jnp.float16), p, steps=2)
  _assert_bitwise(got, want)


def test_mixed_tree_keeps_kernel_seeds_per_leaf_index():
  """A float16 leaf between bf16 leaves does not shift their rounding seeds."""
  mixed = {"a": jnp.ones(5, jnp.bfloat16), "b": jnp.ones(3, jnp.float16), "c": jnp.ones(7, jnp.bfloat16) * 3}
  tx = fo.scale_by_adam(seed=5)
  g = jax.tree.map(lambda x: (x * 0.3001).astype(x.dtype), mixed)
  u_mixed, s_mixed = tx.update(g, tx.init(mixed))
  same = dict(mixed, b=jnp.ones(3, jnp.bfloat16))
  g2 = dict(g, b=g["b"].astype(jnp.bfloat16))
  u_same, s_same = tx.update(g2, tx.init(same))
  for k in "ac":
    np.testing.assert_array_equal(np.asarray(s_mixed.nu[k]), np.asarray(s_same.nu[k]))
    np.testing.assert_array_equal(np.asarray(u_mixed[k]), np.asarray(u_same[k]))
  assert s_mixed.mu["b"].dtype == jnp.float16


def _xla_divides_by_reciprocal() -> bool:
  """Whether the installed XLA compiles ``x / b``, ``b`` a broadcast scalar,
  as ``x * (1 / b)`` (jax 0.12.0.1 and earlier on the CPU), which is how
  fuseopt writes its bias corrections; jax 0.12.1's XLA divides. 6.29 / 0.1
  is 62.899998 in fp32, 6.29 * fl(1 / 0.1) is 62.9."""
  x, b = jnp.full((8,), 6.29, jnp.float32), jnp.float32(0.1)
  return bool(jax.jit(lambda x, b: x / b)(x, b)[0] == x[0] * (jnp.float32(1.0) / b))


@pytest.mark.parametrize("nesterov", [False, True])
def test_fp32_scale_by_adam_is_optax_bitwise_eagerly(nesterov):
  """Not jitted: bias corrections as optax computes them (in a jit; an eager
  ``b ** count`` would take integer_pow and miss by 1e-5 relative).

  optax divides by its bias corrections, fuseopt multiplies by their
  reciprocals (the same bits in a leaf and its shards, and what a TPU runs
  fast). Where XLA compiles optax's division to that multiplication, the
  twelve steps are bitwise optax's; where it divides (jax 0.12.1), the
  moments are bitwise and the updates within a few fp32 ulps of optax's, as
  jitted (3e-7 relative, or of the leaf's largest update where nesterov's sum
  cancels), each step taken from optax's parameters (an ulp fed back through
  the parameters into the gradients would grow)."""
  params = {"w": jax.random.normal(jax.random.key(1), (37, 5))}
  ours = fo.scale_by_adam(nesterov=nesterov, moment_dtype=None)
  theirs = optax.scale_by_adam(nesterov=nesterov)
  if _xla_divides_by_reciprocal():
    _assert_bitwise(_run(ours, params, steps=12), _run(theirs, params, steps=12))
    return
  state_a, state_b = ours.init(params), theirs.init(params)
  for t in range(12):
    g = jax.tree.map(lambda p: jnp.sin(p * (t + 1.5)) * 3, params)
    u_a, state_a = ours.update(g, state_a, params)
    u_b, state_b = theirs.update(g, state_b, params)
    _assert_bitwise(jax.tree.leaves(state_a), jax.tree.leaves(state_b))
    a, b = np.asarray(u_a["w"]), np.asarray(u_b["w"])
    np.testing.assert_allclose(a, b, rtol=3e-7, atol=3e-7 * np.abs(b).max())
    params = optax.apply_updates(params, u_b)


@pytest.mark.fma_off
def test_fp32_adam_is_optax_within_ulps_jitted():
  """The moments bitwise; the updates within a few fp32 ulps: fuseopt
  multiplies by the bias corrections' reciprocals, and XLA compiles optax's
  divisions either so or, in this program, as ``mu / (bc1 * d)`` (docs/testing.md,
  "FMA")."""
  params = _tree(jnp.float32)
  got = _run(fo.adamw(0.01, moment_dtype=None), params, jit=True)
  want = _run(optax.adamw(0.01), params, jit=True)
  _assert_bitwise([s for _, s in got[1]], [s for _, s in want[1]])
  _assert_bitwise(got, want, rtol=3e-7)


@pytest.mark.parametrize("factory, optax_factory, kwargs, fp32", [
    (fo.adam, optax.adam, {}, {"moment_dtype": None}),
    (fo.adamw, optax.adamw, {"weight_decay": 0.1}, {"moment_dtype": None}),
    (fo.muon, optax.contrib.muon, {"ns_coeffs": JORDAN},
     {"execution": fo.Execution(newton_schulz=fo.NewtonSchulz(dtype="float32")), "moment_dtype": None}),
])
def test_inject_hyperparams_injects_what_optax_injects(factory, optax_factory, kwargs, fp32):
  """fuseopt's extra arguments (moment_dtype, seed, the execution record
  and its newton_schulz record) are not injected: the same
  hyperparameters as optax's, and under jit the injected fuseopt follows the
  injected optax as the plain ones follow each other (hyperparameters become
  fp32 arrays, in both)."""
  static = ("ns_steps",) if factory is fo.muon else ()
  params = _tree(jnp.float32)
  g = jax.tree.map(jnp.cos, params)
  for extra in ({}, fp32):
    injected = optax.inject_hyperparams(factory, static_args=static)(
        learning_rate=0.02, **kwargs, **extra)
    reference = optax.inject_hyperparams(optax_factory, static_args=static)(learning_rate=0.02, **kwargs)
    state = jax.jit(injected.init)(params)
    ref_state = jax.jit(reference.init)(params)
    assert set(state.hyperparams) == set(ref_state.hyperparams)
    u, new_state = jax.jit(injected.update)(g, state, params)
    if extra:
      u_ref, ref_new = jax.jit(reference.update)(g, ref_state, params)
      # Muon: fuseopt's NS kernel against optax's iteration, both fp32, their
      # products summed in other orders: an error relative to the matrix's
      # largest entry (jax 0.12.1: 2.3e-8 on an entry of 1.1e-3 in a leaf
      # whose largest is 1.8e-2). Adam: fuseopt multiplies by the bias
      # corrections' reciprocals, which is what XLA makes of optax's
      # divisions in most programs; in this one it rewrote optax's
      # `mu / bc1 / d` into `mu / (bc1 * d)` instead (docs/testing.md,
      # "FMA"): a few fp32 ulps.
      if factory is fo.muon:
        _assert_bitwise(u, u_ref, rtol=2e-5, of_largest=True)
      else:
        _assert_bitwise(u, u_ref, rtol=3e-7)
      _assert_bitwise(new_state.inner_state, ref_new.inner_state)
    plain = factory(learning_rate=0.02, **kwargs, **extra)
    u_plain, _ = jax.jit(plain.update)(g, plain.init(params), params)
    for x, y in zip(jax.tree.leaves(u), jax.tree.leaves(u_plain)):
      np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=1e-4)


# ------------------------------------- optax.inject_hyperparams, optax's way --
def _attn_tree():
  k1, k2 = jax.random.split(jax.random.key(3))
  return {"attn": {"q_proj": jax.random.normal(k1, (8, 8)), "k_proj": jax.random.normal(k2, (8, 8))},
          "b": jnp.linspace(-1.0, 1.0, 4)}


# qk_stats of the "attn" module (2 heads): head 0 is clipped at tau = 50.
_QK = {"attn": jnp.array([300.0, 20.0])}
_QK_LOW = {"attn": jnp.array([30.0, 20.0])}
INJECTED = [
    pytest.param(fo.adam, {}, {}, {}, id="adam"),
    pytest.param(fo.adamw, {"weight_decay": 0.1}, {}, {}, id="adamw"),
    pytest.param(fo.muon, {"weight_decay": 0.1}, {}, {}, id="muon"),
    pytest.param(fo.normuon, {"weight_decay": 0.1}, {}, {}, id="normuon"),
    pytest.param(fo.muonclip, {"tau": 50.0}, {"qk_stats": _QK}, {"qk_stats": _QK_LOW}, id="muonclip"),
]


def _with_lr(state, lr):
  hp = dict(state.hyperparams)
  hp["learning_rate"] = jnp.asarray(lr, hp["learning_rate"].dtype)
  return state._replace(hyperparams=hp)


@pytest.mark.parametrize("factory, kwargs, extra, unclipped", INJECTED)
def test_inject_hyperparams_under_jit_as_optax_does(factory, kwargs, extra, unclipped):
  """optax's pattern with no static_args: ``jax.jit(tx.init)``, several
  ``jax.jit(tx.update)`` steps, the learning rate changed by hand in
  ``state.hyperparams`` between them. Each step is bitwise the plain
  transform built from the same hyperparameter values, and the update
  scales with the learning rate written into the state."""
  params = _attn_tree()
  tx = optax.inject_hyperparams(factory)(learning_rate=1e-2, **kwargs)
  state = jax.jit(tx.init)(params)
  # Muon's ns_steps (like every kernel-sizing argument) stays static.
  assert "ns_steps" not in state.hyperparams
  _assert_bitwise(state.inner_state, factory(1e-2, **kwargs).init(params))
  update = jax.jit(tx.update)
  plain_update = jax.jit(lambda hp, g, s, p, ex: factory(**hp).update(g, s, p, **ex))

  for t, lr in enumerate([1e-2, 1e-2, 4e-2, 5e-3]):
    g = jax.tree.map(lambda p: jnp.sin(p * (t + 1.5)) * 3, params)
    state = _with_lr(state, lr)
    u, new_state = update(g, state, params, **extra)
    assert float(new_state.hyperparams["learning_rate"]) == np.float32(lr)
    u_plain, inner_plain = plain_update(state.hyperparams, g, state.inner_state, params, extra)
    _assert_bitwise(u, u_plain)
    _assert_bitwise(new_state.inner_state, inner_plain)
    # Twice the rate, twice the update (exactly: the rate is one fp32 factor);
    # the clip is not linear in the update, so its heads stay below tau here.
    u1, _ = update(g, state, params, **unclipped)
    u2, _ = update(g, _with_lr(state, 2 * lr), params, **unclipped)
    _assert_bitwise(u2, jax.tree.map(lambda x: 2 * x, u1))
    if t == 0:
      # The plain transform given the same fp32 values outside jit, as
      # constants: XLA compiles the clip's arithmetic on a constant learning
      # rate (NorMuon's on a constant b2) in another order (1 ulp), the rest
      # is bitwise.
      plain = factory(**state.hyperparams)
      u_const, _ = jax.jit(plain.update)(g, plain.init(params), params, **extra)
      _assert_bitwise(u, u_const, rtol=1e-6 if factory in (fo.muonclip, fo.normuon) else 0.0)
    params = optax.apply_updates(params, u)
    state = new_state


def test_inject_hyperparams_of_muonclip_injects_what_it_injects_into_muon():
  params = _attn_tree()
  muon_hp = jax.jit(optax.inject_hyperparams(fo.muon)(learning_rate=1e-2).init)(params).hyperparams
  clip_hp = jax.jit(optax.inject_hyperparams(fo.muonclip)(learning_rate=1e-2).init)(params).hyperparams
  assert set(clip_hp) == set(muon_hp) | {"tau"}


def test_inject_hyperparams_ns_steps_given_is_concrete_eagerly_and_refused_traced():
  """A number passed for ns_steps is injected (as optax injects it): eagerly
  its value is read, under jit the error says to list it in static_args."""
  params = _attn_tree()
  g = jax.tree.map(jnp.cos, params)
  tx = optax.inject_hyperparams(fo.muon)(learning_rate=1e-2, ns_steps=3)
  state = tx.init(params)
  assert int(state.hyperparams["ns_steps"]) == 3
  u, _ = tx.update(g, state, params)
  plain = fo.muon(**state.hyperparams)
  _assert_bitwise(u, plain.update(g, plain.init(params), params)[0])
  with pytest.raises(TypeError, match="ns_steps.*traced.*static_args"):
    jax.jit(tx.update)(g, state, params)
  static = optax.inject_hyperparams(fo.muon, static_args=("ns_steps",))(learning_rate=1e-2, ns_steps=3)
  s = jax.jit(static.init)(params)
  jax.jit(static.update)(g, s, params)


def test_ns_steps_default_reads_as_five():
  import inspect
  for f in (fo.muon, fo.scale_by_muon, fo.muonclip):
    default = inspect.signature(f).parameters["ns_steps"].default
    assert default == 5 and repr(default) == "5" and int(default) == 5


@pytest.mark.parametrize("factory, kwargs, extra, unclipped", INJECTED)
def test_step_on_an_injected_transform_falls_back_and_says_why(factory, kwargs, extra, unclipped,
                                                               caplog):
  """inject_hyperparams builds the inner transformation inside update(), so
  step cannot reach its in-place rule: it runs tx.update + apply_updates
  (bitwise) and logs why."""
  del unclipped
  params = _attn_tree()
  g = jax.tree.map(jnp.cos, params)
  tx = optax.inject_hyperparams(factory)(learning_rate=1e-2, **kwargs)
  state = jax.jit(tx.init)(params)
  with caplog.at_level("DEBUG", logger="fuseopt"):
    new_params, new_state = jax.jit(lambda g, s, p: fo.step(tx, g, s, p, **extra))(g, state, params)
  assert "inject_hyperparams hides the inner transformation's in-place rule" in caplog.text
  def fallback(g, s, p):
    u, s = tx.update(g, s, p, **extra)
    return optax.apply_updates(p, u), s
  want_params, want_state = jax.jit(fallback)(g, state, params)
  _assert_bitwise(new_params, want_params)
  _assert_bitwise(new_state, want_state)


def test_max_elements_rejects_an_array():
  with pytest.raises(ValueError, match="NewtonSchulz: max_elements must be an int >= 1 or None"):
    fo.scale_by_muon(execution=fo.Execution(newton_schulz=fo.NewtonSchulz(max_elements=jnp.asarray(4))))


def test_apply_updates_without_seed_is_optax():
  params = {"f": jnp.ones(3), "i": jnp.arange(3), "h": jnp.ones(2, jnp.bfloat16), "n": None}
  updates = {"f": jnp.full(3, 0.5), "i": jnp.full(3, 1.7), "h": jnp.full(2, 1e-3, jnp.bfloat16), "n": None}
  _assert_bitwise(fo.apply_updates(params, updates), optax.apply_updates(params, updates))
  assert fo.apply_updates(None, jnp.ones(3)) is None
  assert optax.apply_updates(None, jnp.ones(3)) is None
  # Seeded: integer leaves still add as optax does, None params stay None.
  out = fo.apply_updates(params, updates, seed=1)
  _assert_bitwise(out["i"], optax.apply_updates(params, updates)["i"])
  assert out["n"] is None


@pytest.mark.parametrize("ns_coeffs", [JORDAN, ((4.0, -5.0, 2.0),) * 5, "dion"])
def test_muon_state_is_optax_muon_state(ns_coeffs):
  params = {"w": jnp.ones((4, 6)), "b": jnp.ones(3)}
  ours = fo.scale_by_muon(ns_coeffs=ns_coeffs).init(params)
  optax_coeffs = {"dion": None}.get(ns_coeffs, ns_coeffs) if isinstance(ns_coeffs, str) else ns_coeffs
  assert isinstance(ours, optax.contrib.MuonState)
  assert type(ours) is optax.contrib.MuonState
  if optax_coeffs is not None:
    theirs = optax.contrib.scale_by_muon(ns_coeffs=optax_coeffs).init(params)
    _assert_bitwise(ours, theirs)
  # The hybrid's whole state has optax.contrib.muon's structure, and with
  # moment_dtype=None (optax's: the AdamW moments in the parameters' dtype) its
  # dtypes, so a checkpoint of one restores into the other.
  if optax_coeffs is not None:
    ours = fo.muon(0.02, ns_coeffs=optax_coeffs, weight_decay=0.1, moment_dtype=None).init(params)
    theirs = optax.contrib.muon(0.02, ns_coeffs=optax_coeffs, weight_decay=0.1).init(params)
    _assert_bitwise(ours, theirs)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.complex64])
def test_muon_uncovered_dtypes_run_optax_iteration(dtype):
  params = {"w": (jax.random.normal(jax.random.key(3), (5, 8)) * (1 + 1j if dtype == jnp.complex64 else 1)).astype(dtype)}
  got = _run(fo.muon(0.02, ns_coeffs=JORDAN), params, steps=2)
  want = _run(optax.contrib.muon(0.02, ns_coeffs=JORDAN), params, steps=2)
  tol = 2e-3 if dtype == jnp.float16 else 1e-5
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert x.dtype == y.dtype
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


@pytest.mark.parametrize("factory", [fo.muon, fo.normuon, fo.muonclip])
def test_inject_hyperparams_injects_the_numbers_and_keeps_the_records(factory):
  """The Muon family under inject_hyperparams: the numeric hyperparameters
  are injected (an injected learning rate of 0 stops every parameter), the
  settings records pass through as they are."""
  ns = fo.NewtonSchulz(dtype="float32", max_elements=1 << 20)
  ex = fo.Execution(implementation="xla", newton_schulz=ns)
  tx = optax.inject_hyperparams(factory)(learning_rate=0.02, weight_decay=0.1, execution=ex)
  params = {"w": jnp.linspace(-1.0, 1.0, 8 * 16).reshape(8, 16), "b": jnp.ones((16,))}
  g = jax.tree.map(jnp.cos, params)
  state = tx.init(params)
  assert {"learning_rate", "weight_decay", "beta", "eps", "adam_b1"} <= set(state.hyperparams)
  assert not {"newton_schulz", "execution"} & set(state.hyperparams)
  u, _ = jax.jit(tx.update)(g, state, params)
  assert all(bool(jnp.any(x != 0)) for x in jax.tree.leaves(u))
  state.hyperparams["learning_rate"] = jnp.zeros([], jnp.float32)
  u, _ = jax.jit(tx.update)(g, state, params)
  assert all(bool(jnp.all(x == 0)) for x in jax.tree.leaves(u))


def test_muon_signature_is_optaxs_then_the_moment_format_and_the_execution_record():
  """fo.muon takes optax.contrib.muon's arguments, in its order, then the
  AdamW side's moment format (adamw's name for it) and the one settings
  record, Execution (the Newton-Schulz settings are its newton_schulz
  field): at most 20 parameters. Every variant is a piece of a value
  (Experts specs, a cautious rate), not a parameter."""
  import inspect
  ours = list(inspect.signature(fo.muon).parameters)
  theirs = list(inspect.signature(optax.contrib.muon).parameters)
  assert ours == theirs + ["moment_dtype", "execution"]
  assert len(ours) <= 20
  assert list(inspect.signature(fo.scale_by_muon).parameters)[-1] == "execution"
  assert "newton_schulz" not in inspect.signature(fo.scale_by_muon).parameters


def test_the_newton_schulz_settings_are_an_execution_field():
  """Execution(newton_schulz=...) takes the record or a mapping of its fields
  (unknown ones refused, naming them); Adam, which runs no Newton-Schulz,
  refuses a record that sets it rather than ignoring it."""
  ex = fo.Execution(newton_schulz={"dtype": "float32", "gram": False})
  assert ex.newton_schulz == fo.NewtonSchulz(dtype="float32", gram=False)
  with pytest.raises(ValueError, match=r"Execution: newton_schulz has unknown fields \['steps'\]"):
    fo.Execution(newton_schulz={"steps": 3})
  with pytest.raises(TypeError, match=r"Execution: newton_schulz must be a fuseopt.optim.NewtonSchulz"):
    fo.Execution(newton_schulz="float32")
  for make in (fo.adam, fo.adamw):
    with pytest.raises(ValueError, match=rf"{make.__name__}: execution.newton_schulz is the Muon "
                                         rf"family's"):
      make(1e-3, execution=ex)
  with pytest.raises(ValueError, match=r"scale_by_adam: execution.newton_schulz"):
    fo.scale_by_adam(execution={"newton_schulz": {"dtype": "float32"}})
  with pytest.raises(TypeError, match=r"unexpected keyword argument 'newton_schulz'"):
    fo.muon(0.02, newton_schulz=fo.NewtonSchulz())
  # The Muon family takes it, its AdamW side running without it.
  params = {"w": jnp.ones((8, 16)), "b": jnp.ones((16,))}
  tx = fo.muon(0.02, execution=ex, moment_dtype=None)
  state = tx.init(params)
  tx.update(params, state, params)
