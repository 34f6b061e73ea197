"""pytest-benchmark suite: Newton–Schulz (5 steps, bf16 input); every variant
of every case of fuseopt.benchmarks.cases.newton_schulz (CPU: small shapes)."""

import math

import jax
import pytest

from benchutil import CaseTable

from fuseopt.benchmarks.cases import newton_schulz as ns_cases

TABLE = CaseTable(ns_cases.cases)
_CASES = TABLE.by_size


@TABLE.parametrize
def test_newton_schulz(bench_variant, bench_size, name, variant):
  case = TABLE.get(bench_size, name, variant)
  info = bench_variant(case, variant)
  # bf16 in, bf16 out of the same shape: the op returns nothing else.
  assert info["output_bytes"] == 2 * math.prod(int(d) for d in name.split("x"))


def test_newton_schulz_check():
  """The case's correctness check passes on the CPU shapes (kernel vs reference
  vs optax)."""
  from fuseopt.benchmarks import core
  case = _CASES["quick"][1]  # a wide shape: standard and Gram variants
  outs = {}
  for label, build in case.variants.items():
    fn, args, _ = core.build_variant(build)
    outs[label] = fn(*args)
  figures = case.check(outs)
  assert core.check_passed(figures), figures


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_accelerator_variants_lower(platform):
  """Dry run of the accelerator rows without one: every variant of the
  stacked and the wide anchor shapes lowers for an H200 / a TPU v5e."""
  import jax.numpy as jnp
  from tests.kernels import harness
  target = harness.targets_for("triton" if platform == "gpu" else "mosaic_tpu")[0]
  for shape in ((16, 2048, 2048), (2048, 8192)):
    for label, fn in ns_cases.variant_fns(shape, platform).items():
      harness.lower_for(target, fn, jax.ShapeDtypeStruct(shape, jnp.bfloat16),
                        expect_kernel=label.startswith("fuseopt[") and "xla" not in label)


def test_ns_configs_script_dry_run(tmp_path):
  """bench/ns_configs.py (every kernel config once on a device) works: a tiny
  interpret-mode run, every record correct."""
  import importlib.util
  import json
  from pathlib import Path
  path = Path(__file__).with_name("ns_configs.py")
  spec = importlib.util.spec_from_file_location("ns_configs", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  out = tmp_path / "ns_configs.json"
  assert mod.main([str(out), "--interpret"]) == 0
  summary = json.loads(out.read_text())
  assert summary["records"] and not summary["failed"]
  assert set(summary["best"]) == {"gram", "poly", "update", "fused"}
