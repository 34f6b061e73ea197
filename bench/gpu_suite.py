"""Everything fuseopt measures on one accelerator, in one run (< 8 minutes).

  python bench/gpu_suite.py [OUT_ROOT] [--size full|quick] [--budget-s 390] [--ops OP ...]

Writes ``OUT_ROOT/<device-kind-slug>/suite.json`` (default OUT_ROOT:
bench/results) in the schema of ``fuseopt.benchmarks.report``, rewritten
after every case so a run cut short still leaves its rows, plus
``bench.png`` and ``scaling.png``. Then commit the directory and run
``fuseopt report`` to render the README's performance table.

What it does:
1. the ceilings, measured now: copy bandwidth (the best of XLA's fp32
   ``x*a+b``, copy and axpy and, on a GPU, a persistent Pallas-Triton
   streaming kernel with 128-bit accesses: ``core.measure_ceilings``) and
   bf16 matmul rate; on an NVIDIA GPU, the clocks and power that
   ``nvidia-smi -q -d CLOCK,POWER`` reports at the start, right after the
   ceilings and at the end (``meta["clocks_power"...]``);
2. every bench case of every op module that exists, at the size that suits
   the device: correctness of each fuseopt variant against its reference on
   these large inputs (the case's ``check``), and the time of every variant,
   its baseline in the same run, effective GB/s or TFLOP/s and fraction of
   the roofline floor; compiled temp/argument/output bytes;
3. where torch with CUDA is installed (``--torch auto``, the default), the
   PyTorch baselines of ``bench/torch_baselines.py`` (fused/foreach AdamW,
   fused AdamW with bf16 moments, torch.optim.Muon + AdamW), run first in a
   subprocess so that JAX's preallocation does not starve them, merged into
   the Adam and Muon cases with their ratio to the optax baseline of this run;
4. on a GPU, FlashOptim's fused 8-bit AdamW (``flashoptim_jax``, the JAX
   peer of 8-bit moments) as rows of the Adam cases, where it imports: an
   installed copy, else the wheel vendored under ``bench/vendor/`` (put on
   ``sys.path`` here; the device machines install nothing). It is never a
   dependency of fuseopt; ``meta["peers"]`` says which copy ran.

Nothing here names a chip: sizes come from the platform (gpu / tpu) and
the device's memory (the Llama tree: the 1.2 B one where optax's fp32 AdamW
step on it fits, else the most layers that do, ``meta["tree"]``:
:func:`fuseopt.benchmarks.workloads.tree_info`), block configs from each
op's heuristics, so the same file runs on an H200, an L4, an RTX 4090 or a
TPU v5e.

Order and time: first the rows each case names as its headline (the user's
default calls and optax's rows, stage by stage: ``core.plan``), then every
other row with ``--budget-s`` shared fairly among the ops (each op's first
case always runs while budget is left); rows not started in time are marked
``skipped``. Each compile gets ``--compile-budget-s`` (on an accelerator;
one past it is recorded as ``compile_timeout`` and the next row runs), and
every row says its ``compile_s``. A donated optimizer step is timed as
training runs it: its outputs fed back as the next step's inputs, median of
``--iters`` (at least 10) steps after 2 warm-ups. ``--resume`` keeps the
timed rows of an earlier ``suite.json`` in the same directory and runs the
rest. Rows carry, beside the measured copy ceiling's ``fraction_of_floor``,
``fraction_of_spec_floor``: their own bytes moved at the device's spec
bandwidth (``ceilings["spec_gbps"]``, :data:`fuseopt.benchmarks.ceiling.SPEC_GBPS`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import importlib.metadata
import importlib.util
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

import jax

from fuseopt.benchmarks import ceiling, core, environment, report, workloads
from fuseopt.benchmarks.cases import CASE_MODULES, all_cases


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("out_root", nargs="?", type=Path, default=Path("bench/results"),
                  help="results root; the JSON goes to OUT_ROOT/<device-kind-slug>/suite.json")
  ap.add_argument("--size", choices=("quick", "full"), default=None,
                  help="default: full on GPU/TPU, quick on the CPU")
  ap.add_argument("--budget-s", type=float, default=390.0,
                  help="start no new case after this many seconds (default 390, so that the last "
                       "case and the plots end within 8 minutes)")
  ap.add_argument("--ops", nargs="+", choices=CASE_MODULES)
  ap.add_argument("--rows", nargs="+", metavar="SUBSTR")
  ap.add_argument("--iters", type=int, default=None)
  ap.add_argument("--no-plot", action="store_true")
  ap.add_argument("--torch", choices=("auto", "on", "off"), default="auto",
                  help="PyTorch baselines (auto: where torch is installed; needs CUDA)")
  ap.add_argument("--compile-budget-s", type=float, default=None,
                  help="one row's lowering + compile (default 90 on a GPU/TPU, none on the CPU); "
                       "past it the row is recorded as compile_timeout and the next one runs")
  ap.add_argument("--resume", action="store_true",
                  help="keep the timed rows of OUT_ROOT/<device>/suite.json and run the others")
  ap.add_argument("--retry-failed", action="store_true",
                  help="with --resume: run again the rows that failed or timed out compiling")
  ap.add_argument("--no-headline", action="store_true",
                  help="no first pass of the headline rows: every case in the suite's order")
  args = ap.parse_args(argv)

  t0 = time.perf_counter()
  # Before JAX touches the device: torch's run needs the memory JAX preallocates.
  torch_result = _torch_baselines(args)
  platform = jax.default_backend()
  size = args.size or core.default_size(platform)
  meta = core.run_meta(size)
  meta["suite"] = "bench/gpu_suite.py"
  meta["peers"] = _peer_versions()
  meta["tree"] = workloads.tree_info(platform, size)
  accel = platform in ("gpu", "tpu")
  compile_budget = args.compile_budget_s if args.compile_budget_s is not None else (90.0 if accel else None)
  meta["compile_budget_s"] = compile_budget
  out_dir = args.out_root / meta["device_slug"]
  path = out_dir / "suite.json"
  tree = meta["tree"]
  print(f"gpu_suite: {meta['device_kind']} ({platform}, {jax.device_count()} devices), size {size}, "
        f"jax {jax.__version__} -> {path}", flush=True)
  print(f"gpu_suite: tree {tree['name']} ({tree['layers']} layers, {tree['params']:,} params; optax fp32 "
        f"AdamW step {tree['adamw_fp32_step_bytes'] / 2**30:.1f} GiB modelled, device limit "
        f"{(tree['bytes_limit'] or 0) / 2**30:.1f} GiB); compile budget {compile_budget} s", flush=True)
  previous, done = _previous_rows(path, args) if args.resume else ([], set())
  if args.resume:
    print(f"gpu_suite: --resume: kept {len(previous)} rows of {path}", flush=True)
  if platform == "cpu":
    print("gpu_suite: no accelerator; running the CPU sizes (a smoke run)", flush=True)

  errors: dict[str, str] = {}
  cases = core.select_cases(all_cases(size, platform, args.ops, errors=errors), rows=args.rows)
  for op, msg in errors.items():
    print(f"gpu_suite: cases of {op!r} left out: {msg}", flush=True)

  ceilings = ceiling.measure_ceilings(platform, quick=size == "quick")
  spec = ceiling.spec_gbps(meta["device_kind"])
  if spec:
    ceilings["spec_gbps"] = spec
  _record_clocks(meta, "clocks_power_after_ceilings")
  print(f"gpu_suite: ceilings copy {ceilings['copy_gbps']:.0f} GB/s "
        f"({ceilings.get('copy_ceiling_source')}), "
        f"bf16 matmul {ceilings['matmul_tflops']:.3g} TFLOP/s, spec {spec or '?'} GB/s "
        f"({time.perf_counter() - t0:.0f} s)", flush=True)

  def save(rows):
    meta["wall_s"] = round(time.perf_counter() - t0, 1)
    report.save_json(report.make_results(meta, ceilings, rows, errors), path)

  def on_case(case, recs, rows):
    save(rows)
    for r in recs:
      what = r.get("error") or r.get("skipped") and f"skipped ({r['skipped']})" or (
          f"{r['ms']:.3f} ms  ratio {_num(r.get('ratio_to_baseline'))}  {report.throughput(r)}"
          + (f"  {100 * r['fraction_of_spec_floor']:.0f}% of spec floor" if r.get("fraction_of_spec_floor")
             else ""))
      print(f"  {case.id} {r['variant']}: {what} (compile {r.get('compile_s') or 0:.1f} s)", flush=True)
    ok = core.check_passed(recs[0].get("check")) if recs else None
    if ok is not None:
      print(f"  {case.id} check: {'ok' if ok else 'FAILED'} {recs[0]['check']}", flush=True)

  save(previous)
  iters = args.iters or (10 if platform in ("gpu", "tpu") else 5)
  first, rest = core.plan(cases, done=done, headline=not args.no_headline)
  # The headline rows first, then each op gets a fair share of what is left
  # of the budget (core.run_suite); the JSON is written after every row.
  rows = core.run_suite(rest, ceilings, iters=iters, on_case=on_case, first=first, previous=previous,
                        budget_s=max(0.0, args.budget_s - (time.perf_counter() - t0)),
                        compile_budget_s=compile_budget, on_record=save)
  if torch_result is not None:
    rows = torch_baselines.merge_rows(rows, torch_result["rows"])
    meta["torch"] = torch_result.get("torch")
  elif args.torch != "off":
    meta["torch"] = "not run"

  _record_clocks(meta, "clocks_power_end")
  results = report.make_results(meta, ceilings, rows, errors)
  report.validate(results)
  save(rows)
  print(report.format_header(results))
  print(report.format_table(rows))
  if not args.no_plot:
    try:
      report.plot(results, out_dir)
    except ImportError as e:  # a bare machine: the JSON is the record
      print(f"gpu_suite: no plots ({e}); the JSON has every figure", flush=True)
    except Exception:  # noqa: BLE001 - plots are a convenience; the JSON is the record
      traceback.print_exc()
  failed = [r for r in rows if "error" in r]
  bad = sorted({f"{r['op']}/{r['case']}" for r in rows if core.check_passed(r.get("check")) is False})
  unchecked = sorted({f"{r['op']}/{r['case']}" for r in rows if "ms" in r and not r.get("check")})
  if unchecked:
    print(f"gpu_suite: cases without a correctness check: {', '.join(unchecked)}")
  print(f"gpu_suite: {len(rows)} rows, {len(failed)} errors, checks failed: {bad or 'none'}; "
        f"{time.perf_counter() - t0:.0f} s -> {path}", flush=True)
  return 1 if (failed or bad) else 0


def _num(v) -> str:
  return "-" if v is None else f"{v:.2f}"


def _previous_rows(path: Path, args) -> tuple[list, set]:
  """(rows of an earlier suite.json to keep, their (op, case, variant)):
  the timed ones and those of the same program as another, and, unless
  ``--retry-failed``, those whose compile timed out (they would again)."""
  try:
    old = json.loads(path.read_text())
  except (OSError, ValueError):
    return [], set()
  keep = []
  for r in old.get("rows", []):
    timed = "ms" in r and "error" not in r
    if timed or r.get("same_program_as") or (r.get("status") == "compile_timeout" and not args.retry_failed):
      keep.append({**r, "resumed": True})
  return keep, {(r["op"], r["case"], r["variant"]) for r in keep}


def _record_clocks(meta: dict, key: str) -> None:
  """``meta[key]``: nvidia-smi's clocks and power now (the GPU has just been
  busy), where nvidia-smi exists; nothing elsewhere, never an error."""
  try:
    clocks = environment.clocks_and_power()
  except Exception:  # noqa: BLE001 - a record, never a reason to stop
    clocks = None
  if clocks is not None:
    meta[key] = clocks


VENDOR = Path(__file__).with_name("vendor")


def _vendored_wheels() -> None:
  """Puts the pure-Python wheels of ``bench/vendor`` (FlashOptim's) on
  ``sys.path`` behind an installed copy: a wheel imports as a zip archive."""
  for wheel in sorted(VENDOR.glob("*.whl")):
    if str(wheel) not in sys.path:
      sys.path.append(str(wheel))


def _peer_versions() -> dict:
  """The optional JAX peers: version and where each was imported from, or
  why not."""
  out = {}
  for module, dist in (("flashoptim_jax", "flashoptim-jax"),):
    try:
      mod = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - an optional peer is reported, never fatal
      out[dist] = f"not importable: {type(e).__name__}: {e}"[:200]
      continue
    try:
      version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
      version = "?"
    out[dist] = {"version": version, "from": str(Path(mod.__file__).parent)}
  return out


def _torch_baselines(args):
  """torch_baselines.py's result, or None (no torch, --torch off, or a failure)."""
  if args.torch == "off" or (args.torch == "auto" and importlib.util.find_spec("torch") is None):
    return None
  out = args.out_root / "torch_baselines.json"
  cmd = [sys.executable, str(Path(__file__).with_name("torch_baselines.py")), str(out)]
  try:
    subprocess.run(cmd, check=True, timeout=150)
    return json.loads(out.read_text())
  except Exception as e:  # noqa: BLE001 - optional baselines must not sink the suite
    print(f"gpu_suite: torch baselines not run: {type(e).__name__}: {e}", flush=True)
    if args.torch == "on":
      raise
    return None
  finally:
    out.unlink(missing_ok=True)


sys.path.insert(0, str(Path(__file__).parent))
import torch_baselines  # noqa: E402  (bench/ is not a package)

_vendored_wheels()

if __name__ == "__main__":
  rc = main()
  if core.ABANDONED_COMPILES:
    # A compile given up on still runs in its thread: leave without waiting
    # for it (everything is written).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
  sys.exit(rc)
