"""pytest-benchmark suite: stochastic rounding fp32 → bf16 (6 B/element);
every variant of every case of fuseopt.benchmarks.cases.stochastic_round."""

import jax
import pytest

from fuseopt.benchmarks.cases import stochastic_round as sr_cases

_PLATFORM = jax.default_backend()
_CASES = {size: sr_cases.cases(size, _PLATFORM) for size in ("quick", "full")}
_IDS = sorted({(c.name, v) for cs in _CASES.values() for c in cs for v in c.variants})


@pytest.mark.parametrize("name,variant", _IDS, ids=[f"{n}-{v}" for n, v in _IDS])
def test_stochastic_round(bench_variant, bench_size, name, variant):
  case = next((c for c in _CASES[bench_size] if c.name == name), None)
  if case is None or variant not in case.variants:
    pytest.skip(f"{name}/{variant} is not a {bench_size} case")
  info = bench_variant(case, variant)
  assert info["output_bytes"] == 2 * int(name)  # bf16 out: the op writes nothing else
