"""The compile tier's cases (:func:`cases`), and which of them CI compiles where.

- ``kernel/...``: every kernel the ops' heuristics pick for the shapes their
  benchmarks use, each dtype signature and option of the Adam kernel, the
  Newton–Schulz paths (fused, tiled, Gram, batched, ragged); with
  ``full=True`` also every config of every search space;
- ``step/...``: the AdamW, hybrid Muon + AdamW and builder recipes on the
  1.20 B Llama tree (abstract shapes: nothing is allocated), fused
  (:func:`fuseopt.optim.step`) and through ``tx.update`` +
  ``optax.apply_updates``, beside optax's own recipe;
- ``sharded/...``: the AdamW and hybrid steps on 8 devices, FSDP
  placements, on Explicit and Auto meshes, beside optax's;
- ``scale/...``: the hybrid step of 8.8 B to 80 B models in the layouts real
  codebases use, on 8 to 1024 devices (:mod:`fuseopt.benchmarks.scale`).

Sharded and scale cases place the optimizer state like the parameters and
donate it (:func:`~fuseopt.benchmarks.compile_steps.shard_like_params`): their figures are of the program users
run.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from fuseopt import targets as targets_lib
from fuseopt.benchmarks import compile_steps, user_step
from fuseopt.benchmarks import memory
from fuseopt.benchmarks.compile_harness import Case

F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)


def _S(shape, dtype=F32):
  return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _cfg_name(cfg) -> str:
  if cfg is None:
    return "heuristic"
  fields = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else {"cfg": cfg}
  parts = []
  for k, v in fields.items():
    if isinstance(v, dict):
      v = "-".join(f"{a}{b}" for a, b in v.items()) if v else "none"
    parts.append(f"{k}={v}")
  return f"{type(cfg).__name__}({','.join(parts)})"


def _dt(d) -> str:
  return {F32: "f32", BF16: "bf16"}[jnp.dtype(d)]


# Mosaic GPU kernels compile on sm_90 only (the dispatch refuses sm_89, where
# the compiler aborts the process): their cases run on the GPU targets (whose
# backend is triton) and in CI on the H200.
_MOSAIC_GPU = dict(implementations=("triton",), ci_targets=("h200",), sm90_only=True)


def _on(impl: str) -> dict:
  return _MOSAIC_GPU if impl == "mosaic_gpu" else dict(implementations=(impl,))


def _sr_cases(impl: str) -> list[Case]:
  from fuseopt.benchmarks import workloads
  from fuseopt.kernels import stochastic_round as sr
  from fuseopt.kernels.stochastic_round.backends import BACKENDS
  backend = BACKENDS[impl]
  heur, space = backend.heuristic, backend.SEARCH_SPACE
  out, seen = [], set()

  def case(shape, cfg, full_only=False):
    def build(t, shape=shape, cfg=cfg):
      fn = lambda x: sr.stochastic_round_bf16(x, 7, implementation=impl, config=cfg)
      return fn, (_S(shape),), ()
    return Case(f"kernel/stochastic_round/{impl}/{'x'.join(map(str, shape))}/{_cfg_name(cfg)}",
                build, full_only=full_only, **_on(impl))
  # The benchmark sizes (flat), a ragged one and the tests' small sizes, each
  # distinct heuristic config once; then leaves in their own layout (on a TPU
  # the kernel tiles a leaf's last two dims): a matrix of the 1.2 B tree, a
  # ragged matrix and a ragged stack.
  for n in (*workloads.SR_SIZES["quick"], *workloads.SR_SIZES["full"], 1_000_003, 4096, 1000):
    cfg = heur(n)
    if cfg not in seen:
      seen.add(cfg)
      out.append(case((n,), cfg))
  out += [case(shape, None) for shape in ((2048, 8192), (1000, 3001), (4, 1000, 3001))]
  out += [case((1 << 24,), cfg, full_only=True) for cfg in space if cfg not in seen]
  out += [case(shape, cfg, full_only=True) for cfg in space
          for shape in ((1000, 3001), (4, 1000, 3001))]
  return out


_ADAM_SHAPE = (2048, 8192)   # the 1.2 B tree's MLP matrix
_ADAM_RAGGED = (1000, 3001)


def _adam_cases(impl: str) -> list[Case]:
  from fuseopt.kernels import adam
  from fuseopt.kernels.adam.backends import BACKENDS
  space = BACKENDS[impl].SEARCH_SPACE
  out = []

  def case(tag, shape, pd, gd, md, *, cfg=None, full_only=False, **opts):
    def build(t):
      def fn(p, g, mu, nu):
        return adam.adam_update(p, g, mu, nu, count=3, learning_rate=1e-3, weight_decay=0.1,
                                implementation=impl, config=cfg, **opts)
      p = None if pd is None else _S(shape, pd)
      donate = (0, 2, 3) if p is not None else (2, 3)
      return fn, (p, _S(shape, gd), _S(shape, md), _S(shape, md)), donate
    return Case(f"kernel/adam_update/{impl}/{tag}/{_cfg_name(cfg)}", build,
                full_only=full_only, **_on(impl))
  # Every dtype signature: params x grads x moments.
  for pd in (F32, BF16):
    for gd in (F32, BF16):
      for md in (BF16, F32):
        out.append(case(f"p{_dt(pd)}-g{_dt(gd)}-m{_dt(md)}", _ADAM_SHAPE, pd, gd, md))
  # Options: nesterov, a traced clip scale and skip flag, direction only, ragged.
  def traced_options(p, g, mu, nu):
    scale = jnp.minimum(1.0, 1.0 / (1e-6 + jnp.sqrt(jnp.sum(jnp.square(g.astype(F32))))))
    return dict(grad_scale=scale, apply=jnp.all(jnp.isfinite(g)))

  def options_case(tag, **static):
    def build(t):
      def fn(p, g, mu, nu):
        return adam.adam_update(p, g, mu, nu, count=3, learning_rate=1e-3, weight_decay=0.1,
                                implementation=impl, **static, **traced_options(p, g, mu, nu))
      return fn, (_S(_ADAM_SHAPE), _S(_ADAM_SHAPE), _S(_ADAM_SHAPE, BF16),
                  _S(_ADAM_SHAPE, BF16)), (0, 2, 3)
    return Case(f"kernel/adam_update/{impl}/{tag}/heuristic", build, **_on(impl))
  out.append(options_case("pf32-gf32-mbf16-nesterov-clip-skip", nesterov=True))
  out.append(case("direction-only-gf32-mbf16", _ADAM_SHAPE, None, F32, BF16))
  out.append(case("ragged-pf32-gf32-mbf16", _ADAM_RAGGED, F32, F32, BF16))
  out.append(case("small-pf32-gf32-mbf16", (64, 256), F32, F32, BF16))   # the tests' size
  out += [case("pf32-gf32-mbf16", _ADAM_SHAPE, F32, F32, BF16, cfg=c, full_only=True)
          for c in space]
  # The variants: cautious weight decay (one more runtime scalar, the same
  # kernel's operands) and mantissa-tracked bf16 params (an int16 companion
  # read and written in place: two more streams; an int8 one: a 24-bit master).
  out.append(case("cautious-pf32-gf32-mbf16", _ADAM_SHAPE, F32, F32, BF16,
                  cautious_weight_decay=True))
  out += [_adam_mantissa_case(impl, tag, shape, lo)
          for tag, shape, lo in (("mantissa-pbf16-gf32-mbf16", _ADAM_SHAPE, jnp.int16),
                                 ("mantissa-ragged-pbf16-gf32-mbf16", _ADAM_RAGGED, jnp.int16),
                                 ("mantissa24-pbf16-gf32-mbf16", _ADAM_SHAPE, jnp.int8))]
  out += [_adam_mantissa_blockwise_case(impl, int4) for int4 in (False, True)]
  if impl in ("triton", "mosaic_gpu"):
    out += _adam_group_cases(impl)
  if impl == "triton":
    out += [_adam_group_mantissa_case(impl)] + _adam_int8_group_cases(impl)
    out += _adam_int8_group_cases(impl, int4=True)
  out.append(_adam_int8_case(impl))
  out += [_adam_int8_case(impl, cfg) for cfg in space]
  out.append(_adam_int8_case(impl, int4=True))
  # (the 4-bit per-leaf kernel's own space where the backend has one: Triton's
  # leaves out the config at which it spills)
  int4_space = getattr(BACKENDS[impl], "INT4_SEARCH_SPACE", space)
  out += [_adam_int8_case(impl, cfg, int4=True) for cfg in int4_space]
  return out


def _blockwise_moments(shape, int4: bool):
  """Abstract 8-bit (int8 mu, uint8 nu) or 4-bit (packed uint8) moments of a leaf."""
  from fuseopt.kernels.adam import int4 as q4
  from fuseopt.kernels.adam import quantized as q8
  if int4:
    m = q4.PackedMoment(_S(q4.codes_shape(shape), jnp.uint8), _S(q4.scales_shape(shape), F32))
    return m, m
  return tuple(q8.QuantizedMoment(_S(shape, d), _S(q8.scales_shape(shape), F32))
               for d in (jnp.int8, jnp.uint8))


def _adam_int8_group_cases(impl: str = "triton", int4: bool = False) -> list[Case]:
  """The 1-layer Llama tree, 8-bit (or 4-bit) moments on every leaf, grouped launches."""
  from fuseopt.kernels import adam
  from fuseopt.kernels.adam.backends import BACKENDS
  fmt = "int4" if int4 else "int8"

  def case(cfg):
    def build(t):
      leaves = _llama_leaves()
      moms = list(zip(*[_blockwise_moments(x.shape, int4) for x in leaves]))
      fn = lambda ps, gs, mus, nus: adam.adam_update_tree(
          ps, gs, mus, nus, count=3, learning_rate=1e-3, weight_decay=0.1,
          implementation=impl, config=cfg, group=True)
      return fn, (leaves, leaves, *[list(m) for m in moms]), (0, 2, 3)
    return Case(f"kernel/adam_update_tree/{impl}/llama-1-layer-{fmt}/{_cfg_name(cfg)}", build,
                full_only=cfg is not None, **_on(impl))
  space = BACKENDS[impl].QUANTIZED_GROUP_SEARCH_SPACE
  return [case(None)] + [case(c) for c in space]


def _adam_int8_case(impl: str, cfg=None, int4: bool = False) -> Case:
  """8-bit moments (int8 mu, uint8 nu, fp32 scales per 256) or 4-bit ones
  (packed, fp32 scales per 128) on the MLP matrix, each backend's blockwise
  kernel: the heuristic config in CI, every config of the backend's space in
  the full sweep."""
  from fuseopt.kernels import adam

  def build(t):
    def fn(p, g, mu, nu):
      return adam.adam_update(p, g, mu, nu, count=3, learning_rate=1e-3, weight_decay=0.1,
                              implementation=impl, config=cfg)
    return fn, (_S(_ADAM_SHAPE), _S(_ADAM_SHAPE), *_blockwise_moments(_ADAM_SHAPE, int4)), (0, 2, 3)
  fmt = "int4" if int4 else "int8"
  return Case(f"kernel/adam_update/{impl}/{fmt}-pf32-gf32/{_cfg_name(cfg)}", build,
              full_only=cfg is not None, **_on(impl))


def _adam_mantissa_case(impl: str, tag: str, shape, companion) -> Case:
  """A mantissa-tracked leaf (bf16 p, an int16 or int8 companion), the heuristic config."""
  from fuseopt.kernels import adam

  def build(t):
    def fn(p, g, mu, nu, lo):
      return adam.adam_update(p, g, mu, nu, count=3, learning_rate=1e-3, weight_decay=0.1,
                              implementation=impl, params_lo=lo)
    return fn, (_S(shape, BF16), _S(shape, F32), _S(shape, BF16), _S(shape, BF16),
                _S(shape, companion)), (0, 2, 3, 4)
  return Case(f"kernel/adam_update/{impl}/{tag}/heuristic", build, **_on(impl))


def _adam_mantissa_blockwise_case(impl: str, int4: bool) -> Case:
  """A bf16 leaf with a 24-bit master (an int8 companion) on 8-bit or 4-bit
  moments, the heuristic config: the backend's blockwise kernel reads and
  writes the master in its one pass."""
  from fuseopt.kernels import adam

  def build(t):
    def fn(p, g, mu, nu, lo):
      return adam.adam_update(p, g, mu, nu, count=3, learning_rate=1e-3, weight_decay=0.1,
                              implementation=impl, params_lo=lo)
    return fn, (_S(_ADAM_SHAPE, BF16), _S(_ADAM_SHAPE, F32),
                *_blockwise_moments(_ADAM_SHAPE, int4), _S(_ADAM_SHAPE, jnp.int8)), (0, 2, 3, 4)
  fmt = "int4" if int4 else "int8"
  return Case(f"kernel/adam_update/{impl}/mantissa24-pbf16-gf32-{fmt}/heuristic", build,
              **_on(impl))


def _adam_group_mantissa_case(impl: str = "triton") -> Case:
  """The 1-layer Llama tree in bf16, its matrices mantissa-tracked and its
  norms not (two dtype signatures: two kinds of grouped launch)."""
  from fuseopt.kernels import adam

  def build(t):
    leaves = _llama_leaves(BF16)
    gs = [_S(x.shape, F32) for x in leaves]
    mom = [_S(x.shape, BF16) for x in leaves]
    los = [_S(x.shape, jnp.int16) if len(x.shape) > 1 else None for x in leaves]

    def fn(ps, gs, mus, nus, los):
      return adam.adam_update_tree(ps, gs, mus, nus, count=3, learning_rate=1e-3,
                                   weight_decay=0.1, implementation=impl, group=True,
                                   params_lo=los)
    return fn, (leaves, gs, mom, mom, los), (0, 2, 3, 4)
  return Case(f"kernel/adam_update_tree/{impl}/llama-1-layer-mantissa/heuristic", build,
              **_on(impl))


def _llama_leaves(dtype=F32):
  from fuseopt.benchmarks import workloads
  return jax.tree.leaves(workloads.llama_tree(dtype, layers=1))


def _adam_group_cases(impl: str = "triton") -> list[Case]:
  from fuseopt.kernels import adam
  from fuseopt.kernels.adam.backends import BACKENDS
  space = BACKENDS[impl].GROUP_SEARCH_SPACE

  def case(cfg, full_only):
    def build(t):
      leaves = _llama_leaves()
      mom = [_S(x.shape, BF16) for x in leaves]

      def fn(ps, gs, mus, nus):
        return adam.adam_update_tree(ps, gs, mus, nus, count=3, learning_rate=1e-3,
                                     weight_decay=0.1, implementation=impl, config=cfg,
                                     group=True)
      return fn, (leaves, leaves, mom, mom), (0, 2, 3)
    return Case(f"kernel/adam_update_tree/{impl}/llama-1-layer/{_cfg_name(cfg)}", build,
                full_only=full_only, **_on(impl))
  return [case(None, False)] + [case(c, True) for c in space]


def _ns_cases(impl: str) -> list[Case]:
  from fuseopt.benchmarks import workloads
  from fuseopt.kernels.newton_schulz import api as ns
  from fuseopt.kernels.newton_schulz import fused
  from fuseopt.kernels.newton_schulz import gemm as update
  from fuseopt.kernels.newton_schulz import sym as gram
  out = []

  def case(tag, shape, *, cfg=None, gram_=False, full_only=False, dtype=BF16):
    def build(t):
      fn = lambda x: ns.newton_schulz(x, implementation=impl, config=cfg, gram=gram_)
      return fn, (_S(shape, dtype),), ()
    return Case(f"kernel/newton_schulz/{impl}/{tag}/{_cfg_name(cfg)}", build,
                full_only=full_only, **_on(impl))
  # The benchmark shapes, each distinct choice of config=None once (the
  # single-kernel path or the tiled kernels' heuristic configs: shapes that
  # pick the same configs differ only in their grids), Gram NS, a ragged
  # shape and a small batch the single-kernel path takes.
  small = 128 if impl in ("triton", "mosaic_gpu") else 256
  seen = set()
  for shape in sorted(workloads.NS_SHAPES, key=lambda s: -len(s)):   # stacks first
    *batch, a, b = shape
    bsz, m, n = math.prod(batch), min(a, b), max(a, b)
    picks = ("fused",) if fused.fits(impl, m, n) else (
        "tiled", gram.heuristic(impl, bsz, m, n), update.heuristic(impl, bsz, m, n))
    out.append(case(workloads.shape_name(shape), shape, full_only=picks in seen))
    seen.add(picks)
  out.append(case("gram-2048x8192", (2048, 8192), gram_=True))
  out.append(case("ragged-1000x2900", (1000, 2900)))
  out.append(case(f"fused-8x{small}x{2 * small}", (8, small, 2 * small)))
  if impl != "mosaic_gpu":   # Mosaic GPU iterates in bf16/f16 only (refuses fp32)
    out.append(case("f32-1024x1024", (1024, 1024), dtype=F32, full_only=True))
  # The full sweep: every config of each kernel's search space at 2048x8192.
  sym_space = gram.BACKENDS[impl].SEARCH_SPACE
  mm_space = update.BACKENDS[impl].SEARCH_SPACE
  fused_space = fused.BACKENDS[impl].SEARCH_SPACE
  out += [case("2048x8192", (2048, 8192), cfg=ns.TiledConfig(sym=c), full_only=True)
          for c in sym_space]
  out += [case("2048x8192", (2048, 8192), cfg=ns.TiledConfig(matmul=c), full_only=True)
          for c in mm_space]
  out += [case(f"8x{small}x{2 * small}", (8, small, 2 * small), cfg=c, full_only=True)
          for c in fused_space]
  return out


def kernel_cases() -> list[Case]:
  out = []
  for impl in ("triton", "mosaic_tpu"):
    out += _sr_cases(impl) + _adam_cases(impl) + _ns_cases(impl)
  return out + _sr_cases("mosaic_gpu") + _adam_cases("mosaic_gpu") + _ns_cases("mosaic_gpu")


# Recipes on the 1.2 B tree.
def _recipes() -> dict[str, dict[str, tuple[Any, Any]]]:
  """recipe -> {variant: (transformation, fused)}."""
  from fuseopt.benchmarks.cases import step as step_cases
  out = step_cases.recipes()
  out["builder_recipe"] = _builder_recipe()
  return out


def _builder_recipe():
  import optax

  import fuseopt.optim as fo
  config = fo.OptimConfig.from_dict({
      "optimizer": "muon",
      "schedule": {"kind": "wsd", "peak": 0.02, "warmup_steps": 100, "decay_fraction": 0.2},
      "adam_schedule": {"kind": "wsd", "peak": 3e-4, "warmup_steps": 100,
                        "decay_fraction": 0.2},
      "muon_patterns": ["layers/*/attn/*", "layers/*/mlp/*"],
      "weight_decay": 0.1,
      "moment_dtype": "bfloat16",
      "param_groups": [{"name": "no_decay", "patterns": ["*_norm", "final_norm"],
                        "weight_decay": 0.0},
                       {"name": "rest", "patterns": ["*"]}],
      "clip_norm": 1.0,
  })
  tx = fo.build_optimizer(config, steps=1000)
  sched = optax.warmup_cosine_decay_schedule(0.0, 0.02, 100, 1000)
  from fuseopt.benchmarks.cases import muon as muon_cases
  optax_tx = optax.chain(optax.clip_by_global_norm(1.0), optax.contrib.muon(
      sched, weight_decay=0.1, adam_weight_decay=0.1, ns_coeffs=muon_cases.COEFFS,
      muon_weight_dimension_numbers=muon_cases.muon_dims))
  return {"optax_chain": (optax_tx, False), "fuseopt_fallback": (tx, False),
          "fuseopt_step": (tx, True)}


# Which targets CI compiles the costly cases on (the rest is the full sweep,
# `fuseopt compile-check --target all --all`; docs/compile_tier.md says why
# each): libtpu takes 1-3 min for one sharded or Muon step of the 1.20 B tree
# on the 2-core CI machine, and one target's steps share one worker.
# The steps' TPU is v5e: libtpu takes up to 7 times as long for v6e's (the
# same Mosaic kernels and the same shardings), docs/compile_tier.md.
CI_TARGETS = {
    "fallback": ("h200",),
    "builder_fallback": (),
    "builder": ("h200", "v5e"),
    "sharded_explicit": ("h200", "v5e"),
    "sharded_auto": ("h200", "v5e"),
    "sharded_int8_explicit": ("h200", "v5e"),
    "sharded_int8_auto": ("h200",),
    "steps": ("h200", "l4", "rtx4090", "v5e"),
    "variants": ("h200",),
    "int8": ("h200",),
}


def step_cases() -> list[Case]:
  from fuseopt.benchmarks import workloads
  out = []
  for recipe in ("adamw_recipe", "hybrid_recipe", "builder_recipe"):
    for variant in ("fuseopt_step", "fuseopt_fallback", "optax_chain"):
      if recipe == "builder_recipe" and variant == "optax_chain":
        continue   # the same as the hybrid recipe's optax chain

      def build(t, recipe=recipe, variant=variant):
        tx, fused = _recipes()[recipe][variant]
        tree = workloads.llama_tree(F32)
        state = jax.eval_shape(tx.init, tree)
        return user_step.step_fn(tx, fused), (tree, state, tree), (0, 1)
      ci = CI_TARGETS["builder"] if recipe == "builder_recipe" else CI_TARGETS["steps"]
      if variant == "fuseopt_fallback":
        ci = CI_TARGETS["builder_fallback" if recipe == "builder_recipe" else "fallback"]
      out.append(Case(f"step/{recipe}/{variant}/llama1.2b", build, kind="step",
                      expect_kernels=variant != "optax_chain", baseline=variant == "optax_chain",
                      ci_targets=ci))
  return out


def _variant_recipes():
  """recipe -> (transformation, parameter dtype): the Muon-family variants
  (NorMuon, cautious weight decay, mantissa-tracked bf16 parameters) on the
  hybrid recipe's split, fused."""
  import fuseopt.optim as fo
  from fuseopt.benchmarks.cases import muon as muon_cases
  from fuseopt.optim import fusion, safeguards
  def hybrid(factory, mantissa=False, cautious=False):
    wd = fo.cautious(0.1) if cautious else 0.1
    tx = factory(0.02, weight_decay=wd, adam_weight_decay=wd, ns_coeffs="jordan",
                 muon_weight_dimension_numbers=muon_cases.muon_dims)
    return fusion.chain(safeguards.clip_by_global_norm(1.0),
                        fo.track_mantissa(tx, owner="muon") if mantissa else tx)
  return {
      "normuon_recipe": (hybrid(fo.normuon), F32),
      "cautious_hybrid_recipe": (hybrid(fo.muon, cautious=True), F32),
      # bf16 parameters (and gradients) with their int16 companions: the
      # mantissa wrapper inside the clip, as the builder places it.
      "mantissa_adamw_recipe": (fusion.chain(
          safeguards.clip_by_global_norm(1.0),
          fo.track_mantissa(fo.adamw(1e-3, weight_decay=0.1))), BF16),
      "mantissa_hybrid_recipe": (hybrid(fo.muon, mantissa=True), BF16),
  }


