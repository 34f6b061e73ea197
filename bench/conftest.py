"""pytest-benchmark suites of fuseopt's bench cases.

  .venv/bin/python -m pytest bench --benchmark-enable            # CPU sizes
  .venv/bin/python -m pytest bench --benchmark-enable --bench-size full

Each test times one variant of one case (``fuseopt.benchmarks.cases``) and
stores, in the benchmark's ``extra_info`` (saved by ``--benchmark-json``),
its case's baseline time measured in the same run, the ratio, the effective
GB/s or TFLOP/s and the fraction of the roofline floor from ceilings
measured in the same pytest run. Without ``--benchmark-enable`` (the project's
default addopts) every variant runs once, as a smoke test.
"""

from __future__ import annotations

import jax
import pytest

from fuseopt.benchmarks import ceiling, core


def pytest_addoption(parser):
  parser.addoption("--bench-size", choices=("quick", "full"), default=None,
                   help="bench case sizes (default: full on GPU/TPU, quick on the CPU)")


@pytest.fixture(scope="session")
def platform():
  return jax.default_backend()


@pytest.fixture(scope="session")
def bench_size(request, platform):
  return request.config.getoption("--bench-size") or core.default_size(platform)


@pytest.fixture(scope="session")
def ceilings(platform, bench_size):
  return ceiling.measure_ceilings(platform, quick=bench_size == "quick")


_BASELINE_MS: dict[str, float] = {}


def _baseline_ms(case):
  if case.id not in _BASELINE_MS:
    fn, args, refresh = core.build_variant(case.variants[case.baseline])
    _BASELINE_MS[case.id] = core.time_fn(fn, args, refresh=refresh, iters=5)["ms"]
  return _BASELINE_MS[case.id]


@pytest.fixture
def bench_variant(benchmark, ceilings):
  """``bench_variant(case, label)``: times ``case.variants[label]`` with
  pytest-benchmark and records the roofline figures in ``extra_info``."""

  def run(case, label):
    fn, args, refresh = core.build_variant(case.variants[label])
    call = lambda *a: core.block(fn(*a))  # noqa: E731 - time until the result exists
    core.block(call(*(refresh() if refresh else args)))  # compile outside the timing
    if refresh:
      benchmark.pedantic(call, setup=lambda: (refresh(), {}), rounds=10, warmup_rounds=1)
    else:
      benchmark.pedantic(call, args=args, rounds=10, warmup_rounds=1)
    stats = getattr(benchmark, "stats", None)
    info = benchmark.extra_info
    info.update({"op": case.op, "case": case.name, "variant": label, "baseline": case.baseline})
    info.update(core.compiled_stats(fn, args if not refresh else refresh()))
    if stats is not None and getattr(stats, "stats", None) is not None:
      ms = stats.stats.median * 1e3
      base = _baseline_ms(case)
      info.update({"ms": ms, "baseline_ms": base, "ratio_to_baseline": ms / base})
      if case.bytes:
        info["gbps"] = case.bytes / (ms * 1e-3) / 1e9
      if case.flops:
        info["tflops"] = case.flops / (ms * 1e-3) / 1e12
      floor = core.floor_ms(case, ceilings)
      if floor:
        info["fraction_of_floor"] = floor / ms
    return info

  return run
