"""The compile tier: fuseopt compiled by the real compilers, without hardware.

Lowering is not compiling: a kernel that lowers for a TPU can still be
rejected by libtpu's Mosaic compiler, and a Triton kernel by ptxas. Each
case here is compiled (``.compile()``) for a target of
:mod:`fuseopt.targets` by the compiler that target's device would run, on a
CPU-only machine, and its compiled figures are recorded:

================  ==========================================================
figure            what it is
================  ==========================================================
temp_bytes        XLA's temporary buffers (``memory_analysis()``)
argument_bytes    inputs, per device
output_bytes      outputs, per device
alias_bytes       outputs that reuse a donated input's buffer
kernels           Pallas kernel launches in the compiled program
collectives       per kind (all-gather, all-to-all, ...): count and bytes
spills            ptxas's register-spill warnings (GPU targets)
lower_s,          seconds to trace + lower, and to compile (reported only)
compile_s
================  ==========================================================

Cases (:func:`cases`):

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
donate it (:func:`shard_like_params`): their figures are of the program users
run.

The figures of every case and target are committed under
``bench/results/compiled/<target>.json``; :func:`compare` is the gate
(bytes, launches, collectives and spills are deterministic for pinned
compiler versions: any increase fails; times are reported only).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import os
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp

from fuseopt import targets as targets_lib
from fuseopt.benchmarks import core

SCHEMA = "fuseopt-compiled/1"
RESULTS_DIR = Path("bench/results/compiled")
F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)

# --------------------------------------------------------------- figures --
_KERNEL_TARGET = re.compile(
    r'custom_call_target="(tpu_custom_call|__gpu\$xla\.gpu\.triton|mosaic_gpu[^"]*)"')
_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT )?\S+ = (.+?) (all-to-all|all-gather|all-reduce|reduce-scatter|"
    r"collective-permute|collective-broadcast|ragged-all-to-all)(-start)?\(", re.M)
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|c64|c128)\[([\d,]*)\]")
# ptxas -v: "Compiling entry function 'k' ...", "Function properties for k",
# then "S bytes stack frame, N bytes spill stores, M bytes spill loads"; and
# --warn-on-spills: "Registers are spilled to local memory in function 'k',
# N bytes spill stores, M bytes spill loads", which names its kernel itself.
# XLA runs ptxas on several threads, so such a warning can land inside
# another kernel's report: it must not be attributed to the kernel before it.
_PTXAS = re.compile(r"spilled to local memory in function '([^']+)', "
                    r"(\d+) bytes spill stores, (\d+) bytes spill loads|"
                    r"Compiling entry function '([^']+)'|Function properties for (\S+)|"
                    r"(\d+) bytes spill stores, (\d+) bytes spill loads")
KERNEL_PREFIX = "fuseopt_"   # every fuseopt Pallas kernel is named fuseopt_<op>


def spills(log_lines) -> list[str]:
  """ptxas's register spills, ``"<kernel>: S B spill stores, L B spill loads"``,
  from its verbose report (see :func:`fuseopt.targets.report_ptxas`), for
  every kernel of the program: fuseopt's (named ``fuseopt_*``) and XLA's own
  fusions."""
  out, entry = set(), "?"
  for m in _PTXAS.finditer("\n".join(log_lines)):
    if m.group(1):
      name, stores, loads = m.group(1), m.group(2), m.group(3)
    elif m.group(4) or m.group(5):
      entry = (m.group(4) or m.group(5)).strip("'\"")
      continue
    else:
      name, stores, loads = entry, m.group(6), m.group(7)
    if int(stores) or int(loads):
      out.add(f"{name}: {stores} B spill stores, {loads} B spill loads")
  return sorted(out)


def fuseopt_spills(spilled: list[str]) -> list[str]:
  """The spills of fuseopt's own kernels (XLA's fusions are XLA's)."""
  return [s for s in spilled if s.startswith(KERNEL_PREFIX)]


def kernel_launches(hlo: str) -> int:
  """Pallas kernel calls (Mosaic TPU, Triton, Mosaic GPU) in compiled HLO."""
  return len(_KERNEL_TARGET.findall(hlo))


