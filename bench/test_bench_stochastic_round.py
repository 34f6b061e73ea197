"""pytest-benchmark suite: stochastic rounding fp32 → bf16 (6 B/element);
every variant of every case of fuseopt.benchmarks.cases.stochastic_round."""


from benchutil import CaseTable

from fuseopt.benchmarks.cases import stochastic_round as sr_cases

TABLE = CaseTable(sr_cases.cases)
_CASES = TABLE.by_size


@TABLE.parametrize
def test_stochastic_round(bench_variant, bench_size, name, variant):
  case = TABLE.get(bench_size, name, variant)
  info = bench_variant(case, variant)
  assert info["output_bytes"] == 2 * int(name)  # bf16 out: the op writes nothing else
