"""The sharded fused steps under jax.distributed: 2 local CPU processes with 4
devices each (gloo collectives, coordinator on 127.0.0.1) against one process."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from tests.kernels.harness import assert_bitwise_equal
from tests.sharding import multiprocess_case as case

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_match_one(tmp_path):
  out = tmp_path / "result.npz"
  port = _free_port()
  # Each worker sets its own 4 devices; the instruction set stays the one of
  # this process (tests/conftest.py: FMA on, or off with FUSEOPT_TEST_FMA=0), so both
  # sides round alike.
  isa = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.startswith("--xla_cpu_max_isa")]
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), XLA_FLAGS=" ".join(isa))
  worker = Path(__file__).with_name("multiprocess_worker.py")
  procs = [subprocess.Popen([sys.executable, str(worker), str(i), str(port), str(out)],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=TIMEOUT_S)[0])
  except subprocess.TimeoutExpired:
    pytest.fail(f"the 2-process run took over {TIMEOUT_S} s")
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)

  got = np.load(out)
  params, grads = case.inputs()
  adam_p, adam_s = case.adamw_steps(params, grads)
  muon_p = case.muon_steps(params, grads)
  want = {"adam_params": adam_p, "adam_mu": adam_s[0].mu, "adam_nu": adam_s[0].nu,
          "muon_params": muon_p}
  for path, leaf in jax.tree_util.tree_flatten_with_path(want)[0]:
    key = jax.tree_util.keystr(path)
    if key.startswith("['muon"):
      # bf16 NS over differently batched matrices: within the NS's bf16 band
      # (3 steps x lr x sqrt(2) x 2^-6), the AdamW leaves bitwise.
      np.testing.assert_allclose(got[key], np.asarray(leaf, np.float32),
                                 atol=3 * 1e-2 * np.sqrt(2) * 2.0**-6, err_msg=key)
    else:
      assert_bitwise_equal(got[key], np.asarray(leaf, np.float32), key)
