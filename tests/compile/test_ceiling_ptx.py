"""The copy ceiling's streaming kernel compiles for the H200 with 128-bit
global accesses only (fuseopt/benchmarks/ceiling.py): its loads and stores in
the PTX XLA emits are ``ld.global.v4`` / ``st.global.v4``, none narrower."""
import pytest

from fuseopt import targets
from fuseopt.benchmarks import ceiling
from fuseopt.benchmarks import ptx_figures


@pytest.mark.skipif(targets.missing("h200") is not None,
                    reason=str(targets.missing("h200")))
@pytest.mark.parametrize("config", ceiling.CONFIGS,
                         ids=lambda c: f"w{c.num_warps}v{c.vectors}p{c.programs_per_sm}")
def test_stream_moves_128_bit_vectors_on_h200(config):
  ptx = ptx_figures.stream_ptx("h200", config=config)
  got = ptx_figures.accesses(ptx)
  # Each thread moves ``vectors`` 4-fp32 vectors a loop step, in and out,
  # and nothing narrower.
  assert ptx_figures.histogram(got, "ld") == {"128": config.vectors}, got
  assert ptx_figures.histogram(got, "st") == {"128": config.vectors}, got
  # The persistent grid: one loop over blocks, inside the kernel.
  assert "bra" in ptx
