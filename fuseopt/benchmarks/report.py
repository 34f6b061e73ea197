"""Benchmark reports: the console table, the results JSON, PNG plots and the
performance tables (the summary of docs/performance.md, every row in
docs/benchmarks.md).

Results JSON (``SCHEMA``)::

  {"schema": "fuseopt-bench/1",
   "meta": {"device_kind", "device_slug", "platform", "size", "jax", "time_utc", ...},
   "ceilings": {"copy_gbps", "matmul_tflops", ...},
   "rows": [{"op", "case", "variant", "is_baseline", "ms", "baseline_ms",
             "ratio_to_baseline", "floor_ms", "fraction_of_floor", "gbps" | "tflops",
             "temp_bytes", "argument_bytes", "output_bytes", "state_bytes_per_param",
             "check", "error" | "skipped", ...}],
   "module_errors": {op: message}}
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Iterable

SCHEMA = "fuseopt-bench/1"
ROW_REQUIRED = ("op", "case", "variant", "is_baseline")
PERF_START = "<!-- perf-table:start -->"
PERF_END = "<!-- perf-table:end -->"


def make_results(meta: dict, ceilings: dict, rows: list[dict], module_errors: dict | None = None) -> dict:
  return {"schema": SCHEMA, "meta": meta, "ceilings": ceilings, "rows": rows,
          "module_errors": module_errors or {}}


def validate(results: dict) -> None:
  """Raises ValueError naming what is wrong with a results dict."""
  if results.get("schema") != SCHEMA:
    raise ValueError(f"results: schema must be {SCHEMA!r}, got {results.get('schema')!r}")
  for key in ("meta", "ceilings", "rows"):
    if key not in results:
      raise ValueError(f"results: missing {key!r}")
  for key in ("device_kind", "platform", "size", "jax"):
    if key not in results["meta"]:
      raise ValueError(f"results['meta']: missing {key!r}")
  for i, r in enumerate(results["rows"]):
    for key in ROW_REQUIRED:
      if key not in r:
        raise ValueError(f"results['rows'][{i}]: missing {key!r}")
    if "error" not in r and "skipped" not in r:
      if not (isinstance(r.get("ms"), (int, float)) and r["ms"] > 0):
        raise ValueError(f"results['rows'][{i}] ({r['op']}/{r['case']}/{r['variant']}): ms must be > 0")


def save_json(results: dict, path: Path | str) -> Path:
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(results, indent=1, default=_default) + "\n")
  return path


def _default(o):
  try:
    return float(o)
  except Exception:  # noqa: BLE001
    return repr(o)


# ------------------------------------------------------------------ console

def fmt_bytes(v) -> str:
  if v is None:
    return "-"
  for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if abs(v) >= div:
      return f"{v / div:.1f} {unit}"
  return f"{int(v)} B"


def _num(v, spec=".3f", none="-"):
  return none if v is None else format(v, spec)


def throughput(r: dict) -> str:
  if r.get("tflops") is not None and r.get("flops"):
    return f"{r['tflops']:.3g} TFLOP/s"
  if r.get("gbps") is not None:
    return f"{r['gbps']:.4g} GB/s"
  return "-"


def _check(r: dict) -> str:
  from fuseopt.benchmarks.core import check_passed
  ok = check_passed(r.get("check"))
  return {True: "ok", False: "FAIL", None: ""}[ok]


def table_rows(rows: Iterable[dict]) -> list[list[str]]:
  out = []
  for r in rows:
    if "error" in r or "skipped" in r:
      why = r.get("error") or f"skipped ({r['skipped']})"
      out.append([r["op"], r["case"], r["variant"], why[:60]] + [""] * 7)
      continue
    out.append([
        r["op"], r["case"],
        r["variant"] + (" *" if r.get("is_baseline") else "") + (" (default)" if r.get("is_default") else ""),
        _num(r.get("ms")), _num(r.get("baseline_ms")), _num(r.get("ratio_to_baseline"), ".2f"),
        _num(r.get("fraction_of_floor") and 100 * r["fraction_of_floor"], ".0f") +
        ("%" if r.get("fraction_of_floor") else ""),
        throughput(r), fmt_bytes(r.get("temp_bytes")),
        _num(r.get("state_bytes_per_param"), ".1f"), _check(r),
    ])
  return out


HEADER = ["op", "case", "variant", "ms", "base ms", "ratio", "floor", "throughput", "temp", "state B/p", "check"]


def format_table(rows: Iterable[dict]) -> str:
  """Plain-text table (``*`` marks each case's baseline variant; ratio =
  ms / baseline ms, lower is better; floor = roofline floor / ms)."""
  body = table_rows(rows)
  widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(HEADER)]
  line = lambda cells: "  ".join(c.ljust(w) if i < 3 else c.rjust(w)  # noqa: E731
                                 for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
  return "\n".join([line(HEADER), line(["-" * w for w in widths])] + [line(b) for b in body])


def format_header(results: dict) -> str:
  m, c = results["meta"], results["ceilings"]
  return (f"fuseopt bench: {m['device_kind']} ({m['platform']}), size {m['size']}, jax {m['jax']}; "
          f"ceilings: copy {c.get('copy_gbps', 0):.0f} GB/s, bf16 matmul {c.get('matmul_tflops', 0):.1f} TFLOP/s")


# ------------------------------------------------------------------ plots

def _matrix_elems(name: str) -> int | None:
  if re.fullmatch(r"\d+(x\d+)+", name):
    dims = [int(x) for x in name.split("x")]
    return math.prod(dims)
  return None


def _compact(v: float) -> str:
  for div, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
    if abs(v) >= div:
      return f"{v / div:g}{suffix}"
  return f"{v:g}"


def _plain_log_ticks(*axes):
  # Log axes label minor ticks as "3×10^0" by default, which overlap.
  from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
  for a in axes:
    a.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    a.set_major_formatter(FuncFormatter(lambda v, _: _compact(v)))
    a.set_minor_formatter(NullFormatter())


def plot(results: dict, out_dir: Path | str) -> list[Path]:
  """Writes ``bench.png`` (per case: best fuseopt variant, baseline and the
  roofline floor, log time) and ``scaling.png`` (time against parameter
  count and against matrix elements, one line per op/variant)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  out_dir = Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  rows = [r for r in results["rows"] if "ms" in r and "error" not in r]
  title = f"{results['meta']['device_kind']} · size {results['meta']['size']} · jax {results['meta']['jax']}"
  paths = []

  cases: dict[str, dict[str, Any]] = {}
  for r in rows:
    c = cases.setdefault(f"{r['op']}/{r['case']}", {"fuseopt": None, "baseline": None, "floor": None})
    if r.get("is_baseline"):
      c["baseline"] = (r["variant"], r["ms"])
    elif r["variant"].startswith("fuseopt") and (c["fuseopt"] is None or r["ms"] < c["fuseopt"][1]):
      c["fuseopt"] = (r["variant"], r["ms"])
    if r.get("floor_ms"):
      c["floor"] = r["floor_ms"]
  names = list(cases)
  # A dot plot: times span orders of magnitude, and bars on a log axis
  # would make their (arbitrary) left end look meaningful.
  fig, ax = plt.subplots(figsize=(9, 0.4 * len(names) + 1.6))
  plotted = 0
  for key, color, marker, label in (("floor", "tab:gray", "|", "roofline floor"),
                                    ("baseline", "tab:orange", "s", "baseline"),
                                    ("fuseopt", "tab:blue", "o", "fuseopt (best variant)")):
    ys, xs = [], []
    for i, n in enumerate(names):
      v = cases[n][key]
      v = v[1] if isinstance(v, tuple) else v
      if v:
        ys.append(i)
        xs.append(v)
    ax.scatter(xs, ys, color=color, marker=marker, s=90 if marker == "|" else 40, label=label, zorder=3)
    plotted += len(xs)
  for i, n in enumerate(names):
    vals = [v[1] if isinstance(v, tuple) else v for v in cases[n].values() if v]
    if vals:
      ax.plot([min(vals), max(vals)], [i, i], color="lightgray", lw=1, zorder=1)
  ax.set_yticks(range(len(names)), names)
  ax.set_ylim(max(len(names), 1) - 0.5, -0.5)
  if not names:
    ax.text(0.5, 0.5, "no timed rows", ha="center", va="center", transform=ax.transAxes)
  if plotted:
    ax.set_xscale("log")
    _plain_log_ticks(ax.xaxis)
  ax.grid(True, axis="x", which="both", alpha=0.3)
  ax.set_xlabel("ms per call (log)")
  ax.set_title(title, fontsize=9)
  ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
  fig.tight_layout()
  p = out_dir / "bench.png"
  fig.savefig(p, dpi=110)
  plt.close(fig)
  paths.append(p)

  fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
  series_p: dict[str, list] = {}
  series_m: dict[str, list] = {}
  for r in rows:
    key = f"{r['op']}: {r['variant']}"
    if r.get("params"):
      series_p.setdefault(key, []).append((r["params"], r["ms"]))
    me = _matrix_elems(r["case"])
    if me is not None:
      stacked = " (stacked)" if r["case"].count("x") >= 2 else ""
      series_m.setdefault(key + stacked, []).append((me, r["ms"]))
  for ax_, series, xl in ((a1, series_p, "parameters"), (a2, series_m, "matrix elements (m·n, × batch)")):
    for key, pts in sorted(series.items()):
      pts.sort()
      ax_.plot([p_[0] for p_ in pts], [p_[1] for p_ in pts], marker="o", label=key)
    if series:
      ax_.set_xscale("log")
      ax_.set_yscale("log")
      _plain_log_ticks(ax_.xaxis, ax_.yaxis)
      ax_.legend(fontsize=6)
    else:
      ax_.text(0.5, 0.5, "no rows", ha="center", va="center", transform=ax_.transAxes)
    ax_.set_xlabel(xl)
    ax_.set_ylabel("ms")
    ax_.grid(True, which="both", alpha=0.3)
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  p = out_dir / "scaling.png"
  fig.savefig(p, dpi=110)
  plt.close(fig)
  paths.append(p)
  return paths


