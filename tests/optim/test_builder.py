"""build_optimizer: every optimizer, groups, clip, accumulation, safeguards, YAML."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fuseopt.optim import schedules as S
from fuseopt.optim import safeguards
from fuseopt.optim.builder import build_optimizer
from fuseopt.optim.config import OPTIMIZERS, OptimConfig
from fuseopt.optim.groups import ParamGroup, mup_param_groups


def tree(fill=1.0):
  return {"embed_tokens": {"embedding": jnp.full((16, 8), fill)},
          "layers_0": {"q_proj": {"kernel": jnp.full((8, 8), fill), "bias": jnp.full((8,), fill)},
                       "norm": {"scale": jnp.full((8,), fill)}}}


def grads(seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  return jax.tree.map(lambda p, k: jax.random.normal(k, p.shape), tree(), jax.tree.unflatten(
      jax.tree.structure(tree()), list(keys)))


def run(tx, gs, params=None, jit=False):
  """Updates and states after each of the gradients ``gs``.

  Eager by default: on these tiny trees dispatch costs less than compiling
  each solver; MultiSteps' lax.cond compiles anyway, so it jits.
  """
  params = tree() if params is None else params
  state = tx.init(params)
  update = jax.jit(tx.update) if jit else tx.update
  outs = []
  for g in gs:
    u, state = update(g, state, params)
    outs.append((u, state))
  return outs


def assert_trees_equal(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def assert_trees_close(a, b, rtol=1e-6, atol=1e-7):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol), a, b)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_builds_and_steps(name):
  cfg = OptimConfig(optimizer=name, schedule=S.Cosine(peak=1e-2, warmup_steps=1),
                    weight_decay=0.0 if name == "adam" else 0.1, clip_norm=1.0)
  tx = build_optimizer(cfg, steps=10)
  (u1, _), (u2, _) = run(tx, [grads(0), grads(1)])
  if name != "adafactor":  # optax's adafactor decays weights by an absolute rate, not lr-scaled
    assert all(bool(jnp.all(u == 0)) for u in jax.tree.leaves(u1))  # warmup starts at rate 0
  for u in jax.tree.leaves(u2):
    assert bool(jnp.all(jnp.isfinite(u))) and bool(jnp.any(u != 0))


def test_muon_records_from_a_config_are_the_records():
  """A YAML config's ``execution`` mapping (its ``newton_schulz`` a mapping
  too) builds the same solver as the records; an unknown field is refused by
  name."""
  import fuseopt.optim as fo
  base = dict(optimizer="muon", learning_rate=1e-2, weight_decay=0.1)
  from_map = build_optimizer(OptimConfig(**base, optimizer_kwargs={
      "ns_coeffs": "polar_express",
      "execution": {"implementation": "xla", "newton_schulz": {"dtype": "float32", "gram": "auto"}}}),
      steps=10)
  from_records = build_optimizer(OptimConfig(**base, optimizer_kwargs={
      "ns_coeffs": "polar_express",
      "execution": fo.Execution(implementation="xla",
                                newton_schulz=fo.NewtonSchulz(dtype=jnp.float32, gram="auto"))}),
      steps=10)
  (u_map, _), = run(from_map, [grads(0)])
  (u_records, _), = run(from_records, [grads(0)])
  assert_trees_equal(u_map, u_records)
  with pytest.raises(ValueError, match=r"newton_schulz has unknown fields \['steps'\]"):
    build_optimizer(OptimConfig(**base, optimizer_kwargs={
        "execution": {"newton_schulz": {"steps": 3}}}), 10)
  with pytest.raises(ValueError, match="NewtonSchulz: matmul must be one of"):
    fo.NewtonSchulz(matmul="cublas")


def test_bf16_moments():
  cfg = OptimConfig(optimizer="adamw", learning_rate=1e-3, moment_dtype="bfloat16")
  (_, state), = run(build_optimizer(cfg, 10), [grads()])
  dtypes = {x.dtype for x in jax.tree.leaves(state) if x.shape == (16, 8)}
  assert jnp.dtype(jnp.bfloat16) in dtypes
  with pytest.raises(ValueError, match="moment_dtype.*lamb"):
    OptimConfig(optimizer="lamb", learning_rate=1e-3, moment_dtype="bfloat16")
  with pytest.raises(ValueError, match="moment_dtype.*adafactor"):
    OptimConfig(optimizer="adafactor", learning_rate=1e-3, moment_dtype="bfloat16")


def test_int8_moments():
  """moment_dtype="int8": Adam's moments (and the Muon family's AdamW side's) as
  8-bit codes with fp32 block scales; Muon's momentum stays fp32; optimizers
  without Adam moments refuse it at construction."""
  params = {"w": jnp.ones((4, 256)), "b": jnp.ones((256,))}
  g = jax.tree.map(lambda x: 0.01 * x, params)
  for name in ("adamw", "adam", "muon", "normuon"):
    cfg = OptimConfig(optimizer=name, learning_rate=1e-3, moment_dtype="int8")
    tx = build_optimizer(cfg, 10)
    state = tx.init(params)
    _, state = jax.jit(tx.update)(g, state, params)
    kinds = {str(x.dtype) for x in jax.tree.leaves(state)}
    assert {"int8", "uint8"} <= kinds, (name, kinds)
    if name in ("muon", "normuon"):  # the (4, 256) matrix's momentum: fp32
      assert any(x.shape == (4, 256) and x.dtype == jnp.float32 for x in jax.tree.leaves(state))
  for name in ("lamb", "lion", "adafactor"):
    with pytest.raises(ValueError, match=f"moment_dtype='int8'.*{name}"):
      OptimConfig(optimizer=name, learning_rate=1e-3, moment_dtype="int8")


def test_the_moment_format_has_one_name_from_yaml_to_kernel():
  """The moments' format is ``moment_dtype`` in YAML, in OptimConfig, on
  adam/adamw and on the Muon family (whose Execution record no longer holds
  one): what the config names reaches the state. Naming it again in
  ``optimizer_kwargs`` points at the config field; the old names are gone."""
  params = {"w": jnp.ones((4, 256)), "b": jnp.ones((256,))}
  for name in ("adamw", "muon"):
    for moment_dtype, kinds in (("int8", {"int8", "uint8"}), ("bfloat16", {"bfloat16"}),
                                ("float32", {"float32"})):
      cfg = OptimConfig.from_yaml(f"optimizer: {name}\nlearning_rate: 1e-3\n"
                                  f"moment_dtype: {moment_dtype}\n")
      state = build_optimizer(cfg, 10).init(params)
      adam = [x for x in jax.tree.leaves(state) if x.shape in ((256,), (1,))]
      assert {str(x.dtype) for x in adam} <= kinds | {"float32"}, (name, moment_dtype)
      assert kinds <= {str(x.dtype) for x in jax.tree.leaves(state)}, (name, moment_dtype)
  with pytest.raises(ValueError, match=r"moment_dtype.*OptimConfig.moment_dtype"):
    OptimConfig(optimizer="adamw", learning_rate=1e-3, moment_dtype="int8",
                optimizer_kwargs={"moment_dtype": "bfloat16"})
  with pytest.raises(TypeError, match="state_dtype"):
    OptimConfig(optimizer="adamw", learning_rate=1e-3, state_dtype="int8")
  with pytest.raises(ValueError, match=r"moment_dtype must be one of \('float32', 'bfloat16', "
                                       r"'int8', 'int4'\), got 'int2'"):
    OptimConfig(optimizer="adamw", learning_rate=1e-3, moment_dtype="int2")
  with pytest.raises(ValueError, match=r"execution has unknown fields \['adam_moment_dtype'\]"):
    build_optimizer(dict(optimizer="muon", learning_rate=1e-3,
                         optimizer_kwargs={"execution": {"adam_moment_dtype": "int8"}}), 10)


def test_groups_get_their_rate_and_decay():
  # AdamW's first step moves each weight by lr * (sign(g) + wd * p) (m/sqrt(v) = sign(g)).
  lr, wd = 1e-2, 0.1
  cfg = OptimConfig(optimizer="adamw", learning_rate=lr, weight_decay=wd, eps=0.0,
                    param_groups=mup_param_groups(4.0))
  g = jax.tree.map(jnp.ones_like, tree())
  (u, _), = run(build_optimizer(cfg, 10), [g])
  np.testing.assert_allclose(u["embed_tokens"]["embedding"], -lr * (1 + wd), rtol=1e-5)  # base rate, decay
  np.testing.assert_allclose(u["layers_0"]["q_proj"]["kernel"], -lr / 4 * (1 + wd), rtol=1e-5)  # muP rate
  np.testing.assert_allclose(u["layers_0"]["q_proj"]["bias"], -lr, rtol=1e-5)  # no decay
  np.testing.assert_allclose(u["layers_0"]["norm"]["scale"], -lr, rtol=1e-5)


def test_clip_sees_all_grads_across_groups():
  # Two groups whose gradients have norms 6 and 8: the global norm is 10, so
  # the clip to 1 scales both by 1/10 (a per-group clip would give 1/6, 1/8).
  params = {"a": jnp.ones((4,)), "b": jnp.ones((16,))}
  g = {"a": jnp.full((4,), 3.0), "b": jnp.full((16,), 2.0)}
  groups = (ParamGroup("a", ("a",)), ParamGroup("b", ("b",), 0.5))
  # eps = 1 makes Adam's step g / (|g| + 1): not scale invariant, so the clip shows.
  base = dict(optimizer="adam", learning_rate=1.0, eps=1.0, param_groups=groups)
  (clipped, state), = run(build_optimizer(OptimConfig(clip_norm=1.0, **base), 10), [g], params)
  (manual, _), = run(build_optimizer(OptimConfig(**base), 10), [jax.tree.map(lambda x: x / 10, g)], params)
  assert_trees_close(clipped, manual)
  np.testing.assert_allclose(safeguards.global_norm_of(state), 10.0, rtol=1e-6)
  np.testing.assert_allclose(clipped["a"], -0.3 / 1.3, rtol=1e-5)


def test_clip_zero_reports_without_clipping():
  base = dict(optimizer="adam", learning_rate=1.0, eps=1.0)
  g = jax.tree.map(lambda x: 5 * x, grads())
  (u0, state), = run(build_optimizer(OptimConfig(clip_norm=0.0, **base), 10), [g])
  (u1, _), = run(optax.adam(1.0, eps=1.0), [g])
  assert_trees_close(u0, u1)
  np.testing.assert_allclose(safeguards.global_norm_of(state), optax.tree.norm(g), rtol=1e-6)


def _nan_like(g):
  out = jax.tree.map(lambda x: x, g)
  out["layers_0"]["norm"]["scale"] = out["layers_0"]["norm"]["scale"].at[3].set(jnp.nan)
  return out


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_skipped_step_leaves_state_and_schedule_untouched(name):
  # Linear warmup makes every step's rate different: if the NaN step advanced
  # the count, the following update would not match the run without it.
  cfg = OptimConfig(optimizer=name, schedule=S.Linear(peak=1e-2, warmup_steps=4), weight_decay=0.1,
                    clip_norm=1.0, skip_nonfinite=True)
  tx = build_optimizer(cfg, 10)
  g0, g1 = grads(0), grads(1)
  skipped = run(tx, [g0, _nan_like(g1), g1])
  clean = run(tx, [g0, g1])
  (_, s0), (u_nan, s_nan), (u2, s2) = skipped
  # The whole update is zero: the Muon side and the AdamW side together.
  for u in jax.tree.leaves(u_nan):
    assert bool(jnp.all(u == 0))
  assert_trees_equal(s_nan.inner_state, s0.inner_state)
  assert int(s_nan.consecutive_skips) == 1 and int(s_nan.total_skips) == 1 and not bool(s_nan.last_finite)
  assert_trees_equal(u2, clean[1][0])
  assert_trees_equal(s2.inner_state, clean[1][1].inner_state)
  assert int(s2.consecutive_skips) == 0 and int(s2.total_skips) == 1


def test_skip_limit_raise_and_apply():
  bad = _nan_like(grads())
  cfg = OptimConfig(optimizer="adamw", learning_rate=1e-2, skip_nonfinite=True, max_consecutive_skips=2)
  outs = run(build_optimizer(cfg, 10), [bad, bad])
  assert int(outs[-1][1].consecutive_skips) == 2
  with pytest.raises(Exception, match="consecutive non-finite"):
    jax.block_until_ready(run(build_optimizer(cfg, 10), [bad, bad, bad]))
  cfg = OptimConfig(optimizer="adamw", learning_rate=1e-2, skip_nonfinite=True, max_consecutive_skips=2,
                    on_max_skips="apply")
  (_, _), (_, _), (u, s) = run(build_optimizer(cfg, 10), [bad, bad, bad])
  assert not bool(jnp.all(jnp.isfinite(u["layers_0"]["norm"]["scale"])))  # applied, NaN and all
  assert int(s.consecutive_skips) == 0 and int(s.total_skips) == 2


def test_accumulation_is_multisteps():
  # k = 2 micro-steps apply the mean gradient once; the schedule counts applied updates only.
  base = dict(optimizer="adamw", schedule=S.Linear(peak=1e-2, warmup_steps=2), weight_decay=0.1)
  micro = [grads(i) for i in range(4)]
  acc = run(build_optimizer(OptimConfig(accumulate_steps=2, **base), 10), micro, jit=True)
  ref = run(build_optimizer(OptimConfig(**base), 10),
            [jax.tree.map(lambda a, b: (a + b) / 2, micro[0], micro[1]),
             jax.tree.map(lambda a, b: (a + b) / 2, micro[2], micro[3])])
  for u in jax.tree.leaves(acc[0][0]) + jax.tree.leaves(acc[2][0]):
    assert bool(jnp.all(u == 0))
  assert_trees_close(acc[1][0], ref[0][0])
  assert_trees_close(acc[3][0], ref[1][0])


def test_frozen_params_get_zero_updates_and_hold_no_state():
  params = {"base": {"kernel": jnp.ones((8, 8))},
            "lora_a": jnp.ones((8, 2)), "lora_b": jnp.ones((2, 8))}
  g = jax.tree.map(lambda p: jnp.full(p.shape, 2.0), params)
  for cfg in (OptimConfig(optimizer="adamw", learning_rate=1e-2, trainable=("lora_*",), clip_norm=1.0),
              OptimConfig(optimizer="adamw", learning_rate=1e-2, frozen=("base/*",), clip_norm=1.0,
                          skip_nonfinite=True, accumulate_steps=2)):
    tx = build_optimizer(cfg, 10)
    state = tx.init(params)
    assert not any(x.shape == (8, 8) for x in jax.tree.leaves(state))  # no moments, no accumulator
    u, state = jax.jit(tx.update)(g, state, params)
    u, state = jax.jit(tx.update)(g, state, params)
    assert bool(jnp.all(u["base"]["kernel"] == 0))
    assert bool(jnp.any(u["lora_a"] != 0))
    # The clip's norm covers the trainable gradients only: 2 * sqrt(32).
    np.testing.assert_allclose(safeguards.global_norm_of(state), 2 * np.sqrt(32), rtol=1e-6)


def test_muonclip_gets_qk_stats_through_every_layer():
  # qk_stats must reach QK-Clip through freeze, skip_nonfinite, MultiSteps,
  # the clip and the group partition: the q/k updates differ from plain Muon's,
  # the rest do not.
  params = {"embed_tokens": {"embedding": jnp.ones((16, 8))},
            "attn": {"q_proj": {"kernel": jnp.ones((8, 8))}, "k_proj": {"kernel": jnp.ones((8, 8))}},
            "norm": {"scale": jnp.ones((8,))}, "lora": jnp.ones((8, 2))}
  g = jax.tree.map(lambda p: 0.1 * jnp.ones_like(p), params)
  layers = dict(learning_rate=1e-2, accumulate_steps=2, skip_nonfinite=True, frozen=("lora",), clip_norm=1.0,
                param_groups=mup_param_groups(2.0))
  clip = build_optimizer(OptimConfig(optimizer="muonclip", qk_clip_tau=100.0, **layers), 10)
  plain = build_optimizer(OptimConfig(optimizer="muon", **layers), 10)
  cs, ps = clip.init(params), plain.init(params)
  clip_update, plain_update = jax.jit(clip.update), jax.jit(plain.update)
  for _ in range(2):
    u, cs = clip_update(g, cs, params, qk_stats={"attn": jnp.array([200.0, 50.0])})
    r, ps = plain_update(g, ps, params)
  assert float(jnp.abs(u["attn"]["q_proj"]["kernel"] - r["attn"]["q_proj"]["kernel"]).max()) > 1e-3
  assert_trees_equal(u["embed_tokens"], r["embed_tokens"])


def test_yaml_and_dict_round_trip():
  cfg = OptimConfig(
      optimizer="muon", weight_decay=0.1, b1=0.9, b2=0.95, moment_dtype="bfloat16",
      schedule=S.Power(peak=0.02, warmup_steps=100, a=0.1, tail=S.PowerTail(start=800, end=1e-5)),
      param_groups=mup_param_groups(4.0), clip_norm=1.0, accumulate_steps=4, skip_nonfinite=True,
      frozen=("*frozen*",), trainable=("*lora_*",), optimizer_kwargs={"beta": 0.9, "ns_steps": 5})
  assert OptimConfig.from_yaml(cfg.to_yaml()) == cfg
  assert OptimConfig.from_dict(cfg.to_dict()) == cfg
  for s in (S.Cosine(peak=1e-3, warmup_steps=5), S.WSD(peak=1e-3, decay_fraction=0.1, decay="linear")):
    c = OptimConfig(schedule=s)
    assert OptimConfig.from_yaml(c.to_yaml()) == c


def test_hand_written_yaml_and_overrides():
  cfg = OptimConfig.from_yaml("""