def variant_step_cases() -> list[Case]:
  """The fused steps of :func:`_variant_recipes` on the 1.2 B tree; CI
  compiles them for the H200 (every target in the full sweep)."""
  from fuseopt.benchmarks import workloads
  out = []
  for recipe in _variant_recipes():
    def build(t, recipe=recipe):
      tx, dtype = _variant_recipes()[recipe]
      tree = workloads.llama_tree(dtype)
      state = jax.eval_shape(tx.init, tree)
      return user_step.step_fn(tx, True), (tree, state, tree), (0, 1)
    # (cautious decay: the hybrid step with one more elementwise term, full sweep)
    out.append(Case(f"step/{recipe}/fuseopt_step/llama1.2b", build, kind="step",
                    ci_targets=() if recipe == "cautious_hybrid_recipe" else CI_TARGETS["variants"]))
  # AdamW on 8-bit moments, fused: state 2.03 B/param (CI: one GPU).
  def build_int8(t):
    import fuseopt.optim as fo
    tx = fo.adamw(1e-3, weight_decay=0.1, moment_dtype="int8")
    tree = workloads.llama_tree(F32)
    state = jax.eval_shape(tx.init, tree)
    return user_step.step_fn(tx, True), (tree, state, tree), (0, 1)
  out.append(Case("step/adamw_int8_recipe/fuseopt_step/llama1.2b", build_int8, kind="step",
                  ci_targets=CI_TARGETS["int8"]))
  return out


