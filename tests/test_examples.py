"""The examples: smoke runs of a few steps. examples/char_lm.py and
examples/quality.py (flax nnx) with every optimizer; examples/train_lm.py
(plain JAX) with three formats, and bench/largest_model.py's dry run, whose
JSON ``fuseopt report`` renders into docs/training.md."""

import importlib.util
import json
import math
import subprocess
import sys
import types
from pathlib import Path

import jax
import pytest

needs_flax = pytest.mark.skipif(importlib.util.find_spec("flax") is None, reason="needs flax")

ROOT = Path(__file__).resolve().parents[1]


@needs_flax
def test_char_lm_smoke(capsys):
  spec = importlib.util.spec_from_file_location("char_lm", ROOT / "examples" / "char_lm.py")
  char_lm = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(char_lm)
  text = char_lm.corpus(50)
  assert text == char_lm.corpus(50) and text.count(".") == 50  # generated, deterministic
  results = char_lm.main(["--steps", "3", "--d", "16", "--layers", "1", "--heads", "2", "--seq", "8",
                          "--batch", "2", "--no-plot"])
  assert list(results) == ["optax AdamW", "fuseopt AdamW (bf16, fused)", "optax Muon", "fuseopt builder hybrid"]
  first = {name: losses[0] for name, (losses, _) in results.items()}
  assert len(set(first.values())) == 1  # same initial model and batch for every optimizer
  for losses, ms in results.values():
    assert len(losses) == 3 and all(math.isfinite(l) for l in losses) and min(ms) > 0
  assert "ms/step" in capsys.readouterr().out


@needs_flax
def test_char_lm_bf16_params_smoke():
  spec = importlib.util.spec_from_file_location("char_lm", ROOT / "examples" / "char_lm.py")
  char_lm = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(char_lm)
  results = char_lm.main(["--steps", "3", "--d", "16", "--layers", "1", "--heads", "2", "--seq", "8",
                          "--batch", "2", "--no-plot", "--bf16-params"])
  assert list(results) == ["fp32 params", "bf16, round to nearest (optax)",
                           "bf16, stochastic rounding", "bf16 + mantissa companion"]
  for losses, _ in results.values():
    assert len(losses) == 3 and all(math.isfinite(l) for l in losses)
  # The first loss is the model's before any update: bf16 runs share theirs.
  bf16 = [losses[0] for name, (losses, _) in results.items() if name != "fp32 params"]
  assert len(set(bf16)) == 1


@needs_flax
def test_char_lm_moments_smoke():
  spec = importlib.util.spec_from_file_location("char_lm", ROOT / "examples" / "char_lm.py")
  char_lm = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(char_lm)
  results = char_lm.main(["--steps", "3", "--d", "256", "--layers", "1", "--heads", "2", "--seq", "8",
                          "--batch", "2", "--no-plot", "--moments", "fp32,int8"])
  assert list(results) == ["fuseopt AdamW, fp32 moments", "fuseopt AdamW, int8 moments"]
  for losses, _ in results.values():
    assert len(losses) == 3 and all(math.isfinite(l) for l in losses)
  assert results["fuseopt AdamW, fp32 moments"][0][0] == results["fuseopt AdamW, int8 moments"][0][0]


@needs_flax
def test_quality_smoke(capsys, monkeypatch):
  spec = importlib.util.spec_from_file_location("quality", ROOT / "examples" / "quality.py")
  quality = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(quality)
  assert quality.parse([]).mode_list == list(quality.MODES)  # the study runs every mode

  def broken(lr, wd, seed):
    raise ValueError("a format this build lacks")
  monkeypatch.setitem(quality.MODES, "broken", quality.Mode("a format to come", quality.jnp.float32, broken))
  modes = ["fp32", "master24", "flashoptim", "broken"]
  out = quality.main(["--modes", ",".join(modes), "--steps", "2", "--layers", "1", "--heads", "2",
                      "--seq", "8", "--batch", "2", "--seeds", "0", "--eval-windows", "2"])
  printed = capsys.readouterr().out
  assert list(out["modes"]) == modes and out["summary"]["reference"] == "fp32"
  assert not out["modes"]["broken"]["available"]
  assert "broken" in printed and "not available in this build (ValueError: a format this build lacks)" in printed
  for name in ("fp32", "master24"):
    assert math.isfinite(out["modes"][name]["heldout"]["0"])
  peer = out["modes"]["flashoptim"]  # flashoptim-jax is the bench extra's, maybe not installed here
  assert math.isfinite(peer["heldout"]["0"]) if peer["available"] else "not available" in peer["verdict"]


def _module(name: str, path: Path):
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


TINY = ["--d", "64", "--ff", "128", "--layers", "2", "--heads", "2", "--seq", "16", "--batch", "2",
        "--steps", "3", "--quiet"]