# ------------------------------------------------------------------ the pages

def find_results(root: Path | str, *, include_cpu: bool = False) -> list[dict]:
  """The newest valid results JSON of each device directory under ``root``
  (``bench/results/<device-slug>/**.json``), ordered by device."""
  root = Path(root)
  best: dict[str, tuple[str, dict]] = {}
  for p in sorted(root.glob("**/*.json")):
    try:
      data = json.loads(p.read_text())
      validate(data)
    except (ValueError, json.JSONDecodeError):
      continue
    if data["meta"]["platform"] == "cpu" and not include_cpu:
      continue
    dev = data["meta"].get("device_slug") or data["meta"]["device_kind"]
    stamp = data["meta"].get("time_utc", "")
    if dev not in best or stamp >= best[dev][0]:
      data["_path"] = str(p)
      best[dev] = (stamp, data)
  return [best[k][1] for k in sorted(best)]


# Suites written before rows said which one is the default call (no
# ``is_default`` in any row: the 2026-12-04 H200 suite,
# bench/results/nvidia-h200/suite.json) are read with their labels mapped to
# today's names; the measured numbers are not touched, and each mapped row
# keeps its label in the file as ``label_in_file``. In those files
# 'fuseopt_step' passed ``group=False`` (one launch per leaf) and
# 'fuseopt_step[grouped]' ``group=True``, which was ``fo.step``'s default
# when the rows were timed: the grouped rows are the default call's program
# of that day, hence today's untagged names, and the per-leaf rows today's
# ``[per_leaf]``. 'fuseopt_muon[gram]' passed ``ns_coeffs="jordan"`` (the
# schedule name, whose Gram restarts differ from the default table's) beside
# ``gram="auto"``: today's ``[gram,jordan]``. 'fuseopt[triton]' passed
# ``implementation="triton"``, the GPU's default backend that day: today's
# untagged 'fuseopt'. 'fuseopt_muon' (Jordan's coefficients, which without
# Gram NS is the default table's program) ran what the default call ran.
LEGACY_NAMES = {  # (op, label in the file) -> today's label
    ("stochastic_round", "fuseopt[triton]"): "fuseopt",
    ("adam", "fuseopt_step"): "fuseopt_step[per_leaf]",
    ("adam", "fuseopt_step[grouped]"): "fuseopt_step",
    ("adam", "fuseopt_step[int8]"): "fuseopt_step[int8,per_leaf]",
    ("adam", "fuseopt_step[int8,grouped]"): "fuseopt_step[int8]",
    ("step", "fuseopt_step"): "fuseopt_step[per_leaf]",
    ("muon", "fuseopt_muon[gram]"): "fuseopt_muon[gram,jordan]",
    # The Muon family's AdamW side kept fp32 moments by default then; bf16 since.
    ("muon", "fuseopt_muon"): "fuseopt_muon[fp32_adam]",
    ("muon", "fuseopt_muon[bf16_adam]"): "fuseopt_muon",
}
LEGACY_DEFAULTS = {  # (op, today's label): the rows that ran the default call's program then
    ("stochastic_round", "fuseopt"), ("adam", "fuseopt_step"),
    ("adam", "fuseopt_step[int8]"), ("muon", "fuseopt_muon"),
}
LEGACY_NOTE = ("written before rows named their default call: labels mapped to today's names "
               "(report.LEGACY_NAMES; the label in the file in brackets), the default call being "
               "`fo.step`'s then, grouped launches")


