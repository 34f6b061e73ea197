"""fuseopt.benchmarks.peak_buffers reads XLA's dump back into the peak of
the temp allocation (here of a CPU program whose temporaries are known)."""

import json
import os
import subprocess
import sys
import textwrap

from fuseopt.benchmarks import peak_buffers

_PROGRAM = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp

    def step(x):
      # Two sorted copies live together (16 MiB each), then one more.
      a = jnp.sort(x * 2.0)
      b = jnp.sort(x * 3.0)
      c = jnp.sort(a * b)
      return c[0] + a[1] + b[2]

    x = jax.ShapeDtypeStruct((4 << 20,), jnp.float32)
    compiled = jax.jit(step).lower(x).compile()
    print(json.dumps({"temp": compiled.memory_analysis().temp_size_in_bytes}))
""")


def test_peak_matches_memory_analysis_and_names_the_buffers(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_dump_to={tmp_path}")
  out = subprocess.run([sys.executable, "-c", _PROGRAM], env=env, capture_output=True,
                       text=True, check=True)
  temp = json.loads(out.stdout.strip().splitlines()[-1])["temp"]
  peak = peak_buffers.peak(tmp_path, module="jit_step")
  # The peak of the temp allocation is its size (slices are reused, never exceeded).
  assert 0.9 * temp <= peak.bytes <= temp, (peak.bytes, temp)
  assert peak.live and peak.live[0].size >= 16 << 20
  assert all(a.size >= b.size for a, b in zip(peak.live, peak.live[1:]))
  assert "f32[4194304]" in peak.table()
