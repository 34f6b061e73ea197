"""pytest-benchmark suite: one hybrid Muon + AdamW step on the Llama-shaped
tree (1.20 B on a GPU/TPU, scaled down on the CPU); every variant of
fuseopt.benchmarks.cases.muon, with XLA's temp memory in ``extra_info``."""

import importlib

import jax
import jax.numpy as jnp
import pytest

from fuseopt.benchmarks import workloads

muon_cases = importlib.import_module("fuseopt.benchmarks.cases.muon")

_PLATFORM = jax.default_backend()
_CASES = {size: muon_cases.cases(size, _PLATFORM) for size in ("quick", "full")}
_IDS = sorted({(c.name, v) for cs in _CASES.values() for c in cs for v in c.variants})


@pytest.mark.parametrize("name,variant", _IDS, ids=[f"{n}-{v}" for n, v in _IDS])
def test_muon_step(bench_variant, bench_size, name, variant):
  case = next((c for c in _CASES[bench_size] if c.name == name), None)
  if case is None or variant not in case.variants:
    pytest.skip(f"{name}/{variant} is not a {bench_size} case")
  info = bench_variant(case, variant)
  assert info["temp_bytes"] >= 0


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_fuseopt_muon_step_lowers(platform):
  """Dry run of the accelerator rows: fuseopt's Muon step on the CPU tree
  lowers for an H200 / a TPU v5e with the Pallas NS kernels inside."""
  from tests.kernels import harness
  impl = "triton" if platform == "gpu" else "mosaic_tpu"
  target = harness.targets_for(impl)[0]
  fmuon = importlib.import_module("fuseopt.optim.fused_muon")
  tx = fmuon.muon(learning_rate=0.02, coeffs="jordan", implementation=impl,
                  muon_weight_dimension_numbers=muon_cases.muon_dims)
  struct = workloads.llama_tree_cpu(jnp.float32, abstract=True)
  state = jax.eval_shape(tx.init, struct)
  harness.lower_for(target, muon_cases.step_fn(tx), struct, struct, state)
