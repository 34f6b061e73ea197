"""The TPU v5e table of docs/benchmarks.md and the README's line on the TPU
run, from ``bench/results/tpu-v5-lite/suite.json`` (``bench/device_run.py``)
or, where that is absent, ``sweep.json`` (``bench/tpu_sweep.py``)
(``scripts/fuseopt report`` renders them; until one exists, both say the
run is pending)."""

from __future__ import annotations

import json
from pathlib import Path

from fuseopt.benchmarks.report import (_check, _label, _moves, _num, _stores, _vs, current_names,
                                       replace_between, validate)

TPU_SLUG = "tpu-v5-lite"          # core.device_slug("TPU v5 lite")
TPU_START, TPU_END = "<!-- tpu-table:start -->", "<!-- tpu-table:end -->"
TPU_STATUS_START, TPU_STATUS_END = "<!-- tpu-status:start -->", "<!-- tpu-status:end -->"
TPU_LINK = "docs/benchmarks.md#tpu-v5e"
TPU_PENDING = (f"TPU v5e: run pending (no `bench/results/{TPU_SLUG}/suite.json` yet; "
               "`bench/device_run.py` on the chip writes it)")


def tpu_results(results_root: Path | str) -> dict | None:
  """The TPU v5e suite (``<root>/tpu-v5-lite/suite.json``), or None where
  there is none (or it does not validate)."""
  path = Path(results_root) / TPU_SLUG / "suite.json"
  try:
    res = json.loads(path.read_text())
    validate(res)
  except (OSError, ValueError):
    return None
  res["_path"] = str(path)
  return res


def _optax_rows(rows: list[dict]) -> list[dict]:
  return sorted((r for r in rows if r["variant"].startswith("optax") and "ms" in r), key=lambda r: r["ms"])


def _pct(v) -> str:
  return f"{100 * v:.0f}%" if v else "-"


