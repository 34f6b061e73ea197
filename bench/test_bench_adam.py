"""pytest-benchmark suite: one AdamW update of the CPU Llama tree; every
variant of fuseopt.benchmarks.cases.adam (optax fp32 / mu bf16, fuseopt
drop-in, the fused step with fp32 and with bf16 params, with 8-bit moments)."""

import numpy as np

from benchutil import CaseTable

from fuseopt.benchmarks.cases import adam as adam_cases

TABLE = CaseTable(adam_cases.cases)
_CASES = TABLE.by_size


@TABLE.parametrize
def test_adam(bench_variant, bench_size, name, variant):
  case = TABLE.get(bench_size, name, variant)
  info = bench_variant(case, variant)
  # The fused step writes params and moments in place: no leaf-sized
  # temporaries (XLA's temp for the optax steps is of the order of 100 bytes).
  # On the CPU 8-bit moments run XLA's reference, whose quantisation blocks
  # are temporaries; the kernels' in-place figure is the compile tier's.
  if variant.startswith("fuseopt_step") and "int8" not in variant:
    assert info["temp_bytes"] < 0.01 * case.state_bytes[variant], info["temp_bytes"]


def test_adam_check_agrees_with_optax():
  """The cases' correctness check on CPU outputs (no timing)."""
  from fuseopt.benchmarks import core
  case = _CASES["quick"][0]
  outs = {}
  for label in ("optax_adamw_fp32", "fuseopt_step"):
    fn, args, refresh = core.build_variant(case.variants[label])
    outs[label] = fn(*args)
  figures = case.check(outs)
  assert figures["ok[fuseopt_step]"] and np.isfinite(figures["rel_err_vs_optax[fuseopt_step]"])
  assert figures["bytes_per_param[fuseopt_step]"] == 20
