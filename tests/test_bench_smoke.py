"""`fuseopt bench` and bench/gpu_suite.py end to end on tiny CPU sizes, the
results JSON schema, the plots, and the named workloads."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from fuseopt import cli
from fuseopt.benchmarks import report, workloads

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"
SMALL = ["--ops", "stochastic_round", "--iters", "2", "--no-progress"]


def _check_results(path):
  data = json.loads(Path(path).read_text())
  report.validate(data)
  assert data["meta"]["platform"] == "cpu" and data["meta"]["size"] == "quick"
  assert data["ceilings"]["copy_gbps"] > 0 and data["ceilings"]["matmul_tflops"] > 0
  rows = data["rows"]
  assert rows and all("error" not in r for r in rows)
  assert sum(r["is_baseline"] for r in rows) == len({(r["op"], r["case"]) for r in rows})
  # A tagged row of the default's own program is recorded, not timed twice
  # (on the CPU the default call runs the reference, 'fuseopt[xla]').
  same = [r for r in rows if r.get("same_program_as")]
  assert all(r["skipped"] == f"same program as {r['same_program_as']}" for r in same)
  rows = [r for r in rows if not r.get("same_program_as")]
  for r in rows:
    assert r["ratio_to_baseline"] > 0 and r["baseline_ms"] > 0 and 0 < r["fraction_of_floor"]
    assert r["gbps"] > 0 and r["temp_bytes"] >= 0 and r["output_bytes"] > 0
    assert r["check"] and all(v is True for v in r["check"].values())
  return data


def test_bench_cli_no_plot(tmp_path, capsys):
  assert cli.main(["bench", *SMALL, "--out", str(tmp_path), "--no-plot"]) == 0
  out = capsys.readouterr().out
  for col in ("op", "case", "variant", "ms", "base ms", "ratio", "floor", "throughput", "temp"):
    assert col in out.splitlines()[2]
  assert "stochastic_round" in out and "xla_convert *" in out
  _check_results(tmp_path / "bench-quick.json")
  assert not list(tmp_path.glob("*.png"))


def test_bench_cli_with_plots_and_row_filter(tmp_path):
  assert cli.main(["bench", *SMALL, "--rows", "stochastic_round/", "--out", str(tmp_path)]) == 0
  _check_results(tmp_path / "bench-quick.json")
  for name in ("bench.png", "scaling.png"):
    assert (tmp_path / name).read_bytes()[:8] == PNG


def test_bench_cli_without_the_bench_extra(tmp_path, capsys, monkeypatch):
  # matplotlib and tqdm absent: the table and the JSON, then one line on the plots; no traceback.
  for name in ("matplotlib", "matplotlib.pyplot", "tqdm"):
    monkeypatch.setitem(sys.modules, name, None)
  args = ["bench", "--ops", "stochastic_round", "--iters", "2", "--out", str(tmp_path)]
  assert cli.main(args) == 0
  out = capsys.readouterr().out
  assert "xla_convert *" in out and "saved " + str(tmp_path / "bench-quick.json") in out
  _check_results(tmp_path / "bench-quick.json")
  assert not list(tmp_path.glob("*.png"))
  last = out.strip().splitlines()[-1]
  assert "matplotlib and tqdm not installed" in last and "pip install 'fuseopt[bench]'" in last


def test_bench_cli_no_rows_selected(tmp_path, capsys):
  assert cli.main(["bench", "--rows", "no-such-case", "--out", str(tmp_path), "--no-progress"]) == 1
  assert "no benchmark cases selected" in capsys.readouterr().out


def test_console_script_entry_point(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "fuseopt.cli", "bench", *SMALL, "--no-plot", "--out",
                         str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  _check_results(tmp_path / "bench-quick.json")


def test_gpu_suite_runs_on_cpu(tmp_path):
  spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "bench" / "gpu_suite.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  assert mod.main([str(tmp_path), "--ops", "stochastic_round", "--iters", "2", "--no-plot"]) == 0
  data = _check_results(tmp_path / "cpu" / "suite.json")
  assert data["meta"]["suite"] == "bench/gpu_suite.py" and data["meta"]["device_slug"] == "cpu"
  # The vendored FlashOptim wheel imports (its rows run on a GPU only).
  assert data["meta"]["peers"]["flashoptim-jax"]["version"] == "0.1.0"
  assert [r["variant"] for r in data["rows"] if r["is_default"]] == ["fuseopt"]
  assert [r.get("same_program_as") for r in data["rows"]] == [None, "fuseopt", None]


def test_gpu_suite_budget_marks_cases_skipped(tmp_path):
  spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "bench" / "gpu_suite.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  assert mod.main([str(tmp_path), "--ops", "stochastic_round", "--budget-s", "0", "--no-plot"]) == 0
  data = json.loads((tmp_path / "cpu" / "suite.json").read_text())
  report.validate(data)
  assert data["rows"] and all(r["skipped"] == "time budget" for r in data["rows"])


def test_validate_rejects_bad_results():
  good = report.make_results({"device_kind": "x", "platform": "gpu", "size": "full", "jax": "0"}, {},
                             [{"op": "a", "case": "b", "variant": "c", "is_baseline": True, "ms": 1.0}])
  report.validate(good)
  with pytest.raises(ValueError, match="schema"):
    report.validate({**good, "schema": "other"})
  with pytest.raises(ValueError, match="ms must be > 0"):
    report.validate({**good, "rows": [{**good["rows"][0], "ms": 0.0}]})
  with pytest.raises(ValueError, match="missing 'variant'"):
    report.validate({**good, "rows": [{"op": "a", "case": "b", "is_baseline": True}]})


def test_llama_tree_matches_measurements():
  tree = workloads.llama_tree()
  leaves = jax.tree.leaves(tree)
  assert len(leaves) == 147 and workloads.tree_params(tree) == 1_204_881_408
  assert all(isinstance(x, jax.ShapeDtypeStruct) and x.dtype == jnp.float32 for x in leaves)
  # docs/measurements.md: the layers' matrices need 53.6 TFLOP of standard 5-step NS.
  tflop = sum(workloads.ns_flops(m.shape) for m in workloads.matrices(tree)) / 1e12
  assert round(tflop, 1) == 53.6
  assert len(workloads.matrices(tree)) == 16 * 7


def test_cpu_tree_is_the_same_structure_and_reproducible():
  small = workloads.llama_tree_cpu()
  assert jax.tree.structure(workloads.llama_tree(layers=2)) == jax.tree.structure(small)
  a = workloads.llama_tree_cpu(jnp.bfloat16, seed=3)
  b = workloads.materialize(workloads.llama_tree_cpu(jnp.bfloat16), seed=3)
  c = workloads.llama_tree_cpu(jnp.bfloat16, seed=4)
  assert not bool((jax.tree.leaves(a)[0] == jax.tree.leaves(c)[0]).all())
  assert workloads.tree_params(a) == 196_928 and workloads.tree_bytes(a) == 2 * 196_928
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == jnp.bfloat16 and bool((x == y).all())
  assert workloads.tree_params(workloads.tree_for("gpu")) == 1_204_881_408
  assert workloads.tree_params(workloads.tree_for("cpu", "full")) > workloads.tree_params(small)


def test_ns_shapes_and_flops():
  assert workloads.NS_SHAPES[0] == (1024, 1024) and (16, 2048, 2048) in workloads.NS_SHAPES
  assert set(workloads.NS_OPTAX_H200_MS) == set(workloads.NS_SHAPES)
  assert workloads.ns_flops((2048, 8192)) == workloads.ns_flops((8192, 2048)) == 5 * (4 * 2048**2 * 8192 + 2 * 2048**3)
  assert workloads.ns_flops((4, 128, 128)) == 4 * workloads.ns_flops((128, 128))
  assert workloads.shape_name((16, 2048, 2048)) == "16x2048x2048"


def test_run_case_donation_errors_and_checks():
  from fuseopt.benchmarks import core

  def donating():
    return jax.jit(lambda x: x * 2, donate_argnums=0), (jnp.ones((256,)),)

  def plain():
    return jax.jit(lambda x: x + x), (jnp.ones((256,)),)

  def broken():
    return jax.jit(lambda x: x @ x.T), (jnp.ones((3,)), jnp.ones((3,)))

  case = core.Case(op="t", name="256", variants={"fuseopt[a]": donating, "fuseopt[b]": broken, "base": plain},
                   baseline="base", bytes=2048, params=256, state_bytes={"fuseopt[a]": 512},
                   check=lambda outs: {"equal": bool((outs["fuseopt[a]"] == outs["base"]).all())})
  recs = {r["variant"]: r for r in core.run_case(case, {"copy_gbps": 1.0, "matmul_tflops": 1.0}, iters=3)}
  assert recs["fuseopt[a]"]["alias_bytes"] == 1024 and recs["fuseopt[a]"]["ms"] > 0
  assert recs["fuseopt[a]"]["state_bytes_per_param"] == 2.0
  assert "TypeError" in recs["fuseopt[b]"]["error"] and "ms" not in recs["fuseopt[b]"]
  assert recs["base"]["ratio_to_baseline"] == 1.0 and recs["fuseopt[a]"]["check"] == {"equal": True}
  assert core.check_passed({"equal": True}) and core.check_passed({"equal": False}) is False
  assert core.device_slug("NVIDIA GeForce RTX 4090") == "nvidia-geforce-rtx-4090"
  assert core.device_slug("TPU v6 lite") == "tpu-v6-lite"
  assert core.hlo_counts("  %f = (f32[2], f32[2]) fusion(%a), kind=kLoop\n  ROOT %c = f32[2] custom-call(%f)\n") == {
      "hlo_ops": 2, "hlo_fusions": 1, "custom_calls": 1}


def test_run_suite_shares_the_budget_among_ops(monkeypatch):
  from fuseopt.benchmarks import core

  clock = [0.0]  # a fake clock: every case takes 1 s, whatever the machine's load

  def tick():
    clock[0] += 1e-4
    return clock[0]

  monkeypatch.setattr(core.time, "perf_counter", tick)

  def slow():
    clock[0] += 1.0
    return jax.jit(lambda x: x + 1), (jnp.ones((8,)),)

  def case(op, name):
    return core.Case(op=op, name=name, variants={"base": slow}, baseline="base")

  cases = [case("a", "1"), case("a", "2"), case("a", "3"), case("b", "1"), case("b", "2"), case("c", "1")]
  seen = []
  recs = core.run_suite(cases, {"copy_gbps": 1.0, "matmul_tflops": 1.0}, iters=1, budget_s=3.5,
                        on_case=lambda c, new, all_: seen.append(c.id))
  ran = [f"{r['op']}/{r['case']}" for r in recs if "ms" in r]
  # a's share is 3.5/3: a/1 (1 s) and a/2 start; b's share (3.5-2)/2: b/1;
  # c/1 starts at 3 s < 3.5 s; nothing else.
  assert ran == ["a/1", "a/2", "b/1", "c/1"], ran
  assert all(r["skipped"] == "time budget" for r in recs if "ms" not in r)
  assert seen == [c.id for c in cases]


def test_plot_survives_rows_without_times(tmp_path):
  meta = {"device_kind": "x", "platform": "gpu", "size": "full", "jax": "0"}
  rows = [{"op": "a", "case": "1", "variant": "base", "is_baseline": True, "skipped": "time budget"},
          {"op": "b", "case": "2", "variant": "base", "is_baseline": True, "error": "OOM"},
          {"op": "b", "case": "2", "variant": "other", "is_baseline": False, "ms": 1.0}]
  paths = report.plot(report.make_results(meta, {}, rows), tmp_path)
  assert [p.read_bytes()[:8] for p in paths] == [PNG, PNG]
  assert "skipped (time budget)" in report.format_table(rows) and "OOM" in report.format_table(rows)


def _torch_baselines_module():
  spec = importlib.util.spec_from_file_location("torch_baselines", ROOT / "bench" / "torch_baselines.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_torch_rows_merge_next_to_their_case_with_ratios():
  tb = _torch_baselines_module()
  rows = [
      {"op": "adam", "case": "llama1.2b", "variant": "optax_adamw_fp32", "is_baseline": True,
       "ms": 10.0, "bytes": 20e9, "floor_ms": 6.0},
      {"op": "adam", "case": "llama1.2b", "variant": "fuseopt_step", "is_baseline": False, "ms": 7.0},
      {"op": "muon", "case": "llama1.2b", "variant": "optax_muon", "is_baseline": True, "ms": 200.0},
  ]
  torch_rows = [
      {"op": "adam", "case": "llama1.2b", "variant": "torch_adamw_fused", "is_baseline": False, "ms": 11.0},
      {"op": "adam", "case": "other", "variant": "torch_adamw_fused", "is_baseline": False, "ms": 1.0},
      {"op": "muon", "case": "llama1.2b", "variant": "torch_muon", "is_baseline": False, "error": "x"},
  ]
  merged = tb.merge_rows(rows, torch_rows)
  assert [r["variant"] for r in merged] == [
      "optax_adamw_fp32", "fuseopt_step", "torch_adamw_fused", "optax_muon", "torch_muon"]
  t = merged[2]
  assert t["ratio_to_baseline"] == 1.1 and t["baseline_ms"] == 10.0
  assert abs(t["gbps"] - 20e9 / 11e-3 / 1e9) < 1e-9 and abs(t["fraction_of_floor"] - 6 / 11) < 1e-12
  assert "ratio_to_baseline" not in merged[4]  # an errored baseline keeps its error, no ratio
  report.validate(report.make_results({"device_kind": "x", "platform": "gpu", "size": "full",
                                       "jax": "0.11.2"}, {}, merged, {}))


def test_torch_rows_say_what_they_store_and_move():
  tb = _torch_baselines_module()
  for name, meta in tb.ROWS.items():
    assert meta["stores"] and meta["calls"], name
  assert {k: (v["stored_bytes_per_param"], v.get("moved_bytes_per_param")) for k, v in tb.ROWS.items()} == {
      "torch_adamw_fused": (12, 28), "torch_adamw_foreach": (12, 28),
      "torch_adamw_fused[bf16_moments]": (8, 20),   # fuseopt_step's format: p fp32, moments bf16
      "torch_muon+adamw_fused": (None, None)}       # 4 + the state measured, filled in on the run
  assert tb.ROWS["torch_adamw_fused[bf16_moments]"]["state_dtype"] == "bfloat16"


def test_torch_tree_split_matches_the_muon_case():
  tb = _torch_baselines_module()
  leaves = list(tb._leaves(workloads.llama_shapes()))
  assert len(leaves) == 147
  assert sum(tb._is_muon_matrix(p, s) for p, s in leaves) == 112  # q/k/v/o, gate/up/down x 16
