"""Test-wide set-up: 8 emulated CPU devices (for shard_map tests)."""
import os

# Tests execute on the CPU; the compile tier (tests/compile) reaches the TPU and
# GPU compilers without making them the default backend.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from fuseopt import targets  # noqa: E402  (jax-free at import)

targets.report_ptxas()   # before XLA first logs: ptxas's spill report for tests/compile

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

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
