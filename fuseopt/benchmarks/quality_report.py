"""docs/adam.md's "Quality" tables, from the committed results of
examples/quality.py (:data:`STUDIES`: the study on English prose and the
second task on Python source): per mode, the held-out loss over seeds and
whether its mean lies within the seed-to-seed spread of the reference (fp32
moments)."""

from __future__ import annotations

import json
from pathlib import Path

# (marker name in docs/adam.md, results under bench/results)
STUDIES = (("quality-table", Path("quality") / "char_lm_quality.json"),
           ("quality-source-table", Path("quality") / "char_lm_quality_source.json"))


def markers(name: str) -> tuple[str, str]:
  """The start and end markers of table ``name``."""
  return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def _pm(mean, std) -> str:
  return f"{mean:.4f}" if std is None else f"{mean:.4f} ± {std:.4f}"


def verdict(name: str, run: dict, summary: dict, markdown: bool = True) -> str:
  """The reference, within or outside its seed spread, or not available."""
  if not run.get("available"):
    return "not available in this build"
  if name == summary.get("reference"):
    return "reference"
  if "within_reference_spread" not in run:
    return "no verdict (the reference needs two seeds or more)"
  within, d, std = run["within_reference_spread"], abs(run["delta"]), summary["reference_std"]
  word = "within" if within else ("**outside**" if markdown else "OUTSIDE")
  bars = "\\|" if markdown else "|"
  return f"{word} ({bars}Δ{bars} {d:.4f} {'≤' if within else '>'} {std:.4f})"


def markdown(data: dict) -> str:
  """The table, then one line saying what was run."""
  summary = data["summary"]
  ref = data["modes"].get(summary["reference"], {})
  out = [f"| mode | held-out loss, mean ± std | seeds {', '.join(ref.get('heldout', {}))} "
         f"| paired Δ vs {ref.get('label', summary['reference'])}, mean ± std | verdict |",
         "| --- | ---: | ---: | ---: | --- |"]
  for name, run in data["modes"].items():
    label = f"`{name}`: {run['label']}"
    if not run.get("available"):
      out.append(f"| {label} | - | - | - | not available in this build |")
      continue
    seeds = ", ".join(f"{v:.4f}" for v in run["heldout"].values())
    paired = ("-" if run.get("paired_delta") is None
              else f"{run['paired_delta']:+.4f}" + ("" if run.get("paired_delta_std") is None
                                                    else f" ± {run['paired_delta_std']:.4f}"))
    out.append(f"| {label} | {_pm(run['mean'], run['std'])} | {seeds} | {paired} "
               f"| {verdict(name, run, summary)} |")
  s, c, v = data["settings"], data["corpus"], data["versions"]
  out.append("")
  out.append(f"`{data['command']}` ({data['date']}, {data['device']}, jax {v['jax']}, "
             f"flax {v['flax']}, flashoptim-jax {v['flashoptim-jax']}, Python {v['python']}; "
             f"{s['parameters']:,} parameters, {s['steps']} steps of {s['batch']} × {s['seq']}, "
             f"peak rate {s['lr']:g}{_warmup(s)}, weight decay {s['weight_decay']:g}; "
             f"{c['train_chars']:,} training and {c['heldout_chars']:,} held-out characters; "
             f"{data['wall_s'] / 60:.0f} min wall, {data['cpu_s'] / 60:.0f} min CPU)")
  return "\n".join(out) + "\n"


def _warmup(settings: dict) -> str:
  return "" if settings.get("warmup") is None else f" after {settings['warmup']} warmup steps"


def render(page: Path | str = "docs/adam.md", results: Path | str = Path("bench/results")) -> bool | None:
  """Rewrites each study's table (:data:`STUDIES`) between its markers in
  ``page`` from its JSON under ``results``; whether any changed, ``None``
  when no study has both its markers and its results."""
  from fuseopt.benchmarks import compiled  # the compile tier's page helper: not needed for markdown
  changed = None
  for name, path in STUDIES:
    if not (Path(results) / path).exists():
      continue
    done = compiled.render_between(page, *markers(name),
                                   markdown(json.loads((Path(results) / path).read_text())))
    if done is not None:
      changed = bool(changed) or done
  return changed
