"""Performance-regression check on the CPU.

Deterministic figures of every bench case's fuseopt variants (labels
starting with ``fuseopt``; the baselines are optax's and XLA's code) at
``size="quick"`` on the CPU — what XLA compiles, not how fast it runs — are
compared with the committed baseline ``bench/baseline/cpu.json``:

=================  =====================================================  ==========
figure             tolerance                                              fails when
=================  =====================================================  ==========
temp_bytes         +max(10 %, 64 KiB)                                     it grows
argument_bytes,    exact                                                  it moves
output_bytes,
alias_bytes,
state_bytes        (optimizer state, as the case declares it)
hlo_ops            ±max(2 %, 1) instructions (fused bodies included)      it moves
hlo_fusions        ±1                                                     it moves
custom_calls       exact (custom calls in the CPU program)                it moves
h200_kernels       exact (Pallas kernel launches per step on an H200,     it moves
                   counted in the lowering for one, see CROSS_TARGET)
cost_flops,        ±2 % (``compiled.cost_analysis()``)                    it moves
cost_bytes
=================  =====================================================  ==========

Moves in both directions fail where the table says "moves": a figure that
drops (fewer FLOPs, one fusion less) is a changed program, and the baseline
should then be updated on purpose. Temp memory that shrinks is reported as
an improvement without failing.

Cases that are new (not in the baseline) or gone (a case module absent or
renamed) are reported, never failed on; so is a case module that does not
import. A variant that compiled in the baseline and no longer does fails.

Wall-clock times on the CPU are compared only as ratios to the baseline
variant (optax / plain XLA) measured in the same run, with a noise margin;
they are reported and never fail.

Update the baseline (after an intended change, or to take in new cases)::

    fuseopt regression --update        # writes bench/baseline/cpu.json

Figures depend on the XLA version, so each jax release has its own baseline
(``bench/baseline/cpu-jax-<release>.json``; ``cpu.json`` is jax 0.11.2's) and
the baseline records jax's version; with another version the comparison is
reported but not enforced.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import jax

from fuseopt.benchmarks import core
from fuseopt.benchmarks.cases import all_cases

SCHEMA = "fuseopt-regression/1"
DEFAULT_BASELINE = Path("bench/baseline/cpu.json")
SIZE = "quick"
WALLCLOCK_NOISE = 0.25   # a CPU ratio within ±25 % of the baseline's is noise
# The test suite runs with 8 emulated CPU devices (tests/conftest.py); the
# CLI sets the same so that a case that shards over jax.devices() compiles
# to the same program in CI and in `fuseopt regression --update`.
CPU_DEVICES = 8


def use_test_devices() -> None:
  """Asks for :data:`CPU_DEVICES` CPU devices if no backend exists yet."""
  try:
    jax.config.update("jax_num_cpu_devices", CPU_DEVICES)
  except Exception:  # noqa: BLE001 - backends already initialised: compare() notes the count
    pass

# LLVM's optimisation level changes the machine code only: HLO, fusions,
# buffer assignment and cost analysis are the same (checked), and compiles
# take 30-50 % less time on the CPU.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}

FIGURES = ("temp_bytes", "argument_bytes", "output_bytes", "alias_bytes", "state_bytes", "hlo_ops",
           "hlo_fusions", "custom_calls", "cost_flops", "cost_bytes", "h200_kernels")

# Kernel launches per step on a GPU, counted from the CPU: the variant is
# traced and lowered for an H200 under an abstract mesh of that device, so
# each op left to choose dispatches as it does on the H200 (its platform
# order: dispatch.select), and the Pallas-Triton calls in the StableHLO are
# counted. Lowering only: no GPU and no compile needed.
CROSS_TARGET = dict(device_kind="NVIDIA H200", platform="gpu", lowering_platform="cuda",
                    num_cores=132)
_TRITON_CALL = r"stablehlo\.custom_call @__gpu\$xla\.gpu\.triton"


@dataclasses.dataclass(frozen=True)
class Tolerance:
  rel: float = 0.0        # allowed move as a fraction of the baseline value
  abs: float = 0.0        # allowed move in the figure's unit; the larger wins
  only_up: bool = False   # True: only growth fails (shrinking is an improvement)

  def allowed(self, base: float) -> float:
    return max(self.rel * abs(base), self.abs)


TOLERANCES: dict[str, Tolerance] = {
    "temp_bytes": Tolerance(rel=0.10, abs=64 * 1024, only_up=True),
    "argument_bytes": Tolerance(),
    "output_bytes": Tolerance(),
    "alias_bytes": Tolerance(),
    "state_bytes": Tolerance(),
    "hlo_ops": Tolerance(rel=0.02, abs=1),
    "hlo_fusions": Tolerance(abs=1),
    "custom_calls": Tolerance(),
    "cost_flops": Tolerance(rel=0.02),
    "cost_bytes": Tolerance(rel=0.02),
    "h200_kernels": Tolerance(),
}


def h200_lowering_text(fn, args) -> str:
  """StableHLO of ``fn(*args)`` lowered for an H200 (:data:`CROSS_TARGET`):
  traced under an abstract mesh of that device, so ops left to choose pick
  what they pick on it (and variants that name ``"xla"`` stay XLA). Arrays in
  ``args`` are replaced by their shapes; nothing is compiled."""
  from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

  t = CROSS_TARGET
  mesh = AbstractMesh((), (), abstract_device=AbstractDevice(
      device_kind=t["device_kind"], num_cores=t["num_cores"], platform=t["platform"]))
  structs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype) if isinstance(a, jax.Array) else a,
                         args)
  fn = fn if hasattr(fn, "trace") else jax.jit(fn)
  with use_abstract_mesh(mesh):
    return fn.trace(*structs).lower(lowering_platforms=(t["lowering_platform"],)).as_text()


def h200_kernels(fn, args) -> int:
  """Pallas-Triton kernel calls of ``fn(*args)`` lowered for an H200 (see
  :data:`CROSS_TARGET`)."""
  import re
  return len(re.findall(_TRITON_CALL, h200_lowering_text(fn, args)))


def repo_root() -> Path:
  """The checkout holding ``bench/`` (for default paths), else the cwd."""
  here = Path(__file__).resolve().parents[2]
  return here if (here / "pyproject.toml").exists() else Path.cwd()


def default_baseline_path(*, write: bool = False) -> Path:
  """The running jax release's baseline. XLA's CPU figures move between
  releases, so each release keeps its own, ``bench/baseline/cpu-jax-<release>.json``;
  ``bench/baseline/cpu.json`` is the baseline of the release it records (jax
  0.11.2's): used for that release, and read (compared, not enforced) by a
  release without a file of its own. ``write``: where ``--update`` writes,
  never another release's file."""
  env = os.environ.get("FUSEOPT_BASELINE")
  if env:
    return Path(env)
  keyed = repo_root() / DEFAULT_BASELINE.with_name(f"cpu-jax-{jax.__version__}.json")
  legacy = repo_root() / DEFAULT_BASELINE
  if keyed.exists() or not legacy.exists():
    return keyed
  if write and json.loads(legacy.read_text()).get("meta", {}).get("jax") != jax.__version__:
    return keyed
  return legacy


def variant_id(op: str, case: str, variant: str) -> str:
  return f"{op}/{case}/{variant}"


def collect(ops=None, *, rows=None, progress: bool = False, cross: bool = True) -> dict[str, Any]:
  """Compiles every quick CPU case's fuseopt variants (never runs them) and
  returns ``{"figures": {variant_id: {figure: value}}, "module_errors": ...}``.
  ``cross``: also count the kernels of each variant lowered for an H200.
  """
  errors: dict[str, str] = {}
  cases = core.select_cases(all_cases(SIZE, "cpu", ops, errors=errors), rows=rows)
  figures: dict[str, dict[str, Any]] = {}
  it = cases
  if progress:
    try:
      from tqdm import tqdm
      it = tqdm(cases, unit="case", dynamic_ncols=True)
    except ImportError:
      pass
  for case in it:
    for label, build in case.variants.items():
      if not label.startswith("fuseopt"):
        continue  # baselines are optax's / XLA's code: their figures move with those versions
      vid = variant_id(case.op, case.name, label)
      try:
        fn, args, _ = core.build_variant(build)
        stats = core.stats_of(core.compile_fn(fn, args, FAST_COMPILE))
        figures[vid] = {k: stats[k] for k in FIGURES if k in stats}
        if label in case.state_bytes:
          figures[vid]["state_bytes"] = int(case.state_bytes[label])
      except Exception as e:  # noqa: BLE001 - recorded, compared below
        figures[vid] = {"error": f"{type(e).__name__}: {e}"[:300]}
        continue
      if not cross:
        continue
      try:
        figures[vid]["h200_kernels"] = h200_kernels(fn, args)
      except Exception as e:  # noqa: BLE001 - recorded, compared below
        figures[vid]["h200_error"] = f"{type(e).__name__}: {e}"[:300]
  ops_present = sorted({c.op for c in cases})
  return {"figures": figures, "module_errors": errors, "ops": ops_present,
          "cases_by_op": {op: sorted(c.name for c in cases if c.op == op) for op in ops_present}}


def wallclock(ops=None, *, rows=None, iters: int = 10, budget_s: float | None = None) -> dict[str, float]:
  """CPU wall-clock ratio (fastest call / fastest call of the case's baseline
  variant, measured in one run) of every variant: a report figure only."""
  cases = core.select_cases(all_cases(SIZE, "cpu", ops, errors={}), rows=rows)
  recs = core.run_suite(cases, {"copy_gbps": 1.0, "matmul_tflops": 1.0}, iters=iters,
                        budget_s=budget_s) if cases else []
  # Ratios of the fastest calls: on a shared CPU the minimum is the figure
  # least disturbed by other processes.
  base = {(r["op"], r["case"]): r["min_ms"] for r in recs if r.get("is_baseline") and "min_ms" in r}
  return {variant_id(r["op"], r["case"], r["variant"]): r["min_ms"] / base[(r["op"], r["case"])]
          for r in recs if "min_ms" in r and (r["op"], r["case"]) in base}


def cpu_model() -> str:
  """The CPU's model name (XLA's CPU passes may depend on its features)."""
  import platform as _pf
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return _pf.processor() or _pf.machine()


def make_baseline(collected: dict[str, Any], ratios: dict[str, float] | None = None) -> dict[str, Any]:
  return {
      "schema": SCHEMA,
      "meta": {"jax": jax.__version__, "size": SIZE, "platform": "cpu", "num_devices": jax.device_count(),
               "cpu": cpu_model(),
               "generated_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "command": "fuseopt regression --update"},
      "tolerances": {k: dataclasses.asdict(v) for k, v in TOLERANCES.items()},
      "figures": dict(sorted(collected["figures"].items())),
      "wallclock_ratios": {k: round(v, 3) for k, v in sorted((ratios or {}).items())},
  }


def load_baseline(path: Path | str | None = None) -> dict[str, Any] | None:
  path = Path(path) if path else default_baseline_path()
  if not path.exists():
    return None
  data = json.loads(path.read_text())
  if data.get("schema") != SCHEMA:
    raise ValueError(f"{path}: schema {data.get('schema')!r}, expected {SCHEMA!r}")
  return data


def write_baseline(data: dict[str, Any], path: Path | str | None = None) -> Path:
  path = Path(path) if path else default_baseline_path()
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
  return path


def _fmt(figure: str, v: float) -> str:
  if figure.endswith("_bytes"):
    return _fmt_bytes(v)
  if figure.startswith("cost_"):
    return f"{v:.4g}"
  return f"{int(v)}"


def _fmt_bytes(v: float) -> str:
  for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if abs(v) >= div:
      return f"{v / div:.1f} {unit}"
  return f"{int(v)} B"


@dataclasses.dataclass
class Report:
  failures: list[str] = dataclasses.field(default_factory=list)     # fail CI
  improvements: list[str] = dataclasses.field(default_factory=list)
  notes: list[str] = dataclasses.field(default_factory=list)        # new / gone / skipped
  compared: int = 0
  enforced: bool = True

  @property
  def ok(self) -> bool:
    return not self.enforced or not self.failures

  def text(self) -> str:
    lines = [f"regression: {self.compared} variants compared with the baseline"
             + ("" if self.enforced else " (not enforced: see notes)")]
    for title, items in (("FAIL", self.failures), ("improved", self.improvements), ("note", self.notes)):
      lines += [f"  {title}: {x}" for x in items]
    if self.failures:
      lines.append("  If the change is intended: fuseopt regression --update  (and commit bench/baseline/cpu.json)")
    lines.append("regression: " + ("OK" if self.ok else f"{len(self.failures)} figure(s) moved"))
    return "\n".join(lines)


def compare(current: dict[str, Any], baseline: dict[str, Any]) -> Report:
  """Compares collected figures with a baseline (see the module docstring
  for the tolerances)."""
  rep = Report()
  if baseline["meta"].get("jax") != jax.__version__:
    rep.enforced = False
    rep.notes.append(f"baseline made with jax {baseline['meta'].get('jax')}, running jax {jax.__version__}: "
                     "figures compared but not enforced")
  cpu = baseline["meta"].get("cpu")
  if cpu is not None and cpu != cpu_model():
    rep.notes.append(f"baseline made on {cpu!r}, running on {cpu_model()!r}: XLA's CPU passes may differ "
                     "by CPU features; if only this moved, regenerate the baseline on the CI machine")
  nd = baseline["meta"].get("num_devices")
  if nd is not None and nd != jax.device_count():
    rep.notes.append(f"baseline made with {nd} CPU devices, running with {jax.device_count()}: "
                     "figures of cases that shard may differ")
  cur, base = current["figures"], baseline["figures"]
  for op, msg in sorted(current.get("module_errors", {}).items()):
    rep.notes.append(f"case module {op!r} did not load: {msg}")
  base_ops = {k.split("/", 1)[0] for k in base}
  cur_ops = set(current.get("ops", ())) | {k.split("/", 1)[0] for k in cur}
  for op in sorted(base_ops - cur_ops):
    rep.notes.append(f"op {op!r} is in the baseline but has no cases now (module absent?)")
  for op in sorted(cur_ops - base_ops):
    rep.notes.append(f"op {op!r} is new (not in the baseline): run `fuseopt regression --update` to track it")
  for vid in sorted(set(base) - set(cur)):
    if vid.split("/", 1)[0] in cur_ops:
      rep.notes.append(f"{vid}: in the baseline, gone now")
  for vid in sorted(set(cur) - set(base)):
    if vid.split("/", 1)[0] in base_ops:
      rep.notes.append(f"{vid}: new, not in the baseline")
  for vid in sorted(set(cur) & set(base)):
    c, b = cur[vid], base[vid]
    if "error" in c:
      if "error" not in b:
        rep.failures.append(f"{vid}: compiled in the baseline, fails now: {c['error']}")
      continue
    if "error" in b:
      rep.notes.append(f"{vid}: failed in the baseline, compiles now")
      continue
    rep.compared += 1
    if "h200_error" in c:
      if "h200_kernels" in b:
        rep.failures.append(f"{vid}: lowered for the H200 in the baseline, fails now: {c['h200_error']}")
      else:
        rep.notes.append(f"{vid}: does not lower for the H200: {c['h200_error']}")
    for fig in FIGURES:
      if fig not in b or fig not in c:
        continue
      bv, cv = float(b[fig]), float(c[fig])
      tol = TOLERANCES[fig]
      delta = cv - bv
      if delta == 0:
        continue
      rel = f", {delta / bv:+.1%}" if bv else ""
      msg = (f"{vid}: {fig} {_fmt(fig, bv)} -> {_fmt(fig, cv)} "
             f"({'+' if delta > 0 else '-'}{_fmt(fig, abs(delta))}{rel}; "
             f"allowed {'+' if tol.only_up else '±'}{_fmt(fig, tol.allowed(bv))})")
      if abs(delta) <= tol.allowed(bv):
        continue
      if tol.only_up and delta < 0:
        rep.improvements.append(msg)
      else:
        rep.failures.append(msg)
  return rep


def compare_wallclock(ratios: dict[str, float], baseline: dict[str, Any]) -> list[str]:
  """One line per variant: its CPU ratio to the baseline variant now and in
  the baseline file, flagged when outside the noise margin. Never fails."""
  old = baseline.get("wallclock_ratios", {}) if baseline else {}
  lines = []
  for vid, r in sorted(ratios.items()):
    if vid not in old:
      lines.append(f"{vid}: ratio {r:.2f} (no baseline ratio)")
      continue
    o = old[vid]
    move = r / o - 1 if o else 0.0
    flag = "" if abs(move) <= WALLCLOCK_NOISE else ("  SLOWER (report only)" if move > 0 else "  faster")
    lines.append(f"{vid}: ratio {r:.2f} vs {o:.2f} in baseline ({move:+.0%}){flag}")
  return lines


def main(update: bool = False, *, baseline_path=None, ops=None, rows=None, timing: bool = False,
         progress: bool = True, out=print) -> int:
  """``fuseopt regression [--update] [--timing]``; returns the exit status."""
  use_test_devices()
  t0 = time.perf_counter()
  path = Path(baseline_path) if baseline_path else default_baseline_path(write=update)
  if not update and not path.exists():
    out(f"no baseline at {path}: run `fuseopt regression --update` to create it")
    return 1
  current = collect(ops, rows=rows, progress=progress)
  if update:
    if ops or rows:
      raise ValueError("--update rewrites the whole baseline: do not combine it with --ops/--rows")
    for op, msg in current["module_errors"].items():
      out(f"warning: case module {op!r} did not load and is left out of the baseline: {msg}")
    ratios = wallclock() if timing else (load_baseline(path) or {}).get("wallclock_ratios", {})
    write_baseline(make_baseline(current, ratios), path)
    n = len(current["figures"])
    out(f"wrote {path}: {n} variants of {len(current['ops'])} ops ({', '.join(current['ops'])}) "
        f"in {time.perf_counter() - t0:.0f} s")
    return 0
  baseline = load_baseline(path)
  if ops or rows:
    keep = set(current["figures"])
    baseline = {**baseline, "figures": {k: v for k, v in baseline["figures"].items() if k in keep}}
  rep = compare(current, baseline)
  out(rep.text())
  if timing:
    out("wall-clock ratios to each case's baseline on this CPU (report only):")
    for line in compare_wallclock(wallclock(ops, rows=rows), baseline):
      out("  " + line)
  out(f"({time.perf_counter() - t0:.0f} s)")
  return 0 if rep.ok else 1


__all__ = ["collect", "compare", "compare_wallclock", "make_baseline", "load_baseline", "write_baseline",
           "wallclock", "main", "h200_kernels", "h200_lowering_text", "TOLERANCES", "FIGURES"]