def is_legacy(res: dict) -> bool:
  return bool(res["rows"]) and not any("is_default" in r for r in res["rows"])


def current_names(res: dict) -> dict:
  """``res`` with a legacy suite's labels mapped (:data:`LEGACY_NAMES`) and
  its default rows marked (``_legacy``: how many labels were mapped); a
  current suite unchanged."""
  if not is_legacy(res):
    return res
  rows = []
  for r in res["rows"]:
    r = dict(r)
    new = LEGACY_NAMES.get((r["op"], r["variant"]))
    if new is not None:
      r["label_in_file"], r["variant"] = r["variant"], new
    r["is_default"] = (r["op"], r["variant"]) in LEGACY_DEFAULTS
    if r["op"] in ("adam", "muon", "step") and r.get("state_bytes_per_param") is not None:
      # What the rows stored: params (fp32, bf16 for fuseopt's rows of the
      # bf16-params case) + the state measured.
      bf16 = r["case"].endswith("_bf16_params") and r["variant"].startswith("fuseopt")
      r.setdefault("stored_bytes_per_param", (2 if bf16 else 4) + r["state_bytes_per_param"])
    if r["op"] == "stochastic_round":
      r.setdefault("moved_bytes_per_param", 6)  # fp32 read, bf16 written, per element
    if r["variant"] in ("torch_adamw_fused", "torch_adamw_foreach"):
      r.setdefault("moved_bytes_per_param", 28)  # fp32 p, g, moments read; p, moments written
    rows.append(r)
  return {**res, "rows": rows, "_legacy": sum("label_in_file" in r for r in rows)}


