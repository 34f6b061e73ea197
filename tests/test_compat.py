"""The supported-release machinery: the compat shim, per-release figures and
baselines, and the declared ranges (docs/compatibility.md)."""

import json
import re
import tomllib
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from fuseopt.kernels import interpret
from fuseopt.benchmarks import compile_results, regression

ROOT = Path(__file__).resolve().parents[1]


def test_tpu_interpret_params_detect_races_where_the_release_raises():
  params = interpret.tpu_params(detect_races=True)
  if interpret.raises_on_race():                 # jax >= 0.12
    assert params.detect_races and params.on_race == "raise"
  else:                                          # 0.10.2, 0.11.2: no public way to raise
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


def _donated_lowering(fn, shape=(16, 256)):
  a = jax.ShapeDtypeStruct(shape, jnp.float32)
  return jax.jit(fn, donate_argnums=0).trace(a).lower()


def test_a_pinned_layout_can_be_a_donated_output():
  """compat.pin_layout's result may be what a donating jit returns on every
  release; a bare with_layout_constraint there raises on jax 0.10.2 ("Input
  layout being donated was None while output layout was AUTO")."""
  from fuseopt import compat
  lowered = _donated_lowering(lambda x: compat.pin_layout(x * 2.0, (1, 0)))
  text = lowered.as_text()
  assert "tf.aliasing_output" in text or "jax.buffer_donor" in text   # the input is donated
  lowered.compile()


def test_muon_leaves_pinned_for_a_tpu_can_be_donated_outputs():
  """A Muon leaf's new parameter pinned to its layout on a TPU (the fused
  step's output) lowers under donation: jax 0.10.2 refused the bare pin."""
  from fuseopt.optim import muon_store
  for shape in ((16, 256), (4, 8, 128)):
    _donated_lowering(lambda x: muon_store.in_leaf_layout(x - 1.0, "tpu"), shape)
    # a mantissa-tracked parameter: a pair, both pinned
    jax.jit(lambda x, y: muon_store.in_leaf_layout((x + 1.0, y), "tpu"),
            donate_argnums=(0, 1)).trace(
                jax.ShapeDtypeStruct(shape, jnp.bfloat16),
                jax.ShapeDtypeStruct(shape, jnp.uint16)).lower()


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
  assert "jax>=0.10.2,<0.13" in deps and "jaxlib>=0.10.2,<0.13" in deps
  assert "optax>=0.2.8" in deps
  assert project["requires-python"] == ">=3.11"
  assert project["license"] == "Apache-2.0"
  extras = project["optional-dependencies"]
  pin = lambda extra, name: next(re.sub(r"^[^=]*==", "", d) for d in extras[extra]
                                 if re.match(rf"{re.escape(name)}(\[tpu\])?==", d))
  floor = dict(line.split("==") for line in (ROOT / "scripts/floor-constraints.txt").read_text().split()
               if "==" in line)
  # compile-floor is the floor's compiler set, compile the newest's: each pins its own jax.
  assert pin("compile-floor", "jax") == pin("compile-floor", "jaxlib") == floor["jax"] == "0.10.2"
  assert pin("compile-floor", "jax-cuda12-plugin") == floor["jax"]
  assert pin("compile-floor", "libtpu") == "0.0.42.1"     # what jax[tpu]==0.10.2 pins
  newest = pin("compile", "jax")
  assert pin("compile", "jaxlib") == pin("compile", "jax-cuda13-plugin") == newest
  assert pin("compile", "jax-cuda13-pjrt") == newest
  # jax[tpu]==0.12.1 asks for libtpu 0.0.53.*, not published: the newest libtpu, pinned beside jax.
  assert newest.startswith("0.12.") and pin("compile", "libtpu") == "0.0.52"
  # ptxas and libdevice of one CUDA release.
  assert pin("compile", "nvidia-cuda-nvcc") == pin("compile", "nvidia-nvvm")