def tpu_markdown(res: dict | None) -> str:
  """The TPU v5e table: per case the default calls first, then fuseopt's
  other timed rows, then optax's rows, each fuseopt row against optax's
  baseline (fp32 AdamW / fp32 Muon) and its fastest row of the same run;
  ms, B/param stored and moved, % of the spec-bandwidth floor (the row's
  own bytes at the device's spec bandwidth) and of the measured copy
  ceiling's, compile time; rows that failed or timed out compiling say so."""
  if res is None:
    return f"_{TPU_PENDING}._\n"
  m, c = res["meta"], res["ceilings"]
  tree = m.get("tree") or {}
  parts = [f"**{m['device_kind']}** — jax {m['jax']}, {m.get('time_utc', '')[:10]}, "
           f"tree `{tree.get('name', '?')}` ({tree.get('layers', '?')} layers, "
           f"{tree.get('params', 0):,} params{'' if tree.get('full_tree', True) else ': the 1.2 B tree does not fit'}); "
           f"spec bandwidth {c.get('spec_gbps', 0):.0f} GB/s, measured copy ceiling "
           f"{c.get('copy_gbps', 0):.0f} GB/s; compile budget {m.get('compile_budget_s')} s "
           f"(`{res.get('_path', '')}`)", "",
           "| op | case | row | ms | vs optax baseline | vs fastest optax | stores B/param | moves B/param "
           "| % of spec floor | % of copy-ceiling floor | compile s | check |",
           "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
  cases: dict[tuple[str, str], list[dict]] = {}
  for r in current_names(res)["rows"]:
    cases.setdefault((r["op"], r["case"]), []).append(r)
  for (op, case), rows in cases.items():
    if not any(r["variant"].startswith("optax") or r.get("is_default") for r in rows):
      continue
    optax = _optax_rows(rows)
    base = next((r for r in rows if r.get("is_baseline") and "ms" in r), None)
    ours = [r for r in rows if not r["variant"].startswith("optax")]
    ordered = ([r for r in ours if r.get("is_default")] + [r for r in ours if not r.get("is_default")]
               + [r for r in rows if r["variant"].startswith("optax")])
    for r in ordered:
      label = _label(r, "default" if r.get("is_default") else "")
      if "ms" not in r:
        why = "compile timeout" if r.get("status") == "compile_timeout" else (
            f"same program as `{r['same_program_as']}`" if r.get("same_program_as") else
            (r.get("error") or f"skipped ({r.get('skipped')})")[:80])
        parts.append(f"| {op} | {case} | {label} | {why} | | | {_stores(r)} | {_moves(r)} | | | "
                     f"{_num(r.get('compile_s'), '.1f')} | |")
        continue
      is_optax = r["variant"].startswith("optax")
      vs_base = "-" if base is None or r is base else _vs(r, base).replace("best peer", "-")
      vs_best = "-" if is_optax or not optax else _vs(r, optax[0]).replace("best peer", "-")
      parts.append(f"| {op} | {case} | {label} | {r['ms']:.3f} | {vs_base} | {vs_best} | {_stores(r)} | "
                   f"{_moves(r)} | {_pct(r.get('fraction_of_spec_floor'))} | {_pct(r.get('fraction_of_floor'))} | "
                   f"{_num(r.get('compile_s'), '.1f')} | {_check(r)} |")
  return "\n".join(parts).rstrip() + "\n"


def tpu_status(res: dict | None) -> str:
  """The README's line on the TPU run: pending, or the default calls' ms
  against optax's baseline, with a link to the table."""
  if res is None:
    return f"{TPU_PENDING}.\n"
  bits = []
  for r in current_names(res)["rows"]:
    if r.get("is_default") and "ms" in r and r.get("ratio_to_baseline"):
      bits.append(f"`{r['variant']}` ({r['op']}) {r['ms']:.1f} ms, {_vs(r, {'ms': r['baseline_ms']})} "
                  f"than optax")
  tree = res["meta"].get("tree") or {}
  return (f"Measured on a TPU v5e ({res['meta'].get('time_utc', '')[:10]}, tree `{tree.get('name', '?')}`): "
          + ("; ".join(bits) or "no default call timed") + f" ([table]({TPU_LINK})).\n")


# The sweep's rows a user meets, in the table's order: (row name, what the
# user calls, the row it is compared with).
SWEEP_ROWS = (
    ("optax_adamw", "`optax.adamw` fp32", None),
    ("optax_adamw_mu_bf16", "`optax.adamw(mu_dtype=bf16)`", "optax_adamw"),
    ("fo_step", "**`fo.step(fo.adamw(...))`** (default)", "optax_adamw"),
    ("fo_dropin", "**`fo.adamw` drop-in** (`update` + `optax.apply_updates`)", "optax_adamw"),
    ("fo_step[xla]", "`fo.step`, `Execution(implementation=\"xla\")` (XLA's fusion)", "optax_adamw"),
    ("fo_step_int8", "**`moment_dtype=\"int8\"`**", "fo_step"),
    ("fo_step_int4", "**`moment_dtype=\"int4\"`**", "fo_step_int8"),
    ("optax_adamw_bf16_params", "`optax.adamw` on bf16 params", None),
    ("fo_step_bf16_params", "**`fo.step` on bf16 params**", "optax_adamw_bf16_params"),
    ("optax_contrib_muon", "`optax.contrib.muon`", None),
    ("fo_muon_step", "**`fo.step(fo.muon(...))`**, donated", "optax_contrib_muon"),
    ("fo_muon_dropin", "**`fo.muon` drop-in**", "optax_contrib_muon"),
    ("fo_muon_step[xla]", "`fo.step(fo.muon)`, `implementation=\"xla\"`", "optax_contrib_muon"),
)


def sweep_results(results_root: Path | str) -> dict | None:
  path = Path(results_root) / TPU_SLUG / "sweep.json"
  try:
    doc = json.loads(path.read_text())
  except (OSError, ValueError):
    return None
  doc["_path"] = str(path)
  return doc


def sweep_markdown(doc: dict) -> str:
  """The sweep's steps (ms, B/param moved, % of the spec-bandwidth floor,
  the ratio to the row it answers, compile time), then stochastic rounding
  and Newton–Schulz per shape."""
  m = doc["meta"]
  rows = {r["name"]: r for r in doc["rows"] if r.get("status") == "ok"}
  out = [f"**{m['device_kind']}**: jax {m['jax']}, Python {m['python']}; {m.get('tree', '')}; median of 10 "
         f"jitted steps, params and state donated, each step's outputs the next one's inputs; floor = "
         f"bytes moved / {m.get('floor_gbs', 819):.0f} GB/s (`{doc.get('_path', '')}`, "
         f"`bench/tpu_sweep.py`).", "",
         "| what a user runs | ms | B/param moved | % of floor | vs | compile s |",
         "| --- | ---: | ---: | ---: | --- | ---: |"]
  for name, label, against in SWEEP_ROWS:
    r = rows.get(name)
    if r is None:
      continue
    vs = ""
    if against in rows:
      vs = f"{r['ms'] / rows[against]['ms']:.2f} × {against}"
    moved = f"{r['bytes'] / r['params']:.2f}" if r.get("bytes") else "-"
    pct = f"{r['pct_floor']:.0f} %" if r.get("pct_floor") else "-"
    out.append(f"| {label} | {r['ms']:.2f} | {moved} | {pct} | {vs} | {r['compile_s']:.1f} |")
  sr = [r for r in doc["rows"] if r["part"] == "sr" and r.get("status") == "ok"]
  if sr:
    out += ["", "Stochastic rounding, 2^28 fp32 elements (6 B each):", "",
            "| path | ms | % of floor |", "| --- | ---: | ---: |"]
    out += [f"| {r['name']} | {r['ms']:.2f} | {r['pct_floor']:.0f} % |" for r in sr]
  ns = [r for r in doc["rows"] if r["part"] == "ns" and r.get("status") == "ok"]
  if ns:
    out += ["", "Newton–Schulz, 5 steps, bf16 (TFLOP/s at the standard count; `default` as measured, "
            "before the Gram iteration moved to XLA's matmuls on a TPU: today's default is the "
            "`xla,gram` row where the aspect ratio is ≥ 2, else `xla`):", "",
            "| shape | variant | ms | TFLOP/s |", "| --- | --- | ---: | ---: |"]
    out += [f"| {'x'.join(map(str, r['shape']))} | {r['variant']} | {r['ms']:.2f} | {r['tflops']:.0f} |"
            for r in ns]
  checks = [r for r in doc["rows"] if r["part"] == "check"]
  if checks:
    bad = [r["name"] for r in checks if r.get("status") != "ok"]
    out += ["", f"On-chip checks against the reference (two steps, codes and scales equal, "
            f"parameters to the ulp): {len(checks) - len(bad)} of {len(checks)} ok"
            + (f"; not ok: {', '.join(bad)}" if bad else "") + "."]
  return "\n".join(out) + "\n"


def sweep_status(doc: dict) -> str:
  rows = {r["name"]: r for r in doc["rows"] if r.get("status") == "ok"}
  bits = []
  for name, label, against in (("fo_step", "`fo.step(fo.adamw)`", "optax_adamw"),
                               ("fo_dropin", "the drop-in", "optax_adamw"),
                               ("fo_muon_step", "`fo.step(fo.muon)`", "optax_contrib_muon")):
    if name in rows and against in rows:
      bits.append(f"{label} {rows[name]['ms']:.1f} ms ({rows[name]['ms'] / rows[against]['ms']:.2f} × "
                  f"optax)")
  return (f"Measured on a TPU v5e (jax {doc['meta']['jax']}, 533 M-parameter Llama tree): "
          + "; ".join(bits) + f" ([table]({TPU_LINK})).\n")


def render_tpu(results_root: Path | str, readme: Path | str | None = None,
               page: Path | str | None = None) -> bool:
  """Replaces the TPU markers' text in ``readme`` (a status line) and
  ``page`` (docs/benchmarks.md: the table), where the markers exist."""
  res = tpu_results(results_root)
  sweep = sweep_results(results_root) if res is None else None
  status = sweep_status(sweep) if sweep is not None else tpu_status(res)
  table = sweep_markdown(sweep) if sweep is not None else tpu_markdown(res)
  changed = False
  for path, start, end, body in ((readme, TPU_STATUS_START, TPU_STATUS_END, status),
                                 (page, TPU_START, TPU_END, table)):
    if path is not None and Path(path).exists() and start in Path(path).read_text():
      changed |= replace_between(path, start, end, body)
  return changed
