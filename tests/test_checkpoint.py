"""orbax-checkpoint: save the optimizer state mid-run, restore it, continue:
the next steps are bitwise those of the uninterrupted run (bf16 moments and
their stochastic rounding seeds, Muon's state, the builder's nested state)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

ocp = pytest.importorskip("orbax.checkpoint")

import fuseopt.optim as fo  # noqa: E402


def _params():
  k = iter(jax.random.split(jax.random.key(0), 8))
  n = lambda *s: 0.1 * jax.random.normal(next(k), s)
  return {"embed": {"embedding": n(32, 8)},
          "layers": {"w1": {"kernel": n(8, 16)}, "w2": {"kernel": n(16, 8)}, "norm": {"scale": 1.0 + n(8)}},
          "head": {"kernel": n(8, 32)}}


def _grads(step, params):
  keys = jax.random.split(jax.random.fold_in(jax.random.key(1), step), len(jax.tree.leaves(params)))
  leaves, treedef = jax.tree.flatten(params)
  return treedef.unflatten([jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])


_DIMS = {"embed": {"embedding": None}, "head": {"kernel": None},
         "layers": {"w1": {"kernel": fo.MuonDimensionNumbers(0, 1)}, "w2": {"kernel": fo.MuonDimensionNumbers(0, 1)},
                    "norm": {"scale": None}}}

CASES = {
    # bf16 moments, stochastically rounded with per-step seeds, through the fused step.
    "adamw_bf16_fused_step": (lambda: fo.adamw(1e-2, weight_decay=0.1), True),
    # Muon's momentum and its AdamW side's bf16 moments.
    "muon": (lambda: fo.muon(1e-2, muon_weight_dimension_numbers=_DIMS, moment_dtype=jnp.bfloat16), False),
    # The builder's nesting: freeze / skip_nonfinite / MultiSteps / clip / partition of groups.
    "builder": (lambda: fo.build_optimizer(fo.OptimConfig.from_dict({
        "optimizer": "muon", "schedule": {"kind": "cosine", "peak": 0.02, "warmup_steps": 2},
        "adam_learning_rate": 3e-3, "muon_patterns": ["layers/*/kernel"], "moment_dtype": "bfloat16",
        "weight_decay": 0.1, "clip_norm": 1.0, "accumulate_steps": 2, "skip_nonfinite": True,
        "frozen": ["embed/*"],
        "param_groups": [{"name": "no_decay", "patterns": ["*/scale"], "weight_decay": 0.0},
                         {"name": "rest", "patterns": ["*"]}]}), steps=8), False),
}


def _updater(tx, fused):
  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def update(params, state, grads):
    if fused:
      return fo.step(tx, grads, state, params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return update


def _run(update, params, state, steps):
  for t in steps:
    params, state = update(params, state, _grads(t, params))
  return params, state


@pytest.mark.parametrize("name", sorted(CASES))
def test_restore_and_continue_is_bitwise(name, tmp_path):
  make, fused = CASES[name]
  tx = make()
  update = _updater(tx, fused)  # one compile serves both runs
  params = _params()
  straight = _run(update, params, tx.init(params), range(4))

  params = _params()
  half = _run(update, params, tx.init(params), range(2))
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(tmp_path / "ckpt", half)
    ckptr.wait_until_finished()
    # A new process would build the abstract target from a fresh init.
    fresh = tx.init(_params())
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, (_params(), fresh))
    restored = ckptr.restore(tmp_path / "ckpt", target)
  assert jax.tree.structure(restored) == jax.tree.structure(half)
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(half)):
    assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
  resumed = _run(update, *restored, range(2, 4))

  leaves_a, leaves_b = jax.tree.leaves(resumed), jax.tree.leaves(straight)
  assert len(leaves_a) == len(leaves_b)
  assert any(x.dtype == jnp.bfloat16 for x in leaves_a)  # bf16 state really went through orbax
  for a, b in zip(leaves_a, leaves_b):
    assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


def test_nnx_optimizer_restore_and_continue_is_bitwise(tmp_path):
  nnx = pytest.importorskip("flax.nnx")
  import fuseopt.nnx as fnnx  # pylint: disable=g-import-not-at-top

  def fresh():
    model = nnx.Sequential(nnx.Linear(8, 16, rngs=nnx.Rngs(0)), nnx.Linear(16, 4, rngs=nnx.Rngs(1)))
    return model, fnnx.Optimizer(model, fo.adamw(1e-2, weight_decay=0.1), wrt=nnx.Param)

  @nnx.jit
  def train(model, opt, t):
    x = jax.random.normal(jax.random.fold_in(jax.random.key(2), t), (4, 8))
    grads = nnx.grad(lambda m: (m(x) ** 2).mean())(model)
    opt.update(model, grads)

  def pure(model, opt):
    return nnx.to_pure_dict(nnx.state(model)), nnx.to_pure_dict(nnx.state(opt))

  model, opt = fresh()
  for t in range(4):
    train(model, opt, t)
  straight = pure(model, opt)

  model, opt = fresh()
  for t in range(2):
    train(model, opt, t)
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(tmp_path / "nnx", pure(model, opt))
    ckptr.wait_until_finished()
    model, opt = fresh()  # a new process: fresh objects, state from the checkpoint
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, pure(model, opt))
    model_state, opt_state = ckptr.restore(tmp_path / "nnx", target)
  for obj, restored in ((model, model_state), (opt, opt_state)):
    state = nnx.state(obj)
    nnx.replace_by_pure_dict(state, restored)
    nnx.update(obj, state)
  for t in range(2, 4):
    train(model, opt, t)
  resumed = pure(model, opt)
  leaves_a, leaves_b = jax.tree.leaves(resumed), jax.tree.leaves(straight)
  assert len(leaves_a) == len(leaves_b) and any(x.dtype == jnp.bfloat16 for x in leaves_a)
  for a, b in zip(leaves_a, leaves_b):
    assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


def _wide_params():
  """Leaves with 8-bit moments (last axes of whole blocks of 256) and one
  that keeps bf16 moments."""
  k = iter(jax.random.split(jax.random.key(3), 4))
  n = lambda *s: 0.1 * jax.random.normal(next(k), s)
  return {"w": n(8, 512), "e": n(4, 256), "norm": n(8)}


_INT8 = {"adamw": lambda: fo.adamw(1e-2, weight_decay=0.1, moment_dtype="int8"),
         "adamw_int4": lambda: fo.adamw(1e-2, weight_decay=0.1, moment_dtype="int4"),
         # Muon's momentum in 8 bits (w, e), the AdamW side's moments bf16 (norm)
         "muon": lambda: fo.muon(1e-2, weight_decay=0.1, mu_dtype="int8")}


@pytest.mark.parametrize("name", sorted(_INT8))
def test_int8_moments_restore_and_continue_is_bitwise(name, tmp_path):
  """8-bit moments (codes and scales, a NamedTuple in the state) through
  orbax: the resumed run is bitwise the uninterrupted one."""
  import warnings  # pylint: disable=g-import-not-at-top
  tx = _INT8[name]()
  update = _updater(tx, True)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")   # "norm" keeps bf16 moments
    init = lambda: tx.init(_wide_params())
    straight = _run(update, _wide_params(), init(), range(4))
    half = _run(update, _wide_params(), init(), range(2))
    with ocp.StandardCheckpointer() as ckptr:
      ckptr.save(tmp_path / "ckpt", half)
      ckptr.wait_until_finished()
      target = jax.tree.map(ocp.utils.to_shape_dtype_struct, (_wide_params(), init()))
      restored = ckptr.restore(tmp_path / "ckpt", target)
  assert jax.tree.structure(restored) == jax.tree.structure(half)
  if name == "muon":
    mu = restored[1].inner_states["muon"].inner_state[0].mu
    assert mu["w"].codes.dtype == jnp.int8 and mu["e"].scales.shape == (4, 1)
  else:
    assert isinstance(restored[1][0].mu["w"], type(half[1][0].mu["w"]))
    assert restored[1][0].mu["w"].codes.dtype == (jnp.uint8 if "int4" in name else jnp.int8)
    assert restored[1][0].nu["w"].codes.dtype == jnp.uint8
  resumed = _run(update, *restored, range(2, 4))
  for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight)):
    assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
