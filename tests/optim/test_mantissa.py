"""bf16 parameters with a master: an int16 companion keeps the fp32 master in the
state, an int8 companion a 24-bit master."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fuseopt.optim as fo
from fuseopt.optim import fusion
from fuseopt.kernels import mantissa as bits
from fuseopt.optim import MuonDimensionNumbers as MDN

SHAPES = {"w": (48, 32), "stack": (2, 16, 24), "b": (32,)}
DIMS = {"w": MDN(0, 1), "stack": MDN(1, 2), "b": None}
_STEPS = 5

FACTORIES = {
    "adamw": lambda **kw: fo.adamw(3e-3, weight_decay=0.1, **kw),
    "adamw-cautious": lambda **kw: fo.adamw(3e-3, weight_decay=fo.cautious(0.1),
                                            **kw),
    "adam-fp32-moments": lambda **kw: fo.adam(3e-3, moment_dtype=jnp.float32, **kw),
    "muon": lambda **kw: fo.muon(2e-2, weight_decay=0.1, adam_weight_decay=0.1,
                                 muon_weight_dimension_numbers=DIMS, **kw),
    "normuon": lambda **kw: fo.normuon(2e-2, weight_decay=0.1, adam_weight_decay=0.1,
                                       muon_weight_dimension_numbers=DIMS, **kw),
}


def _exact_bf16(name):
  """The optimizer ``name`` on exact bf16 parameters: composed with
  track_mantissa, one way for Adam and the Muon family."""
  return fo.track_mantissa(FACTORIES[name](), owner=name)


def _tree(seed, scale=1.0):
  keys = jax.random.split(jax.random.key(seed), len(SHAPES))
  return {n: scale * jax.random.normal(k, s) for k, (n, s) in zip(keys, sorted(SHAPES.items()))}


def _grads(seed):
  """fp32 gradients whose values are bf16 values (what a bf16 model gives)."""
  return jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), _tree(seed))


def _bf16_start():
  """bf16 params, and the same values in fp32 (the fp32 run's start)."""
  p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _tree(0))
  return p16, jax.tree.map(lambda x: x.astype(jnp.float32), p16)


def _assert_bitwise(a, b, what, rtol=0.0):
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
    assert x.dtype == y.dtype, (what, path)
    if rtol:
      np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=rtol,
                                 atol=1e-7, err_msg=f"{what} {jax.tree_util.keystr(path)}")
    else:
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y),
                                    err_msg=f"{what} {jax.tree_util.keystr(path)}")


def _runner(tx, fused, apply=optax.apply_updates):
  """``jit(fo.step)``, or ``jit(tx.update + apply)``."""
  if fused:
    return jax.jit(lambda g, s, p: fo.step(tx, g, s, p))

  def one(g, s, p):
    u, s = tx.update(g, s, p)
    return apply(p, u), s
  return jax.jit(one)


@pytest.mark.parametrize("grad_dtype", [jnp.float32, jnp.bfloat16], ids=["gf32", "gbf16"])
@pytest.mark.parametrize("fused", [True, False], ids=["step", "update"])
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_masters_follow_an_fp32_run_bit_for_bit(name, fused, grad_dtype):
  """Same gradient values, five steps: the joined masters equal the fp32
  params of an fp32 run of the same optimizer fed those values in fp32, and
  the wrapped state equals its state, whatever the gradients' dtype (bf16
  parameters have bf16 gradients). Bit for bit for every optimizer, in the
  fused step and through ``update`` + ``apply_updates``."""
  make = FACTORIES[name]
  p16, p32 = _bf16_start()
  tx16, tx32 = _exact_bf16(name), make()
  s16, s32 = tx16.init(p16), tx32.init(p32)
  step16, step32 = _runner(tx16, fused), _runner(tx32, fused)
  for t in range(_STEPS):
    g = _grads(t + 1)
    p16, s16 = step16(jax.tree.map(lambda x: x.astype(grad_dtype), g), s16, p16)
    p32, s32 = step32(g, s32, p32)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(p16))
    masters = fo.master_params(p16, s16)
    _assert_bitwise(masters, p32, f"{name} step {t} params")
    _assert_bitwise(s16.inner_state, s32, f"{name} step {t} state")
    # The visible half is the bf16 value nearest the master.
    for m, h in zip(jax.tree.leaves(p32), jax.tree.leaves(p16)):
      nearest = m.astype(jnp.bfloat16).astype(jnp.float32)
      assert bool(jnp.all(jnp.abs(h.astype(jnp.float32) - m) <= jnp.abs(nearest - m)))