def _is_peer(r: dict) -> bool:
  return not r["variant"].startswith("fuseopt")


def _tags(label: str) -> tuple[str, tuple[str, ...]]:
  """``"fuseopt_step[int8,group]"`` -> ``("fuseopt_step", ("int8", "group"))``."""
  m = re.fullmatch(r"([^\[]*)(?:\[(.*)\])?", label)
  return m.group(1), tuple(t for t in (m.group(2) or "").split(",") if t)


def case_views(res: dict) -> list[dict]:
  """Per case, in the suite's order: ``defaults`` (the default calls' rows,
  each with its ``variants``: the fuseopt rows whose tags extend the
  default's, e.g. ``fuseopt_step[int8,group]`` under ``fuseopt_step[int8]``;
  rows of no default's format go under the first), ``orphans`` (fuseopt
  rows of a case with no default row), ``peers`` (every other row, fastest
  first) and ``best_peer``. Rows timed, or recorded as the same program as
  another row (``same_program_as``); errors and skipped rows are left out."""
  res = current_names(res)
  cases: dict[tuple[str, str], list[dict]] = {}
  for r in res["rows"]:
    if ("ms" in r and "error" not in r) or r.get("same_program_as"):
      cases.setdefault((r["op"], r["case"]), []).append(r)
  out = []
  for (op, case), rows in cases.items():
    peers = sorted((r for r in rows if _is_peer(r) and "ms" in r), key=lambda r: r["ms"])
    defaults = [{"row": r, "variants": []} for r in rows if r.get("is_default") and "ms" in r]
    orphans = []
    for r in rows:
      if _is_peer(r) or any(d["row"] is r for d in defaults):
        continue
      name, tags = _tags(r["variant"])
      home = [d for d in defaults if _tags(d["row"]["variant"])[0] == name
              and set(_tags(d["row"]["variant"])[1]) <= set(tags)]
      if home:
        max(home, key=lambda d: len(_tags(d["row"]["variant"])[1]))["variants"].append(r)
      elif defaults:
        defaults[0]["variants"].append(r)
      else:
        orphans.append(r)
    for d in defaults:  # the default's own tags first (its launch layouts), then other calls
      d["variants"].sort(key=lambda r: _tags(r["variant"])[0] != _tags(d["row"]["variant"])[0])
    out.append({"op": op, "case": case, "defaults": defaults, "orphans": orphans, "peers": peers,
                "best_peer": peers[0] if peers else None})
  return out


