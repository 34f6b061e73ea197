"""Test-wide set-up: 8 emulated CPU devices (for shard_map tests)."""
import os
import platform

# Tests execute on the CPU; the compile tier (tests/compile) reaches the TPU and
# GPU compilers without making them the default backend.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from fuseopt import targets  # noqa: E402  (jax-free at import)

targets.report_ptxas()   # before XLA first logs: ptxas's spill report for tests/compile

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# XLA:CPU contracts a multiply and an add into one fused multiply-add wherever
# the instruction set has FMA, and which products it contracts depends on the
# program around them (docs/testing.md, "FMA"). The tests run where users
# stand, FMA on (XLA's default on every current CPU): fuseopt's XLA arithmetic
# rounds every product that feeds an add where it stands, so its contracts
# (sharded = unsharded, mantissa = fp32, ...) hold there. FUSEOPT_TEST_FMA=0
# runs an x86-64 instruction set without FMA, where every multiply and add
# round as written: what the tests marked `fma_off` need (a Pallas kernel's
# body in interpret mode against the reference, bit for bit, or optax's own
# unfenced program), and what CI's floor leg runs.
FMA_OFF = os.environ.get("FUSEOPT_TEST_FMA") == "0" or "xla_cpu_max_isa" in os.environ["XLA_FLAGS"]
if FMA_OFF and platform.machine().lower() in ("x86_64", "amd64") and (
    "xla_cpu_max_isa" not in os.environ["XLA_FLAGS"]):
  os.environ["XLA_FLAGS"] += " --xla_cpu_max_isa=AVX"
FMA_OFF = FMA_OFF and platform.machine().lower() in ("x86_64", "amd64")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "fma_off: compares two programs bit for bit where neither rounds its products "
      "where they stand (a Pallas kernel's body in interpret mode, optax's own program): runs "
      "with FUSEOPT_TEST_FMA=0 (XLA:CPU without FMA, docs/testing.md), skipped with FMA on")
  config.addinivalue_line(
      "markers", "fresh_inputs: draws fresh random inputs every run (harness.fresh_key); "
      "set on collection, selected by scripts/seed-sweep")
  config.addinivalue_line(
      "markers", "mosaic_gpu_refusal: a Mosaic GPU test that checks what fuseopt refuses or "
      "chooses without running a Mosaic GPU kernel: runs on every release (the others, every "
      "test whose id names mosaic_gpu, skip where jax's Mosaic GPU lacks what the kernels use)")


def pytest_collection_modifyitems(config, items):
  """Marks the tests that draw fresh random inputs, so that the seed sweep
  (scripts/seed-sweep, docs/testing.md) runs only the tests whose inputs
  change between runs; skips what the installed release cannot run (FMA,
  Mosaic GPU)."""
  import inspect
  import pytest
  from fuseopt import compat
  fma_skip = pytest.mark.skip(reason="needs XLA:CPU without FMA (FUSEOPT_TEST_FMA=0; docs/testing.md)")
  # A release whose Mosaic GPU lacks what fuseopt's kernels use (jax 0.10.2):
  # the mosaic_gpu backend refuses every call there (compat.py), and the tests
  # that run its kernels skip with the same reason.
  mosaic_gpu_reason = compat.mosaic_gpu_release_reason()
  for item in items:
    if not FMA_OFF and item.get_closest_marker("fma_off") is not None:
      item.add_marker(fma_skip)
    if (mosaic_gpu_reason and "mosaic_gpu" in item.nodeid
        and item.get_closest_marker("mosaic_gpu_refusal") is None):
      item.add_marker(pytest.mark.skip(reason=mosaic_gpu_reason))
    fn = getattr(item, "function", None)
    try:
      fresh = fn is not None and "fresh_key(" in inspect.getsource(fn)
    except (OSError, TypeError):
      fresh = False
    if fresh:
      item.add_marker(pytest.mark.fresh_inputs)
