"""fo.scale_by_adam / adam / adamw with blockwise moments (``moment_dtype="int8"``
and ``"int4"``): the state, its bytes, the fallback of leaves that do not
divide into blocks, the fused step, optax.inject_hyperparams."""

import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fuseopt.optim as fo
from fuseopt.benchmarks import workloads
from fuseopt.kernels.adam import int4 as Q4
from fuseopt.kernels.adam import quantized as Q


def _params():
  k = jax.random.split(jax.random.key(0), 3)
  return {"w": jax.random.normal(k[0], (8, 512)), "e": jax.random.normal(k[1], (4, 256), jnp.bfloat16),
          "b": jax.random.normal(k[2], (10,))}


def _grads(t, params):
  leaves, treedef = jax.tree.flatten(params)
  ks = jax.random.split(jax.random.fold_in(jax.random.key(1), t), len(leaves))
  return treedef.unflatten([jax.random.normal(k, x.shape, x.dtype) for k, x in zip(ks, leaves)])


def _same_tree(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(la, lb):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(np.atleast_1d(np.asarray(x)).view(np.uint8),
                                  np.atleast_1d(np.asarray(y)).view(np.uint8))


def test_state_layout_and_fallback_warning():
  params = _params()
  tx = fo.adamw(1e-3, moment_dtype="int8")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    state = tx.init(params)
    tx.init(params)                      # warned once per transformation
  msgs = [str(w.message) for w in caught]
  assert len(msgs) == 1 and "['b']" in msgs[0] and "256" in msgs[0], msgs
  adam_state = state[0]
  assert isinstance(adam_state, optax.ScaleByAdamState)
  for name, shape in (("w", (8, 512)), ("e", (4, 256))):
    mu, nu = adam_state.mu[name], adam_state.nu[name]
    assert isinstance(mu, Q.QuantizedMoment) and isinstance(nu, Q.QuantizedMoment)
    assert mu.codes.dtype == jnp.int8 and nu.codes.dtype == jnp.uint8
    assert mu.codes.shape == shape and mu.scales.shape == shape[:-1] + (shape[-1] // 256,)
    assert mu.scales.dtype == jnp.float32
  assert adam_state.mu["b"].dtype == jnp.bfloat16 and adam_state.nu["b"].dtype == jnp.bfloat16


def test_int4_state_layout_blocks_over_trailing_axes():
  """4-bit moments: packed codes (the leaf's last axis halved), a scale per
  128 of the blocked view; an nnx-shaped (d, heads, 64) leaf is blocked over
  its trailing axes, an odd last axis keeps bf16."""
  params = {"q": jnp.ones((8, 4, 64)), "w": jnp.ones((8, 512)), "odd": jnp.ones((256, 3))}
  with pytest.warns(UserWarning, match=r"'int4' needs .*even last axis.*\['odd'\]"):
    state = fo.adamw(1e-3, moment_dtype="int4").init(params)
  mu = state[0].mu
  assert isinstance(mu["q"], Q4.PackedMoment) and mu["q"].codes.shape == (8, 4, 32)
  assert mu["q"].scales.shape == (8, 2) and mu["w"].scales.shape == (8, 4)
  assert mu["odd"].dtype == jnp.bfloat16


@pytest.mark.parametrize("fmt,most", [("int8", 2.05), ("int4", 1.1)])
def test_state_bytes_of_the_llama_tree(fmt, most):
  """8-bit: 2 + 8/256 bytes a parameter (2.03); 4-bit: 1 + 8/128 (1.06)."""
  params = workloads.llama_tree()
  state = jax.eval_shape(fo.adamw(1e-3, moment_dtype=fmt).init, params)
  n = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
  state_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state))
  assert state_bytes / n <= most, state_bytes / n
  bf16 = jax.eval_shape(fo.adamw(1e-3).init, params)
  assert sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(bf16)) / n >= 4


def test_bad_arguments_are_named():
  with pytest.raises(ValueError, match="mu_dtype must be None with moment_dtype='int8'"):
    fo.adamw(1e-3, mu_dtype=jnp.bfloat16, moment_dtype="int8")
  with pytest.raises(ValueError, match="mu_dtype"):
    fo.scale_by_adam(mu_dtype="float32", moment_dtype=jnp.int8)
  with pytest.raises(ValueError, match="moment_dtype"):
    fo.adam(1e-3, moment_dtype="uint8")


