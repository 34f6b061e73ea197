"""pytest-benchmark suite: one hybrid Muon + AdamW step on the Llama-shaped
tree (1.20 B on a GPU/TPU, scaled down on the CPU); every variant of
fuseopt.benchmarks.cases.muon, with XLA's temp memory in ``extra_info``."""


import jax
import jax.numpy as jnp
import pytest

from benchutil import CaseTable

from fuseopt.benchmarks import workloads

from fuseopt.benchmarks.cases import muon as muon_cases  # noqa: E402

TABLE = CaseTable(muon_cases.cases)
_CASES = TABLE.by_size


@TABLE.parametrize
def test_muon_step(bench_variant, bench_size, name, variant):
  case = TABLE.get(bench_size, name, variant)
  info = bench_variant(case, variant)
  assert info["temp_bytes"] >= 0


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_fuseopt_muon_step_lowers(platform):
  """Dry run of the accelerator rows: fuseopt's Muon step on the CPU tree
  lowers for an H200 / a TPU v5e with the Pallas NS kernels inside."""
  from tests.kernels import harness
  impl = "triton" if platform == "gpu" else "mosaic_tpu"
  target = harness.targets_for(impl)[0]
  from fuseopt.optim import muon_transforms as fmuon
  tx = fmuon.muon(learning_rate=0.02, ns_coeffs="jordan", muon_weight_dimension_numbers=muon_cases.muon_dims,
                  execution=fmuon.Execution(implementation=impl))
  struct = workloads.llama_tree_cpu(jnp.float32, abstract=True)
  state = jax.eval_shape(tx.init, struct)
  harness.lower_for(target, muon_cases.step_fn(tx), struct, struct, state)
