"""The compile tier: fuseopt compiled by the real compilers, without hardware.

Lowering is not compiling: a kernel that lowers for a TPU can still be
rejected by libtpu's Mosaic compiler, and a Triton kernel by ptxas. Each
case (:mod:`fuseopt.benchmarks.compile_cases`) is compiled for a target of
:mod:`fuseopt.targets` by the compiler that target's device would run, on a
CPU-only machine (:mod:`fuseopt.benchmarks.compile_harness`, which lists the
figures read off the compiled program), and its figures are held against the
committed ones (:mod:`fuseopt.benchmarks.compile_results`).

This module runs that (``fuseopt compile-check``: :func:`run`, :func:`main`)
and renders the committed figures into docs/compile_tier.md's tables
(:func:`render_tables`).
"""

from __future__ import annotations

import json
import os
import re
import traceback
from pathlib import Path
from typing import Any

from fuseopt import targets as targets_lib
from fuseopt.benchmarks.compile_cases import KINDS, Case, cases
from fuseopt.benchmarks.compile_harness import CompileFailure, compile_case, fuseopt_spills
from fuseopt.benchmarks.compile_results import RESULTS_DIR, compare, load, versions_match, write


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

# (row label, fuseopt case suffix, optax case suffix) for docs/compile_tier.md's table.
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


def gb(v) -> str:
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
    return "does not fit" + (f" ({gb(want)})" if want else "")
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
                else f"XLA + ptxas (nvcc {env.get('nvidia-cuda-nvcc') or env.get('nvidia-cuda-nvcc-cu12', '?')})")
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
      theirs_temp = gb(b.get("temp_bytes")) if "error" not in b else why_failed(b["error"])
      out.append(f"| {label} | {gb(a.get('temp_bytes'))} | {theirs_temp} | "
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
      if not fresh:   # no case selected (v5p's CI cases: none): no empty file
        out(f"{name}: no cases selected, nothing written")
        continue
      path = write(name, keep, root)
      lost = len(fresh) - len(keep)
      out(f"{path}: {len(keep)} cases written" + (f" ({lost} failed, not written)" if lost else ""))
  return 1 if bad else 0
