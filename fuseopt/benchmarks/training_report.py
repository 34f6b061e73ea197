"""docs/training.md's tables, from bench/largest_model.py's results under
``bench/results/<device-slug>/``: the largest model each optimizer format
trains (``largest_model.json``), every format's speed at a fixed size
(``speed_fixed.json``) and their held-out quality (``quality.json``). A table
whose results are absent says it has not yet been run and how to run it."""

from __future__ import annotations

import json
from pathlib import Path

SCHEMA = "fuseopt-largest-model/1"
REFERENCE = "optax-adamw"   # the mode the others' largest models are compared with
TABLES = {  # kind -> (file, start marker, end marker, the command that writes it)
    "largest": ("largest_model.json", "<!-- training-largest:start -->",
                "<!-- training-largest:end -->",
                "PYTHONPATH=$PWD python bench/largest_model.py --budget-s 540 --resume"),
    "fixed": ("speed_fixed.json", "<!-- training-speed:start -->", "<!-- training-speed:end -->",
              "PYTHONPATH=$PWD python bench/largest_model.py --fixed-layers 6 --budget-s 540 --resume"),
    "quality": ("quality.json", "<!-- training-quality:start -->", "<!-- training-quality:end -->",
                "PYTHONPATH=$PWD python bench/largest_model.py --quality 800 --seeds 0 1 2 "
                "--budget-s 540 --resume"),
    "compiled": ("largest_compiled.json", "<!-- training-compiled:start -->",
                 "<!-- training-compiled:end -->",
                 "JAX_PLATFORMS=cpu PYTHONPATH=$PWD python bench/largest_model.py --compile-for v5e "
                 "--budget-s 7200"),
}


def find(root: Path | str, kind: str, include_dry_run: bool = False) -> list[dict]:
  """Every device's results of ``kind`` under ``root``, by device slug."""
  out = []
  for path in sorted(Path(root).glob(f"*/{TABLES[kind][0]}")):
    try:
      data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
      continue
    if data.get("schema") != SCHEMA or data.get("kind") != ("largest" if kind == "compiled" else kind):
      continue
    if data.get("dry_run") and not include_dry_run:
      continue
    data["_path"] = str(path)
    out.append(data)
  return out


def _gib(x) -> str:
  return "-" if x is None else f"{x / 2**30:.2f} GiB"


def _num(x, spec: str) -> str:
  return "-" if x is None else format(x, spec)


def _params(n) -> str:
  if n is None:
    return "-"
  return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def _label(mode: str, rec: dict) -> str:
  opt = rec.get("optimizer") or {}
  call = f" `{opt['call']}`" if opt.get("call") else ""
  params = f", {opt['params']} params" if opt.get("params") else ""
  return f"`{mode}`{call}{params}"


def _footer(data: dict) -> str:
  f, dev, v = data["family"], data["device"], data.get("versions", {})
  fam = (f"d {f['d']}, ff {f['ff']}, {f['heads']} heads, vocab {f['vocab']}, "
         f"{f['batch']} × {f['seq']} tokens a step" + (", remat" if data.get("remat") else ""))
  return (f"{dev['device_kind']}, jax {v.get('jax', '?')}, Python {v.get('python', '?')}, "
          f"{data.get('date', '?')}: family {fam}; {data['steps']} steps a run "
          f"(`{data.get('command', '')}`; `{data.get('_path', '')}`)"
          + (" — a CPU dry run, not a measurement" if data.get("dry_run") else ""))


def _first_trial(m: dict, layers) -> dict:
  return next((t for t in m.get("trials", []) if t["layers"] == layers), {})


def _times(big: dict, ref: dict) -> float | None:
  """A mode's largest model's parameters over the reference mode's."""
  return (big["parameters"] / ref["parameters"]
          if big.get("parameters") and ref.get("parameters") else None)


