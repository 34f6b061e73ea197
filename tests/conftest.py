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