@pytest.mark.parametrize("fused", [True, False], ids=["step", "update"])
@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_24_bit_masters_are_each_steps_fp32_result_rounded(name, fused):
  """With an int8 companion each step's master is what the wrapped fp32
  optimizer makes of the previous master, rounded to 15 mantissa bits
  (``bits.master``), and its state the fp32 optimizer's, bit for bit."""
  tx24, tx32 = fo.track_mantissa(FACTORIES[name](), master_bits=24), FACTORIES[name]()
  p16, _ = _bf16_start()
  s24 = tx24.init(p16)
  step24, step32 = _runner(tx24, fused), _runner(tx32, fused)
  for t in range(_STEPS):
    g = _grads(t + 1)
    p32, s32 = step32(g, s24.inner_state, fo.master_params(p16, s24))
    p16, s24 = step24(jax.tree.map(lambda x: x.astype(jnp.bfloat16), g), s24, p16)
    want = jax.tree.map(lambda x: bits.master(x, jnp.int8), p32)
    _assert_bitwise(fo.master_params(p16, s24), want, f"{name} step {t} masters")
    _assert_bitwise(s24.inner_state, s32, f"{name} step {t} state")


@pytest.mark.parametrize("master_bits", [32, 24])
def test_masters_compose_with_8_bit_moments(master_bits):
  """bf16 parameters with a master on 8-bit moments (3 + 2.03 bytes a
  parameter with a 24-bit master): the fused step stores what update +
  apply_updates stores, and each step's master is the fp32 optimizer's step
  of the previous master, rounded as the companion keeps it."""
  make = lambda: fo.adamw(3e-3, weight_decay=0.1, moment_dtype="int8")
  tx, tx32 = fo.track_mantissa(make(), master_bits=master_bits), make()
  keys = jax.random.split(jax.random.key(5), 2)
  p16 = {"w": jax.random.normal(keys[0], (8, 512)).astype(jnp.bfloat16),
         "b": jax.random.normal(keys[1], (32,)).astype(jnp.bfloat16)}
  lo = jnp.int16 if master_bits == 32 else jnp.int8
  s = fused_s = tx.init(p16)
  fused_p = p16
  for t in range(3):
    g = jax.tree.map(lambda x: jnp.cos(x.astype(jnp.float32) * (t + 2)).astype(jnp.bfloat16), p16)
    p32, s32 = _runner(tx32, False)(jax.tree.map(lambda x: x.astype(jnp.float32), g), s.inner_state,
                                    fo.master_params(p16, s))
    p16, s = _runner(tx, False)(g, s, p16)
    fused_p, fused_s = _runner(tx, True)(g, fused_s, fused_p)
    _assert_bitwise(fo.master_params(p16, s), jax.tree.map(lambda x: bits.master(x, lo), p32),
                    f"step {t} masters")
    _assert_bitwise(fused_p, p16, f"step {t} fused params")
    _assert_bitwise(fused_s, s, f"step {t} fused state")
  assert type(s.inner_state[0].mu["w"]).__name__ == "QuantizedMoment"


def test_master_bits_are_checked_by_name():
  for bad in (16, 23, np.int32(16)):
    with pytest.raises(ValueError, match=r"master_bits must be one of \(32, 24\).*got"):
      fo.track_mantissa(fo.adamw(1e-3), master_bits=bad)
  # Of the wrong kind (it used to say "unhashable type" for a list or an array):
  for bad in ("24", True, 24.0, [24], jnp.array([24]), jnp.array(24.0)):
    with pytest.raises(TypeError, match=r"track_mantissa: master_bits must be one of \(32, 24\) "
                                        r"\(32: an fp32 master, an int16 companion; 24: a 24-bit "
                                        r"master, an int8 companion\), a static int, got"):
      fo.track_mantissa(fo.adamw(1e-3), master_bits=bad)
  # A concrete integer scalar is its int.
  for good in (jnp.array(24), np.int64(24), np.array(24, np.int8)):
    state = fo.track_mantissa(fo.adamw(1e-3), master_bits=good).init(_bf16_start()[0])
    assert {x.dtype for x in jax.tree.leaves(state.companion)} == {jnp.dtype(jnp.int8)}
  cfg = fo.OptimConfig(optimizer="adamw", learning_rate=1e-3, bf16_params="mantissa24")
  state = fo.build_optimizer(cfg, steps=10).init(_bf16_start()[0])
  (mantissa_state,) = [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, fo.MantissaState))
                       if isinstance(s, fo.MantissaState)]
  assert {x.dtype for x in jax.tree.leaves(mantissa_state.companion)} == {jnp.dtype(jnp.int8)}


