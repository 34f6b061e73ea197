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
# program around them (since jax 0.12 on the shape of the loop, so a sharded
# and an unsharded step of the same values may differ in the last bit). The
# tests check fuseopt's order of operations, not XLA:CPU's choice of
# contraction: they run on an x86-64 instruction set without FMA
# (docs/testing.md, "XLA:CPU without FMA"). FUSEOPT_TEST_FMA=1 keeps FMA.
if (platform.machine().lower() in ("x86_64", "amd64") and os.environ.get("FUSEOPT_TEST_FMA") != "1"
    and "xla_cpu_max_isa" not in os.environ["XLA_FLAGS"]):
  os.environ["XLA_FLAGS"] += " --xla_cpu_max_isa=AVX"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "fresh_inputs: draws fresh random inputs every run (harness.fresh_key); "
      "set on collection, selected by scripts/seed-sweep")


def pytest_collection_modifyitems(config, items):
  """Marks the tests that draw fresh random inputs, so that the seed sweep
  (scripts/seed-sweep, docs/testing.md) runs only the tests whose inputs
  change between runs."""
  import inspect
  import pytest
  for item in items:
    fn = getattr(item, "function", None)
    try:
      fresh = fn is not None and "fresh_key(" in inspect.getsource(fn)
    except (OSError, TypeError):
      fresh = False
    if fresh:
      item.add_marker(pytest.mark.fresh_inputs)
