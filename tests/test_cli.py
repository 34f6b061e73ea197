"""The `fuseopt` command line: parsing, `report` (docs/performance.md's
summary table, docs/benchmarks.md's rows) and `regression` exit codes."""

import json

import pytest

from fuseopt import cli
from fuseopt.benchmarks import regression, report

PAGE = """# Performance
intro: the table lies between `<!-- perf-table:start -->` and `<!-- perf-table:end -->`.
## Performance
<!-- perf-table:start -->
old table
<!-- perf-table:end -->
after
"""


def _results(tmp_path, slug="nvidia-h200", kind="NVIDIA H200", platform="gpu", ms=2.0, stamp="2026-11-30T20:00:00Z"):
  rows = [{"op": "newton_schulz", "case": "2048x2048", "variant": "optax", "is_baseline": True, "ms": 0.658,
           "baseline_ms": 0.658, "ratio_to_baseline": 1.0, "tflops": 391.0, "flops": 2.58e11, "temp_bytes": 2 << 20},
          {"op": "newton_schulz", "case": "2048x2048", "variant": "fuseopt[triton]", "is_baseline": False,
           "ms": ms / 5, "baseline_ms": 0.658, "ratio_to_baseline": ms / 5 / 0.658, "fraction_of_floor": 0.675,
           "tflops": 640.0, "flops": 2.58e11, "temp_bytes": 1024, "check": {"fuseopt[triton]": True}},
          {"op": "adam", "case": "llama-1.2b", "variant": "fuseopt[triton]", "is_baseline": False,
           "error": "RuntimeError: x"}]
  meta = {"device_kind": kind, "device_slug": slug, "platform": platform, "size": "full", "jax": "0.11.2",
          "time_utc": stamp}
  data = report.make_results(meta, {"copy_gbps": 3354.0, "matmul_tflops": 641.0}, rows)
  path = tmp_path / "results" / slug / f"suite-{stamp[:13]}.json"
  report.save_json(data, path)
  return path


def test_help_and_bad_arguments(capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["--help"])
  assert e.value.code == 0
  out = capsys.readouterr().out
  assert all(c in out for c in ("bench", "regression", "report"))
  with pytest.raises(SystemExit) as e:
    cli.main(["bench", "--ops", "no_such_op"])
  assert e.value.code == 2
  assert "invalid choice" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    cli.main([])


def _page(tmp_path, text=None):
  (tmp_path / "docs").mkdir(exist_ok=True)
  page = tmp_path / "docs" / "performance.md"
  page.write_text(PAGE if text is None else text)
  return page


def test_report_renders_the_summary_between_markers(tmp_path, capsys):
  _results(tmp_path)
  _results(tmp_path, ms=1.0, stamp="2026-11-30T21:00:00Z")  # newer run of the same device wins
  _results(tmp_path, slug="cpu", kind="cpu", platform="cpu")
  (tmp_path / "results" / "junk.json").write_text("{not json")
  summary = _page(tmp_path)
  args = ["report", "--results", str(tmp_path / "results"), "--root", str(tmp_path)]
  assert cli.main(args) == 0
  text = summary.read_text()
  assert text.startswith(PAGE.split("old table")[0]) and text.endswith("<!-- perf-table:end -->\nafter\n")
  assert "old table" not in text and "NVIDIA H200: jax" in text and "cpu: jax" not in text
  # The front page: per case the default call's row (none here), fuseopt's
  # rows, the fastest peer; ratios against that peer.
  assert "| newton_schulz | 2048x2048 | no row of this run is the default call |" in text
  assert "| newton_schulz | 2048x2048 | `fuseopt[triton]` | 0.200 | 68% | 3.29× faster |" in text
  assert "| newton_schulz | 2048x2048 | best peer `optax` | 0.658 | - | best peer |" in text
  assert "llama-1.2b" not in text  # failed rows are not rendered
  assert "updated" in capsys.readouterr().out
  assert cli.main(args) == 0 and summary.read_text() == text  # idempotent
  assert "unchanged" in capsys.readouterr().out
  assert cli.main(args + ["--include-cpu"]) == 0 and "cpu: jax" in summary.read_text()


def test_report_renders_every_row_into_the_benchmarks_page(tmp_path, capsys):
  _results(tmp_path)
  _page(tmp_path)
  page = tmp_path / "docs" / "benchmarks.md"
  page.write_text("# Benchmarks\n<!-- perf-table:start -->\nold\n<!-- perf-table:end -->\nend\n")
  assert cli.main(["report", "--results", str(tmp_path / "results"), "--root", str(tmp_path)]) == 0
  text = page.read_text()
  assert "old" not in text and "**NVIDIA H200**" in text and text.endswith("end\n")
  assert "| newton_schulz | 2048x2048 | `fuseopt[triton]` | 0.400 | 68% | 1.65× faster |" in text
  assert "| newton_schulz | 2048x2048 | best peer `optax` | 0.658 | - | best peer |" in text


def test_report_print_and_missing_markers(tmp_path, capsys):
  _results(tmp_path)
  assert cli.main(["report", "--results", str(tmp_path / "results"), "--print"]) == 0
  assert "| op | case | row | ms | % of floor | vs best peer |" in capsys.readouterr().out
  _page(tmp_path, "# no markers\n")
  assert cli.main(["report", "--results", str(tmp_path / "results"), "--root", str(tmp_path)]) == 2
  assert "perf-table:start" in capsys.readouterr().err
  assert report.markdown([]).startswith("_No hardware results yet")


def test_regression_command_exit_codes(tmp_path, capsys):
  path = tmp_path / "cpu.json"
  assert cli.main(["regression", "--baseline", str(path), "--no-progress"]) == 1
  assert "fuseopt regression --update" in capsys.readouterr().out
  sel = ["--ops", "stochastic_round", "--no-progress", "--baseline", str(path)]
  assert cli.main(["regression", "--update", *sel]) == 2  # --update rewrites everything
  collected = regression.collect(["stochastic_round"])
  regression.write_baseline(regression.make_baseline(collected), path)
  assert cli.main(["regression", *sel]) == 0
  assert "regression: OK" in capsys.readouterr().out
  data = json.loads(path.read_text())
  vid = next(iter(data["figures"]))
  data["figures"][vid]["argument_bytes"] += 1 << 20
  path.write_text(json.dumps(data))
  assert cli.main(["regression", *sel]) == 1
  out = capsys.readouterr().out
  assert f"FAIL: {vid}: argument_bytes" in out and "(-1.0 MiB" in out


def test_demo_trains_and_reports_state_bytes(capsys, monkeypatch):
  everything = cli._demo_optimizers()
  keep = "fuseopt.optim.adamw (bf16 moments)"  # one optimizer: each compile costs seconds
  monkeypatch.setattr(cli, "_demo_optimizers", lambda: {keep: everything[keep]})
  assert cli.main(["demo", "--steps", "20"]) == 0
  cells = next(l for l in capsys.readouterr().out.splitlines() if l.startswith(keep)).split()
  assert float(cells[-3]) < float(cells[-4])  # the loss went down
  assert float(cells[-2]) == 4.0  # bf16 mu + nu: 4 bytes of state per parameter