@pytest.mark.parametrize("apply", [optax.apply_updates, fo.apply_updates],
                         ids=["optax", "fuseopt"])
def test_updates_of_tracked_leaves_are_fp32_and_land_on_the_new_half(apply):
  """With bf16 gradients the update of a tracked leaf is fp32 (a bf16 one
  would round the step), and either apply_updates lands exactly on the
  new bf16 half (fuseopt's stochastic rounding leaves a bf16 value alone)."""
  tx = fo.track_mantissa(fo.adamw(1e-3, weight_decay=0.1))
  p16, _ = _bf16_start()
  kw = {"seed": 7} if apply is fo.apply_updates else {}
  unfused, fused = _runner(tx, False, lambda p, u: apply(p, u, **kw)), _runner(tx, True)
  state = fused_state = tx.init(p16)
  new = want = p16
  for t in range(3):   # (the first step's direction is +-1, a bf16 value)
    g = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _grads(t + 1))
    updates, _ = jax.jit(tx.update)(g, state, new)
    assert all(u.dtype == jnp.float32 for u in jax.tree.leaves(updates))
    new, state = unfused(g, state, new)
    want, fused_state = fused(g, fused_state, want)
    _assert_bitwise(fo.master_params(new, state), fo.master_params(want, fused_state),
                    f"step {t} masters")
  _assert_bitwise(new, want, "applied update vs fused step")


@pytest.mark.parametrize("master_bits, dtype", [(32, jnp.int16), (24, jnp.int8)])
def test_state_holds_a_companion_shaped_like_the_params(master_bits, dtype):
  p16, _ = _bf16_start()
  state = fo.track_mantissa(fo.adamw(1e-3), master_bits=master_bits).init(p16)
  assert isinstance(state, fo.MantissaState)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), state.companion) == \
      jax.tree.map(lambda x: (x.shape, jnp.dtype(dtype)), p16)
  # master_params without a companion: the params widened.
  plain = fo.adamw(1e-3).init(p16)
  _assert_bitwise(fo.master_params(p16, plain), jax.tree.map(lambda x: x.astype(jnp.float32), p16),
                  "no companion")


def _bit_patterns():
  """fp32 values of every exponent: random bit patterns (NaN payloads
  included), the specials, ties of both roundings and the bf16 overflow edge."""
  x = np.random.default_rng(0).integers(0, 2**32, 1 << 16, dtype=np.uint64).astype(np.uint32)
  edges = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 1, 0x80000001,
                    0x3F808000, 0x3F818000, 0xBF808000, 0x3F800080, 0x3F800180, 0x3F7FFF80,
                    0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0xFF7FFFFF], np.uint32)
  return np.concatenate([x, edges]).view(np.float32)


def test_the_split_is_nearest_and_the_join_exact_with_an_int16_companion():
  x = _bit_patterns()
  hi, lo = bits.split(jnp.asarray(x))
  assert hi.dtype == jnp.bfloat16 and lo.dtype == jnp.int16
  back = np.asarray(bits.join(hi, lo))
  nan = np.isnan(x)
  np.testing.assert_array_equal(back[~nan].view(np.uint32), x[~nan].view(np.uint32))
  assert np.isnan(back[nan]).all() and np.isnan(np.asarray(hi, np.float32)[nan]).all()
  # hi is as near the master as bf16's own round to nearest even (ties away
  # from zero instead of to even).
  h, cast = np.asarray(hi, np.float64), np.asarray(jnp.asarray(x).astype(jnp.bfloat16), np.float64)
  ok = np.isfinite(x) & np.isfinite(cast)
  assert (np.abs(h[ok] - x[ok]) <= np.abs(cast[ok] - x[ok])).all()


