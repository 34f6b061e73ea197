"""docs/adam.md's quality table (fuseopt.benchmarks.quality_report): rendered
from examples/quality.py's JSON by `fuseopt report`, and the committed page
matches the committed results."""

import json
from pathlib import Path

import pytest

from fuseopt import cli
from fuseopt.benchmarks import quality_report

ROOT = Path(__file__).resolve().parents[1]


def _data():
  run = lambda label, vals, **kw: dict({"label": label, "available": True, "heldout": vals,
                                        "mean": sum(vals.values()) / len(vals), "std": 0.01}, **kw)
  return {
      "command": "python examples/quality.py --json x.json", "date": "2026-12-06", "device": "cpu",
      "versions": {"jax": "0.12.0.1", "flax": "0.12.12", "flashoptim-jax": "0.1.0", "python": "3.13.0"},
      "settings": {"parameters": 1000, "steps": 1000, "batch": 8, "seq": 64, "lr": 3e-3,
                   "weight_decay": 0.1},
      "corpus": {"train_chars": 900, "heldout_chars": 100}, "wall_s": 600.0, "cpu_s": 300.0,
      "summary": {"reference": "fp32", "reference_mean": 1.5, "reference_std": 0.01},
      "modes": {
          "fp32": run("fp32 moments", {"0": 1.49, "1": 1.51}),
          "int8": run("8-bit moments", {"0": 1.495, "1": 1.515}, delta=0.005, paired_delta=0.005,
                      paired_delta_std=0.0, within_reference_spread=True),
          "sr": run("bf16 params", {"0": 1.53, "1": 1.55}, delta=0.04, paired_delta=0.04,
                    paired_delta_std=0.0, within_reference_spread=False),
          "int4": {"label": "4-bit moments", "available": False, "reason": "ValueError: int4"},
      }}


def test_the_table_gives_each_mode_its_spread_and_verdict():
  rows = quality_report.markdown(_data()).splitlines()
  assert rows[0].startswith("| mode | held-out loss, mean ± std | seeds 0, 1 | paired Δ vs fp32 moments")
  row = {r.split("`")[1]: r for r in rows if r.startswith("| `")}
  assert "| 1.5000 ± 0.0100 | 1.4900, 1.5100 | - | reference |" in row["fp32"]
  assert "| +0.0050 ± 0.0000 | within (\\|Δ\\| 0.0050 ≤ 0.0100) |" in row["int8"]
  assert "**outside** (\\|Δ\\| 0.0400 > 0.0100)" in row["sr"]
  assert row["int4"].endswith("| - | - | - | not available in this build |")
  assert rows[-1].startswith("`python examples/quality.py --json x.json` (2026-12-06, cpu")


def test_fuseopt_report_renders_it_into_docs_adam(tmp_path, capsys):
  results = tmp_path / "results"
  (results / "quality").mkdir(parents=True)
  (results / quality_report.STUDIES[0][1]).write_text(json.dumps(_data()))
  (tmp_path / "docs").mkdir()
  (tmp_path / "docs" / "performance.md").write_text("<!-- perf-table:start -->\n<!-- perf-table:end -->\n")
  page = tmp_path / "docs" / "adam.md"
  start, end = quality_report.markers("quality-table")
  page.write_text(f"a\n{start}\nold\n{end}\nb\n")
  assert cli.main(["report", "--results", str(results), "--root", str(tmp_path)]) == 0
  assert "adam.md: quality tables updated" in capsys.readouterr().out
  table = quality_report.markdown(_data())
  assert page.read_text() == f"a\n{start}\n{table}{end}\nb\n"
  assert quality_report.render(page, results) is False


@pytest.mark.parametrize("name,path", quality_report.STUDIES, ids=[n for n, _ in quality_report.STUDIES])
def test_docs_adam_shows_the_committed_results(name, path):
  data = json.loads((ROOT / "bench" / "results" / path).read_text())
  page = (ROOT / "docs" / "adam.md").read_text()
  start, end = quality_report.markers(name)
  body = page.split(start + "\n", 1)[1].split(end, 1)[0]
  assert body == quality_report.markdown(data)