# (optimizer, B/param of params + grads + state on the tiny model: its embedding and head,
# AdamW's on the Muon side, weigh more than at scale); the first also times the update alone
# and reports the held-out loss (two more programs: one case pays for them).
TRAIN_LM_CASES = [("fo-int4", 9.06, 9.2), ("optax-adamw", 16.0, 16.0), ("fo-muon-int8", 5.02, 6.0)]


@pytest.mark.parametrize("optimizer,low,high", TRAIN_LM_CASES)
def test_train_lm_smoke(optimizer, low, high, tmp_path):
  train_lm = _module("train_lm", ROOT / "examples" / "train_lm.py")
  out = tmp_path / "run.json"
  first = optimizer == TRAIN_LM_CASES[0][0]
  extra = ["--timing", "opt", "--eval-batches", "1"] if first else ["--timing", "none"]
  rec = train_lm.main(TINY + ["--optimizer", optimizer, "--remat", "--vocab", "320",
                              "--json", str(out)] + extra)
  assert rec["status"] == "ok" and json.loads(out.read_text())["status"] == "ok"
  losses = rec["runs"][0]["losses"]
  assert len(losses) == 3 and all(math.isfinite(l) for l in losses) and rec["tokens_per_s"] > 0
  if first:
    assert math.isfinite(rec["runs"][0]["heldout_loss"]) and rec["timing"]["opt_alone_ms"] > 0
  assert rec["optimizer"]["params"] == ("bfloat16" if optimizer == "fo-muon-int8" else "float32")
  assert low - 0.01 <= rec["bytes"]["bytes_per_param"] <= high + 0.01


def test_largest_model_search_brackets_then_bisects():
  lm = _module("largest_model", ROOT / "bench" / "largest_model.py")
  for true in (1, 5, 13):
    for guess in (1, 6, 40):
      calls = []
      found = lm.search({}, lambda n: calls.append(n) or n <= true, guess, 64)
      assert found == (true, True) and len(calls) == len(set(calls))
  assert lm.search({}, lambda n: False, 5, 64) == (None, True)
  assert lm.search({}, lambda n: True, 5, 20) == (20, True)
  assert lm.search({3: True, 4: False}, lambda n: pytest.fail("no trial needed"), 9, 64) == (3, True)
  assert lm.search({}, lambda n: None, 5, 64) == (None, False)  # out of budget


def test_largest_model_dry_run_renders(tmp_path):
  from fuseopt.benchmarks import training_report
  out = tmp_path / "results"
  subprocess.run([sys.executable, "bench/largest_model.py", str(out), "--dry-run", "--modes",
                  "fo-int4"], cwd=ROOT, check=True, capture_output=True, text=True)
  data = json.loads((out / "cpu" / "largest_model.json").read_text())
  m = data["modes"]["fo-int4"]
  assert m["complete"] and m["largest_layers"] >= 1 and data["dry_run"]
  assert any(t["trains"] and t["status"] == "ok" for t in m["trials"])
  assert m["first_failing_layers"] is None or m["first_failing_layers"] > m["largest_layers"]
  page = tmp_path / "training.md"
  page.write_text((ROOT / "docs" / "training.md").read_text())
  training_report.render(page, out)  # a dry run is left out by default
  assert page.read_text().count("_Not yet run:") == 4
  assert training_report.render(page, out, include_dry_run=True) is True
  text = page.read_text()
  assert "| `fo-int4` `fo.adamw(lr, moment_dtype=\"int4\")`, float32 params | 9.0" in text
  assert "a CPU dry run, not a measurement" in text
  assert text.count("_Not yet run:") == 3  # the compiled, speed and quality tables


def test_training_report_speed_and_quality_tables():
  from fuseopt.benchmarks import training_report as tr
  base = {"schema": tr.SCHEMA, "family": {"d": 64, "ff": 128, "heads": 2, "vocab": 256, "seq": 16,
                                          "batch": 2}, "device": {"device_kind": "TPU v5 lite"},
          "steps": 20, "date": "2026-12-07", "command": "python bench/largest_model.py"}
  speed = dict(base, kind="fixed", layers=6, modes={
      "fo-int8": {"status": "ok", "tokens_per_s": 1234.0, "step_ms": 10.0,
                  "memory": {"peak_bytes_in_use": 2**30},
                  "timing": {"fwd_bwd_ms": 9.0, "opt_in_step_ms": 1.0, "opt_share": 0.1,
                             "opt_alone_ms": 1.2}}})
  row = tr.speed_markdown(speed).splitlines()[4]
  assert row == "| `fo-int8` | 1,234 | 10.00 | 9.00 | 1.00 (10.0%) | 1.20 | 1.00 GiB | ok |"
  quality = dict(base, kind="quality", seeds=[0, 1], modes={
      "optax-adamw": {"heldout": {"0": 1.50, "1": 1.52}}, "fo-int4": {"heldout": {"0": 1.53, "1": 1.57}},
      "fo-int8": {"status": "timeout"}})
  lm = _module("largest_model", ROOT / "bench" / "largest_model.py")
  quality["summary"] = lm.summarise_quality(quality["modes"])
  text = tr.quality_markdown(quality)
  assert "| `optax-adamw` | 1.5100 ± 0.0141 | 1.5000, 1.5200 | - | yardstick |" in text
  assert "| `fo-int4` | 1.5500 ± 0.0283 | 1.5300, 1.5700 | +0.0400 | **outside**" in text
  assert "| `fo-int8` | - | - | - | timeout |" in text
  assert tr.markdown("fixed", []).startswith("_Not yet run: `PYTHONPATH=$PWD python bench/largest_model.py --fixed-layers")