def collectives(hlo: str) -> dict[str, dict[str, int]]:
  """``{kind: {"count", "bytes"}}`` of compiled per-device HLO. Bytes are
  those of the collective's result on one device (for an async pair, the
  ``-start``'s array results: the received buffers)."""
  out: dict[str, dict[str, int]] = {}
  for shape, kind, _ in _COLLECTIVE.findall(hlo):
    nbytes = 0
    # Scalars are an async start's context words, not data.
    arrays = [a for a in _ARRAY.findall(shape) if a[1]]
    # An async start returns (operands, results): count the results.
    if shape.startswith("(") and len(arrays) >= 2:
      arrays = arrays[len(arrays) // 2:]
    for dtype, dims in arrays:
      n = math.prod(int(d) for d in dims.split(",") if d)
      nbytes += n * core.HLO_ITEMSIZE.get(dtype, 4)
    rec = out.setdefault(kind, {"count": 0, "bytes": 0})
    rec["count"] += 1
    rec["bytes"] += nbytes
  return dict(sorted(out.items()))


@contextlib.contextmanager
def _captured_stderr(fd: int = 2) -> Iterator[list[str]]:
  """Collects what native code writes to file descriptor 2 (ptxas's warnings
  reach the process's stderr from XLA, below Python's ``sys.stderr``), or to
  ``fd`` (1: Mosaic GPU's ptxas report, ``MOSAIC_GPU_DUMP_PTXAS``)."""
  lines: list[str] = []
  stream = sys.stderr if fd == 2 else sys.stdout
  stream.flush()
  saved = os.dup(fd)
  with tempfile.TemporaryFile(mode="w+b") as tmp:
    os.dup2(tmp.fileno(), fd)
    try:
      yield lines
    finally:
      stream.flush()
      os.dup2(saved, fd)
      os.close(saved)
      tmp.seek(0)
      text = tmp.read().decode("utf-8", "replace")
      lines.extend(text.splitlines())


@dataclasses.dataclass(frozen=True)
class Case:
  """One thing to compile.

  ``build(target)`` returns ``(fn, args, donate_argnums)``: ``fn`` a plain
  function, ``args`` abstract arrays (``jax.ShapeDtypeStruct``; placed on the
  target's devices by :func:`compile_case` unless they carry a sharding).
  """
  id: str
  build: Callable[[targets_lib.Target], tuple[Callable, tuple, tuple]]
  kind: str = "kernel"               # "kernel", "step", "sharded" or "scale"
  devices: int = 1
  implementations: tuple[str, ...] = ("triton", "mosaic_tpu")
  full_only: bool = False            # only in the full sweep (``full=True``)
  expect_kernels: bool = True        # False for optax's baselines and XLA paths
  # optax's own step, compiled beside fuseopt's for the figures: recorded by
  # ``compile-check --update``, left out of the tests (its figures move with
  # optax's and jax's versions, not with fuseopt's code).
  baseline: bool = False
  # The targets whose CI run compiles this case (``None``: every target); on
  # the others it belongs to the full sweep (``full=True``). See CI_TARGETS.
  ci_targets: tuple[str, ...] | None = None
  mesh: Callable[[targets_lib.Target], Any] | None = None   # sharded cases
  # Mosaic GPU kernels: only GPUs of compute capability 9.0, even in the full
  # sweep (fuseopt refuses the others before lowering).
  sm90_only: bool = False
  # The targets the case belongs to (``None``: every target with its device
  # count); the scale cases name theirs.
  on_targets: tuple[str, ...] | None = None
  # A compile failure is a figure of the case (a step that does not fit the
  # device, a layout that does not compile yet), recorded as ``{"error"}``;
  # the tests then hold the case to it (see tests/compile/tier.py).
  records_failure: bool = False


class CompileFailure(AssertionError):
  pass


def compile_case(target, case: Case) -> dict[str, Any]:
  """Compiles ``case`` for ``target``; returns its figures.

  Raises :class:`CompileFailure` naming the target, the case and the
  compiler's message when lowering or compiling fails.
  """
  t = targets_lib.get(target)
  mesh = case.mesh(t) if case.mesh is not None else None
  try:
    t0 = time.perf_counter()
    with targets_lib.lowering_for(t, mesh):
      fn, args, donate = case.build(t)
      args = _placed(t, args)
      lowered = jax.jit(fn, donate_argnums=donate).trace(*args).lower(
          lowering_platforms=(t.lowering_platform,))
    t1 = time.perf_counter()
    with _captured_stderr() as log, _captured_stderr(1) as out_log:
      compiled = lowered.compile()
    t2 = time.perf_counter()
  except Exception as e:  # noqa: BLE001 - every compiler error becomes one clear failure
    msg = f"{type(e).__name__}: {e}"
    raise CompileFailure(f"{case.id} does not compile for {t.name} ({t.device_kind}): "
                         f"{_short(msg)}") from e
  hlo = compiled.as_text()
  mem = compiled.memory_analysis()
  spilled = sorted(set(spills(log)) | set(spills(out_log)))
  for line in log:   # the compilers' warnings and errors stay visible
    if re.match(r"\s*[WE]\d{4}|.*\b(warning|error)\b", line, re.I) and "ptxas info" not in line:
      print(line, file=sys.stderr)
  figures = {
      "temp_bytes": int(mem.temp_size_in_bytes),
      "argument_bytes": int(mem.argument_size_in_bytes),
      "output_bytes": int(mem.output_size_in_bytes),
      "alias_bytes": int(mem.alias_size_in_bytes),
      "kernels": kernel_launches(hlo),
      "collectives": collectives(hlo),
      "spills": spilled,
      "lower_s": round(t1 - t0, 2),
      "compile_s": round(t2 - t1, 2),
  }
  if case.expect_kernels and figures["kernels"] == 0:
    raise CompileFailure(f"{case.id} compiled for {t.name} without any {t.implementation} "
                         "kernel: the dispatch fell back to XLA")
  return figures


def _short(msg: str, limit: int = 4000) -> str:
  # libtpu's messages carry the whole MLIR location stack: keep the head.
  return msg if len(msg) <= limit else msg[:limit] + " [...]"


def _placed(t, args):
  leaves, treedef = jax.tree.flatten(args)
  default = None
  out = []
  for x in leaves:
    if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None:
      if default is None:
        default = jax.sharding.NamedSharding(targets_lib.mesh(t), jax.sharding.PartitionSpec())
      x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=default)
    out.append(x)
  return jax.tree.unflatten(treedef, out)


