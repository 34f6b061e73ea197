"""The copy ceiling's streaming kernel (interpret mode), its measurements on
the CPU, and the nvidia-smi clocks/power record (fuseopt/benchmarks/ceiling.py)."""

import subprocess

import jax.numpy as jnp
import numpy as np
import pytest

from fuseopt.benchmarks import ceiling, environment

SMALL = ceiling.StreamConfig(num_warps=1, vectors=1, programs_per_sm=1)   # block 128


@pytest.mark.parametrize("blocks,sms", [(7, 3), (4, 4), (2, 5), (1, 1)])
def test_stream_computes_every_block_once(blocks, sms):
  # 7 blocks over 3 programs: the grid-stride loop runs 3, 2 and 2 steps;
  # more programs than blocks: one program a block.
  n = blocks * SMALL.block
  # Distinct integers: x * 3 - 1.25 is exact, however XLA:CPU contracts it.
  x = jnp.asarray(np.random.default_rng(0).permutation(n) - n // 2, jnp.float32)
  got = ceiling.stream(x, config=SMALL, num_sms=sms, scale=3.0, shift=-1.25, interpret=True)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(x) * np.float32(3.0) - np.float32(1.25))


def test_stream_with_a_default_config():
  config = ceiling.CONFIGS[0]
  assert config.block == 4 * 32 * config.num_warps * config.vectors
  x = jnp.arange(3 * config.block, dtype=jnp.float32)
  got = ceiling.stream(x, config=config, num_sms=1, interpret=True)
  np.testing.assert_allclose(np.asarray(got), np.asarray(x) * np.float32(1.0001) + np.float32(0.5),
                             rtol=1e-6)


def test_stream_refuses_what_it_does_not_move():
  with pytest.raises(ValueError, match="multiple of the block"):
    ceiling.stream(jnp.ones((SMALL.block + 4,), jnp.float32), config=SMALL, num_sms=1, interpret=True)
  with pytest.raises(ValueError, match="fp32"):
    ceiling.stream(jnp.ones((SMALL.block,), jnp.bfloat16), config=SMALL, num_sms=1, interpret=True)
  with pytest.raises(ValueError, match="vectors"):
    ceiling.StreamConfig(vectors=3)


def test_copy_ceilings_on_a_gpu_records_the_pallas_kernel(monkeypatch):
  # The GPU path on the CPU: the kernel in interpret mode, one "SM".
  monkeypatch.setattr(ceiling, "num_sms", lambda device=None: 1)
  monkeypatch.setattr(ceiling, "CONFIGS", (SMALL, ceiling.StreamConfig(1, 1, 2)))
  got = ceiling.copy_ceilings("gpu", calls=1, reps=1, n=4 * SMALL.block, interpret=True)
  for key in ("copy_gbps_xla_copy", "copy_gbps_xla_axpy", "copy_gbps_pallas_stream"):
    assert got[key] > 0, key
  assert "block=128" in got["pallas_stream_config"]
  assert not [k for k in got if k.endswith("_error")]


def test_copy_ceilings_elsewhere_are_xla_only():
  got = ceiling.copy_ceilings("cpu", calls=1, reps=1, n=1 << 12)
  assert got["copy_gbps_xla_copy"] > 0 and got["copy_gbps_xla_axpy"] > 0
  assert not [k for k in got if "pallas" in k]


def test_measure_ceilings_takes_the_best_and_names_it(monkeypatch):
  from fuseopt.benchmarks import core
  fake = {"copy_stream_elements": 8, "copy_gbps_xla_copy": 5.0, "copy_gbps_xla_axpy": 7.0,
          "copy_gbps_pallas_stream": 1e6}
  monkeypatch.setattr(ceiling, "copy_ceilings", lambda *a, **k: dict(fake))
  got = ceiling.measure_ceilings("cpu", quick=True)
  assert got["copy_gbps"] == 1e6 and got["copy_ceiling_source"] == "pallas_stream"
  assert got["copy_gbps_xla_scale_shift"] > 0 and got["copy_gbps_xla_axpy"] == 7.0
  assert got["matmul_tflops"] > 0


