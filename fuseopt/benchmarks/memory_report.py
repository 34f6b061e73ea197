"""docs/adam.md's "Memory by mode" table: :mod:`fuseopt.benchmarks.memory`'s
figures of each mode, its fused step's compiled figures as the compile tier
recorded them, and the largest model per chip."""

from __future__ import annotations

from pathlib import Path

from fuseopt.benchmarks import memory

MEMORY_START = "<!-- memory-table:start -->"
MEMORY_END = "<!-- memory-table:end -->"


def _compiled(root: Path) -> dict[str, dict]:
  """target -> the step cases' figures the compile tier recorded under
  ``root``, each case from the newest jax release that recorded it (the
  memory cases are the full sweep's, not CI's: a release that CI moved to
  may not have recorded them yet)."""
  from fuseopt.benchmarks import scale_report
  out = {}
  for target in memory.STEP_TARGETS:
    merged = {}
    for _, cases in reversed(scale_report.records(target, root)):   # oldest first
      merged.update(cases)
    if merged:
      out[target] = merged
  return out


def _gb(x: float) -> str:
  return f"{x / 1e9:.1f} B"


def markdown(results: Path | str = Path("bench/results/compiled")) -> str:
  """The memory table: a row a mode."""
  compiled = _compiled(Path(results))
  n12 = memory.figures("adamw", "1.2B")["params"]
  head = ["family", "stores", "call", "B/param p + state, 1.2 B", "8.8 B"]
  head += [f"step temp / moved B/param ({t})" for t in memory.STEP_TARGETS]
  head += [f"largest model, {c}" for c in memory.CHIPS]
  rows = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] * 3 + ["---:"] * (
      len(head) - 3)) + " |"]
  for mode in memory.MODES:
    cells = [mode.family, mode.stores, f"`{mode.call}`"]
    cells += [f"{memory.figures(mode.key, t)['stored']:.2f}" for t in ("1.2B", "8.8B")]
    for target in memory.STEP_TARGETS:
      r = compiled.get(target, {}).get(f"step/memory/{mode.key}/llama1.2b")
      if r is None:
        cells.append("-")
        continue
      moved = (r["argument_bytes"] + r["output_bytes"]) / n12
      cells.append(f"{r['temp_bytes']:,} B / {moved:.2f}")
    cells += [_gb(memory.largest_model(mode.key, chip)) for chip in memory.CHIPS]
    rows.append("| " + " | ".join(cells) + " |")
  return "\n".join(rows) + "\n"


def render(page: Path | str = "docs/adam.md",
           results: Path | str = Path("bench/results/compiled")) -> bool | None:
  """Rewrites the table between the memory-table markers of ``page``."""
  from fuseopt.benchmarks import compiled
  return compiled.render_between(page, MEMORY_START, MEMORY_END, markdown(results))
