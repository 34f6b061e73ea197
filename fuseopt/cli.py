"""The ``fuseopt`` command line.

::

  fuseopt bench [--size auto|quick|full] [--ops OP ...] [--rows SUBSTR ...]
                [--out DIR] [--no-plot] [--iters N] [--budget-s S]
  fuseopt regression [--update] [--timing] [--ops OP ...] [--rows SUBSTR ...] [--baseline PATH]
  fuseopt report [--results DIR] [--root DIR] [--include-cpu] [--print]
  fuseopt demo [--steps N]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from fuseopt.benchmarks.cases import CASE_MODULES

CPU_BUDGET_S = 240.0  # `fuseopt bench` on a laptop-class CPU stays within a few minutes


def _add_selection(p):
  p.add_argument("--ops", nargs="+", choices=CASE_MODULES, metavar="OP",
                 help=f"only these ops (of {', '.join(CASE_MODULES)})")
  p.add_argument("--rows", nargs="+", metavar="SUBSTR",
                 help="only cases whose id 'op/case' contains one of these substrings")


def build_parser() -> argparse.ArgumentParser:
  from fuseopt import targets
  ap = argparse.ArgumentParser(prog="fuseopt", description="fuseopt: fused optimizer kernels for JAX")
  sub = ap.add_subparsers(dest="command", required=True)

  b = sub.add_parser("bench", help="run the benchmarks that exist, print the table, save JSON and plots")
  b.add_argument("--size", choices=("auto", "quick", "full"), default="auto",
                 help="problem sizes: auto = full on GPU/TPU, quick on the CPU (default)")
  _add_selection(b)
  b.add_argument("--out", type=Path, default=None,
                 help="directory for bench-<size>.json and the PNGs (default bench/results/<device-kind> "
                      "on GPU/TPU, bench/out/cpu on the CPU)")
  b.add_argument("--no-plot", action="store_true", help="do not draw the PNGs")
  b.add_argument("--iters", type=int, default=None, help="timed calls per variant (default 10; 5 on the CPU)")
  b.add_argument("--budget-s", type=float, default=None,
                 help="start no new case after this many seconds (the rest are marked skipped); "
                      f"default {CPU_BUDGET_S:.0f} on the CPU, none on an accelerator")
  b.add_argument("--no-progress", action="store_true", help="no progress bar")

  r = sub.add_parser("regression", help="compare deterministic compiled figures with bench/baseline/cpu.json")
  r.add_argument("--update", action="store_true", help="rewrite the baseline from this checkout")
  r.add_argument("--timing", action="store_true",
                 help="also measure CPU wall-clock ratios to each case's baseline (report only)")
  r.add_argument("--baseline", type=Path, default=None, help="baseline file (default bench/baseline/cpu.json)")
  r.add_argument("--no-progress", action="store_true")
  r.add_argument("--compiled", metavar="TARGET", default=None,
                 help="instead: the compile tier's gate for a target (or 'all'): compile with the "
                      "real compilers and compare with bench/results/compiled (= compile-check)")
  _add_selection(r)

  p = sub.add_parser("report", help="render the performance tables of docs/performance.md and "
                     "docs/benchmarks.md from bench/results/**.json, the compiled "
                     "tables of docs/compile_tier.md, the scale table of docs/scaling.md and the "
                     "quality and memory tables of docs/adam.md, the training tables of docs/training.md")
  p.add_argument("--results", type=Path, default=Path("bench/results"))
  p.add_argument("--root", type=Path, default=Path("."),
                 help="the checkout whose docs/ pages get the tables (default: here)")
  p.add_argument("--include-cpu", action="store_true", help="also render CPU results")
  p.add_argument("--print", action="store_true", help="print the markdown instead of editing the pages")
  c = sub.add_parser("compile-check",
                     help="compile every case with the real compilers for a target (no hardware) "
                          "and compare with bench/results/compiled/<target>.json")
  c.add_argument("--target", required=True,
                 help=f"a target of fuseopt.targets ({', '.join(targets.TARGETS)}) or 'all'")
  c.add_argument("--all", action="store_true", dest="full",
                 help="also every config of every search space (the full sweep)")
  c.add_argument("--update", action="store_true", help="write the fresh figures into the JSON")
  c.add_argument("--match", default=None, help="only cases whose id matches this regex")
  c.add_argument("--jobs", type=int, default=1, help="worker processes (one compile each)")
  c.add_argument("--no-baselines", action="store_true",
                 help="leave out optax's steps (the tests do: they do not move with fuseopt's code)")
  c.add_argument("--results", type=Path, default=Path("bench/results/compiled"))
  d = sub.add_parser("demo", help="train a small MLP with optax's and fuseopt's optimizers side by side")
  d.add_argument("--steps", type=int, default=300)
  return ap


def _demo_optimizers():
  import jax.numpy as jnp
  import optax

  import fuseopt.optim as fo
  return {
      "optax.adamw (fp32 moments)": lambda: optax.adamw(3e-3, weight_decay=1e-4),
      "optax.adamw (mu_dtype=bf16)": lambda: optax.adamw(3e-3, weight_decay=1e-4, mu_dtype=jnp.bfloat16),
      "fuseopt.optim.adamw (bf16 moments)": lambda: fo.adamw(3e-3, weight_decay=1e-4),
      "fuseopt.optim.muon": lambda: fo.muon(0.02),
  }


def cmd_demo(args, out=print) -> int:
  """Fits a 2-layer MLP to a random teacher with each optimizer: same data,
  same init; prints loss, optimizer-state bytes per parameter and step time."""
  import jax
  import jax.numpy as jnp
  import optax

  from fuseopt.benchmarks import core, workloads

  k = jax.random.split(jax.random.key(0), 4)
  teacher = {"w1": jax.random.normal(k[0], (32, 64)) / 32 ** 0.5, "w2": jax.random.normal(k[1], (64, 8)) / 8}
  x = jax.random.normal(k[2], (512, 32))
  y = jnp.tanh(x @ teacher["w1"]) @ teacher["w2"]
  init = {"w1": jax.random.normal(k[3], (32, 128)) / 32 ** 0.5, "b1": jnp.zeros((128,)),
          "w2": jnp.zeros((128, 8)), "b2": jnp.zeros((8,))}
  n = workloads.tree_params(init)

  def loss_fn(p):
    return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"] - y) ** 2)

  out(f"fuseopt demo: 2-layer MLP ({n} parameters) fitting a random teacher, {args.steps} steps, "
      f"{jax.devices()[0].device_kind}")
  out(f"{'optimizer':38s} {'loss@0':>9s} {'loss@end':>9s} {'state B/param':>14s} {'ms/step':>8s}")
  status = 0
  for name, make in _demo_optimizers().items():
    try:
      tx = make()
      state = tx.init(init)

      @jax.jit
      def step(p, s):
        loss, g = jax.value_and_grad(loss_fn)(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

      p, s = init, state
      first = None
      for _ in range(args.steps):
        p, s, loss = step(p, s)
        first = float(loss) if first is None else first
      final = float(loss_fn(p))
      ms = core.time_fn(step, (p, s), iters=5)["ms"]
      state_b = workloads.tree_bytes([a for a in jax.tree.leaves(state) if getattr(a, "ndim", 0) > 0])
      out(f"{name:38s} {first:9.4f} {final:9.4f} {state_b / n:14.1f} {ms:8.3f}")
    except Exception as e:  # noqa: BLE001 - one optimizer's failure must not hide the others
      out(f"{name:38s} failed: {type(e).__name__}: {str(e)[:80]}")
      status = 1
  return status


def _missing_bench_extra(*, plot: bool, progress: bool) -> list[str]:
  """The ``bench`` extra's packages this run would use and cannot import."""
  missing = []
  for name, wanted in (("matplotlib", plot), ("tqdm", progress)):
    if wanted:
      try:
        __import__(name)
      except ImportError:
        missing.append(name)
  return missing