def test_the_24_bit_master_is_fp32_rounded_to_15_mantissa_bits():
  x = _bit_patterns()
  hi, lo = bits.split(jnp.asarray(x), jnp.int8)
  assert hi.dtype == jnp.bfloat16 and lo.dtype == jnp.int8
  master = np.asarray(bits.join(hi, lo))
  np.testing.assert_array_equal(master.view(np.uint32), np.asarray(bits.master(jnp.asarray(x), jnp.int8)).view(np.uint32))
  fin = np.isfinite(x) & np.isfinite(master) & (np.abs(x) >= np.finfo(np.float32).tiny)
  assert ((master.view(np.uint32) & 0xFF) == 0)[~np.isnan(x)].all()
  # Round to nearest at 15 mantissa bits: within half its last place, 2**-16 relative.
  assert (np.abs(master[fin].astype(np.float64) - x[fin]) <= 2.0**-16 * np.abs(x[fin])).all()
  # A 24-bit value is its own master: splitting it again changes nothing.
  again = np.asarray(bits.join(*bits.split(jnp.asarray(master), jnp.int8)))
  np.testing.assert_array_equal(again[~np.isnan(x)].view(np.uint32), master[~np.isnan(x)].view(np.uint32))


def test_builder_skipped_step_keeps_params_and_companion():
  cfg = fo.OptimConfig(optimizer="adamw", learning_rate=1e-3, weight_decay=0.1,
                       bf16_params="mantissa", skip_nonfinite=True, clip_norm=1.0)
  tx = fo.build_optimizer(cfg, steps=10)
  p16, _ = _bf16_start()
  state = tx.init(p16)
  step = jax.jit(lambda g, s, p: fo.step(tx, g, s, p))
  p1, state = step(_tree(1), state, p16)
  m1 = fo.master_params(p1, state)
  bad = jax.tree.map(lambda g: g.at[0].set(jnp.nan), _tree(2))
  p2, state2 = step(bad, state, p1)
  _assert_bitwise(p2, p1, "skipped params")
  _assert_bitwise(fo.master_params(p2, state2), m1, "skipped masters")
  assert not all(bool(jnp.all(a == b)) for a, b in zip(jax.tree.leaves(fo.master_params(p1, state)),
                                                       jax.tree.leaves(_bf16_start()[1])))


@pytest.mark.parametrize("factory", [fo.adam, fo.adamw, fo.muon, fo.normuon])
def test_bad_input_is_refused_by_name(factory):
  # Exact bf16 parameters are one composition for every optimizer: no flag.
  with pytest.raises(TypeError, match="bf16_params"):
    factory(1e-3, bf16_params="mantissa")
  tx = fo.track_mantissa(factory(1e-3))
  with pytest.raises(ValueError, match="exact bf16 parameters .* need bfloat16 parameters.*'w'"
                                       ".*float32"):
    tx.init({"w": jnp.ones((8, 8), jnp.float32)})


def test_muonclip_and_config_refuse_mantissa():
  with pytest.raises(ValueError, match="bf16_params='mantissa': not with optimizer 'muonclip'"):
    fo.OptimConfig(optimizer="muonclip", learning_rate=0.1, bf16_params="mantissa")
  with pytest.raises(ValueError, match="bf16_params must be one of"):
    fo.OptimConfig(optimizer="adamw", learning_rate=0.1, bf16_params="mantisa")


# ------------------------------------------------------------- composition --
_LABELS = {"b": "plain", "stack": "tracked", "w": "tracked"}