def largest_markdown(data: dict) -> str:
  ref = (data.get("modes", {}).get(REFERENCE) or {}).get("largest") or {}
  out = ["| mode | B/param (params + grads + state) | first guess | largest that trains: layers "
         f"| parameters | × `{REFERENCE}`'s | tokens/s | optimizer share | compiled temp "
         "| smallest that fails |",
         "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
  for mode, m in data.get("modes", {}).items():
    bm = m.get("byte_model", {})
    big = m.get("largest") or {}
    first = m.get("trials", [{}])[0] if m.get("trials") else {}
    guess = m.get("first_guess") or {"layers": bm.get("estimated_layers"), "from": "byte model"}
    fail = m.get("first_failing_layers")
    failed = _first_trial(m, fail)
    why = (failed.get("status", "") + (f" at {failed['phase']}" if failed.get("phase") else "")
           if failed else "refused by the chip's compiler, deviceless"
           if (m.get("compiled") or {}).get("refused_layers") == fail else "")
    layers = m.get("largest_layers")
    temp = (_first_trial(m, layers).get("compiled_memory") or {}).get("temp_size")
    ratio = _times(big, ref)
    cells = [_label(mode, first), _num(bm.get("bytes_per_param"), ".2f"),
             "-" if guess.get("layers") is None else f"{guess['layers']} ({guess['from']})",
             ("-" if layers is None else str(layers)) + ("" if m.get("complete") else " (unfinished)"),
             _params(big.get("parameters")), _num(ratio, ".2f") + ("×" if ratio else ""),
             _num(big.get("tokens_per_s"), ",.0f"),
             _num(big.get("opt_share") and 100 * big["opt_share"], ".1f") + ("%" if big.get("opt_share") else ""),
             _gib(temp), "-" if fail is None else f"{fail} layers ({why})"]
    if m.get("error"):
      cells[3:] = ["error: " + m["error"].splitlines()[-1][:120].replace("|", "/")] + ["-"] * 6
    out.append("| " + " | ".join(cells) + " |")
  return "\n".join(out) + "\n\n" + _footer(data) + "\n"


def _needed(error: str) -> str:
  """The bytes a refused compile needed, as the compiler wrote them."""
  import re
  found = re.search(r"required for HLO temporaries \(([\d.]+G)\)", error or "")
  return f", needed {found.group(1)}" if found else ""


def compiled_markdown(data: dict) -> str:
  ref = (data.get("modes", {}).get(REFERENCE) or {}).get("largest") or {}
  out = [f"| mode | largest the compiler takes: layers | parameters | × `{REFERENCE}`'s | compiled temp "
         "| smallest refused |", "| --- | ---: | ---: | ---: | ---: | --- |"]
  for mode, m in data.get("modes", {}).items():
    big = m.get("largest") or {}
    layers, fail = m.get("largest_layers"), m.get("first_failing_layers")
    first = m.get("trials", [{}])[0] if m.get("trials") else {}
    temp = (_first_trial(m, layers).get("compiled_memory") or {}).get("temp_size")
    ratio = _times(big, ref)
    out.append("| " + " | ".join([
        _label(mode, first), "-" if layers is None else str(layers), _params(big.get("parameters")),
        _num(ratio, ".2f") + ("×" if ratio else ""), _gib(temp),
        "-" if fail is None else f"{fail} layers{_needed(_first_trial(m, fail).get('error'))}"]) + " |")
  v = data.get("versions", {})
  return ("\n".join(out) + f"\n\nCompiled for a {data['device']['device_kind']} without one: jax "
          f"{v.get('jax', '?')}, libtpu {v.get('libtpu', '?')}, memory limit "
          f"{_gib(data.get('memory_limit_bytes'))}, {data.get('date', '?')} "
          f"(`{data.get('command', '')}`; `{data.get('_path', '')}`)\n")


def speed_markdown(data: dict) -> str:
  out = [f"At {data.get('layers', '?')} layers:", "",
         "| mode | tokens/s | step ms | forward+backward ms | optimizer in the step ms (share) "
         "| optimizer alone ms | peak memory | status |",
         "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
  for mode, r in data.get("modes", {}).items():
    t = r.get("timing", {})
    share = (f"{t['opt_in_step_ms']:.2f} ({100 * t['opt_share']:.1f}%)"
             if "opt_in_step_ms" in t else "-")
    out.append(f"| {_label(mode, r)} | {_num(r.get('tokens_per_s'), ',.0f')} | "
               f"{_num(r.get('step_ms'), '.2f')} | {_num(t.get('fwd_bwd_ms'), '.2f')} | {share} | "
               f"{_num(t.get('opt_alone_ms'), '.2f')} | "
               f"{_gib(r.get('memory', {}).get('peak_bytes_in_use'))} | {r.get('status', '-')} |")
  return "\n".join(out) + "\n\n" + _footer(data) + "\n"


def quality_markdown(data: dict) -> str:
  s = data.get("summary", {})
  ref = s.get("reference", "optax-adamw")
  out = [f"| mode | held-out loss (nats a byte), mean ± std | seeds {', '.join(map(str, data.get('seeds', [])))} "
         f"| paired Δ vs `{ref}` | verdict |", "| --- | ---: | ---: | ---: | --- |"]
  for mode, r in data.get("modes", {}).items():
    if not r.get("heldout"):
      out.append(f"| {_label(mode, r)} | - | - | - | {r.get('status', 'not run')} |")
      continue
    mean = f"{r['mean']:.4f}" + ("" if r.get("std") is None else f" ± {r['std']:.4f}")
    seeds = ", ".join(f"{v:.4f}" for v in r["heldout"].values())
    paired = "-" if r.get("paired_delta") is None else f"{r['paired_delta']:+.4f}"
    if mode == ref:
      verdict = "yardstick"
    elif "within_reference_spread" not in r:
      verdict = "no verdict (the yardstick needs two seeds)"
    else:
      w = r["within_reference_spread"]
      verdict = (f"{'within' if w else '**outside**'} (\\|Δ\\| {abs(r['delta']):.4f} "
                 f"{'≤' if w else '>'} {s['reference_std']:.4f})")
    out.append(f"| {_label(mode, r)} | {mean} | {seeds} | {paired} | {verdict} |")
  return "\n".join(out) + "\n\n" + _footer(data) + "\n"


RENDER = {"largest": largest_markdown, "fixed": speed_markdown, "quality": quality_markdown,
          "compiled": compiled_markdown}


def markdown(kind: str, results: list[dict]) -> str:
  """Every device's table of ``kind``, or the line saying it has not yet run."""
  if not results:
    return (f"_Not yet run: `{TABLES[kind][3]}` on a device writes "
            f"`bench/results/<device>/{TABLES[kind][0]}`; `python -m fuseopt.cli report` renders "
            "it here._\n")
  return "\n".join(f"**{d['device']['device_kind']}**\n\n" + RENDER[kind](d) for d in results)


def render(page: Path | str = "docs/training.md", root: Path | str = "bench/results",
           include_dry_run: bool = False) -> bool | None:
  """Rewrites each table of ``page`` between its markers; ``None`` when the
  page has none of them, else whether it changed."""
  from fuseopt.benchmarks import compiled
  changed = None
  for kind, (_, start, end, _) in TABLES.items():
    c = compiled.render_between(page, start, end,
                                markdown(kind, find(root, kind, include_dry_run)))
    if c is not None:
      changed = bool(changed) or c
  return changed