def _emulate_cpu_mesh():
  """8 emulated CPU devices, for the sharded cases (the same as the tests'
  set-up); harmless on accelerators: only the CPU client reads it."""
  import jax
  try:
    jax.config.update("jax_num_cpu_devices", 8)
  except RuntimeError:  # a backend already started (e.g. tests calling this)
    pass


def cmd_bench(args, out=print) -> int:
  import jax

  _emulate_cpu_mesh()
  from fuseopt.benchmarks import ceiling, core, report
  from fuseopt.benchmarks.cases import all_cases

  platform = jax.default_backend()
  size = core.default_size(platform) if args.size == "auto" else args.size
  errors: dict[str, str] = {}
  cases = core.select_cases(all_cases(size, platform, args.ops, errors=errors), rows=args.rows)
  for op, msg in errors.items():
    out(f"warning: cases of {op!r} left out: {msg}")
  if not cases:
    out("no benchmark cases selected")
    return 1
  meta = core.run_meta(size)
  accel = platform in ("gpu", "tpu")
  # Accelerator results are committed (bench/results); CPU runs go to the
  # git-ignored bench/out.
  out_dir = args.out or Path("bench/results" if accel else "bench/out") / meta["device_slug"]
  json_path = out_dir / f"bench-{size}.json"
  iters = args.iters or (10 if accel else 5)
  out(f"fuseopt bench: {len(cases)} cases on {meta['device_kind']} ({platform}), size {size}")
  t0 = time.perf_counter()
  ceilings = ceiling.measure_ceilings(platform, quick=not accel or size == "quick")

  def save(case, new, rows):
    report.save_json(report.make_results(meta, ceilings, rows, errors), json_path)

  budget = args.budget_s if args.budget_s is not None else (None if accel else CPU_BUDGET_S)
  rows = core.run_suite(cases, ceilings, iters=iters, budget_s=budget,
                        progress=not args.no_progress, on_case=save)
  results = report.make_results(meta, ceilings, rows, errors)
  report.validate(results)
  report.save_json(results, json_path)
  out(report.format_header(results))
  out(report.format_table(rows))
  out("(* = the case's baseline; ratio = ms / baseline ms; floor = roofline floor / ms)")
  if any(c.op == "adam" for c in cases):
    from fuseopt.benchmarks import memory_report
    out("\nmemory by mode: parameters + optimizer state a parameter on the 1.2 B and 8.8 B trees, "
        "the fused step compiled (recorded figures), the largest model per chip "
        "(docs/adam.md, \"Memory by mode\"):")
    out(memory_report.markdown())
  out(f"saved {json_path}")
  missing = _missing_bench_extra(plot=not args.no_plot, progress=not args.no_progress)
  if not args.no_plot and "matplotlib" not in missing:
    for p in report.plot(results, out_dir):
      out(f"saved {p}")
  out(f"({time.perf_counter() - t0:.0f} s)")
  if missing:
    out(f"{' and '.join(missing)} not installed: for the plots (bench.png, scaling.png) and the progress bar, "
        "pip install 'fuseopt[bench]'")
  failed = [r for r in rows if "error" in r]
  bad = {f"{r['op']}/{r['case']}" for r in rows if core.check_passed(r.get("check")) is False}
  if failed:
    out(f"{len(failed)} variant(s) failed to run")
  if bad:
    out(f"correctness check FAILED for: {', '.join(sorted(bad))}")
  return 1 if (failed or bad) else 0