def _composed(kind):
  """(transformation on the bf16 params with the tracked part in mantissa
  mode, the same on fp32 params without it, the leaves a companion covers)."""
  adamw = lambda **kw: fo.adamw(3e-3, weight_decay=0.1, **kw)
  if kind == "optax.partition":
    return (optax.partition({"tracked": fo.track_mantissa(adamw()), "plain": optax.sgd(1e-2)},
                            _LABELS),
            optax.partition({"tracked": adamw(), "plain": optax.sgd(1e-2)}, _LABELS),
            ("stack", "w"))
  if kind == "fusion.partition":
    make = lambda: fusion.partition({"tracked": adamw(), "plain": fo.adam(1e-3)}, _LABELS)
    return fo.track_mantissa(make()), make(), ("b", "stack", "w")
  if kind == "optax.masked":
    mask = {"b": False, "stack": True, "w": True}
    return (optax.masked(fo.track_mantissa(adamw()), mask), optax.masked(adamw(), mask),
            ("stack", "w"))
  if kind == "optax.chain":
    return (optax.chain(optax.scale_by_schedule(lambda c: 1.0), fo.track_mantissa(adamw())),
            optax.chain(optax.scale_by_schedule(lambda c: 1.0), adamw()), ("b", "stack", "w"))
  config = {"frozen": dict(frozen=("b",)),
            "trainable": dict(trainable=("w", "stack")),
            "param_groups": dict(param_groups=[
                {"name": "no_decay", "patterns": ["b"], "weight_decay": 0.0},
                {"name": "rest", "patterns": ["*"], "learning_rate_multiplier": 0.5}])}[kind]
  make = lambda **kw: fo.build_optimizer(fo.OptimConfig(
      optimizer="adamw", learning_rate=3e-3, weight_decay=0.1, **config, **kw), steps=10)
  covered = ("stack", "w") if kind in ("frozen", "trainable") else ("b", "stack", "w")
  return make(bf16_params="mantissa"), make(), covered


COMPOSED = ["optax.partition", "fusion.partition", "optax.masked", "optax.chain", "frozen",
            "trainable", "param_groups"]


@pytest.mark.parametrize("fused", [True, False], ids=["step", "update"])
@pytest.mark.parametrize("kind", COMPOSED)
def test_composes_and_master_params_reads_every_recipe(kind, fused):
  """Inside partitions, masks, chains, the builder's freeze and groups:
  the covered leaves' masters follow the fp32 run bit for bit (bf16
  gradients), and master_params returns every other leaf as it is."""
  tx16, tx32, covered = _composed(kind)
  p16, p32 = _bf16_start()
  s16, s32 = tx16.init(p16), tx32.init(p32)
  step16, step32 = _runner(tx16, fused), _runner(tx32, fused)
  for t in range(3):
    g = _grads(t + 1)
    p16, s16 = step16(jax.tree.map(lambda x: x.astype(jnp.bfloat16), g), s16, p16)
    p32, s32 = step32(g, s32, p32)
    masters = fo.master_params(p16, s16)
    for name in SHAPES:
      if name in covered:
        _assert_bitwise(masters[name], p32[name], f"{kind} step {t} {name}")
      else:
        assert masters[name] is p16[name], (kind, name)


def test_master_params_names_what_does_not_match():
  p16, _ = _bf16_start()
  state = fo.track_mantissa(fo.adamw(1e-3)).init(p16)
  with pytest.raises(ValueError, match=r"params have \['extra'\] that the state lacks"):
    fo.master_params({**p16, "extra": p16["b"]}, state)
  with pytest.raises(ValueError, match=r"the state has \['w'\] that params lack"):
    fo.master_params({k: v for k, v in p16.items() if k != "w"}, state)
  with pytest.raises(ValueError, match=r"the leaf at \['w'\] has shape \(32, 48\).*\(48, 32\)"):
    fo.master_params({**p16, "w": p16["w"].T}, state)
  with pytest.raises(ValueError, match="do not match the companion tree"):
    fo.master_params([p16["b"], p16["stack"], p16["w"]], state)


def test_track_mantissa_refuses_what_is_no_optimizer_and_nesting():
  with pytest.raises(TypeError, match=r"track_mantissa: tx must be an optax GradientTransformation"
                                      r".*got 'adamw'"):
    fo.track_mantissa("adamw")
  with pytest.raises(ValueError, match=r"track_mantissa: tx is a track_mantissa\(...\) already; "
                                       r"wrap the optimizer once"):
    fo.track_mantissa(fo.track_mantissa(fo.adamw(1e-3)))
  with pytest.raises(ValueError, match=r"track_mantissa: tx is a track_mantissa"):
    fo.track_mantissa(fo.track_mantissa(fo.muon(1e-3), master_bits=24), master_bits=24)
