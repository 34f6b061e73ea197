"""Exact bf16 parameters: a uint16 companion keeps the fp32 master in the state."""

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
    # The visible half is the master truncated toward zero.
    for m, h in zip(jax.tree.leaves(p32), jax.tree.leaves(p16)):
      assert bool(jnp.all(jnp.abs(h.astype(jnp.float32)) <= jnp.abs(m)))


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


def test_state_holds_a_uint16_companion_shaped_like_the_params():
  p16, _ = _bf16_start()
  state = fo.track_mantissa(fo.adamw(1e-3)).init(p16)
  assert isinstance(state, fo.MantissaState)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), state.companion) == \
      jax.tree.map(lambda x: (x.shape, jnp.dtype(jnp.uint16)), p16)
  # master_params without a companion: the params widened.
  plain = fo.adamw(1e-3).init(p16)
  _assert_bitwise(fo.master_params(p16, plain), jax.tree.map(lambda x: x.astype(jnp.float32), p16),
                  "no companion")


def test_the_join_is_exact_and_the_split_truncates():
  x = jnp.concatenate([jax.random.normal(jax.random.key(0), (4096,)) * 100,
                       jnp.array([0.0, -0.0, jnp.inf, -jnp.inf, 1e-40, -3e38])])
  hi, lo = bits.split(x)
  assert hi.dtype == jnp.bfloat16 and lo.dtype == jnp.uint16
  np.testing.assert_array_equal(np.asarray(bits.join(hi, lo)).view(np.uint32),
                                np.asarray(x).view(np.uint32))
  assert bool(jnp.all(jnp.abs(hi.astype(jnp.float32)) <= jnp.abs(x)))


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