@pytest.mark.parametrize("impl,fmt", [("xla", "int8"), ("triton", "int8"), ("xla", "int4")])
def test_fused_step_equals_update_and_apply(impl, fmt):
  """fo.step and tx.update + apply_updates: the same moments bit for bit, and
  (fp32 leaves) the same parameters, over three steps."""
  params = _params()
  tx = fo.adamw(1e-2, weight_decay=0.1, moment_dtype=fmt, seed=5,
                execution=fo.Execution(implementation=impl, interpret=True))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    state = tx.init(params)

  @jax.jit
  def unfused(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  fused = jax.jit(functools.partial(fo.step, tx), donate_argnums=(1, 2))
  pa, sa = params, state
  pb, sb = jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, state)
  for t in range(3):
    g = _grads(t, params)
    pa, sa = unfused(pa, sa, g)
    pb, sb = fused(g, sb, pb)
  _same_tree(sa, sb)
  np.testing.assert_allclose(np.asarray(pa["w"]), np.asarray(pb["w"]), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_inject_hyperparams(fmt):
  params = _params()
  plain = fo.adamw(1e-2, weight_decay=0.1, moment_dtype=fmt)
  # (b1, b2, eps static: injected, they would be fp32 arrays, and 1 - b1 rounds
  # differently from the Python float's)
  inj = optax.inject_hyperparams(fo.adamw, static_args=("b1", "b2", "eps", "eps_root"))(
      learning_rate=1e-2, weight_decay=0.1, moment_dtype=fmt)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    s1, s2 = plain.init(params), inj.init(params)
  g = _grads(0, params)
  u1, s1 = jax.jit(plain.update)(g, s1, params)
  u2, s2 = jax.jit(inj.update)(g, s2, params)
  # (injected hyperparameters are fp32 arrays where the plain chain multiplies
  # by Python floats: the updates agree to fp32 rounding of lr and wd, the
  # moments, which use neither, bit for bit; a bf16 leaf's update may come out
  # in fp32 from the injected chain)
  for a, b in zip(jax.tree.leaves(u1), jax.tree.leaves(u2)):
    rtol = 1e-4 if a.dtype == b.dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=rtol)
  _same_tree(s1, s2.inner_state)
  assert isinstance(s2.inner_state[0].mu["w"], Q.QuantizedMoment if fmt == "int8"
                    else Q4.PackedMoment)


