"""Cases, timing, memory figures and hardware ceilings for benchmarks.

A :class:`Case` is one row of the report: an op on one shape, with several
*variants* (fuseopt's implementations and the baselines) measured in the same
run. Each variant is a builder returning ``(fn, args)``: ``fn`` is already
jitted, ``args`` are device arrays; or a :class:`Loop` for a donated
optimizer step, timed as a training loop runs it (each step's outputs are
the next step's inputs). Timing is the median of repeated calls after
warm-up; memory comes from ``memory_analysis()`` of the compiled function,
which is deterministic (also on the CPU) and so usable in CI. Every row
carries ``compile_s`` (lowering + compiling) and a ``status`` (``ok``,
``error``, ``compile_timeout``, ``skipped``); a compile past the run's
compile budget is recorded as ``compile_timeout`` and the next variant runs.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import re
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from fuseopt.benchmarks import environment
from fuseopt.benchmarks.timing import (ABANDONED_COMPILES, CompileTimeout, Loop,  # noqa: F401 (re-exported)
                                       block, compile_within, time_fn, time_loop)

Builder = Callable[[], tuple[Callable[..., Any], tuple]]


@dataclasses.dataclass
class Case:
  op: str                       # "stochastic_round", "adam", "newton_schulz", "muon", ...
  name: str                     # the shape or workload, e.g. "4096x4096"
  variants: dict[str, Builder]  # label -> builder; fuseopt variants and baselines
  baseline: str                 # label of the baseline variant in ``variants``
  flops: float | None = None    # useful FLOPs of one call (roofline: matmul ceiling)
  bytes: float | None = None    # minimal bytes one call must move (roofline: bandwidth)
  params: int | None = None     # parameters, for scaling plots and bytes/param
  state_bytes: dict[str, int] = dataclasses.field(default_factory=dict)  # label -> optimizer state bytes
  check: Callable[[dict[str, Any]], dict[str, Any]] | None = None  # outputs by label -> correctness figures
  # The label of the variant that is the op's default call (no argument
  # beyond the workload's own), one per format where a case has several
  # (Adam's bf16 and 8-bit moments), or None where no variant is; its row gets
  # ``is_default``. Every other fuseopt label carries a tag naming what it
  # passes besides (docs/benchmarks.md, "Row names").
  default: str | tuple[str, ...] | None = None
  # label -> figures copied into that variant's row: what it stores and moves
  # per parameter (``stores``, ``stored_bytes_per_param``,
  # ``moved_bytes_per_param``), what it calls (``calls``).
  meta: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
  # Stages of the suite's first pass (:func:`plan`): ``headline[k]`` are the
  # labels of this case that run in stage k, before any case's other rows
  # (the default calls and their peers first, on a device where time is short).
  headline: tuple[tuple[str, ...], ...] = ()
  # (label, outputs) -> what the check keeps of a variant's outputs (e.g.
  # :func:`fuseopt.benchmarks.workloads.sample`); None keeps them whole.
  reduce: Callable[[str, Any], Any] | None = None
  # Frees the case's shared inputs; the suite calls it after the case, failed or not.
  release: Callable[[], None] | None = None

  @property
  def id(self) -> str:
    return f"{self.op}/{self.name}"

  @property
  def defaults(self) -> tuple[str, ...]:
    return (self.default,) if isinstance(self.default, str) else tuple(self.default or ())


def tree_rel_err(a, b) -> float:
  """Relative Frobenius error ``||a - b|| / ||b||`` over whole trees, in fp32."""
  f32 = lambda x: x.astype(jnp.float32)
  num = sum(float(jnp.sum((f32(x) - f32(y)) ** 2))
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  den = sum(float(jnp.sum(f32(y) ** 2)) for y in jax.tree.leaves(b))
  return (num / max(den, 1e-30)) ** 0.5


def checks_against(deltas: dict[str, Any], baseline: str, tol: float) -> dict[str, Any]:
  """The usual check figures of a step case: per variant, whether its
  parameter change is finite and its relative error to ``baseline``'s change
  (``ok`` when finite and below ``tol``)."""
  ref = deltas.get(baseline)
  figures: dict[str, Any] = {}
  for label, d in deltas.items():
    finite = all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(d))
    figures[f"finite[{label}]"] = finite
    if ref is not None and label != baseline:
      e = tree_rel_err(d, ref)
      figures[f"rel_err_vs_optax[{label}]"] = e
      figures[f"ok[{label}]"] = bool(finite and math.isfinite(e) and e < tol)
  return figures


def memory_stats(fn: Callable, args: tuple) -> dict[str, int]:
  """Bytes from ``memory_analysis()`` of the compiled ``fn`` (deterministic)."""
  compiled = fn.lower(*args).compile() if hasattr(fn, "lower") else jax.jit(fn).lower(*args).compile()
  m = compiled.memory_analysis()
  out = {}
  for k in ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
            "alias_size_in_bytes", "generated_code_size_in_bytes"):
    v = getattr(m, k, None)
    if v is not None:
      out[k.replace("_size_in_bytes", "_bytes")] = int(v)
  return out


# An instruction line of HLO text: ``[ROOT ]name = shape opcode(operands...)``;
# the shape is one token or a parenthesised tuple.
_INSTR = r"^\s*(?:ROOT )?\S+ = (?:\([^)]*\)|\S+) "


def hlo_counts(hlo: str) -> dict[str, int]:
  """Op, fusion and custom-call counts of compiled HLO text.

  ``hlo_ops`` counts every instruction, fused computations' bodies included
  (so a fusion that grows shows up); ``hlo_fusions`` the fusion instructions
  (kernels XLA emits); ``custom_calls`` the custom calls (Pallas kernels and
  library calls: kernel launches beyond XLA's own).
  """
  return {
      "hlo_ops": len(re.findall(r"^\s*(?:ROOT )?\S+ = ", hlo, re.M)),
      "hlo_fusions": len(re.findall(_INSTR + r"fusion\(", hlo, re.M)),
      "custom_calls": len(re.findall(_INSTR + r"custom-call\(", hlo, re.M)),
  }


_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT )?\S+ = (\([^)]*\)|\S+) (all-to-all|all-gather|all-reduce|reduce-scatter|"
    r"collective-permute)(?:-start)?\(", re.M)
_ARRAY = re.compile(r"([a-z]+\d*)\[([\d,]*)\]")
# Bytes per element of each HLO element type.
HLO_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
             "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}


def collective_stats(hlo: str) -> dict[str, int]:
  """Collectives of compiled (per-device) HLO: how many, and the bytes of
  their results on one device (``collective_bytes``; an all-to-all or
  all-gather receives about that much, an all-reduce moves about twice it)."""
  count, nbytes = 0, 0
  for shape, _ in _COLLECTIVE.findall(hlo):
    count += 1
    for dtype, dims in _ARRAY.findall(shape):
      n = 1
      for d in filter(None, dims.split(",")):
        n *= int(d)
      nbytes += n * HLO_ITEMSIZE.get(dtype, 4)
  return {"collectives": count, "collective_bytes": nbytes}


def compiled_stats(fn: Callable, args: tuple) -> dict[str, Any]:
  """Deterministic figures of the compiled ``fn``: memory, HLO op and fusion
  counts, custom calls (kernel launches), FLOPs and bytes from cost analysis."""
  return stats_of(compile_fn(fn, args))


def compile_fn(fn: Callable, args: tuple, compiler_options: dict | None = None):
  lowered = fn.lower(*args) if hasattr(fn, "lower") else jax.jit(fn).lower(*args)
  return lowered.compile(compiler_options=compiler_options) if compiler_options else lowered.compile()


def stats_of(compiled) -> dict[str, Any]:
  """:func:`compiled_stats` of an already compiled function."""
  stats: dict[str, Any] = {}
  m = compiled.memory_analysis()
  for k in ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes"):
    v = getattr(m, k, None)
    if v is not None:
      stats[k.replace("_size_in_bytes", "_bytes")] = int(v)
  text = compiled.as_text()
  stats.update(hlo_counts(text))
  try:
    stats.update(collective_stats(text))
  except Exception:  # noqa: BLE001 - not every executable prints its HLO
    pass
  try:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
      cost = cost[0] if cost else {}
    stats["cost_flops"] = float(cost.get("flops", 0.0))
    stats["cost_bytes"] = float(cost.get("bytes accessed", 0.0))
  except Exception:  # cost analysis is not available on every backend
    pass
  return stats


def floor_ms(case: Case, ceilings: dict[str, float]) -> float | None:
  """The roofline floor of a case: the larger of its FLOP time and byte time."""
  parts = []
  if case.flops:
    parts.append(case.flops / (ceilings["matmul_tflops"] * 1e12) * 1e3)
  if case.bytes:
    parts.append(case.bytes / (ceilings["copy_gbps"] * 1e9) * 1e3)
  return max(parts) if parts else None


def build_variant(build: Builder, *, with_feed: bool = False):
  """Calls a variant builder: ``(fn, args)``, ``(fn, args, refresh)`` or a
  :class:`Loop`; returns ``(fn, args, refresh)`` (and ``feed`` with
  ``with_feed``).

  ``refresh()`` returns fresh args (a builder whose ``fn`` donates its inputs
  gives one). A :class:`Loop`'s ``feed`` makes the next call's args from the
  last call's outputs; without ``with_feed`` its ``refresh`` builds the
  variant again (for callers that time each call on fresh args).
  """
  out = build()
  if isinstance(out, Loop):
    if with_feed:
      return out.fn, out.args, None, out.feed
    return out.fn, out.args, lambda: build().args
  if len(out) == 2:
    out = (*out, None)
  return (*out, None) if with_feed else tuple(out)


def spec_figures(rec: dict, params: int | None, ceilings: dict) -> dict:
  """``spec_floor_ms`` (the row's own ``moved_bytes_per_param`` × params at
  the device's spec bandwidth ``ceilings["spec_gbps"]``) and
  ``fraction_of_spec_floor``; empty where either is unknown."""
  spec, moved = ceilings.get("spec_gbps"), rec.get("moved_bytes_per_param")
  if not (spec and moved and params and rec.get("ms")):
    return {}
  floor = moved * params / (spec * 1e9) * 1e3
  return {"spec_floor_ms": floor, "fraction_of_spec_floor": floor / rec["ms"]}


def fill_ratios(records: list[dict]) -> None:
  """``baseline_ms`` and ``ratio_to_baseline`` of every row against its
  case's baseline row (timed in the same run, in any pass)."""
  base = {(r["op"], r["case"]): r["ms"] for r in records if r.get("is_baseline") and "ms" in r}
  for r in records:
    b = base.get((r["op"], r["case"]))
    if b is None or "same_program_as" in r:
      continue
    r["baseline_ms"] = b
    if "ms" in r:
      r["ratio_to_baseline"] = r["ms"] / b


def run_case(case: Case, ceilings: dict[str, float], *, iters: int = 10,
             with_memory: bool = True, min_time: float = 0.0, compile_budget_s: float | None = None,
             deadline: float | None = None, outputs: dict | None = None,
             on_record: Callable[[list], None] | None = None) -> list[dict[str, Any]]:
  """Measures every variant of ``case``; returns one record per variant.

  A variant that fails is recorded with an ``error`` and the others still
  run; a compile past ``compile_budget_s`` is recorded as
  ``compile_timeout``; variants not started by ``deadline`` (a
  ``time.perf_counter()`` value) as skipped. Every record has ``status`` and,
  once compiled, ``compile_s``. Memory/HLO figures come from
  :func:`compiled_stats` (deterministic). ``outputs`` (label -> outputs,
  reduced by ``case.reduce``) carries earlier passes' outputs of this case
  into the check; ``on_record(records)`` is called after each variant.
  """
  records = []
  outputs = {} if outputs is None else outputs
  programs: dict[str, str] = {}  # lowered program text -> the first label that lowered to it
  floor = floor_ms(case, ceilings)
  for label, build in case.variants.items():
    rec: dict[str, Any] = {"op": case.op, "case": case.name, "variant": label,
                           "is_baseline": label == case.baseline,
                           "is_default": label in case.defaults, "params": case.params,
                           "flops": case.flops, "bytes": case.bytes, **case.meta.get(label, {})}
    if deadline is not None and time.perf_counter() > deadline:
      rec.update(status="skipped", skipped="time budget")
      records.append(rec)
      continue
    fn = args = refresh = feed = None
    try:
      t_build = time.perf_counter()
      fn, args, refresh, feed = build_variant(build, with_feed=True)
      rec["build_s"] = round(time.perf_counter() - t_build, 3)
      compiled_ok = False
      t0 = time.perf_counter()
      try:
        lowered = fn.lower(*args) if hasattr(fn, "lower") else jax.jit(fn).lower(*args)
        text = lowered.as_text()
      except Exception as e:  # noqa: BLE001 - timed through ``fn`` below
        lowered, text = None, None
        rec["memory_error"] = repr(e)[:200]
      if text is not None and text in programs:
        # e.g. a tagged variant that passes the default's own value:
        # the same program as an earlier row, not timed twice.
        rec["same_program_as"] = programs[text]
        rec["skipped"] = f"same program as {programs[text]}"
        rec["status"] = "same_program"
        if programs[text] in outputs:  # the same program's outputs, for the check
          outputs[label] = outputs[programs[text]]
        records.append(rec)
        del fn, args, refresh, feed
        if on_record is not None:
          on_record(records)
        continue
      if lowered is not None:
        programs[text] = label
        lower_s = time.perf_counter() - t0
        compiled, compile_s = compile_within(lowered, None if compile_budget_s is None
                                             else max(1.0, compile_budget_s - lower_s))
        rec["compile_s"] = round(lower_s + compile_s, 3)
        compiled_ok = True
        if with_memory:
          try:
            rec.update(stats_of(compiled))
          except Exception as e:  # noqa: BLE001 - memory is a report figure, not a gate
            rec["memory_error"] = repr(e)[:200]
        if feed is None and refresh is None and donates(compiled):
          # A donating variant without ``refresh``: keep a pristine copy so
          # every timed call gets live buffers (costs one copy of the args).
          refresh = _copying_refresh(args)
          args = refresh()
        if feed is None:
          # Time the executable just compiled: calling ``fn`` would compile
          # it a second time (minutes on a big tree, on an accelerator).
          fn = _prefer_compiled(compiled, fn, refresh() if refresh else args)
        else:
          fn = compiled
      if feed is not None:
        def first(out, label=label):
          # (a copy: the next step donates these buffers)
          outputs[label] = block(case.reduce(label, out) if case.reduce else
                                 jax.tree.map(lambda a: a.copy() if isinstance(a, jax.Array) else a, out))
        t1 = time.perf_counter()
        timing = time_loop(fn, args, feed, iters=iters,
                           first=first if case.check is not None else None)
        if not compiled_ok:  # compiled by the first call
          rec["compile_s"] = round(time.perf_counter() - t1 - timing["ms"] * 1e-3 * (timing["runs"] + 2), 3)
        rec.update(timing)
        args = None
      else:
        t1 = time.perf_counter()
        rec.update(time_fn(fn, args, iters=iters, min_time=min_time, refresh=refresh))
        if not compiled_ok:
          rec["compile_s"] = round(time.perf_counter() - t1 - rec["ms"] * 1e-3 * (rec["runs"] + 2), 3)
        if case.check is not None:
          out = block(fn(*(refresh() if refresh else args)))
          outputs[label] = block(case.reduce(label, out) if case.reduce else out)
          del out
      rec["status"] = "ok"
    except CompileTimeout as e:
      rec.update(status="compile_timeout", error=str(e), compile_s=compile_budget_s)
    except Exception as e:  # noqa: BLE001 - one broken variant must not hide the others
      rec.update(status="error", error=f"{type(e).__name__}: {e}"[:500])
    fn = args = refresh = feed = None
    gc.collect()  # the variant's buffers (and a failed one's) go before the next is built
    if "ms" in rec:
      if label in case.state_bytes and case.params:
        rec["state_bytes_per_param"] = case.state_bytes[label] / case.params
      if case.flops:
        rec["tflops"] = case.flops / (rec["ms"] * 1e-3) / 1e12
      if case.bytes:
        rec["gbps"] = case.bytes / (rec["ms"] * 1e-3) / 1e9
      if floor:
        rec["floor_ms"] = floor
        rec["fraction_of_floor"] = floor / rec["ms"]
      rec.update(spec_figures(rec, case.params, ceilings))
    records.append(rec)
    if on_record is not None:
      on_record(records)
  fill_ratios(records)
  if case.check is not None and outputs:
    figures = case_check(case, outputs)
    for r in records:
      r["check"] = figures
  return records


def case_check(case: Case, outputs: dict) -> dict:
  """``case.check(outputs)`` as JSON-able figures, or its error."""
  try:
    figures = case.check(outputs)
  except Exception as e:  # noqa: BLE001
    figures = {"error": f"{type(e).__name__}: {e}"[:500]}
  return {k: _jsonable(v) for k, v in figures.items()}


def donates(compiled) -> bool:
  """Whether a compiled function donates any of its arguments."""
  try:
    return any(getattr(a, "donated", False) for a in jax.tree.leaves(compiled.args_info))
  except Exception:  # noqa: BLE001
    return False


def _copying_refresh(args):
  pristine = jax.tree.map(lambda a: a.copy() if isinstance(a, jax.Array) else a, args)
  return lambda: jax.tree.map(lambda a: a.copy() if isinstance(a, jax.Array) else a, pristine)


def _prefer_compiled(compiled, fn, args):
  """``compiled`` when one call of it on ``args`` works, else ``fn``."""
  try:
    block(compiled(*args))
    return compiled
  except Exception:  # noqa: BLE001 - e.g. argument layouts a Compiled rejects
    return fn


def _jsonable(v):
  if isinstance(v, (bool, int, float, str)) or v is None:
    return v
  try:
    a = jax.device_get(v)
    return a.item() if getattr(a, "ndim", 1) == 0 else a.tolist()
  except Exception:  # noqa: BLE001
    return repr(v)


def check_passed(figures: dict[str, Any] | None) -> bool | None:
  """Whether a case's check figures say "correct": every boolean figure is
  True and there is no ``error``. None when the case has no check."""
  if not figures:
    return None
  if "error" in figures:
    return False
  bools = [v for v in figures.values() if isinstance(v, bool)]
  return all(bools) if bools else None


def device_kind() -> str:
  d = jax.devices()[0]
  return d.device_kind if d.platform != "cpu" else "cpu"


def device_slug(kind: str | None = None) -> str:
  """``"NVIDIA H200"`` → ``"nvidia-h200"``, ``"TPU v6 lite"`` → ``"tpu-v6-lite"``."""
  kind = kind or device_kind()
  return re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-") or "unknown"


def default_size(platform: str | None = None) -> str:
  """"full" on an accelerator, "quick" on the CPU."""
  platform = platform or jax.default_backend()
  return "full" if platform in ("gpu", "tpu") else "quick"


def run_meta(size: str) -> dict[str, Any]:
  """The ``meta`` of a results JSON. Where ``nvidia-smi`` exists,
  ``clocks_power`` is its ``-q -d CLOCK,POWER`` report now (SM and memory
  clocks current and max, power draw and limit, and the raw text:
  :func:`fuseopt.benchmarks.environment.clocks_and_power`); absent elsewhere."""
  import platform as _pf
  from fuseopt.benchmarks import environment
  d = jax.devices()[0]
  meta = {
      "device_kind": device_kind(), "device_slug": device_slug(), "platform": d.platform,
      "num_devices": jax.device_count(), "size": size, "jax": jax.__version__,
      "python": _pf.python_version(), "machine": _pf.machine(),
      "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
      "env": environment.collect(),  # versions (jaxlib, CUDA plugin, driver, triton, torch, ...)
  }
  clocks = environment.clocks_and_power()
  if clocks is not None:
    meta["clocks_power"] = clocks
  return meta


def select_cases(cases, *, rows=None):
  """Cases whose id (``op/name``) contains any of the substrings ``rows``."""
  if not rows:
    return list(cases)
  return [c for c in cases if any(r in c.id for r in rows)]


def skipped_records(case: Case, why: str) -> list[dict[str, Any]]:
  return [{"op": case.op, "case": case.name, "variant": v, "is_baseline": v == case.baseline,
           "is_default": v in case.defaults, "params": case.params, **case.meta.get(v, {}),
           "status": "skipped", "skipped": why} for v in case.variants]


def subcase(case: Case, labels) -> Case:
  """``case`` with only the variants ``labels`` (in the case's order); the
  same data, check and release."""
  keep = set(labels)
  return dataclasses.replace(case, variants={k: v for k, v in case.variants.items() if k in keep})


def plan(cases, *, done=frozenset(), headline: bool = True) -> tuple[list[Case], list[Case]]:
  """``(first, rest)``: the first pass, stage by stage, the variants each
  case names in ``headline`` (the default calls and their peers), then every
  other variant, case by case. Variants in ``done`` (``(op, case, label)``:
  rows an earlier run finished) are left out; so are cases left empty."""
  def left(case, labels):
    return [k for k in labels if k in case.variants and (case.op, case.name, k) not in done]
  first: list[Case] = []
  taken: dict[str, set] = {}
  if headline:
    for stage in range(max((len(c.headline) for c in cases), default=0)):
      for c in cases:
        if stage < len(c.headline):
          labels = [k for k in left(c, c.headline[stage]) if k not in taken.get(c.id, set())]
          if labels:
            first.append(subcase(c, labels))
            taken.setdefault(c.id, set()).update(labels)
  rest = []
  for c in cases:
    labels = [k for k in left(c, c.variants) if k not in taken.get(c.id, set())]
    if labels:
      rest.append(subcase(c, labels))
  return first, rest


def run_suite(cases, ceilings, *, iters: int = 10, min_time: float = 0.0, budget_s: float | None = None,
              progress: bool = False,
              on_case: Callable[[Case, list, list], None] | None = None,
              compile_budget_s: float | None = None, first=(), previous=(),
              on_record: Callable[[list], None] | None = None) -> list[dict[str, Any]]:
  """Runs cases one after another and returns all records.

  ``first`` (subcases, :func:`plan`) run before ``cases``, in their order,
  while ``budget_s`` lasts. Then, with ``budget_s``, the time left is shared
  fairly among ``cases``' ops (in their order): op k of K may start cases
  until ``(budget_s - elapsed) / (K - k)`` of its own time has gone, and
  starts its first case while any budget is left, so that every op gets
  rows even when an early op's cases are slow; cases not started are
  recorded as ``skipped``, and within a case no variant starts after the
  budget's end. A case that fails as a whole (its setup) is recorded as an
  error in each row and the next case runs; each case's ``release`` is
  called when it is done. ``on_case(case, new_records, all_records)`` is
  called after each case (e.g. to save partial results), ``on_record(all
  records so far)`` after each variant. ``previous``: rows of an earlier run
  kept in the result (``--resume``).
  """
  records: list[dict[str, Any]] = list(previous)
  kept = {id(r) for r in records}
  start = time.perf_counter()
  deadline = None if budget_s is None else start + budget_s
  outputs_by_case: dict[str, dict] = {}
  bar = None
  if progress:
    try:
      from tqdm import tqdm
      bar = tqdm(total=len(first) + len(cases), unit="case", dynamic_ncols=True)
    except ImportError:
      bar = None

  def one(case, why_skipped=None):
    if bar is not None:
      bar.set_description(case.id[:40])
    if why_skipped:
      recs = skipped_records(case, why_skipped)
    else:
      outs = outputs_by_case.setdefault(case.id, {})
      partial = (lambda recs: on_record(records + recs)) if on_record else None
      try:
        recs = run_case(case, ceilings, iters=iters, min_time=min_time, compile_budget_s=compile_budget_s,
                        deadline=deadline, outputs=outs, on_record=partial)
      except Exception as e:  # noqa: BLE001 - one case must not end the run
        recs = [{**r, "status": "error", "error": f"{type(e).__name__}: {e}"[:500]}
                for r in skipped_records(case, "")]
        for r in recs:
          r.pop("skipped")
      finally:
        if case.release is not None:
          try:
            case.release()
          except Exception:  # noqa: BLE001
            pass
        gc.collect()
    records.extend(recs)
    same = [r for r in records if (r["op"], r["case"]) == (case.op, case.name)]
    fill_ratios(same)
    if case.check is not None and len(outputs_by_case.get(case.id) or {}) and not why_skipped:
      figures = case_check(case, outputs_by_case[case.id])  # every pass's outputs so far
      for r in same:
        if ("ms" in r or r.get("same_program_as")) and id(r) not in kept:
          r["check"] = figures
    if on_case is not None:
      on_case(case, recs, records)
    if bar is not None:
      bar.update(1)

  for case in first:
    over = budget_s is not None and time.perf_counter() - start > budget_s
    one(case, "time budget" if over else None)
  ops = list(dict.fromkeys(c.op for c in cases))
  for k, op in enumerate(ops):
    op_start = time.perf_counter()
    share = None
    if budget_s is not None:
      share = max(0.0, budget_s - (op_start - start)) / (len(ops) - k)
    for n, case in enumerate(c for c in cases if c.op == op):
      over_total = budget_s is not None and time.perf_counter() - start > budget_s
      over_share = share is not None and time.perf_counter() - op_start > share
      one(case, "time budget" if over_total or (n > 0 and over_share) else None)
  if bar is not None:
    bar.close()
  outputs_by_case.clear()
  return records