def cmd_regression(args, out=print) -> int:
  if args.compiled:
    import os
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from fuseopt import targets
    targets.report_ptxas()
    from fuseopt.benchmarks import compiled
    return compiled.main(args.compiled, update=args.update, out=out)
  _emulate_cpu_mesh()   # as in the tests, which compare with the same baseline
  from fuseopt.benchmarks import regression
  return regression.main(args.update, baseline_path=args.baseline, ops=args.ops, rows=args.rows,
                         timing=args.timing, progress=not args.no_progress, out=out)


def cmd_report(args, out=print) -> int:
  from fuseopt.benchmarks import report
  if args.print:
    out(report.markdown(report.find_results(args.results, include_cpu=args.include_cpu)))
    return 0
  from fuseopt.benchmarks import compiled
  docs = args.root / "docs"
  changed = report.render_summary(docs / "performance.md", args.results,
                                  include_cpu=args.include_cpu, full_page=docs / "benchmarks.md")
  out(f"{docs / 'performance.md'}, {docs / 'benchmarks.md'}: performance tables "
      f"{'updated' if changed else 'unchanged'}")
  from fuseopt.benchmarks import tpu_report
  changed = tpu_report.render_tpu(args.results, args.root / "README.md", docs / "benchmarks.md")
  out(f"README.md, {docs / 'benchmarks.md'}: TPU v5e rows {'updated' if changed else 'unchanged'}")
  tier_page = docs / "compile_tier.md"
  if tier_page.exists():
    changed = compiled.render_tables(tier_page, args.results / "compiled")
    if changed is not None:
      out(f"{tier_page}: compiled-figures tables {'updated' if changed else 'unchanged'}")
  from fuseopt.benchmarks import llo_figures
  kernels_page = docs / "kernels.md"
  if kernels_page.exists():
    changed = llo_figures.render(kernels_page, args.results / "compiled")
    if changed is not None:
      out(f"{kernels_page}: TPU bundles table {'updated' if changed else 'unchanged'}")
  from fuseopt.benchmarks import scale_report
  scaling = docs / "scaling.md"
  if scaling.exists():
    changed = scale_report.render(scaling, args.results / "compiled")
    if changed is not None:
      out(f"{scaling}: measured-at-scale table {'updated' if changed else 'unchanged'}")
  from fuseopt.benchmarks import quality_report
  adam_page = docs / "adam.md"
  if adam_page.exists():
    changed = quality_report.render(adam_page, args.results)
    if changed is not None:
      out(f"{adam_page}: quality tables {'updated' if changed else 'unchanged'}")
  from fuseopt.benchmarks import training_report
  training = args.root / "docs" / "training.md"
  if training.exists():
    changed = training_report.render(training, args.results, include_dry_run=args.include_cpu)
    if changed is not None:
      out(f"{training}: training tables {'updated' if changed else 'unchanged'}")
  from fuseopt.benchmarks import memory_report
  if adam_page.exists():
    changed = memory_report.render(adam_page, args.results / "compiled")
    if changed is not None:
      out(f"{adam_page}: memory table {'updated' if changed else 'unchanged'}")
  return 0


def cmd_compile_check(args, out=print) -> int:
  import os
  os.environ.setdefault("JAX_PLATFORMS", "cpu")   # compile for devices, run nothing on them
  from fuseopt import targets
  targets.report_ptxas()
  from fuseopt.benchmarks import compiled
  return compiled.main(args.target, full=args.full, update=args.update, match=args.match,
                       jobs=args.jobs, baselines=not args.no_baselines, root=args.results, out=out)


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  try:
    return {"bench": cmd_bench, "regression": cmd_regression, "report": cmd_report,
            "demo": cmd_demo, "compile-check": cmd_compile_check}[args.command](args)
  except ValueError as e:
    print(f"fuseopt {args.command}: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