@pytest.mark.parametrize("factory", ["muon", "normuon"])
def test_muon_adamw_side_takes_int8_moments(factory):
  """fo.muon / fo.normuon(moment_dtype="int8"): the AdamW side's
  leaves hold QuantizedMoment pairs (NorMuon's per-neuron nu stays fp32); the fused step
  equals update + apply_updates."""
  k = jax.random.split(jax.random.key(0), 3)
  params = {"w": jax.random.normal(k[0], (256, 512)), "emb": jax.random.normal(k[1], (64, 256)),
            "b": jax.random.normal(k[2], (512,))}
  dims = {"w": fo.MuonDimensionNumbers(0, 1), "emb": None, "b": None}
  tx = getattr(fo, factory)(1e-2, moment_dtype="int8",
                            muon_weight_dimension_numbers=dims, weight_decay=0.1,
                            adam_weight_decay=0.1)
  state = tx.init(params)
  quant = [x for x in jax.tree.leaves(state, is_leaf=Q.is_quantized) if Q.is_quantized(x)]
  assert len(quant) == 4      # mu and nu of "emb" and "b"
  g = _grads(0, params)
  p_fused, s_fused = jax.jit(lambda p, s, g: fo.step(tx, g, s, p))(params, state, g)
  u, s_plain = jax.jit(tx.update)(g, state, params)
  if factory == "muon":
    _same_tree(s_fused, s_plain)
  else:   # (NorMuon's nu reads the bf16 Newton-Schulz output, which the two programs round apart)
    _same_tree(s_fused.inner_states["adam"], s_plain.inner_states["adam"])
  for name in ("emb", "b"):
    np.testing.assert_allclose(np.asarray(p_fused[name]),
                               np.asarray(optax.apply_updates(params, u)[name]), rtol=1e-6)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("state_format,tx_format,found,keeps", [
    ("bfloat16", "int8", "bfloat16 moments", "8-bit moments"),
    ("float32", "int8", "float32 moments", "8-bit moments"),
    ("int8", "bfloat16", "8-bit moments", "bfloat16 moments"),
    ("int8", "float32", "8-bit moments", "float32 moments"),
    ("int8", None, "8-bit moments", "moments in optax's dtypes"),
])
def test_update_refuses_a_state_of_the_other_moment_format(state_format, tx_format, found,
                                                           keeps, jit):
  """Issue 40, 3: a bf16-moment state given to an 8-bit optimizer's update ran
  and returned bf16 moments (moment_dtype="int8" silently ignored), and 8-bit
  moments ran through a bf16 optimizer. Both now raise at the first update,
  naming the leaf, the format found and the format expected, as fo.step
  refuses such a state by its structure."""
  params = _params()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")     # (the int8 fallback warning of leaf "b")
    state = fo.adamw(1e-3, moment_dtype=state_format).init(params)
  tx = fo.adamw(1e-3, moment_dtype=tx_format)
  g = _grads(0, params)
  update = jax.jit(tx.update) if jit else tx.update
  # (leaf "b" (10,) keeps bf16 moments under int8 too: "e" is the first to differ)
  with pytest.raises(ValueError, match=rf"adamw: the state holds {found}.* at \['e'\], but this "
                                       rf"optimizer keeps {keeps}"):
    update(g, state, params)
  with warnings.catch_warnings(), pytest.raises(ValueError, match="step: state"):
    warnings.simplefilter("ignore")   # (step's tx.init traced: the same warning)
    fo.step(tx, g, state, params)


def test_update_takes_its_own_state_and_the_fallback_leaves():
  """The check refuses no state of the optimizer's own format: an 8-bit state whose
  leaf "b" (10 elements, no block) keeps bf16 moments, a bf16 state under scale_by_adam."""
  params = _params()
  for tx in (fo.adamw(1e-3, moment_dtype="int8"), fo.adam(1e-3, moment_dtype=jnp.int8),
             fo.scale_by_adam(moment_dtype="bfloat16"), fo.adamw(1e-3, moment_dtype=None)):
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      state = tx.init(params)
    tx.update(_grads(0, params), state, params)


@pytest.mark.parametrize("factory", ["muon", "normuon"])
def test_muon_adamw_side_refuses_a_state_of_the_other_moment_format(factory):
  """The Muon family's AdamW side (moment_dtype) refuses as adamw does."""
  k = jax.random.split(jax.random.key(0), 2)
  params = {"w": jax.random.normal(k[0], (8, 16)), "emb": jax.random.normal(k[1], (4, 256))}
  dims = {"w": fo.MuonDimensionNumbers(0, 1), "emb": None}
  make = lambda fmt: getattr(fo, factory)(1e-2, moment_dtype=fmt,
                                          muon_weight_dimension_numbers=dims)
  g = _grads(0, params)
  for state_format, tx_format, found in (("int8", jnp.bfloat16, "8-bit"),
                                         (jnp.bfloat16, "int8", "bfloat16"),
                                         ("int8", None, "8-bit")):
    state = make(state_format).init(params)
    with pytest.raises(ValueError, match=rf"adamw: the state holds {found} .*\['emb'\]"):
      make(tx_format).update(g, state, params)


@pytest.mark.parametrize("mode,most", [("adamw_master24_int8", 5.1), ("adamw_master24_int4", 4.1),
                                       ("muon_master24_int8", 4.1), ("muon_bf16_int8", 3.1)])
def test_memory_modes_meet_their_bytes(mode, most):
  """Parameters + state a parameter of the whole 1.2 B tree (docs/adam.md,
  "Memory by mode"): 24-bit masters with 8-bit moments (goal A) and 4-bit
  ones (goal B), Muon with a 24-bit master and 8-bit momentum (goal C) and on
  stochastically rounded bf16 parameters (goal C')."""
  from fuseopt.benchmarks import memory
  assert memory.figures(mode, "1.2B")["stored"] <= most
