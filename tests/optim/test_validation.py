"""Bad input and edge cases of the transforms, the config and the builder.

Infinite clip norms, patterns that match nothing, NaN/Inf hyperparameters,
the run-length rule of schedules, Muon's 2-D promise, the skip limit's one
name, state dtypes kept across steps (lax.scan carries), ``step`` on a state
of the wrong structure, array-valued hyperparameters, a traced ``ns_steps``,
``shardings`` entries that name no parameter.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fuseopt.optim as fo
from fuseopt.optim import fusion
from fuseopt.optim import safeguards
from fuseopt.optim import schedules as S
from fuseopt.optim.builder import build_optimizer
from fuseopt.optim.config import OptimConfig
from fuseopt.optim.muon_transforms import MuonDimensionNumbers as MDN
from fuseopt.optim.muon_transforms import scale_by_muon
from fuseopt.optim.groups import ParamGroup, mup_param_groups

INF, NAN = float("inf"), float("nan")


def _params():
  return {"layer_0": {"kernel": jnp.ones((4, 4)), "lora_a": jnp.ones((4, 2))},
          "layer_1": {"kernel": jnp.ones((4, 4)), "lora_a": jnp.ones((4, 2))}}


def _grads(scale=1.0):
  return jax.tree.map(lambda p: scale * jnp.arange(p.size, dtype=p.dtype).reshape(p.shape) / 7,
                      _params())


# -------------------------------------------------------- clip_norm = inf ----
def test_infinite_clip_norm_means_no_clip():
  g = _grads(100.0)
  u, state = safeguards.clip_by_global_norm(INF).update(g, None)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), u, g)
  assert float(state.global_norm) > 100
  cfg = OptimConfig.from_yaml("optimizer: adamw\nlearning_rate: 1.0e-2\nclip_norm: .inf\n")
  assert cfg.clip_norm == INF
  tx = build_optimizer(cfg, 10)
  u, _ = tx.update(g, tx.init(_params()), _params())
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(u))
  assert any(np.abs(np.asarray(x)).max() > 0 for x in jax.tree.leaves(u))


def test_nan_clip_norm_raises():
  with pytest.raises(ValueError, match="max_norm"):
    safeguards.clip_by_global_norm(NAN)
  with pytest.raises(ValueError, match="clip_norm"):
    OptimConfig(learning_rate=1e-3, clip_norm=NAN)


# ------------------------------------------------- patterns matching nothing --
@pytest.mark.parametrize("kw,name", [
    (dict(trainable=("lora_*",)), "trainable"),       # nested: the path is 'layer_0/lora_a'
    (dict(frozen=("embed/*",)), "frozen"),
    (dict(trainable=("*lora_*", "*adapter*")), "trainable"),
])
def test_pattern_matching_nothing_raises_naming_it(kw, name):
  tx = build_optimizer(OptimConfig(optimizer="adamw", learning_rate=1e-2, **kw), 10)
  with pytest.raises(ValueError, match=f"{name} pattern '.*' matches no parameter.*layer_0/lora_a"):
    tx.init(_params())


def test_nested_patterns_that_match_work():
  tx = build_optimizer(OptimConfig(optimizer="adamw", learning_rate=1e-2,
                                   trainable=("*/lora_*",)), 10)
  u, _ = tx.update(_grads(), tx.init(_params()), _params())
  assert float(jnp.abs(u["layer_0"]["kernel"]).max()) == 0.0
  assert float(jnp.abs(u["layer_0"]["lora_a"]).max()) > 0.0


# ------------------------------------------------------ NaN / Inf in configs --
@pytest.mark.parametrize("field,value", [
    ("learning_rate", NAN), ("learning_rate", INF), ("weight_decay", NAN), ("weight_decay", INF),
    ("eps", NAN), ("eps", INF), ("clip_norm", NAN), ("qk_clip_tau", NAN), ("qk_clip_tau", 0.0),
    ("b1", NAN), ("b2", INF),
])
def test_config_rejects_non_finite_numbers(field, value):
  with pytest.raises(ValueError, match=f"OptimConfig.{field}"):
    OptimConfig(**{"optimizer": "lion", "learning_rate": 1e-3, field: value})


def test_yaml_nan_is_rejected():
  with pytest.raises(ValueError, match="OptimConfig.learning_rate"):
    OptimConfig.from_yaml("optimizer: lamb\nlearning_rate: .nan\n")


@pytest.mark.parametrize("make,match", [
    (lambda: ParamGroup("g", ("*",), learning_rate_multiplier=INF), "learning_rate_multiplier"),
    (lambda: ParamGroup("g", ("*",), weight_decay=NAN), "weight_decay"),
    (lambda: mup_param_groups(INF), "width_multiplier"),
    (lambda: fo.scale_by_adam(eps=NAN), "eps"),
    (lambda: fo.scale_by_adam(eps=INF), "eps"),
    (lambda: fo.muon(0.02, eps=NAN), "eps"),
    (lambda: scale_by_muon(beta=1.0), "scale_by_muon: beta"),
    (lambda: scale_by_muon(eps=-1.0), "scale_by_muon: eps"),
    (lambda: scale_by_muon(ns_steps=2.5), "scale_by_muon: ns_steps"),
    (lambda: fo.muon(0.02, ns_steps=0), "ns_steps"),
])
def test_non_finite_hyperparameters_raise(make, match):
  with pytest.raises(ValueError, match=match):
    make()


# ----------------------------------------------- array-valued hyperparameters --
@pytest.mark.parametrize("make,match", [
    (lambda: fo.adamw(jnp.array(NAN)), "adamw: learning_rate"),
    (lambda: fo.adamw(1e-3, weight_decay=np.float32(-1.0)), "adamw: weight_decay"),
    (lambda: fo.adam(1e-3, b1=jnp.array(1.0)), "b1"),
    (lambda: fo.scale_by_adam(b2=np.array(1.5)), "b2"),
    (lambda: fo.muon(jnp.float32(-0.1)), "muon: learning_rate"),
    (lambda: fo.muon(0.02, beta=jnp.array(1.0)), "muon: beta"),
])
def test_concrete_array_hyperparameters_are_checked(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_inject_hyperparams_with_traced_values_still_works():
  tx = optax.inject_hyperparams(fo.adamw)(learning_rate=1e-2, weight_decay=0.1)
  params = _params()
  state = tx.init(params)
  u, state = jax.jit(tx.update)(_grads(), state, params)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(u))


def test_traced_ns_steps_is_refused_naming_static_args():
  with pytest.raises(TypeError, match=r"ns_steps must be a static integer.*static_args=\('ns_steps',\)"):
    jax.jit(lambda n: scale_by_muon(ns_steps=n))(jnp.asarray(5))


# ---------------------------------------- shardings entries that name nothing --
def _w_b():
  return {"w": jnp.ones((4, 4)), "b": jnp.ones((4,))}


def _run_step(tx, how, params=None, **kw):
  params = _w_b() if params is None else params
  g = jax.tree.map(lambda p: p * 0.1, params)
  state = tx.init(params)
  if how == "step":
    return fo.step(tx, g, state, params, **kw)
  return tx.update(g, state, params)


P = jax.sharding.PartitionSpec
TYPO = {"w": P(), "b": P(), "zzz": P()}


@pytest.mark.parametrize("how", ["step", "update"])
@pytest.mark.parametrize("make,owner", [
    (lambda sh: fo.adamw(1e-2, execution=fo.Execution(shardings=sh)), "(adamw|scale_by_adam)"),
    (lambda sh: fo.adam(1e-2, execution=fo.Execution(shardings=sh)), "(adam|scale_by_adam)"),
    (lambda sh: fo.muon(1e-2, execution=fo.Execution(shardings=sh)), "scale_by_muon"),
    (lambda sh: fo.scale_by_muon(weight_dimension_numbers={"w": MDN(), "b": None}, execution=fo.Execution(shardings=sh)),
     "scale_by_muon"),
])
def test_a_shardings_entry_naming_no_parameter_raises(make, owner, how):
  """A misspelt key used to be ignored (its leaf then ran without a placement)."""
  with pytest.raises(ValueError, match=owner + r": shardings\['zzz'\] matches no parameter leaf"):
    _run_step(make(TYPO), how)
  _run_step(make({"w": P(), "b": P()}), how)   # the same without the typo runs


def test_step_shardings_entry_naming_no_parameter_raises():
  with pytest.raises(ValueError, match=r"step: shardings\['zzz'\] matches no parameter leaf"):
    _run_step(fo.adamw(1e-2), "step", shardings=TYPO)


@pytest.mark.parametrize("how", ["step", "update"])
def test_a_shardings_entry_for_a_leaf_another_transform_owns_is_accepted(how):
  """Inside optax.partition (and muon's split) a transform sees a
  MaskedNode where another owns the leaf: an entry for that leaf names a
  parameter. A misspelt one still raises; the accepted entries change
  nothing."""
  labels = {"w": "frozen", "b": "adam"}
  def make(sh):
    return fusion.partition({"adam": fo.adamw(1e-2, execution=fo.Execution(shardings=sh)), "frozen": optax.set_to_zero()},
                               labels) if how == "step" else optax.partition(
        {"adam": fo.adamw(1e-2, execution=fo.Execution(shardings=sh)), "frozen": optax.set_to_zero()}, labels)
  got = _run_step(make({"w": P(), "b": P()}), how)
  want = _run_step(make(None), how)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, want)
  with pytest.raises(ValueError, match=r"shardings\['zzz'\] matches no parameter leaf"):
    _run_step(make(TYPO), how)
  # muon: the AdamW side sees the matrix 'w' masked, the Muon side 'b'.
  _run_step(fo.muon(1e-2, execution=fo.Execution(shardings={'w': P(), 'b': P()})), how)


def test_a_shardings_entry_under_a_masked_subtree_is_accepted():
  """optax.masked with a prefix mask puts one MaskedNode where a whole
  subtree was: entries below it name parameters of the model."""
  params = {"enc": {"w": jnp.ones((4, 4)), "b": jnp.ones(4)}, "head": jnp.ones((4, 2))}
  sh = {"enc": {"w": P(), "b": P()}, "head": P()}
  tx = optax.masked(fo.adamw(1e-2, execution=fo.Execution(shardings=sh)), {"enc": False, "head": True})
  _run_step(tx, "update", params)
  with pytest.raises(ValueError, match=r"shardings\['hed'\] matches no parameter leaf"):
    _run_step(optax.masked(fo.adamw(1e-2, execution=fo.Execution(shardings={"enc": P(), "head": P(), "hed": P()})),
                           {"enc": False, "head": True}), "update", params)


# ------------------------------------------------------- the schedules' rule --
RECORDS = [S.Constant(peak=1.0, warmup_steps=5), S.Cosine(peak=1.0, warmup_steps=5, decay_steps=50),
           S.Linear(peak=1.0, warmup_steps=5, decay_steps=50), S.Power(peak=1.0, warmup_steps=5, a=1.0),
           S.WSD(peak=1.0, warmup_steps=5, decay_steps=0 + 1)]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r.kind)
def test_every_schedule_refuses_a_zero_length_run(record):
  with pytest.raises(ValueError, match="steps .*must be an integer >= 1"):
    record.schedule(0)


@pytest.mark.parametrize("record", RECORDS[:4], ids=lambda r: r.kind)
def test_every_schedule_refuses_a_warmup_longer_than_the_run(record):
  with pytest.raises(ValueError, match=r"warmup_steps \(5\) is longer than the run \(3 steps\)"):
    record.schedule(3)
  record.schedule(5)  # a warmup ending with the run is fine


def test_build_optimizer_refuses_zero_steps():
  for cfg in (OptimConfig(schedule=S.Cosine(peak=1e-3)), OptimConfig(learning_rate=1e-3)):
    with pytest.raises(ValueError, match="build_optimizer: steps"):
      build_optimizer(cfg, 0)


# ------------------------------------------------- Muon's None = every leaf 2-D --
def test_scale_by_muon_none_refuses_a_3d_leaf():
  tx = scale_by_muon()
  params = {"w": jnp.ones((4, 4)), "stack": jnp.ones((2, 4, 4))}
  state = tx.init(params)
  with pytest.raises(ValueError, match=r"leaf \['stack'\] has shape \(2, 4, 4\).*weight_dimension_numbers"):
    tx.update(params, state)
  ok = scale_by_muon(weight_dimension_numbers={"w": MDN(), "stack": MDN(1, 2)})
  ok.update(params, ok.init(params))


# ---------------------------------------------------- on_max_skips everywhere --
def test_skip_limit_has_one_name():
  import inspect
  assert "on_max_skips" in inspect.signature(safeguards.skip_nonfinite).parameters
  assert "on_max_skips" in OptimConfig.__dataclass_fields__
  with pytest.raises(ValueError, match="on_max_skips"):
    safeguards.skip_nonfinite(optax.sgd(0.1), 2, on_max_skips="ignore")
  tx = safeguards.skip_nonfinite(optax.sgd(0.1), 1, "raise")
  params = {"w": jnp.ones((2,))}
  state = tx.init(params)
  bad = {"w": jnp.array([jnp.nan, 1.0])}
  with pytest.raises(Exception, match="on_max_skips='apply'"):
    for _ in range(3):
      _, state = tx.update(bad, state, params)
      jax.block_until_ready(state)


# ------------------------------------------ state dtypes kept (scan carries) --
@pytest.mark.parametrize("make", [
    lambda: scale_by_muon(weight_dimension_numbers={"w": MDN(), "b": None}),
    lambda: fo.muon(0.02),
    lambda: fo.adamw(1e-3),
    lambda: fo.scale_by_adam(moment_dtype=None),
    lambda: build_optimizer(OptimConfig(optimizer="lion", learning_rate=1e-3), 10),
    lambda: build_optimizer(OptimConfig(optimizer="lamb", learning_rate=1e-3), 10),
    lambda: build_optimizer(OptimConfig(optimizer="adafactor", learning_rate=1e-3), 10),
])
def test_state_dtypes_survive_lax_scan_with_other_grad_dtypes(make):
  tx = make()
  params = {"w": jnp.ones((4, 8), jnp.bfloat16), "b": jnp.ones((8,), jnp.float32)}
  grads = {"w": jnp.full((4, 8), 0.5, jnp.float32), "b": jnp.full((8,), 0.5, jnp.bfloat16)}
  state = tx.init(params)

  def body(state, _):
    _, state = tx.update(grads, state, params)
    return state, None

  final, _ = jax.lax.scan(body, state, None, length=2)
  jax.tree.map(lambda a, b: np.testing.assert_equal(a.dtype, b.dtype), final, state)


# ------------------------------------------------- step with a foreign state --
def test_step_names_what_differs_in_the_state():
  tx = fo.adamw(1e-3)
  params = {"w": jnp.ones((4, 4)), "b": jnp.ones((4,))}
  grads = jax.tree.map(jnp.ones_like, params)
  other = fo.adamw(1e-3).init({"w": jnp.ones((4, 4))})
  with pytest.raises(ValueError, match=r"step: state does not have the structure.*missing.*'b'"):
    fo.step(tx, grads, other, params)
  wrong_shape = tx.init({"w": jnp.ones((4, 5)), "b": jnp.ones((4,))})
  with pytest.raises(ValueError, match=r"step: state leaf .*\['w'\].*\[4, 5\].*\[4, 4\]"):
    fo.step(tx, grads, wrong_shape, params)
  fp32 = fo.adamw(1e-3, moment_dtype=jnp.float32).init(params)
  with pytest.raises(ValueError, match=r"step: state leaf .*float32.*bfloat16"):
    fo.step(tx, grads, fp32, params)
  sgd = optax.sgd(0.1)
  with pytest.raises(ValueError, match="step: state does not have the structure"):
    fo.step(sgd, grads, tx.init(params), params)
  new_params, _ = fo.step(tx, grads, tx.init(params), params)
  assert jax.tree.structure(new_params) == jax.tree.structure(params)


# ------------------------------------------------ the builder's Muon fields --
def test_qk_clip_tau_is_only_for_muonclip():
  """It used to be ignored with optimizer 'normuon' (while normuon_b2 with
  'muon' was refused)."""
  with pytest.raises(ValueError, match="OptimConfig.qk_clip_tau: only for optimizer 'muonclip'"):
    OptimConfig.from_yaml("optimizer: normuon\nlearning_rate: 0.02\nqk_clip_tau: 5\n")
  with pytest.raises(ValueError, match="OptimConfig.normuon_b2: only for optimizer 'normuon'"):
    OptimConfig(optimizer="muon", learning_rate=0.02, normuon_b2=0.9)
  cfg = OptimConfig(optimizer="muonclip", learning_rate=0.02, qk_clip_tau=5)
  assert cfg.qk_clip_tau == 5.0 and OptimConfig.from_yaml(cfg.to_yaml()) == cfg
  assert OptimConfig(optimizer="muonclip", learning_rate=0.02).qk_clip_tau is None  # 100


def test_normuon_b2_in_optimizer_kwargs_points_to_normuon_b2():
  with pytest.raises(ValueError, match=r"\['b2'\] are OptimConfig fields.*OptimConfig.normuon_b2"):
    OptimConfig(optimizer="normuon", learning_rate=0.02, optimizer_kwargs={"b2": 0.5})


@pytest.mark.parametrize("kwargs,error,match", [
    ({"consistent_rms": "0.2"}, TypeError, "normuon: consistent_rms"),
    ({"consistent_rms": -0.2}, ValueError, "normuon: consistent_rms"),
    ({"normuon_eps": "1e-8"}, TypeError, "normuon: normuon_eps"),
    ({"nu_dtype": "bogus"}, TypeError, "normuon: nu_dtype"),
])
def test_builder_optimizer_kwargs_are_checked_when_built(kwargs, error, match):
  cfg = OptimConfig(optimizer="normuon", learning_rate=0.02, optimizer_kwargs=kwargs)
  with pytest.raises(error, match=match):
    build_optimizer(cfg, 10)


@pytest.mark.parametrize("field,value", [("normuon_b2", True), ("normuon_b2", "0.5"),
                                         ("qk_clip_tau", True), ("qk_clip_tau", "5"),
                                         ("b2", True), ("learning_rate", "1e-3")])
def test_config_refuses_bools_and_strings_for_numbers(field, value):
  optimizer = {"normuon_b2": "normuon", "qk_clip_tau": "muonclip"}.get(field, "adamw")
  with pytest.raises(ValueError, match=f"OptimConfig.{field}"):
    OptimConfig(**{"optimizer": optimizer, "learning_rate": 1e-3, field: value})


def test_a_backend_named_by_the_environment_says_so(monkeypatch):
  """FUSEOPT_IMPLEMENTATION=mosaic_gpu on a CPU: the message named
  implementation='mosaic_gpu', which no argument of the call had set."""
  from fuseopt import kernels
  monkeypatch.setenv("FUSEOPT_IMPLEMENTATION", "mosaic_gpu")
  with pytest.raises(ValueError, match=r"implementation='mosaic_gpu' \(set by the environment "
                                       r"variable FUSEOPT_IMPLEMENTATION\) cannot run"):
    kernels.newton_schulz(jnp.ones((8, 8)))
  with pytest.raises(ValueError, match=r"implementation='mosaic_gpu' cannot run") as info:
    kernels.newton_schulz(jnp.ones((8, 8)), implementation="mosaic_gpu")
  assert "environment" not in str(info.value)


def test_execution_is_one_record_for_adam_and_muon():
  """Adam used to take implementation / interpret / shardings as flat
  arguments and Muon in an Execution record: one record now, and the flat
  arguments are gone."""
  for factory in (fo.adam, fo.adamw, fo.scale_by_adam):
    for flat in ("implementation", "interpret", "shardings"):
      with pytest.raises(TypeError, match=flat):
        factory(**({} if factory is fo.scale_by_adam else {"learning_rate": 1e-3}),
                **{flat: None})
  with pytest.raises(TypeError, match="adam_moment_dtype"):
    fo.Execution(adam_moment_dtype="int8")
  with pytest.raises(ValueError, match=r"execution has unknown fields \['adam_moment_dtype'\]"):
    fo.adamw(1e-3, execution={"adam_moment_dtype": "int8"})
  with pytest.raises(TypeError, match="adamw: execution must be a fuseopt.optim.Execution"):
    fo.adamw(1e-3, execution="xla")
  with pytest.raises(ValueError, match="Execution: interpret must be True or False"):
    fo.Execution(interpret="yes")


# Every reader of a moment format, with the owner and argument its errors name.
_MOMENT_FORMAT_READERS = {
    "adam": (lambda v: fo.adam(1e-3, moment_dtype=v), "adam: moment_dtype"),
    "adamw": (lambda v: fo.adamw(1e-3, moment_dtype=v), "adamw: moment_dtype"),
    "scale_by_adam": (lambda v: fo.scale_by_adam(moment_dtype=v), "scale_by_adam: moment_dtype"),
    "muon": (lambda v: fo.muon(1e-3, moment_dtype=v), "muon: moment_dtype"),
    "normuon": (lambda v: fo.normuon(1e-3, moment_dtype=v), "normuon: moment_dtype"),
    "muonclip": (lambda v: fo.muonclip(1e-3, moment_dtype=v), "muonclip: moment_dtype"),
    "convert_moments": (lambda v: fo.convert_moments((), v), "convert_moments: moment_dtype"),
}


@pytest.mark.parametrize("value,error", [("int2", ValueError), ("uint8", ValueError),
                                         (jnp.uint8, ValueError), ("INT8", TypeError),
                                         (8, TypeError)])
@pytest.mark.parametrize("reader", sorted(_MOMENT_FORMAT_READERS))
def test_a_refused_moment_format_lists_every_accepted_one(reader, value, error):
  """Issue 40, 6: the messages said "float32, bfloat16 or None" and never named
  "int8", the one format a user reaching for uint8 or "INT8" is after; every
  reader now lists all four (one canonicalising function, _checks.moment_format)."""
  make, names = _MOMENT_FORMAT_READERS[reader]
  with pytest.raises(error, match=names) as info:
    make(value)
  message = str(info.value)
  for accepted in ("float32", "bfloat16", "'int8'", "'int4'", "None"):
    assert accepted in message, message
  if value == "INT8":
    assert "did you mean 'int8'?" in message, message


@pytest.mark.parametrize("reader", sorted(_MOMENT_FORMAT_READERS))
def test_every_reader_takes_the_same_moment_formats(reader):
  make, _ = _MOMENT_FORMAT_READERS[reader]
  # (a conversion needs a target: None, optax's dtypes, is one only for the optimizers)
  optax_dtypes = () if reader == "convert_moments" else (None,)
  for value in ("float32", jnp.float32, "bfloat16", jnp.bfloat16, "int8", jnp.int8) + optax_dtypes:
    make(value)


_MU_DTYPE_FACTORIES = {
    "adam": lambda m: fo.adam(1e-3, mu_dtype=m),
    "adamw": lambda m: fo.adamw(1e-3, mu_dtype=m),
    "scale_by_adam": lambda m: fo.scale_by_adam(mu_dtype=m),
    "muon": lambda m: fo.muon(1e-3, mu_dtype=m),
    "normuon": lambda m: fo.normuon(1e-3, mu_dtype=m),
    "muonclip": lambda m: fo.muonclip(1e-3, mu_dtype=m),
    "scale_by_muon": lambda m: fo.scale_by_muon(mu_dtype=m),
    "scale_by_normuon": lambda m: fo.scale_by_normuon(mu_dtype=m),
}


@pytest.mark.parametrize("mu_dtype", ["int8", jnp.int8, jnp.uint8, "int32", jnp.bool_])
@pytest.mark.parametrize("factory", sorted(_MU_DTYPE_FACTORIES))
def test_an_integer_mu_dtype_is_refused_and_points_at_8_bit_moments(factory, mu_dtype):
  """Issue 40, 7: an integer mu_dtype stored the momentum as a plain cast (every
  element 0 after a step of gradients ~1e-3), and the optimizer ran on without
  momentum. Refused at construction, naming mu_dtype, what it takes and the
  8-bit format. The Muon family takes int8 (8-bit momentum, issue 43) and
  lists it among what it takes."""
  muon_family = "adam" not in factory
  if muon_family and jnp.dtype(mu_dtype) == jnp.int8:
    _MU_DTYPE_FACTORIES[factory](mu_dtype)
    return
  with pytest.raises(ValueError, match=r"mu_dtype must be a floating dtype .* or None, got") as info:
    _MU_DTYPE_FACTORIES[factory](mu_dtype)
  if muon_family:
    assert "'int8' (8-bit codes, a scale per block of 256)" in str(info.value)
  else:
    assert "moment_dtype='int8'" in str(info.value)
    assert "AdamW side of muon" in str(info.value)


@pytest.mark.parametrize("factory", sorted(_MU_DTYPE_FACTORIES))
def test_a_floating_mu_dtype_is_taken(factory):
  # (complex too, for complex parameters: optax's tests pass mu_dtype="complex64")
  for mu_dtype in (None, jnp.float32, "bfloat16", jnp.float16, "complex64"):
    _MU_DTYPE_FACTORIES[factory](mu_dtype)


def test_int8_mu_dtype_with_int8_moments_stays_accepted():
  # (Muon's AdamW side passes its moment format as both; documented as "None (or int8)")
  fo.adamw(1e-3, mu_dtype="int8", moment_dtype="int8")
  fo.muon(1e-3, mu_dtype=jnp.bfloat16, moment_dtype="int8")


@pytest.mark.parametrize("factory", [fo.scale_by_muon, fo.scale_by_normuon])
def test_a_direction_has_no_adamw_side_moments(factory):
  # Muon's direction has no AdamW side: a moment_dtype would be dropped.
  with pytest.raises(TypeError, match="moment_dtype"):
    factory(moment_dtype=jnp.bfloat16)


def test_experts_around_something_else_is_refused_by_name():
  params = {"e": jnp.ones((2, 8, 4))}
  tx = fo.muon(0.1, muon_weight_dimension_numbers={"e": fo.Experts((1, 2))})
  with pytest.raises(TypeError, match="Experts.spec must be MuonDimensionNumbers or MatrixViews"):
    tx.update(params, tx.init(params), params)
