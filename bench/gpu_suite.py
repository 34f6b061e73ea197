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
block configs from each op's heuristics, so the same file runs on an H200,
an L4, an RTX 4090 or a TPU v6e. ``--budget-s`` is shared fairly among the
ops (each op's first case always runs while budget is left); cases not
started in time are marked ``skipped`` (the default leaves room for the last
case, start-up and the plots inside 8 minutes).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

import jax

from fuseopt.benchmarks import ceiling, core, environment, report
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
  args = ap.parse_args(argv)

  t0 = time.perf_counter()
  # Before JAX touches the device: torch's run needs the memory JAX preallocates.
  torch_result = _torch_baselines(args)
  platform = jax.default_backend()
  size = args.size or core.default_size(platform)
  meta = core.run_meta(size)
  meta["suite"] = "bench/gpu_suite.py"
  meta["peers"] = _peer_versions()
  out_dir = args.out_root / meta["device_slug"]
  path = out_dir / "suite.json"
  print(f"gpu_suite: {meta['device_kind']} ({platform}, {jax.device_count()} devices), size {size}, "
        f"jax {jax.__version__} -> {path}", flush=True)
  if platform == "cpu":
    print("gpu_suite: no accelerator; running the CPU sizes (a smoke run)", flush=True)

  errors: dict[str, str] = {}
  cases = core.select_cases(all_cases(size, platform, args.ops, errors=errors), rows=args.rows)
  for op, msg in errors.items():
    print(f"gpu_suite: cases of {op!r} left out: {msg}", flush=True)

  ceilings = ceiling.measure_ceilings(platform, quick=size == "quick")
  _record_clocks(meta, "clocks_power_after_ceilings")
  print(f"gpu_suite: ceilings copy {ceilings['copy_gbps']:.0f} GB/s "
        f"({ceilings.get('copy_ceiling_source')}), "
        f"bf16 matmul {ceilings['matmul_tflops']:.3g} TFLOP/s ({time.perf_counter() - t0:.0f} s)", flush=True)

  def save(rows):
    meta["wall_s"] = round(time.perf_counter() - t0, 1)
    report.save_json(report.make_results(meta, ceilings, rows, errors), path)

  def on_case(case, recs, rows):
    save(rows)
    for r in recs:
      what = r.get("error") or r.get("skipped") and f"skipped ({r['skipped']})" or (
          f"{r['ms']:.3f} ms  ratio {r.get('ratio_to_baseline', 0):.2f}  {report.throughput(r)}")
      print(f"  {case.id} {r['variant']}: {what}", flush=True)
    ok = core.check_passed(recs[0].get("check")) if recs else None
    if ok is not None:
      print(f"  {case.id} check: {'ok' if ok else 'FAILED'} {recs[0]['check']}", flush=True)

  save([])
  iters = args.iters or (10 if platform in ("gpu", "tpu") else 5)
  # Each op gets a fair share of what is left of the budget (core.run_suite).
  rows = core.run_suite(cases, ceilings, iters=iters, on_case=on_case,
                        budget_s=max(0.0, args.budget_s - (time.perf_counter() - t0)))
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
        f"{time.perf_counter() - t0:.0f} s -> {path}")
  return 1 if (failed or bad) else 0


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
  sys.exit(main())
