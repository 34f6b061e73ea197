"""The performance-regression gate: deterministic compiled figures of every
quick CPU bench case against bench/baseline/cpu.json (compile only)."""

import copy
import math

import jax
import pytest

from fuseopt.benchmarks import regression


@pytest.fixture(scope="module")
def current():
  return regression.collect()


def test_figures_match_committed_baseline(current):
  baseline = regression.load_baseline()
  assert baseline is not None, "bench/baseline/cpu.json is missing: run `fuseopt regression --update`"
  rep = regression.compare(current, baseline)
  print(rep.text())  # shown with -rA / on failure: which figure moved and by how much
  assert rep.compared > 0 or not baseline["figures"], rep.text()
  assert rep.ok, rep.text()


def test_figures_are_deterministic(current):
  again = regression.collect(["stochastic_round"])
  for vid, figs in again["figures"].items():
    assert figs == current["figures"][vid], vid


def test_wallclock_ratios_are_computed_against_the_cases_baseline():
  """The wall-clock report's arithmetic on one op (stochastic rounding: its
  cases are the smallest), one timed call a variant: a ratio per variant, the
  baseline's exactly 1. The figures themselves are `fuseopt regression`'s
  report, never a test's."""
  ratios = regression.wallclock(["stochastic_round"], iters=1)
  assert ratios and all(math.isfinite(r) and r > 0 for r in ratios.values())
  assert any(r == 1.0 for r in ratios.values())
  lines = regression.compare_wallclock(ratios, regression.load_baseline())
  assert len(lines) == len(ratios)


def _base(figures):
  return {"schema": regression.SCHEMA, "meta": {"jax": jax.__version__}, "figures": figures}


FIGS = {"temp_bytes": 100_000, "argument_bytes": 4096, "output_bytes": 2048, "alias_bytes": 0,
        "hlo_ops": 200, "hlo_fusions": 5, "custom_calls": 2, "cost_flops": 1e6, "cost_bytes": 5e5,
        "h200_kernels": 21}


def _moved(**changes):
  cur = {"figures": {"op/c/v": {**FIGS, **changes}}, "ops": ["op"]}
  return regression.compare(cur, _base({"op/c/v": dict(FIGS)}))


@pytest.mark.parametrize("changes", [
    {}, {"temp_bytes": 100_000 + 64 * 1024}, {"temp_bytes": 0}, {"hlo_fusions": 6}, {"hlo_fusions": 4},
    {"hlo_ops": 204}, {"cost_flops": 1.02e6}, {"cost_bytes": 4.9e5},
])
def test_moves_within_tolerance_pass(changes):
  rep = _moved(**changes)
  assert rep.ok and not rep.failures, rep.text()


@pytest.mark.parametrize("changes,figure", [
    ({"temp_bytes": 100_000 + 64 * 1024 + 1}, "temp_bytes"),
    ({"hlo_fusions": 7}, "hlo_fusions"), ({"hlo_fusions": 3}, "hlo_fusions"),
    ({"custom_calls": 3}, "custom_calls"), ({"custom_calls": 1}, "custom_calls"),
    ({"hlo_ops": 205}, "hlo_ops"), ({"cost_flops": 1.03e6}, "cost_flops"),
    ({"cost_bytes": 4.8e5}, "cost_bytes"), ({"argument_bytes": 8192}, "argument_bytes"),
    ({"h200_kernels": 147}, "h200_kernels"),
])
def test_moved_figure_fails_and_says_what_moved(changes, figure):
  rep = _moved(**changes)
  assert not rep.ok and len(rep.failures) == 1
  assert rep.failures[0].startswith(f"op/c/v: {figure} ")
  assert "allowed" in rep.failures[0] and "->" in rep.failures[0]
  assert "fuseopt regression --update" in rep.text()


def test_large_temp_drop_is_an_improvement_not_a_failure():
  rep = _moved(temp_bytes=1000)
  assert rep.ok and len(rep.improvements) == 1 and "temp_bytes" in rep.improvements[0]


def test_added_and_removed_cases_are_reported_not_failed():
  base = _base({"op/c/v": dict(FIGS), "op/gone/v": dict(FIGS), "oldop/c/v": dict(FIGS)})
  cur = {"figures": {"op/c/v": dict(FIGS), "op/new/v": dict(FIGS), "newop/c/v": dict(FIGS)},
         "ops": ["op", "newop"], "module_errors": {"broken": "SyntaxError: x"}}
  rep = regression.compare(cur, base)
  assert rep.ok and rep.compared == 1
  text = "\n".join(rep.notes)
  for needle in ("op/gone/v", "op/new/v", "'oldop'", "'newop'", "'broken'"):
    assert needle in text