# ------------------------------------------------------------------ cases --
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
  from fuseopt.kernels import dispatch
  from fuseopt.kernels import stochastic_round as sr
  backend = dispatch.backend_module("stochastic_round", impl)
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
  from fuseopt.kernels import adam, dispatch
  space = dispatch.backend_module("adam_update", impl).SEARCH_SPACE
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
  # kernel's operands) and mantissa-tracked bf16 params (a uint16 companion
  # read and written in place: two more streams).
  out.append(case("cautious-pf32-gf32-mbf16", _ADAM_SHAPE, F32, F32, BF16,
                  cautious_weight_decay=True))
  out += [_adam_mantissa_case(impl, tag, shape)
          for tag, shape in (("mantissa-pbf16-gf32-mbf16", _ADAM_SHAPE),
                             ("mantissa-ragged-pbf16-gf32-mbf16", _ADAM_RAGGED))]
  if impl in ("triton", "mosaic_gpu"):
    out += _adam_group_cases(impl)
  if impl == "triton":
    out.append(_adam_group_mantissa_case(impl))
  return out


def _adam_mantissa_case(impl: str, tag: str, shape) -> Case:
  """A mantissa-tracked leaf (bf16 p, uint16 companion), the heuristic config."""
  from fuseopt.kernels import adam

  def build(t):
    def fn(p, g, mu, nu, lo):
      return adam.adam_update(p, g, mu, nu, count=3, learning_rate=1e-3, weight_decay=0.1,
                              implementation=impl, params_lo=lo)
    return fn, (_S(shape, BF16), _S(shape, F32), _S(shape, BF16), _S(shape, BF16),
                _S(shape, jnp.uint16)), (0, 2, 3, 4)
  return Case(f"kernel/adam_update/{impl}/{tag}/heuristic", build, **_on(impl))


def _adam_group_mantissa_case(impl: str = "triton") -> Case:
  """The 1-layer Llama tree in bf16, its matrices mantissa-tracked and its
  norms not (two dtype signatures: two kinds of grouped launch)."""
  from fuseopt.kernels import adam

  def build(t):
    leaves = _llama_leaves(BF16)
    gs = [_S(x.shape, F32) for x in leaves]
    mom = [_S(x.shape, BF16) for x in leaves]
    los = [_S(x.shape, jnp.uint16) if len(x.shape) > 1 else None for x in leaves]

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
  from fuseopt.kernels import adam, dispatch
  space = dispatch.backend_module("adam_update", impl).GROUP_SEARCH_SPACE

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
      "state_dtype": "bfloat16",
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


def _step_fn(tx, fused):
  import optax

  import fuseopt.optim as fo
  if fused:
    def step(params, state, grads):
      return fo.step(tx, grads, state, params)
  else:
    def step(params, state, grads):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state
  return step