def test_train_lm_compiles_for_a_tpu_without_one(tmp_path):
  """``--compile-for v5e``: the donated train step compiled by libtpu with no
  chip; a model that does not fit the chip is refused at compile time, as on
  the chip (status oom), one that fits reports its compiled memory."""
  from fuseopt import targets
  why = targets.missing("v5e")
  if why:
    pytest.skip(why)
  train_lm = _module("train_lm", ROOT / "examples" / "train_lm.py")
  rec = train_lm.main(TINY + ["--optimizer", "fo-muon-int8", "--compile-for", "v5e"])
  assert rec["status"] == "compiled" and rec["compiled_memory"]["temp_size"] > 0
  assert rec["device"]["kind"] == "TPU v5 lite" and "runs" not in rec
  big = ["--d", "2048", "--ff", "8192", "--layers", "24", "--heads", "16", "--vocab", "32000",
         "--seq", "1024", "--batch", "8", "--remat", "--quiet"]
  rec = train_lm.main(big + ["--optimizer", "optax-adamw", "--compile-for", "v5e"])
  assert rec["status"] == "oom" and rec["phase"] == "compile"
  assert "RESOURCE_EXHAUSTED" in rec["error"]


def test_largest_model_starts_where_the_chips_compiler_said(tmp_path):
  """A device run takes the deviceless search's answer (largest_compiled.json,
  the same jax): the first trial at the largest count that compiled, and the
  count the compiler refused is not tried."""
  lm = _module("largest_model", ROOT / "bench" / "largest_model.py")
  family = dict(lm.DRY_FAMILY)
  folder = tmp_path / "cpu"
  folder.mkdir()
  (folder / lm.FILES["compiled"]).write_text(json.dumps(
      {"family": family, "versions": {"jax": jax.__version__},
       "modes": {"fo-int8": {"complete": True, "largest_layers": 3, "first_failing_layers": 4}}}))
  run = types.SimpleNamespace(path=folder / lm.FILES["largest"],
                              args=types.SimpleNamespace(compile_for=None))
  assert lm.compiled_bounds(run, {"jax": jax.__version__}, family) == {"fo-int8": (3, 4)}
  assert lm.compiled_bounds(run, {"jax": "0.0.1"}, family) == {}
  trials = []
  found = lm.search({4: False}, lambda n: trials.append(n) or True, 3, 64)
  assert found == (3, True) and trials == [3]


def test_training_report_compiled_table():
  from fuseopt.benchmarks import training_report as tr
  trial = lambda n, ok, **k: {"layers": n, "trains": ok, "optimizer": {"call": "x"}, **k}
  data = {"schema": tr.SCHEMA, "kind": "largest", "compile_for": "v5e",
          "device": {"device_kind": "TPU v5 lite"}, "versions": {"jax": "0.10.2", "libtpu": "0.0.42.1"},
          "memory_limit_bytes": 16909336064, "modes": {
              "optax-adamw": {"largest_layers": 10, "first_failing_layers": 11,
                              "largest": {"parameters": 802_000_000},
                              "trials": [trial(10, True, compiled_memory={"temp_size": 2**30}),
                                         trial(11, False, error="RESOURCE_EXHAUSTED: Ran out of "
                                               "memory on HBM, the total memory required for HLO "
                                               "temporaries (15.87G) exceeds available HBM")]},
              "fo-muon-int8": {"largest_layers": 38, "first_failing_layers": 39,
                               "largest": {"parameters": 2_686_000_000}, "trials": [trial(38, True)]}}}
  text = tr.compiled_markdown(data)
  assert "| 10 | 802.0 M | 1.00× | 1.00 GiB | 11 layers, needed 15.87G |" in text
  assert "| 38 | 2.69 B | 3.35× | - | 39 layers |" in text
  assert "libtpu 0.0.42.1" in text and "15.75 GiB" in text
