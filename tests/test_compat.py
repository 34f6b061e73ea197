"""The supported-release machinery: the compat shim, per-release figures and
baselines, and the declared ranges (docs/compatibility.md)."""

import json
import re
import tomllib
from pathlib import Path

import jax
import pytest

from fuseopt.kernels import interpret
from fuseopt.benchmarks import compile_results, regression

ROOT = Path(__file__).resolve().parents[1]


def test_tpu_interpret_params_detect_races_where_the_release_raises():
  params = interpret.tpu_params(detect_races=True)
  if interpret.raises_on_race():                 # jax >= 0.12
    assert params.detect_races and params.on_race == "raise"
  else:                                          # 0.11.2: no public way to raise
    assert not params.detect_races and not hasattr(params, "on_race")
  assert not interpret.tpu_params(detect_races=False).detect_races
  # An explicit on_race is accepted on every release (dropped where unknown).
  interpret.tpu_params(detect_races=False, on_race="raise")


def test_interpret_arg_takes_the_environment(monkeypatch):
  from fuseopt.kernels import dispatch
  monkeypatch.setenv("FUSEOPT_DETECT_RACES", "1")
  params = dispatch.interpret_arg("mosaic_tpu", True)
  assert params.detect_races == interpret.raises_on_race()
  monkeypatch.setenv("FUSEOPT_DETECT_RACES", "0")
  assert not dispatch.interpret_arg("mosaic_tpu", True).detect_races
  assert dispatch.interpret_arg("triton", True) is True
  assert dispatch.interpret_arg("mosaic_tpu", False) is False


def _doc(jax_version, **cases):
  return {"schema": compile_results.SCHEMA, "environment": {"jax": jax_version}, "cases": cases}


def test_compiled_figures_are_kept_per_release(tmp_path):
  here = jax.__version__
  legacy = tmp_path / "v6e.json"
  keyed = tmp_path / f"jax-{here}" / "v6e.json"
  # Only another release's legacy file: read (not enforced), never written over.
  legacy.write_text(json.dumps(_doc("0.0.1")))
  assert compile_results.results_path("v6e", tmp_path) == legacy
  assert compile_results.write_path("v6e", tmp_path) == keyed
  assert not compile_results.versions_match(compile_results.load("v6e", tmp_path))
  # The running release's own file wins.
  keyed.parent.mkdir()
  keyed.write_text(json.dumps(_doc(here)))
  assert compile_results.results_path("v6e", tmp_path) == keyed
  # A legacy file of the running release is its file.
  keyed.unlink()
  legacy.write_text(json.dumps(_doc(here)))
  assert compile_results.results_path("v6e", tmp_path) == compile_results.write_path("v6e", tmp_path) == legacy


def test_cpu_baseline_is_kept_per_release(tmp_path, monkeypatch):
  monkeypatch.delenv("FUSEOPT_BASELINE", raising=False)
  monkeypatch.setattr(regression, "repo_root", lambda: tmp_path)
  (tmp_path / "bench/baseline").mkdir(parents=True)
  legacy = tmp_path / "bench/baseline/cpu.json"
  keyed = tmp_path / f"bench/baseline/cpu-jax-{jax.__version__}.json"
  legacy.write_text(json.dumps({"meta": {"jax": "0.0.1"}}))
  assert regression.default_baseline_path() == legacy
  assert regression.default_baseline_path(write=True) == keyed
  keyed.write_text("{}")
  assert regression.default_baseline_path() == keyed


def test_declared_ranges_and_compiler_sets():
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  deps = project["dependencies"]
  assert "jax>=0.11.2,<0.13" in deps and "jaxlib>=0.11.2,<0.13" in deps
  assert "optax>=0.2.8" in deps
  assert project["requires-python"] == ">=3.12"
  assert project["license"] == "Apache-2.0"
  extras = project["optional-dependencies"]
  pin = lambda extra, name: next(re.sub(r"^[^=]*==", "", d) for d in extras[extra]
                                 if re.match(rf"{re.escape(name)}(\[tpu\])?==", d))
  floor = dict(line.split("==") for line in (ROOT / "scripts/floor-constraints.txt").read_text().split()
               if "==" in line)
  # compile-floor is the floor's compiler set, compile the newest's: each pins its own jax.
  assert pin("compile-floor", "jax") == pin("compile-floor", "jaxlib") == floor["jax"] == "0.11.2"
  assert pin("compile-floor", "jax-cuda12-plugin") == floor["jax"]
  newest = pin("compile", "jax")
  assert pin("compile", "jaxlib") == pin("compile", "jax-cuda12-plugin") == newest
  assert newest.startswith("0.12.") and pin("compile", "libtpu").startswith("0.0.50")