SMI = """
==============NVSMI LOG==============

Timestamp                                 : Fri Dec  4 10:00:00 2026
Driver Version                            : 550.54.15
CUDA Version                              : 12.4

Attached GPUs                             : 1
GPU 00000000:19:00.0
    Clocks
        Graphics                          : 1755 MHz
        SM                                : 1755 MHz
        Memory                            : 3201 MHz
        Video                             : 1545 MHz
    Applications Clocks
        Graphics                          : 1980 MHz
        Memory                            : 3201 MHz
    Default Applications Clocks
        Graphics                          : 1980 MHz
        Memory                            : 3201 MHz
    Deferred Clocks
        Memory                            : N/A
    Max Clocks
        Graphics                          : 1980 MHz
        SM                                : 1980 MHz
        Memory                            : 3201 MHz
        Video                             : 1545 MHz
    Max Customer Boost Clocks
        Graphics                          : 1980 MHz
    SM Clock Samples
        Duration                          : Not Found
        Max                               : Not Found
    GPU Power Readings
        Average Power Draw                : 412.50 W
        Instantaneous Power Draw          : 420.10 W
        Current Power Limit               : 700.00 W
        Requested Power Limit             : 700.00 W
        Default Power Limit               : 700.00 W
        Min Power Limit                   : 200.00 W
        Max Power Limit                   : 700.00 W
    Power Samples
        Duration                          : 2.38 sec
        Max                               : 430.51 W
    GPU Memory Power Readings 
        Power Draw                        : N/A
    Module Power Readings
        Power Draw                        : 999.00 W
        Current Power Limit               : N/A
"""


def test_clocks_and_power_are_parsed():
  [gpu] = environment.parse_clocks_and_power(SMI)
  assert gpu["bus_id"] == "00000000:19:00.0"
  assert gpu["clocks"] == {"graphics_mhz": 1755.0, "sm_mhz": 1755.0, "memory_mhz": 3201.0}
  assert gpu["max_clocks"] == {"graphics_mhz": 1980.0, "sm_mhz": 1980.0, "memory_mhz": 3201.0}
  assert gpu["application_clocks"] == {"graphics_mhz": 1980.0, "memory_mhz": 3201.0}
  # The GPU's own readings; the module's and the samples' are not taken.
  assert gpu["power"] == {"average_power_draw_w": 412.5, "power_draw_w": 420.1,
                          "current_power_limit_w": 700.0, "max_power_limit_w": 700.0}


def test_clocks_and_power_absent_without_nvidia_smi(monkeypatch):
  monkeypatch.setattr(environment.shutil, "which", lambda name: None)
  assert environment.clocks_and_power() is None


def test_clocks_and_power_keep_the_raw_text_and_never_raise(monkeypatch):
  monkeypatch.setattr(environment.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
  monkeypatch.setattr(environment.subprocess, "run",
                      lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=SMI, stderr=""))
  got = environment.clocks_and_power()
  assert got["raw"] == SMI and got["gpus"][0]["max_clocks"]["sm_mhz"] == 1980.0

  def fails(*a, **k):
    raise subprocess.CalledProcessError(9, "nvidia-smi")
  monkeypatch.setattr(environment.subprocess, "run", fails)
  assert environment.clocks_and_power() is None


def test_run_meta_records_clocks_only_where_nvidia_smi_is(monkeypatch):
  from fuseopt.benchmarks import core
  monkeypatch.setattr(environment, "clocks_and_power", lambda: None)
  assert "clocks_power" not in core.run_meta("quick")
  monkeypatch.setattr(environment, "clocks_and_power", lambda: {"raw": "x", "gpus": []})
  assert core.run_meta("quick")["clocks_power"] == {"raw": "x", "gpus": []}