# Which targets CI compiles the costly cases on (the rest is the full sweep,
# `fuseopt compile-check --target all --all`): on the 2-core CI machine
# libtpu takes 1.5-3.5 min for one sharded or Muon step of the 1.20 B tree.
# The fused steps and every kernel compile on all five targets; the
# ``tx.update`` + ``apply_updates`` path (XLA glue around the same kernels)
# on one GPU and one TPU; the sharded steps on 8 x H200 and v6e "2x4", and
# the Auto mesh (the FSDP setup the scaling figures quote) on v5e too.
CI_TARGETS = {
    "fallback": ("h200", "v6e"),
    "builder_fallback": ("h200",),
    "sharded_explicit": ("h200", "v6e"),
    "sharded_auto": ("h200", "v5e", "v6e"),
    "variants": ("h200", "v6e"),
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
        return _step_fn(tx, fused), (tree, state, tree), (0, 1)
      ci = None
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
  hybrid = lambda factory, **kw: fusion.chain(
      safeguards.clip_by_global_norm(1.0),
      factory(0.02, weight_decay=0.1, adam_weight_decay=0.1, coeffs="jordan",
              adam_moment_dtype=BF16, muon_weight_dimension_numbers=muon_cases.muon_dims, **kw))
  return {
      "normuon_recipe": (hybrid(fo.normuon), F32),
      "cautious_hybrid_recipe": (hybrid(fo.muon, cautious_weight_decay=True), F32),
      # bf16 parameters (and gradients) with their uint16 companions: the
      # mantissa wrapper inside the clip, as the builder places it.
      "mantissa_adamw_recipe": (fusion.chain(
          safeguards.clip_by_global_norm(1.0),
          fo.adamw(1e-3, weight_decay=0.1, bf16_params="mantissa")), BF16),
      "mantissa_hybrid_recipe": (hybrid(fo.muon, bf16_params="mantissa"), BF16),
  }


def variant_step_cases() -> list[Case]:
  """The fused steps of :func:`_variant_recipes` on the 1.2 B tree; CI
  compiles them for one GPU and one TPU."""
  from fuseopt.benchmarks import workloads
  out = []
  for recipe in _variant_recipes():
    def build(t, recipe=recipe):
      tx, dtype = _variant_recipes()[recipe]
      tree = workloads.llama_tree(dtype)
      state = jax.eval_shape(tx.init, tree)
      return _step_fn(tx, True), (tree, state, tree), (0, 1)
    out.append(Case(f"step/{recipe}/fuseopt_step/llama1.2b", build, kind="step",
                    ci_targets=CI_TARGETS["variants"]))
  return out


FSDP_AXIS = "fsdp"


def _fsdp_spec(x):
  P = jax.sharding.PartitionSpec
  if len(x.shape) >= 2 and x.shape[0] % 8 == 0:
    return P(FSDP_AXIS, *([None] * (len(x.shape) - 1)))
  return P()


def hybrid_tx(variant: str, shardings=None, dims=None, **options):
  """The hybrid Muon + AdamW recipe of the sharded cases: fuseopt's (bf16
  AdamW moments, Jordan's coefficients; ``shardings`` on an Auto mesh;
  ``options`` of :func:`fuseopt.optim.muon`) or optax's ``contrib.muon`` on
  the same split (``dims``: the Muon dimension numbers, the 1.2 B tree's by
  default)."""
  import optax

  import fuseopt.optim as fo
  from fuseopt.benchmarks.cases import muon as muon_cases
  dims = dims or muon_cases.muon_dims
  if variant == "optax":
    return optax.contrib.muon(0.02, ns_coeffs=muon_cases.COEFFS, weight_decay=0.1,
                              adam_weight_decay=0.1, muon_weight_dimension_numbers=dims)
  return fo.muon(0.02, coeffs="jordan", weight_decay=0.1, adam_weight_decay=0.1,
                 adam_moment_dtype=BF16, muon_weight_dimension_numbers=dims, shardings=shardings,
                 **options)


def sharded_step_args(t, tx, tree, shardings, *, fused: bool):
  """``(step, (params, state, grads), donate)`` of one sharded step: params
  and grads placed by ``shardings``, the state placed like the params
  (:func:`shard_like_params`), params and state donated: the program a user
  runs."""
  placed = targets_lib.avals(t, tree, shardings)
  state = jax.eval_shape(tx.init, placed)
  mesh = jax.tree.leaves(shardings)[0].mesh
  return _step_fn(tx, fused), (placed, shard_like_params(state, placed, mesh), placed), (0, 1)


def sharded_cases() -> list[Case]:
  from jax.sharding import AxisType, NamedSharding

  from fuseopt.benchmarks import workloads
  import fuseopt.optim as fo
  import optax
  out = []
  for axis_type in (AxisType.Explicit, AxisType.Auto):
    for recipe in ("adamw", "hybrid"):
      for variant in ("fuseopt_step", "optax"):
        if variant == "optax" and recipe == "hybrid" and axis_type == AxisType.Explicit:
          # optax.contrib.muon does not trace on an Explicit mesh (its
          # Newton-Schulz dot of a row-sharded matrix with its transpose
          # raises a ShardingTypeError): there is no baseline to compile.
          continue
        def mesh_of(t, axis_type=axis_type):
          return targets_lib.mesh(t, (8,), (FSDP_AXIS,), axis_types=(axis_type,))

        def build(t, axis_type=axis_type, recipe=recipe, variant=variant, mesh_of=mesh_of):
          mesh = mesh_of(t)
          tree = workloads.llama_tree(F32)
          specs = jax.tree.map(_fsdp_spec, tree)
          shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
          auto = shardings if axis_type == AxisType.Auto else None
          if recipe == "adamw":
            tx = (optax.adamw(1e-3, weight_decay=0.1) if variant == "optax" else
                  fo.adamw(1e-3, weight_decay=0.1, shardings=auto))
          else:
            tx = hybrid_tx(variant, auto)
          return sharded_step_args(t, tx, tree, shardings, fused=variant != "optax")
        kind = "explicit" if axis_type == AxisType.Explicit else "auto"
        out.append(Case(f"sharded/{recipe}/{variant}/llama1.2b-fsdp8-{kind}", build,
                        kind="sharded", devices=8, expect_kernels=variant != "optax",
                        baseline=variant == "optax", ci_targets=CI_TARGETS[f"sharded_{kind}"],
                        mesh=mesh_of))
  return out


def shard_like_params(state, params, mesh):
  """``state`` (``jax.eval_shape(tx.init, params)``) placed as a user places
  it: like the parameters.

  On an Explicit mesh ``eval_shape`` already gives every state leaf its
  sharding; on Auto axes it gives none, and placing those structs replicated
  would compile a step whose optimizer state arrives whole on every device
  (and cannot be donated into the sharded output). A state leaf found under a
  parameter's key path (Adam's moments, Muon's momentum, a mantissa
  companion, inside any ``optax.chain``/``partition`` wrapper) takes that
  parameter's spec, keeping only the entries whose dimension is the
  parameter's (a per-neuron moment's reduced axis is replicated); anything
  else (counts, coefficient tables) is replicated.
  """
  P, NamedSharding = jax.sharding.PartitionSpec, jax.sharding.NamedSharding
  rep = NamedSharding(mesh, P())
  by_path = {}
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    spec = x.sharding.spec if isinstance(getattr(x, "sharding", None), NamedSharding) else P()
    by_path[tuple(str(k) for k in path)] = (tuple(x.shape), spec)

  def spec_for(path, x):
    keys = tuple(str(k) for k in path)
    for j in range(len(keys)):
      if keys[j:] in by_path:
        shape, spec = by_path[keys[j:]]
        if len(shape) != len(x.shape):
          return P()
        spec = tuple(spec) + (None,) * (len(shape) - len(spec))
        return P(*[e if a == b else None for e, a, b in zip(spec, x.shape, shape)])
    return P()

  def one(path, x):
    if not isinstance(x, jax.ShapeDtypeStruct):
      return x
    s = x.sharding
    if not isinstance(s, NamedSharding) or not any(s.spec):
      s = NamedSharding(mesh, spec_for(path, x)) if x.shape else rep
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
  return jax.tree_util.tree_map_with_path(one, state)


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
    every += step_cases() + variant_step_cases()
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


# ------------------------------------------------------------ baseline --
def results_path(target, root: Path | str = RESULTS_DIR, *, jax_version: str | None = None) -> Path:
  """Where the figures of ``target`` for a jax release live (default: the
  running one). Figures are exact for one set of compilers, and each jax
  release brings its own (libtpu, the CUDA plugin), so each release keeps its
  own file: ``<root>/jax-<release>/<target>.json``. ``<root>/<target>.json``
  is the file of the release it records (jax 0.11.2's, written before the
  releases were keyed): used for that release, and read, not enforced
  (:func:`versions_match`), by a release that has no file of its own."""
  name = targets_lib.get(target).name
  version = jax_version or jax.__version__
  keyed = Path(root) / f"jax-{version}" / f"{name}.json"
  legacy = Path(root) / f"{name}.json"
  return keyed if keyed.exists() or not legacy.exists() else legacy


def _recorded_jax(path: Path) -> str | None:
  try:
    return json.loads(path.read_text()).get("environment", {}).get("jax")
  except (OSError, ValueError):
    return None


def write_path(target, root: Path | str = RESULTS_DIR) -> Path:
  """Where ``--update`` writes the running release's figures: its own file,
  never another release's (:func:`results_path`)."""
  name = targets_lib.get(target).name
  legacy = Path(root) / f"{name}.json"
  if legacy.exists() and _recorded_jax(legacy) == jax.__version__:
    return legacy
  return Path(root) / f"jax-{jax.__version__}" / f"{name}.json"


def environment() -> dict[str, str]:
  from importlib import metadata
  env = {"jax": jax.__version__}
  for dist in ("jaxlib", "libtpu", "jax-cuda12-plugin", "jax-cuda12-pjrt", "nvidia-cuda-nvcc-cu12"):
    try:
      env[dist] = metadata.version(dist)
    except metadata.PackageNotFoundError:
      pass
  return env


def load(target, root: Path | str = RESULTS_DIR) -> dict[str, Any] | None:
  path = results_path(target, root)
  if not path.exists():
    return None
  return json.loads(path.read_text())


def write(target, figures: dict[str, dict], root: Path | str = RESULTS_DIR, *,
          merge: bool = True) -> Path:
  """Writes ``{case id: figures}`` for ``target`` (merged into what is there)."""
  t = targets_lib.get(target)
  path = write_path(t, root)
  old = json.loads(path.read_text()) if merge and path.exists() else None
  cases_ = dict(old["cases"]) if old else {}
  cases_.update(figures)
  # Cases that no longer exist (renamed or removed) leave the file.
  known = {c.id for c in cases(t, full=True, baselines=True)}
  cases_ = {k: v for k, v in cases_.items() if k in known}
  doc = {"schema": SCHEMA, "target": t.name, "device_kind": t.device_kind,
         "platform": t.platform, "implementation": t.implementation,
         "environment": environment(),
         "written": datetime.date.today().isoformat(),
         "cases": dict(sorted(cases_.items()))}
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
  return path


# Figures that fail when they grow; alias_bytes fails when it shrinks (less
# in place).
_GROWTH = ("temp_bytes", "argument_bytes", "output_bytes", "kernels")


def compare(fresh: dict[str, Any], base: dict[str, Any] | None) -> tuple[list[str], list[str]]:
  """(failures, notes) of one case's fresh figures against its baseline."""
  if base is None:
    return [], ["not in the baseline (new case)"]
  fails, notes = [], []
  for k in _GROWTH:
    a, b = fresh.get(k), base.get(k)
    if a is None or b is None:
      continue
    if a > b:
      fails.append(f"{k} grew: {b} -> {a}")
    elif a < b:
      notes.append(f"{k} shrank: {b} -> {a}")
  a, b = fresh.get("alias_bytes"), base.get("alias_bytes")
  if a is not None and b is not None:
    if a < b:
      fails.append(f"alias_bytes shrank (less in place): {b} -> {a}")
    elif a > b:
      notes.append(f"alias_bytes grew: {b} -> {a}")
  fc, bc = fresh.get("collectives", {}), base.get("collectives", {})
  for kind in sorted(set(fc) | set(bc)):
    for k in ("count", "bytes"):
      a, b = fc.get(kind, {}).get(k, 0), bc.get(kind, {}).get(k, 0)
      if a > b:
        fails.append(f"{kind} {k} grew: {b} -> {a}")
      elif a < b:
        notes.append(f"{kind} {k} shrank: {b} -> {a}")
  # Spills are not compared case by case: XLA compiles a kernel once per
  # process, so ptxas reports it for the first case that holds it. The tests
  # fail on any spill of a fuseopt kernel in a default config instead.
  new_spills = sorted(set(fresh.get("spills", [])) - set(base.get("spills", [])))
  if new_spills:
    notes.append(f"ptxas spills not in the baseline: {new_spills}")
  for k in ("lower_s", "compile_s"):
    if fresh.get(k) is not None and base.get(k):
      notes.append(f"{k} {fresh[k]:.1f} (baseline {base[k]:.1f})")
  return fails, notes


def versions_match(doc: dict[str, Any] | None) -> bool:
  """Figures depend on the compilers' versions: a baseline written with other
  versions is reported against, never enforced."""
  if not doc:
    return False
  here = environment()
  return all(here.get(k) == v for k, v in doc.get("environment", {}).items())


# ------------------------------------------------------------------ runner --
def run(target, *, full: bool = False, kinds=KINDS, match: str | None = None,
        jobs: int = 1, baselines: bool = True, log=print) -> dict[str, dict]:
  """Compiles every case of ``target`` (in ``jobs`` worker processes when
  ``jobs > 1``); returns ``{case id: figures or {"error": message}}``."""
  selected = [c for c in cases(target, full=full, kinds=kinds, baselines=baselines)
              if not match or re.search(match, c.id)]
  ids = [c.id for c in selected]
  if jobs <= 1:
    return {c.id: _run_one(target, c, log) for c in selected}
  import concurrent.futures as cf
  import multiprocessing as mp
  out = {}
  ctx = mp.get_context("spawn")
  with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
    futures = {pool.submit(_worker, targets_lib.get(target).name, full, tuple(kinds), baselines, i): i
               for i in ids}
    for fut in cf.as_completed(futures):
      cid = futures[fut]
      out[cid] = fut.result()
      log(_line(cid, out[cid]))
  return {i: out[i] for i in ids}


def _run_one(target, case: Case, log) -> dict:
  try:
    fig = compile_case(target, case)
  except CompileFailure as e:
    fig = {"error": str(e)}
  except Exception:  # noqa: BLE001 - a broken case is a recorded error, not a crash
    fig = {"error": f"{case.id}: {traceback.format_exc(limit=4)}"}
  log(_line(case.id, fig))
  return fig


def _worker(target: str, full: bool, kinds: tuple, baselines: bool, case_id: str) -> dict:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  by_id = {c.id: c for c in cases(target, full=full, kinds=kinds, baselines=baselines)}
  return _run_one(target, by_id[case_id], log=lambda *_: None)


def _line(case_id: str, fig: dict) -> str:
  if "error" in fig:
    return f"FAIL {case_id}: {fig['error'][:300]}"
  coll = ", ".join(f"{k} {v['count']}" for k, v in fig["collectives"].items())
  return (f"ok   {case_id}: temp {fig['temp_bytes']:,} B, {fig['kernels']} kernels"
          f"{', ' + coll if coll else ''}{', spills: ' + str(fig['spills']) if fig['spills'] else ''}; lower "
          f"{fig['lower_s']:.1f} s, compile {fig['compile_s']:.1f} s")


# ------------------------------------------------------------------ report --
COMPILED_START = "<!-- compiled-table:start -->"
COMPILED_END = "<!-- compiled-table:end -->"

# (row label, fuseopt case suffix, optax case suffix) for the README table.
_TABLE_ROWS = (
    ("AdamW recipe, fused `step`", "step/adamw_recipe/fuseopt_step/llama1.2b",
     "step/adamw_recipe/optax_chain/llama1.2b"),
    ("AdamW recipe, `update` + `apply_updates`", "step/adamw_recipe/fuseopt_fallback/llama1.2b",
     "step/adamw_recipe/optax_chain/llama1.2b"),
    ("hybrid Muon + AdamW, fused `step`", "step/hybrid_recipe/fuseopt_step/llama1.2b",
     "step/hybrid_recipe/optax_chain/llama1.2b"),
    ("hybrid, `update` + `apply_updates`", "step/hybrid_recipe/fuseopt_fallback/llama1.2b",
     "step/hybrid_recipe/optax_chain/llama1.2b"),
    ("builder recipe, fused `step`", "step/builder_recipe/fuseopt_step/llama1.2b",
     "step/hybrid_recipe/optax_chain/llama1.2b"),
    ("AdamW, 8 devices FSDP (Explicit), per device", "sharded/adamw/fuseopt_step/llama1.2b-fsdp8-explicit",
     "sharded/adamw/optax/llama1.2b-fsdp8-explicit"),
    ("AdamW, 8 devices FSDP (Auto), per device", "sharded/adamw/fuseopt_step/llama1.2b-fsdp8-auto",
     "sharded/adamw/optax/llama1.2b-fsdp8-auto"),
    ("hybrid, 8 devices FSDP (Explicit), per device", "sharded/hybrid/fuseopt_step/llama1.2b-fsdp8-explicit",
     "sharded/hybrid/optax/llama1.2b-fsdp8-explicit"),
    ("hybrid, 8 devices FSDP (Auto), per device", "sharded/hybrid/fuseopt_step/llama1.2b-fsdp8-auto",
     "sharded/hybrid/optax/llama1.2b-fsdp8-auto"),
)


def _gb(v) -> str:
  if v is None:
    return "-"
  if v < 1 << 20:
    return f"{v / 1024:.0f} KiB" if v else "0"
  if v < 1 << 30:
    return f"{v / (1 << 20):.0f} MiB"
  return f"{v / (1 << 30):.2f} GiB"


_HBM = re.compile(r"required for HLO temporaries \(([\d.]+)([KMGT])\) exceeds available HBM")


def requested_bytes(error: str) -> int | None:
  """What a step that does not fit asked for, from libtpu's
  ``RESOURCE_EXHAUSTED`` message (``None`` if it says no figure)."""
  m = _HBM.search(error)
  if not m:
    return None
  # libtpu's units are binary: a v5e's 16 GiB show as "available HBM (15.75G)".
  scale = 1 << {"K": 10, "M": 20, "G": 30, "T": 40}[m.group(2)]
  return int(float(m.group(1)) * scale)


def why_failed(error: str) -> str:
  """A failure in a few words: "does not fit (17.97 GiB)", "does not trace",
  "does not compile: NotImplementedError"."""
  if "RESOURCE_EXHAUSTED" in error or "Ran out of memory" in error:
    want = requested_bytes(error)
    return "does not fit" + (f" ({_gb(want)})" if want else "")
  if "ShardingTypeError" in error:
    return "does not trace"
  m = re.search(r"compile for \S+ \([^)]*\): (\w+(?:Error|Exception))", error)
  return "does not compile" + (f": {m.group(1)}" if m else "")


def _coll(fig) -> str:
  if not fig or "error" in fig:
    return "-"
  c = fig.get("collectives") or {}
  return ", ".join(f"{v['count']} {k}" for k, v in c.items()) or "none"


def sweep_record(target: str, root: Path | str = RESULTS_DIR) -> dict[str, Any] | None:
  """The figures the docs' tables render: ``<root>/<target>.json``, jax
  0.11.2's full sweep with optax's baselines beside fuseopt's (whatever jax
  runs; each table names the release). The newer releases' files hold the
  CI cases the gate compares, without the baselines."""
  path = Path(root) / f"{targets_lib.get(target).name}.json"
  return json.loads(path.read_text()) if path.exists() else None


def markdown(root: Path | str = RESULTS_DIR) -> str:
  """The compiled-figures tables of docs/compile_tier.md: fuseopt beside optax per target,
  from ``<root>/<target>.json`` whatever jax runs (each heading names the
  release and compilers of its figures)."""
  docs = [(t, sweep_record(t, root)) for t in targets_lib.TARGETS]
  docs = [(t, d) for t, d in docs if d]
  if not docs:
    return "_No compiled figures yet: run `fuseopt compile-check --target NAME --update`._\n"
  out = []
  for name, doc in docs:
    cs = doc["cases"]
    kernels = [k for k in cs if k.startswith("kernel/")]
    if not kernels and not any(ours in cs for _, ours, _ in _TABLE_ROWS):
      out.append(f"**{doc['device_kind']}** (`{name}`): the scale cases only "
                 f"([scaling.md](scaling.md#measured-at-scale))")
      out.append("")
      continue
    env = doc.get("environment", {})
    compiler = (f"libtpu {env['libtpu']}" if "libtpu" in env and doc["platform"] == "tpu"
                else f"XLA + ptxas (nvcc {env.get('nvidia-cuda-nvcc-cu12', '?')})")
    ci_ids = {c.id for c in cases(name, kinds=("kernel",))}
    spilled = [k for k in kernels if fuseopt_spills(cs[k].get("spills", []))]
    out.append(f"**{doc['device_kind']}** (`{name}`; jax {env.get('jax', '?')}, {compiler}): "
               f"{len(kernels)} kernel cases compile ({len(ci_ids & set(kernels))} in CI); "
               f"fuseopt kernels spill in {len(spilled)} of them"
               f"{', none a default config' if not set(spilled) & ci_ids else ''}")
    out.append("")
    out.append("| step (1.20 B Llama tree, fp32 params, donated) | fuseopt temp | optax temp "
               "| fuseopt kernels | fuseopt collectives | optax collectives "
               "| lower + compile s (fuseopt / optax) |")
    out.append("| --- | ---: | ---: | ---: | --- | --- | ---: |")
    for label, ours, theirs in _TABLE_ROWS:
      a, b = cs.get(ours), cs.get(theirs)
      if not a or "error" in a:
        continue
      b = b or {}
      secs = lambda f: (f"{f['lower_s'] + f['compile_s']:.0f}" if "lower_s" in f else "-")
      theirs_temp = _gb(b.get("temp_bytes")) if "error" not in b else why_failed(b["error"])
      out.append(f"| {label} | {_gb(a.get('temp_bytes'))} | {theirs_temp} | "
                 f"{a.get('kernels', '-')} | {_coll(a) if ours.startswith('sharded') else '-'} | "
                 f"{_coll(b) if ours.startswith('sharded') else '-'} | {secs(a)} / {secs(b)} |")
    out.append("")
  return "\n".join(out).rstrip() + "\n"


def render_between(path: Path | str, start_marker: str, end_marker: str, body: str) -> bool | None:
  """Replaces what lies between the two marker lines of ``path`` with
  ``body``; ``None`` when it has neither marker, else whether it changed."""
  path = Path(path)
  text = path.read_text()
  start = re.search(rf"^{re.escape(start_marker)}[ \t]*\n", text, re.M)
  end = re.search(rf"^{re.escape(end_marker)}[ \t]*$", text, re.M)
  if not start and not end:
    return None
  if not start or not end or end.start() < start.end():
    raise ValueError(f"{path}: needs the markers {start_marker} and {end_marker}, "
                     "each on a line of its own, in that order")
  new = text[:start.end()] + body + text[end.start():]
  if new != text:
    path.write_text(new)
  return new != text


def render_tables(page: Path | str = "docs/compile_tier.md",
                  root: Path | str = RESULTS_DIR) -> bool | None:
  """Replaces what lies between the compiled-table markers of ``page``;
  ``None`` when it has neither marker."""
  return render_between(page, COMPILED_START, COMPILED_END, markdown(root))


def target_names(target: str) -> list[str]:
  """The targets ``compile-check --target`` means: every entry of
  :data:`fuseopt.targets.TARGETS` for ``"all"``, else the one named."""
  return list(targets_lib.TARGETS) if target == "all" else [targets_lib.get(target).name]


def main(target: str, *, full: bool = False, update: bool = False, match: str | None = None,
         jobs: int = 1, baselines: bool = True, root: Path | str = RESULTS_DIR, out=print) -> int:
  """``fuseopt compile-check``: compile, compare with (or ``update``) the
  committed figures; 1 if anything fails to compile or regresses."""
  names = target_names(target)
  bad = 0
  for name in names:
    why = targets_lib.missing(name)
    if why:
      out(f"{name}: skipped: {why}")
      bad += 1
      continue
    out(f"== {name} ({targets_lib.get(name).device_kind})")
    fresh = run(name, full=full, match=match, jobs=jobs, baselines=baselines, log=out)
    every = {c.id: c for c in cases(name, full=full, baselines=True)}
    # optax's baselines and the cases whose failure is a figure (a step that
    # does not fit) are written failed, so that the tables can say why.
    recorded = {k for k, c in every.items() if c.baseline or c.records_failure}
    doc = load(name, root)
    errors = {k: v for k, v in fresh.items() if "error" in v}
    for k in errors:
      if k not in recorded:
        bad += 1
      elif every[k].baseline:
        out(f"note {k}: optax's baseline does not compile here ({why_failed(errors[k]['error'])})")
      else:
        was = (doc or {}).get("cases", {}).get(k)
        if was is not None and "error" not in was and not update:
          out(f"FAIL {k}: compiled before, now {why_failed(errors[k]['error'])}")
          bad += 1
        else:
          out(f"note {k}: {why_failed(errors[k]['error'])} (a recorded figure)")
    enforced = versions_match(doc)
    for cid, fig in fresh.items():
      if "error" in fig:
        continue
      was = (doc or {}).get("cases", {}).get(cid)
      if was is not None and "error" in was:
        out(f"note {cid}: compiles now (recorded: {why_failed(was['error'])}); record it with --update")
        continue
      if not full and fuseopt_spills(fig["spills"]):
        out(f"FAIL {cid}: ptxas spills in a default config: {fuseopt_spills(fig['spills'])}")
        bad += 1
      fails, notes = compare(fig, (doc or {}).get("cases", {}).get(cid))
      for n in notes:
        if "shrank" in n or "new case" in n:
          out(f"note {cid}: {n}")
      if fails and not update:
        out(f"{'FAIL' if enforced else 'moved'} {cid}: {'; '.join(fails)}")
        bad += len(fails) if enforced else 0
    if update:
      # A fuseopt case that fails is not written (its test then fails), unless
      # its failure is a figure.
      keep = {k: v for k, v in fresh.items() if "error" not in v or k in recorded}
      path = write(name, keep, root)
      lost = len(fresh) - len(keep)
      out(f"{path}: {len(keep)} cases written" + (f" ({lost} failed, not written)" if lost else ""))
  return 1 if bad else 0