def test_variant_that_stops_compiling_fails():
  cur = {"figures": {"op/c/v": {"error": "TypeError: boom"}}, "ops": ["op"]}
  rep = regression.compare(cur, _base({"op/c/v": dict(FIGS)}))
  assert not rep.ok and "fails now" in rep.failures[0]


def test_variant_that_stops_lowering_for_the_h200_fails():
  cur = {"figures": {"op/c/v": {**{k: v for k, v in FIGS.items() if k != "h200_kernels"},
                                "h200_error": "NotImplementedError: x"}}, "ops": ["op"]}
  rep = regression.compare(cur, _base({"op/c/v": dict(FIGS)}))
  assert not rep.ok and "H200" in rep.failures[0]


def test_kernel_launches_are_counted_in_the_h200_lowering():
  import jax.numpy as jnp

  from fuseopt.kernels import adam_update, stochastic_round_bf16
  x = jnp.ones((4096,), jnp.float32)
  m = jnp.zeros((4096,), jnp.bfloat16)
  # implementation chosen at trace time, as the H200 chooses it: a kernel
  # for Adam, XLA's fusion for stochastic rounding (its GPU order)
  auto = jax.jit(lambda x, m: adam_update(x, x, m, m, count=1))
  forced_xla = jax.jit(lambda x, m: adam_update(x, x, m, m, count=1, implementation="xla"))
  assert regression.h200_kernels(auto, (x, m)) == 1
  assert regression.h200_kernels(forced_xla, (x, m)) == 0
  assert regression.h200_kernels(jax.jit(lambda x: stochastic_round_bf16(x, 1)), (x,)) == 0
  named = jax.jit(lambda x: stochastic_round_bf16(x, 1, implementation="triton"))
  assert regression.h200_kernels(named, (x,)) == 1
  # (the count steers nothing through the environment)
  assert "FUSEOPT_IMPLEMENTATION" not in __import__("os").environ


def test_other_jax_version_is_reported_not_enforced():
  base = _base({"op/c/v": dict(FIGS)})
  base["meta"]["jax"] = "0.0.1"
  rep = regression.compare({"figures": {"op/c/v": {**FIGS, "custom_calls": 9}}, "ops": ["op"]}, base)
  assert rep.failures and rep.ok and not rep.enforced


def test_update_then_check_round_trip(tmp_path, monkeypatch):
  real = regression.all_cases
  monkeypatch.setattr(regression, "all_cases",  # one op keeps this test fast
                      lambda size, platform, ops=None, errors=None: real(size, platform, ["stochastic_round"],
                                                                         errors=errors))
  path = tmp_path / "cpu.json"
  lines = []
  assert regression.main(True, baseline_path=path, progress=False, out=lines.append) == 0
  data = regression.load_baseline(path)
  assert data["meta"]["command"] == "fuseopt regression --update" and data["figures"]
  assert regression.main(False, baseline_path=path, progress=False, out=lines.append) == 0
  vid = sorted(data["figures"])[0]
  tampered = copy.deepcopy(data)
  tampered["figures"][vid]["hlo_fusions"] += 5
  regression.write_baseline(tampered, path)
  lines.clear()
  assert regression.main(False, baseline_path=path, progress=False, out=lines.append) == 1
  assert any(f"{vid}: hlo_fusions" in line for line in "\n".join(lines).splitlines())


def test_collect_records_state_bytes_and_errors(monkeypatch):
  import jax.numpy as jnp

  from fuseopt.benchmarks.core import Case

  def good():
    return jax.jit(lambda x: x * 2, donate_argnums=0), (jnp.ones((64,)),)

  def bad():
    raise RuntimeError("cannot build")

  case = Case(op="fake", name="64", variants={"fuseopt[xla]": good, "fuseopt[broken]": bad, "optax": good},
              baseline="optax", state_bytes={"fuseopt[xla]": 128})
  monkeypatch.setattr(regression, "all_cases", lambda size, platform, ops=None, errors=None: [case])
  got = regression.collect()["figures"]
  assert got["fake/64/fuseopt[xla]"]["state_bytes"] == 128
  assert got["fake/64/fuseopt[xla]"]["alias_bytes"] == 256  # the donated buffer is reused
  assert "RuntimeError: cannot build" in got["fake/64/fuseopt[broken]"]["error"]
  assert "fake/64/optax" not in got  # baselines are not fuseopt's code