def memory_step_cases() -> list[Case]:
  """The fused step of each storage mode (:mod:`fuseopt.benchmarks.memory`)
  on the 1.2 B tree (the full sweep; ``memory.STEP_TARGETS`` recorded)."""
  from fuseopt.benchmarks import workloads
  from fuseopt.benchmarks.cases import muon as muon_cases
  out = []
  for mode in memory.MODES:
    if mode.key == "optax_adamw":
      continue   # optax's step is compiled by the other step cases

    def build(t, mode=mode):
      tx = mode.make(muon_cases.muon_dims)
      tree = workloads.llama_tree(mode.params)
      state = memory.quiet(jax.eval_shape, tx.init, tree)
      return user_step.step_fn(tx, True), (tree, state, tree), (0, 1)
    out.append(Case(f"step/memory/{mode.key}/llama1.2b", build, kind="step", ci_targets=(),
                    full_only=True, on_targets=memory.STEP_TARGETS))
  return out


def sharded_cases() -> list[Case]:
  from jax.sharding import AxisType, NamedSharding

  from fuseopt.benchmarks import workloads
  import fuseopt.optim as fo
  import optax
  out = []
  for axis_type in (AxisType.Explicit, AxisType.Auto):
    for recipe in ("adamw", "hybrid", "adamw_int8"):
      for variant in ("fuseopt_step", "optax"):
        if variant == "optax" and (recipe == "adamw_int8" or (
            recipe == "hybrid" and axis_type == AxisType.Explicit)):
          continue  # no baseline: optax has no 8-bit moments, and optax.contrib.muon does not
          # trace on an Explicit mesh (its Newton-Schulz raises a ShardingTypeError)
        def mesh_of(t, axis_type=axis_type):
          return targets_lib.mesh(t, (8,), (compile_steps.FSDP_AXIS,), axis_types=(axis_type,))

        def build(t, axis_type=axis_type, recipe=recipe, variant=variant, mesh_of=mesh_of):
          mesh = mesh_of(t)
          tree = workloads.llama_tree(F32)
          specs = jax.tree.map(compile_steps.fsdp_spec, tree)
          shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
          auto = shardings if axis_type == AxisType.Auto else None
          if recipe.startswith("adamw"):
            tx = (optax.adamw(1e-3, weight_decay=0.1) if variant == "optax" else
                  fo.adamw(1e-3, weight_decay=0.1, execution=fo.Execution(shardings=auto),
                           **({"moment_dtype": "int8"} if recipe == "adamw_int8" else {})))
          else:
            tx = compile_steps.hybrid_tx(variant, auto)
          return compile_steps.sharded_step_args(t, tx, tree, shardings, fused=variant != "optax")
        kind = "explicit" if axis_type == AxisType.Explicit else "auto"
        out.append(Case(f"sharded/{recipe}/{variant}/llama1.2b-fsdp8-{kind}", build,
                        kind="sharded", devices=8, expect_kernels=variant != "optax",
                        baseline=variant == "optax", ci_targets=CI_TARGETS[f"sharded_{'int8_' * (recipe == 'adamw_int8')}{kind}"],
                        mesh=mesh_of))
  return out