NO_DEFAULT = "no row of this run is the default call"


def _vs(r: dict, best: dict | None) -> str:
  """``r``'s time against the best peer's, in words."""
  if r.get("same_program_as"):
    return "-"
  if best is None:
    return "-"
  if r is best:
    return "best peer"
  ratio = r["ms"] / best["ms"]
  return f"{1 / ratio:.2f}× faster" if ratio <= 1 else f"{ratio:.2f}× slower"


def _floor(r: dict) -> str:
  return f"{100 * r['fraction_of_floor']:.0f}%" if r.get("fraction_of_floor") else "-"


def _stores(r: dict) -> str:
  return _num(r.get("stored_bytes_per_param"), ".2f").removesuffix("0").removesuffix(".0")


def _moves(r: dict) -> str:
  v = r.get("moved_bytes_per_param")
  if v is None:
    v = (r.get("check") or {}).get(f"bytes_per_param[{r.get('label_in_file', r['variant'])}]")
  return _num(v, ".2f").removesuffix("0").removesuffix(".0")


def _label(r: dict, role: str = "") -> str:
  text = f"`{r['variant']}`"
  if r.get("label_in_file"):
    text += f" (`{r['label_in_file']}`)"
  if role == "default":
    text = f"**{text}** default"
  elif role == "best peer":
    text = f"best peer {text}"
  if r.get("same_program_as"):
    text += f" = `{r['same_program_as']}`"
  return text


def _ordered(view: dict, every_peer: bool) -> list[tuple[dict, str]]:
  """(row, role) in the rendering order: each default row, then its
  variants; fuseopt rows of a case without a default row; the peers (the
  best alone unless ``every_peer``)."""
  out = []
  for d in view["defaults"]:
    out.append((d["row"], "default"))
    out += [(r, "variant") for r in d["variants"]]
  out += [(r, "variant") for r in view["orphans"]]
  peers = view["peers"] if every_peer else view["peers"][:1]
  out += [(r, "best peer" if r is view["best_peer"] else "peer") for r in peers]
  return out


def _runs_note(res: dict) -> str:
  runs = res["meta"].get("merged_from") or []
  if not runs:
    return ""
  parts = [f"{r.get('time_utc', '?')[11:16]} UTC: {r.get('ops', '?')}" for r in runs]
  return f"; rows of {len(runs)} runs that day, merged ({'; '.join(parts)})"


