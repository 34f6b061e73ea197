"""Benchmark reports: the console table, the results JSON, PNG plots and the
README performance table.

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
README_START = "<!-- perf-table:start -->"
README_END = "<!-- perf-table:end -->"


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
        r["op"], r["case"], r["variant"] + (" *" if r.get("is_baseline") else ""),
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


# ------------------------------------------------------------------ README

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


def markdown(results_list: list[dict]) -> str:
  if not results_list:
    return ("_No hardware results yet: fuseopt has not yet been measured on a GPU or TPU. Run "
            "`python bench/gpu_suite.py bench/results` on one, commit the JSON, then `scripts/fuseopt report`._\n")
  parts = []
  for res in results_list:
    m, c = res["meta"], res["ceilings"]
    parts.append(f"**{m['device_kind']}** — jax {m['jax']}, size {m['size']}, {m.get('time_utc', '')[:10]}; "
                 f"measured ceilings: copy {c.get('copy_gbps', 0):.0f} GB/s, "
                 f"bf16 matmul {c.get('matmul_tflops', 0):.3g} TFLOP/s"
                 + (f" (`{res['_path']}`)" if res.get("_path") else ""))
    parts.append("")
    parts.append("| op | case | variant | ms | vs baseline | % of floor | throughput | temp memory "
                 "| state B/param | check |")
    parts.append("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in res["rows"]:
      if "ms" not in r or "error" in r:
        continue
      ratio = r.get("ratio_to_baseline")
      vs = "baseline" if r.get("is_baseline") else (f"{1 / ratio:.2f}× faster" if ratio and ratio <= 1
                                                     else f"{ratio:.2f}× slower" if ratio else "-")
      floor = f"{100 * r['fraction_of_floor']:.0f}%" if r.get("fraction_of_floor") else "-"
      parts.append(f"| {r['op']} | {r['case']} | {r['variant']} | {r['ms']:.3f} | {vs} | {floor} | "
                   f"{throughput(r)} | {fmt_bytes(r.get('temp_bytes'))} | "
                   f"{_num(r.get('state_bytes_per_param'), '.1f')} | {_check(r)} |")
    parts.append("")
  return "\n".join(parts).rstrip() + "\n"


def summary_markdown(results_list: list[dict]) -> str:
  """The front page's table: per device and case, the baseline, the fastest
  fuseopt variant and the fastest other peer (e.g. PyTorch), one row each."""
  if not results_list:
    return markdown([])
  runs = "; ".join(f"{r['meta']['device_kind']}: jax {r['meta']['jax']}, {r['meta'].get('time_utc', '')[:10]}"
                   + (f" (`{r['_path']}`)" if r.get("_path") else "") for r in results_list)
  parts = [f"{runs}. Every row: [benchmarks.md](docs/benchmarks.md#measured-on-hardware).", "",
           "| device | op | case | baseline | ms | fastest fuseopt | ms | vs baseline | state B/param "
           "| fastest peer | ms |",
           "| --- | --- | --- | --- | ---: | --- | ---: | ---: | ---: | --- | ---: |"]
  for res in results_list:
    cases: dict[tuple[str, str], list[dict]] = {}
    for r in res["rows"]:
      if "ms" in r and "error" not in r:
        cases.setdefault((r["op"], r["case"]), []).append(r)
    for (op, case), rows in cases.items():
      base = next((r for r in rows if r.get("is_baseline")), None)
      ours = min((r for r in rows if r["variant"].startswith("fuseopt")), key=lambda r: r["ms"],
                 default=None)
      peers = [r for r in rows if not r.get("is_baseline") and not r["variant"].startswith("fuseopt")
               and not r["variant"].startswith(("optax", "xla"))]
      peer = min(peers, key=lambda r: r["ms"], default=None)
      if base is None or ours is None:
        continue
      ratio = ours["ms"] / base["ms"]
      vs = f"{1 / ratio:.2f}× faster" if ratio <= 1 else f"{ratio:.2f}× slower"
      parts.append(f"| {res['meta']['device_kind']} | {op} | {case} | {base['variant']} | {base['ms']:.3f} "
                   f"| {ours['variant']} | {ours['ms']:.3f} | {vs} "
                   f"| {_num(ours.get('state_bytes_per_param'), '.1f')} "
                   f"| {peer['variant'] if peer else '-'} | {f'{peer['ms']:.3f}' if peer else '-'} |")
  return "\n".join(parts) + "\n"


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


def render_readme(readme: Path | str, results_root: Path | str, *, include_cpu: bool = False,
                  full_page: Path | str | None = None) -> bool:
  """Replaces the text between the perf-table markers of ``readme`` with
  :func:`summary_markdown` of :func:`find_results`, and those of
  ``full_page`` (docs/benchmarks.md) with every row (:func:`markdown`).
  Returns whether a file changed."""
  results = find_results(results_root, include_cpu=include_cpu)
  changed = replace_between(readme, README_START, README_END, summary_markdown(results))
  if full_page is not None and Path(full_page).exists():
    changed |= replace_between(full_page, README_START, README_END, markdown(results))
  return changed
