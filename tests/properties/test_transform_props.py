"""Properties of the transforms, the builder, schedules and apply_updates.

- the state keeps tx.init's structure, shapes and dtypes across steps (so it
  is a valid lax.scan carry), whatever the params' and grads' dtypes;
- apply_updates on bf16 leaves gives a bf16 neighbour of p + u, for seeds
  over the whole uint32 range;
- schedules: finite, >= 0, peak at the end of the warmup, the run-length
  rule; configs round-trip through YAML; bad numbers raise naming the field.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fuseopt.optim as fo
from fuseopt.optim import schedules as S
from fuseopt.optim.builder import build_optimizer
from fuseopt.optim.config import OptimConfig
from fuseopt.optim.groups import mup_param_groups
from tests.properties.strategies import FAST, MEDIUM, UINT32, bf16_neighbours, bits16

F32, BF16 = jnp.float32, jnp.bfloat16
# Shapes Muon and AdamW both take: 2-D matrices go to Muon, the rest to AdamW.
LEAF_SHAPES = [(), (0,), (6,), (4, 6), (6, 4), (2, 3, 4)]


@st.composite
def trees(draw):
  n = draw(st.integers(1, 4))
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  params, grads = {}, {}
  for i in range(n):
    shape = draw(st.sampled_from(LEAF_SHAPES))
    pd, gd = draw(st.sampled_from([F32, BF16])), draw(st.sampled_from([F32, BF16]))
    params[f"block_{i}"] = {"kernel": jnp.asarray(rng.standard_normal(shape), pd)}
    grads[f"block_{i}"] = {"kernel": jnp.asarray(rng.standard_normal(shape), gd)}
  return params, grads


def _solvers():
  mdn = lambda p: jax.tree.map(lambda x: fo.MuonDimensionNumbers() if x.ndim == 2 else None, p)
  return {
      "adam": lambda: fo.adam(1e-3),
      "adamw_fp32": lambda: fo.adamw(1e-3, weight_decay=0.1, moment_dtype=jnp.float32),
      "adamw_param_dtype": lambda: fo.adamw(1e-3, moment_dtype=None),
      "scale_by_adam_nesterov": lambda: fo.scale_by_adam(nesterov=True),
      "muon": lambda: fo.muon(0.02, weight_decay=0.1),
      "muon_bf16_momentum": lambda: fo.muon(0.02, mu_dtype=jnp.bfloat16, moment_dtype=jnp.bfloat16),
      "scale_by_muon": lambda: fo.scale_by_muon(weight_dimension_numbers=mdn),
      "skip_nonfinite": lambda: fo.skip_nonfinite(fo.adamw(1e-3), 3),
  }


SOLVERS = _solvers()


def _same_avals(a, b, what):
  sa = jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype)), a)
  sb = jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype)), b)
  assert jax.tree.structure(a) == jax.tree.structure(b), what
  assert jax.tree.leaves(sa) == jax.tree.leaves(sb), what


def _two_steps_keep_avals(tx, params, grads, what):
  state0 = tx.init(params)
  # abstract evaluation: the property is about avals, and it costs no compile
  state = state0
  for _ in range(2):
    _, state = jax.eval_shape(tx.update, grads, state, params)
  _same_avals(state, state0, what)


@MEDIUM
@given(tree=trees(), name=st.sampled_from(sorted(SOLVERS)))
def test_state_structure_and_dtypes_are_kept_across_steps(tree, name):
  params, grads = tree
  _two_steps_keep_avals(SOLVERS[name](), params, grads, name)


@MEDIUM
@given(tree=trees(), clip=st.sampled_from([0.0, 1.0, math.inf]), skip=st.booleans(),
       accumulate=st.integers(1, 2),
       optimizer=st.sampled_from(["adamw", "lion", "lamb", "adafactor", "muon"]),
       groups=st.booleans(), bf16=st.booleans())
def test_built_solvers_keep_their_state_avals(tree, clip, skip, accumulate, optimizer, groups, bf16):
  params, grads = tree
  bf16 = bf16 and optimizer not in ("lamb", "adafactor")  # fp32 state only
  cfg = OptimConfig(optimizer=optimizer, schedule=S.Cosine(peak=1e-3, warmup_steps=2),
                    weight_decay=0.1, clip_norm=clip, skip_nonfinite=skip,
                    accumulate_steps=accumulate, moment_dtype="bfloat16" if bf16 else "float32",
                    param_groups=mup_param_groups(2.0) if groups else ())
  _two_steps_keep_avals(build_optimizer(cfg, 10), params, grads, cfg)


@FAST
@given(seed=UINT32, rng_seed=st.integers(0, 2**32 - 1), scale=st.floats(1e-8, 1e2))
def test_apply_updates_bf16_leaves_land_on_neighbours(seed, rng_seed, scale):
  rng = np.random.default_rng(rng_seed)
  p = jnp.asarray(rng.standard_normal(300), BF16)
  u = jnp.asarray(rng.standard_normal(300) * scale, F32)
  out = fo.apply_updates({"w": p}, {"w": u}, seed=seed)["w"]
  exact = np.asarray(p, np.float32) + np.asarray(u)
  lo, hi = bf16_neighbours(exact)
  got = bits16(out)
  assert ((got == lo) | (got == hi)).all()


SCHEDULES = st.one_of(
    st.builds(S.Constant, peak=st.floats(0, 10), warmup_steps=st.integers(0, 50)),
    st.builds(S.Cosine, peak=st.floats(0, 10), warmup_steps=st.integers(0, 50),
              end=st.floats(0, 1), init=st.floats(0, 1)),
    st.builds(S.Linear, peak=st.floats(0, 10), warmup_steps=st.integers(0, 50), end=st.floats(0, 1)),
    st.builds(S.Power, peak=st.floats(0, 10), warmup_steps=st.integers(0, 50),
              a=st.floats(1e-3, 10), b=st.floats(-1, 0)),
    st.builds(S.WSD, peak=st.floats(0.1, 10), warmup_steps=st.integers(0, 50),
              decay_fraction=st.floats(0.01, 0.5), decay=st.sampled_from(["cosine", "linear"])),
)


@FAST
@given(record=SCHEDULES, extra=st.integers(0, 500),
       counts=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=5))
def test_schedules_are_finite_non_negative_and_peak_after_warmup(record, extra, counts):
  steps = max(1, 2 * record.warmup_steps + extra)
  try:
    fn = record.schedule(steps)
  except ValueError as e:  # only the WSD decay overlapping the warmup may refuse
    assert isinstance(record, S.WSD) and "decay_fraction" in str(e)
    return
  values = np.array([float(fn(jnp.int32(c))) for c in counts + [record.warmup_steps]])
  assert np.isfinite(values).all() and (values >= 0).all()
  if record.warmup_steps and isinstance(record, (S.Constant, S.Cosine, S.Linear, S.WSD)):
    assert values[-1] == pytest.approx(record.peak, rel=1e-5)


@FAST
@given(record=SCHEDULES, steps=st.integers(-3, 50))
def test_the_run_length_rule_holds_for_every_kind(record, steps):
  if steps < 1:
    with pytest.raises(ValueError, match="steps"):
      record.schedule(steps)
  elif record.warmup_steps > steps:
    with pytest.raises(ValueError, match="warmup_steps|decay_steps|decay_fraction"):
      record.schedule(steps)


NUMBER_FIELDS = ["learning_rate", "weight_decay", "eps", "clip_norm", "qk_clip_tau", "b1", "b2"]


@FAST
@given(field=st.sampled_from(NUMBER_FIELDS),
       value=st.one_of(st.just(float("nan")), st.just(-float("inf")), st.floats(max_value=-1e-9)))
def test_config_numbers_name_the_field(field, value):
  with pytest.raises(ValueError, match=f"OptimConfig.{field}"):
    OptimConfig(**{"optimizer": "adamw", "learning_rate": 1e-3, field: value})


@FAST
@given(lr=st.floats(0, 1), wd=st.floats(0, 1), clip=st.one_of(st.floats(0, 10), st.just(math.inf)),
       b1=st.one_of(st.none(), st.floats(0, 0.999)), skips=st.one_of(st.none(), st.integers(1, 9)),
       on=st.sampled_from(["raise", "apply"]), optimizer=st.sampled_from(["adamw", "lion", "muon"]))
def test_configs_round_trip_through_yaml(lr, wd, clip, b1, skips, on, optimizer):
  cfg = OptimConfig(optimizer=optimizer, learning_rate=lr, weight_decay=wd, clip_norm=clip, b1=b1,
                    max_consecutive_skips=skips, on_max_skips=on, skip_nonfinite=True)
  assert OptimConfig.from_yaml(cfg.to_yaml()) == cfg


# Every numeric argument of the solvers: (factory, argument, range), where
# range says which finite numbers are refused.
NEGATIVE, DECAY, POSITIVE = "negative", "decay", "positive"
SOLVER_ARGS = [
    (fo.adam, "learning_rate", NEGATIVE), (fo.adam, "b1", DECAY), (fo.adam, "b2", DECAY),
    (fo.adam, "eps", NEGATIVE), (fo.adam, "eps_root", NEGATIVE),
    (fo.adamw, "learning_rate", NEGATIVE), (fo.adamw, "weight_decay", NEGATIVE),
    (fo.adamw, "b1", DECAY), (fo.adamw, "b2", DECAY), (fo.adamw, "eps", NEGATIVE),
    (fo.muon, "learning_rate", NEGATIVE), (fo.muon, "beta", DECAY), (fo.muon, "eps", NEGATIVE),
    (fo.muon, "weight_decay", NEGATIVE), (fo.muon, "adam_b1", DECAY), (fo.muon, "adam_b2", DECAY),
    (fo.muon, "adam_eps_root", NEGATIVE), (fo.muon, "adam_learning_rate", NEGATIVE),
    (fo.muon, "consistent_rms", POSITIVE),
    (fo.normuon, "b2", DECAY), (fo.normuon, "normuon_eps", NEGATIVE),
    (fo.normuon, "consistent_rms", POSITIVE), (fo.normuon, "beta", DECAY),
    (fo.muonclip, "consistent_rms", POSITIVE), (fo.muonclip, "adam_b2", DECAY),
]
_NAME = {fo.adam: "adam", fo.adamw: "adamw", fo.muon: "muon", fo.normuon: "normuon",
         fo.muonclip: "muonclip"}


def _refused(kind, v):
  if kind == DECAY:
    return not 0.0 <= v < 1.0
  return v <= 0.0 if kind == POSITIVE else v < 0.0


@FAST
@given(case=st.sampled_from(SOLVER_ARGS),
       value=st.one_of(st.booleans(), st.sampled_from(["0.5", "1e-8", ""]),
                       st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3)))
def test_solver_arguments_are_checked_by_name(case, value):
  make, name, kind = case
  args = {} if name == "learning_rate" else {"learning_rate": 0.02}
  build = lambda: make(**args, **{name: value})
  named = f"{_NAME[make]}: {name} must be"
  if isinstance(value, (bool, str)):
    with pytest.raises(TypeError, match=named):
      build()
  elif not math.isfinite(value) or _refused(kind, float(value)):
    with pytest.raises(ValueError, match=named):
      build()
  else:
    build()