def markdown(results_list: list[dict]) -> str:
  """Every row of the newest run on each device, default-first: per case
  each default call's row, its tagged variants, then the peers, every
  ratio against the fastest peer measured in the same run."""
  if not results_list:
    return ("_No hardware results yet: fuseopt has not yet been measured on a GPU or TPU. Run "
            "`python bench/gpu_suite.py bench/results` on one, commit the JSON, then `scripts/fuseopt report`._\n")
  parts = []
  for res in results_list:
    res = current_names(res)
    m, c = res["meta"], res["ceilings"]
    parts.append(f"**{m['device_kind']}** — jax {m['jax']}, size {m['size']}, {m.get('time_utc', '')[:10]}; "
                 f"measured ceilings: copy {c.get('copy_gbps', 0):.0f} GB/s, "
                 f"bf16 matmul {c.get('matmul_tflops', 0):.3g} TFLOP/s"
                 + (f" (`{res['_path']}`)" if res.get("_path") else "") + _runs_note(res)
                 + (f"; {LEGACY_NOTE}" if res.get("_legacy") else ""))
    parts.append("")
    parts.append("| op | case | row | ms | % of floor | vs best peer | throughput | temp memory "
                 "| stores B/param | moves B/param | check |")
    parts.append("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for view in case_views(res):
      if not view["defaults"]:
        parts.append(f"| {view['op']} | {view['case']} | {NO_DEFAULT} | | | | | | | | |")
      for r, role in _ordered(view, every_peer=True):
        same = bool(r.get("same_program_as"))
        parts.append(
            f"| {view['op']} | {view['case']} | {_label(r, role)} | "
            f"{'-' if same else format(r['ms'], '.3f')} | {'-' if same else _floor(r)} | "
            f"{_vs(r, view['best_peer'])} | {'-' if same else throughput(r)} | "
            f"{'-' if same else fmt_bytes(r.get('temp_bytes'))} | {_stores(r)} | {_moves(r)} | "
            f"{'' if same else _check(r)} |")
    parts.append("")
  return "\n".join(parts).rstrip() + "\n"


def summary_markdown(results_list: list[dict]) -> str:
  """The front page's table, one per device: per case each default call's
  row first (ms, % of the floor, ratio to the fastest peer of the same
  run), its tagged variants, then that fastest peer."""
  if not results_list:
    return markdown([])
  parts = []
  for res in results_list:
    res = current_names(res)
    m = res["meta"]
    parts.append(f"{m['device_kind']}: jax {m['jax']}, {m.get('time_utc', '')[:10]}"
                 + (f" (`{res['_path']}`)" if res.get("_path") else "")
                 + (f", rows of {len(m['merged_from'])} runs that day" if m.get("merged_from") else "")
                 + (", labels mapped to today's names (the label in the file in brackets)"
                    if res.get("_legacy") else "")
                 + ". Every row and peer: [benchmarks.md](benchmarks.md#measured-on-hardware).")
    parts += ["", "| op | case | row | ms | % of floor | vs best peer | stores B/param | moves B/param |",
              "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for view in case_views(res):
      if not view["defaults"]:
        parts.append(f"| {view['op']} | {view['case']} | {NO_DEFAULT} | | | | | |")
      for r, role in _ordered(view, every_peer=False):
        same = bool(r.get("same_program_as"))
        parts.append(f"| {view['op']} | {view['case']} | {_label(r, role)} | "
                     f"{'-' if same else format(r['ms'], '.3f')} | {'-' if same else _floor(r)} | "
                     f"{_vs(r, view['best_peer'])} | {_stores(r)} | {_moves(r)} |")
    parts.append("")
  return "\n".join(parts).rstrip() + "\n"


def replace_between(path: Path | str, start_marker: str, end_marker: str, body: str) -> bool:
  """Replaces the text between two marker lines of ``path`` with ``body``.
  Returns whether the file changed."""
  path = Path(path)
  text = path.read_text()
  # Markers count only on lines of their own (prose may quote them).
  start = re.search(rf"^{re.escape(start_marker)}[ \t]*\n", text, re.M)
  end = re.search(rf"^{re.escape(end_marker)}[ \t]*$", text, re.M)
  if not start or not end or end.start() < start.end():
    raise ValueError(f"{path}: needs the markers {start_marker} and {end_marker}, "
                     "each on a line of its own, in that order")
  new = text[:start.end()] + body + text[end.start():]
  if new != text:
    path.write_text(new)
  return new != text


def render_summary(page: Path | str, results_root: Path | str, *, include_cpu: bool = False,
                   full_page: Path | str | None = None) -> bool:
  """Replaces the text between the perf-table markers of ``page``
  (docs/performance.md) with :func:`summary_markdown` of :func:`find_results`,
  and those of ``full_page`` (docs/benchmarks.md) with every row
  (:func:`markdown`). Returns whether a file changed."""
  results = find_results(results_root, include_cpu=include_cpu)
  changed = replace_between(page, PERF_START, PERF_END, summary_markdown(results))
  if full_page is not None and Path(full_page).exists():
    changed |= replace_between(full_page, PERF_START, PERF_END, markdown(results))
  return changed