optimizer: adamw
schedule: {kind: wsd, peak: 3e-4, warmup_steps: 100, decay_fraction: 0.2}
weight_decay: 0.1
param_groups:
  - {name: no_decay, patterns: ['*/bias', '*/scale'], weight_decay: 0.0}
  - {name: rest, patterns: ['*']}
""")
  assert cfg.schedule == S.WSD(peak=3e-4, warmup_steps=100, decay_fraction=0.2)
  assert cfg.param_groups[0].weight_decay == 0.0
  over = cfg.override("optimizer=muon", "schedule.peak=1e-3", "clip_norm=1")
  assert (over.optimizer, over.schedule.peak, over.clip_norm) == ("muon", 1e-3, 1.0)
  assert cfg.override("learning_rate=2e-4").schedule is None


@pytest.mark.parametrize("d,match", [
    ({"learning_rate": 1e-3, "lr_schedule": "wsd"}, r"unknown key.*lr_schedule"),
    ({"learning_rate": 1e-3, "weight_decy": 0.1}, r"did you mean 'weight_decay'"),
    ({"learning_rate": 1e-3, "optimizer": "adamx"}, r"optimizer.*did you mean 'adam"),
    ({"learning_rate": 1e-3, "optimizer": "adam", "weight_decay": 0.1}, r"weight_decay.*adamw"),
    ({}, r"learning_rate / OptimConfig.schedule"),
    ({"learning_rate": 1e-3, "schedule": {"kind": "constant", "peak": 1.0}}, r"exactly one"),
    ({"learning_rate": -1.0}, r"learning_rate"),
    ({"learning_rate": 1e-3, "accumulate_steps": 0}, r"accumulate_steps"),
    ({"learning_rate": 1e-3, "clip_norm": -1.0}, r"clip_norm"),
    ({"learning_rate": 1e-3, "b2": 1.0}, r"b2"),
    ({"learning_rate": 1e-3, "on_max_skips": "ignore"}, r"on_max_skips"),
    ({"learning_rate": 1e-3, "optimizer_kwargs": {"weight_decay": 0.1}}, r"optimizer_kwargs"),
    ({"schedule": {"kind": "wsd", "peak": 1.0}}, r"WSD.decay_steps"),
    ({"learning_rate": 1e-3, "param_groups": [{"name": "a", "patterns": []}]}, r"patterns is empty"),
])
def test_bad_configs_raise(d, match):
  with pytest.raises(ValueError, match=match):
    OptimConfig.from_dict(d)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_a_skipped_fused_step_leaves_8bit_moments_untouched(name):
  """Issue 40, 4: ``skip_nonfinite`` with ``moment_dtype: int8``, the fused
  step: a NaN gradient keeps the parameters and every moment array -- the
  codes and the scales -- bit for bit, so the run goes on as if the step had
  not come."""
  from fuseopt.kernels.adam import quantized
  from fuseopt.optim.step import step
  cfg = OptimConfig(optimizer=name, schedule=S.Linear(peak=1e-2, warmup_steps=4), weight_decay=0.1,
                    skip_nonfinite=True, moment_dtype="int8")
  tx = build_optimizer(cfg, 10)
  shapes = {"embed_tokens": {"embedding": (8, 256)},
            "layers_0": {"q_proj": {"kernel": (32, 256), "bias": (256,)}, "norm": {"scale": (256,)}}}
  def draw(seed):
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return treedef.unflatten([jax.random.normal(k, s) for k, s in zip(keys, leaves)])
  params = draw(7)
  fused = jax.jit(lambda g, s, p: step(tx, g, s, p))

  def replay(gs):
    p, s, out = params, tx.init(params), []
    for g in gs:
      p, s = fused(g, s, p)
      out.append(jax.device_get((p, s)))
    return out

  g0, g1 = draw(0), draw(1)
  (p0, s0), (p_nan, s_nan), (p2, s2) = replay([g0, _nan_like(g1), g1])
  clean = replay([g0, g1])
  moments = jax.tree.leaves(s0.inner_state, is_leaf=quantized.is_quantized)
  assert any(quantized.is_quantized(x) for x in moments), "8-bit moments in the state"
  assert_trees_equal(p_nan, p0)
  assert_trees_equal(s_nan.inner_state, s0.inner_state)
  assert_trees_equal(p2, clean[1][0])
  assert_trees_equal(s2.inner_state, clean[1][1].inner_state)


def test_each_optimizer_is_declared_once_and_built():
  """The builder's optimizers are config.CAPABILITIES' keys (one declaration
  each); the capability tuples are read off that table."""
  from fuseopt.optim import builder, config
  assert tuple(builder.OPTIMIZER_MAP) == config.OPTIMIZERS == tuple(config.CAPABILITIES)
  caps = config.CAPABILITIES
  assert config.BLOCKWISE_MOMENT_OPTIMIZERS == tuple(n for n in caps if caps[n].blockwise_moments)
  assert set(config.MUON_OPTIMIZERS) <= set(config.CAUTIOUS_OPTIMIZERS)


def test_muon_momentum_format_is_a_config_field():
  """OptimConfig.momentum_dtype asks for the Muon family's own momentum
  format, 8-bit included (optimizer_kwargs' mu_dtype is refused, pointing
  here; there used to be no way to ask for it), from YAML to the state."""
  import fuseopt.optim as fo
  from fuseopt.kernels.adam import quantized
  from fuseopt.optim import config
  params = {"w": jnp.ones((8, 512)), "b": jnp.ones((512,))}
  muon_states = (optax.contrib.MuonState, fo.NorMuonState)

  def momentum(state):
    return [s.mu["w"] for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, muon_states))
            if isinstance(s, muon_states)]

  for name in config.MUON_OPTIMIZERS:
    if name == "muonclip":
      continue   # (its update takes qk_stats; the same builder path)
    cfg = OptimConfig.from_yaml(f"optimizer: {name}\nlearning_rate: 0.01\nmomentum_dtype: int8\n"
                                f"moment_dtype: int4\n")
    assert OptimConfig.from_yaml(cfg.to_yaml()) == cfg and cfg.momentum_dtype == "int8"
    solver = build_optimizer(cfg, steps=10)
    state = solver.init(params)
    (mu,) = momentum(state)
    assert quantized.is_quantized(mu), name
    _, state = jax.jit(solver.update)(params, state, params)
    (mu,) = momentum(state)
    assert quantized.is_quantized(mu), name
  for fmt, dtype in (("float32", jnp.float32), ("bfloat16", jnp.bfloat16)):
    state = build_optimizer(OptimConfig(optimizer="muon", learning_rate=0.01, momentum_dtype=fmt),
                            steps=10).init(params)
    (muon_state,) = [s for s in jax.tree.leaves(
        state, is_leaf=lambda x: isinstance(x, optax.contrib.MuonState))
                     if isinstance(s, optax.contrib.MuonState)]
    assert muon_state.mu["w"].dtype == dtype
  with pytest.raises(ValueError, match=r"OptimConfig.momentum_dtype must be one of \('float32', "
                                       r"'bfloat16', 'int8'\) or None, got 'int4'"):
    OptimConfig(optimizer="muon", learning_rate=0.01, momentum_dtype="int4")
  with pytest.raises(ValueError, match=r"OptimConfig.momentum_dtype: only for optimizers "
                                       r"\('muon', 'muonclip', 'normuon'\)"):
    OptimConfig(optimizer="adamw", learning_rate=0.01, momentum_dtype="int8")
  with pytest.raises(ValueError, match=r"\['mu_dtype'\] are OptimConfig fields.*Muon's own momentum "
                                       r"is OptimConfig.momentum_dtype, one of \('float32', "
                                       r"'bfloat16', 'int8'\)"):
    OptimConfig(optimizer="muon", learning_rate=0.01, optimizer_kwargs={"mu_dtype": "int8"})