KINDS = ("kernel", "step", "sharded", "scale")


def cases(target, *, full: bool = False, kinds: tuple[str, ...] = KINDS,
          baselines: bool = False) -> list[Case]:
  """The cases that apply to ``target``: its backend's kernels, the steps,
  (where it has an 8-device topology) the sharded steps and the scale cases
  that name it. ``full`` adds every config of every search space and the
  cases CI leaves out, ``baselines`` optax's steps."""
  from fuseopt.benchmarks import scale
  t = targets_lib.get(target)
  every = []
  if "kernel" in kinds:
    every += kernel_cases()
  if "step" in kinds:
    every += step_cases() + variant_step_cases() + memory_step_cases()
  if "sharded" in kinds and 8 in t.topologies:
    every += sharded_cases()
  if "scale" in kinds:
    every += scale.cases()

  def selected(c):
    in_ci = not c.full_only and (c.ci_targets is None and t.ci_shared_cases
                                 or t.name in (c.ci_targets or ()))
    return (t.implementation in c.implementations and (full or in_ci)
            and c.devices in t.topologies and (baselines or not c.baseline)
            and (c.on_targets is None or t.name in c.on_targets)
            and (not c.sm90_only or t.compute_capability == (9, 0)))
  return [c for c in every if selected(c)]
