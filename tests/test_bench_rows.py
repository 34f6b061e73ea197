"""The suite's row names and the report's tables (docs/benchmarks.md, "Row names").

An untagged fuseopt row (``fuseopt_step``, ``fuseopt_step[int8]`` in the 8-bit
format, ``fuseopt_muon``, and stochastic rounding's ``fuseopt[<backend>]`` of
the dispatcher's choice) is the default call; a tagged row passes what its
tag names. Checked on the programs: each row's step, lowered for an H200 from
the CPU, is the program of the call written out here, so a row keeps its
meaning whatever the defaults become. The report renders each default row
first, then its variants, with every ratio against the fastest peer of the
same run; the committed 2026-12-04 suite is read with its labels mapped.
"""

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest

import fuseopt.optim as fo
from fuseopt.benchmarks import core, report, workloads
from fuseopt.benchmarks.cases import adam as adam_cases
from fuseopt.benchmarks.cases import muon as muon_cases
from fuseopt.benchmarks.cases import stochastic_round as sr_cases
from fuseopt.kernels import stochastic_round_bf16
from tests.kernels import harness

ROOT = Path(__file__).resolve().parents[1]
H200 = harness.targets_for("triton")[0]
S = jax.ShapeDtypeStruct
LR, WD = 1e-3, 0.1


def _tree(dtype):
  """Three leaves of one dtype (shared launches and one per leaf differ),
  last axes divisible by the 8-bit block."""
  return {"a": S((256, 512), dtype), "b": S((512, 256), dtype), "c": S((512,), dtype)}


def _h200_text(fn, *avals) -> str:
  with jax.sharding.use_abstract_mesh(harness.abstract_mesh(H200)):
    return fn.trace(*avals).lower(lowering_platforms=("cuda",)).as_text()


def _adam_written_out(tx, **kwargs):
  """``fo.step(tx, grads, state, params, **kwargs)`` as a user writes it."""
  def step(params, state, grads):
    return fo.step(tx, grads, state, params, **kwargs)
  return jax.jit(step, donate_argnums=(0, 1))


@pytest.mark.parametrize("params_dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_untagged_adam_rows_are_the_default_calls(params_dtype):
  assert (adam_cases.LR, adam_cases.WD) == (LR, WD)
  rows = (adam_cases.optimizers("gpu") if params_dtype == jnp.float32
          else adam_cases.bf16_optimizers("gpu"))
  struct = _tree(params_dtype)
  formats = {"": {}} if params_dtype == jnp.bfloat16 else {"": {}, "int8": {"moment_dtype": "int8"}}
  for fmt, tx_kwargs in formats.items():
    prefix = "fuseopt_step" + (f"[{fmt}]" if fmt else "")
    written = {prefix: {}, f"fuseopt_step[{fmt + ',' if fmt else ''}group]": {"group": True},
               f"fuseopt_step[{fmt + ',' if fmt else ''}per_leaf]": {"group": False}}
    texts = {}
    for label, step_kwargs in written.items():
      tx = fo.adamw(LR, weight_decay=WD, **tx_kwargs)   # the same call as the case's, written anew
      state = jax.eval_shape(tx.init, struct)
      texts[label] = _h200_text(adam_cases.step_fn(rows[label].tx, rows[label].how), struct, state, struct)
      assert texts[label] == _h200_text(_adam_written_out(tx, **step_kwargs), struct, state, struct), label
      assert ("group=" in rows[label].calls) == bool(step_kwargs), rows[label].calls
    group, per_leaf = list(texts.values())[1:]
    assert group != per_leaf, fmt  # the tags name two different programs
  # The untagged rows are the suite's default rows.
  for case in adam_cases.cases("quick", "gpu"):
    assert case.defaults == (("fuseopt_step", "fuseopt_step[int8]") if "bf16" not in case.name
                             else ("fuseopt_step",))


def test_untagged_muon_row_is_the_default_call():
  struct = _tree(jnp.float32)
  rows = muon_cases.optimizers("gpu")
  common = dict(weight_decay=0.1, muon_weight_dimension_numbers=muon_cases.muon_dims)
  written = {"fuseopt_muon": fo.muon(0.02, **common),
             "fuseopt_muon[gram]": fo.muon(0.02, **common, execution=fo.Execution(newton_schulz=fo.NewtonSchulz(gram="auto"))),
             "fuseopt_muon[no_gram]": fo.muon(0.02, **common, execution=fo.Execution(newton_schulz=fo.NewtonSchulz(gram=False)))}
  for label, tx in written.items():
    state = jax.eval_shape(tx.init, struct)
    ours = _h200_text(muon_cases.step_fn(rows[label][0]), struct, struct, state)
    assert ours == _h200_text(muon_cases.step_fn(tx), struct, struct, state), label
  # ``fuseopt_step``: the same call through fo.step, as a user writes it.
  tx = fo.muon(0.02, **common)
  state = jax.eval_shape(tx.init, struct)

  def step(params, grads, state):
    return fo.step(tx, grads, state, params)
  written_step = jax.jit(step, donate_argnums=(0, 2))
  assert (_h200_text(muon_cases.step_fn(rows["fuseopt_step"][0], "step"), struct, struct, state)
          == _h200_text(written_step, struct, struct, state))
  assert [c.defaults for c in muon_cases.cases("quick", "gpu")] == [("fuseopt_muon", "fuseopt_step")]


def test_stochastic_rounding_default_row_is_the_default_call():
  x = S((1 << 20,), jnp.float32)
  fns = sr_cases.variant_fns("gpu")
  assert set(fns) == {"fuseopt", "fuseopt[triton]", "fuseopt[xla]", "xla_convert"}
  written = {"fuseopt": lambda x: stochastic_round_bf16(x, sr_cases.SEED),
             "fuseopt[triton]": lambda x: stochastic_round_bf16(x, sr_cases.SEED, implementation="triton"),
             "fuseopt[xla]": lambda x: stochastic_round_bf16(x, sr_cases.SEED, implementation="xla")}
  for label, fn in written.items():
    assert _h200_text(jax.jit(fns[label]), x) == _h200_text(jax.jit(fn), x), label
  assert [c.defaults for c in sr_cases.cases("quick", "cpu")] == [("fuseopt",)]


def test_a_tagged_row_of_the_defaults_program_is_not_timed_twice():
  def same():
    return jax.jit(lambda x: x * 2), (jnp.ones((256,)),)

  def other():
    return jax.jit(lambda x: x + 1), (jnp.ones((256,)),)

  case = core.Case(op="t", name="256", variants={"base": other, "fuseopt": same, "fuseopt[a]": same},
                   baseline="base", default="fuseopt", bytes=2048, params=256,
                   meta={"fuseopt[a]": {"calls": "f(x, a=default)"}})
  recs = {r["variant"]: r for r in core.run_case(case, {"copy_gbps": 1.0, "matmul_tflops": 1.0}, iters=2)}
  assert recs["fuseopt"]["is_default"] and recs["fuseopt"]["ms"] > 0
  assert recs["fuseopt[a]"]["same_program_as"] == "fuseopt" and "ms" not in recs["fuseopt[a]"]
  assert recs["fuseopt[a]"]["calls"] == "f(x, a=default)" and not recs["base"]["is_default"]
  report.validate(report.make_results({"device_kind": "x", "platform": "cpu", "size": "quick",
                                       "jax": "0"}, {}, list(recs.values())))


def _row(variant, ms, **kw):
  return {"op": "adam", "case": "llama1.2b", "variant": variant, "is_baseline": False,
          "is_default": False, "ms": ms, **kw}


def _run(rows):
  meta = {"device_kind": "NVIDIA H200", "platform": "gpu", "size": "full", "jax": "0.11.2",
          "time_utc": "2027-01-01T00:00:00Z"}
  return report.make_results(meta, {"copy_gbps": 3300.0, "matmul_tflops": 700.0}, rows)


def test_report_puts_each_default_first_and_compares_with_the_best_peer():
  rows = [  # the suite's order: the baseline and a weak peer before fuseopt's rows
      _row("optax_adamw_fp32", 13.0, is_baseline=True, fraction_of_floor=0.5),
      _row("fuseopt_step[per_leaf]", 12.0),
      _row("fuseopt_step", 15.0, is_default=True, fraction_of_floor=0.45,
           stored_bytes_per_param=8, moved_bytes_per_param=20),
      _row("fuseopt_step[group]", None, same_program_as="fuseopt_step",
           skipped="same program as fuseopt_step"),
      _row("fuseopt_step[int8,per_leaf]", 9.0),
      _row("fuseopt_step[int8]", 16.0, is_default=True),
      _row("torch_adamw_fused", 10.0, stored_bytes_per_param=12, moved_bytes_per_param=28),
      _row("fuseopt_step[xla]", 20.0, error="boom"),
  ]
  for r in rows:
    if r["ms"] is None:
      del r["ms"]
  text = report.summary_markdown([_run(rows)])
  body = [line for line in text.splitlines() if line.startswith("| adam")]
  labels = [line.split(" | ")[2] for line in body]
  assert labels == ["**`fuseopt_step`** default", "`fuseopt_step[per_leaf]`",
                    "`fuseopt_step[group]` = `fuseopt_step`",
                    "**`fuseopt_step[int8]`** default", "`fuseopt_step[int8,per_leaf]`",
                    "best peer `torch_adamw_fused`"]
  # Every ratio is against the fastest peer (torch, 10 ms), not optax's 13 ms.
  assert body[0] == "| adam | llama1.2b | **`fuseopt_step`** default | 15.000 | 45% | 1.50× slower | 8 | 20 |"
  assert "| 1.20× slower |" in body[1] and "| 1.11× faster |" in body[4]
  assert body[5].endswith("| 10.000 | - | best peer | 12 | 28 |")
  assert "optax_adamw_fp32" not in text and "fuseopt_step[xla]" not in text  # only the best peer; no errors
  full = report.markdown([_run(rows)])
  assert "| adam | llama1.2b | `optax_adamw_fp32` | 13.000 | 50% | 1.30× slower |" in full
  assert full.index("**`fuseopt_step`** default") < full.index("best peer `torch_adamw_fused`") < full.index(
      "`optax_adamw_fp32`")


def test_the_committed_h200_suite_is_read_with_todays_names():
  path = ROOT / "bench" / "results" / "nvidia-h200" / "suite.json"
  data = json.loads(path.read_text())
  assert report.is_legacy(data)
  mapped = report.current_names(data)
  by_name = {(r["op"], r["case"], r["variant"]): r for r in mapped["rows"]}
  in_file = {(r["op"], r["case"], r["variant"]): r for r in data["rows"]}
  # The grouped launch was fo.step's default when timed: today's untagged name;
  # the per-leaf row is today's [per_leaf]. Numbers untouched.
  default = by_name[("adam", "llama1.2b", "fuseopt_step")]
  assert default["is_default"] and default["label_in_file"] == "fuseopt_step[grouped]"
  assert default["ms"] == in_file[("adam", "llama1.2b", "fuseopt_step[grouped]")]["ms"]
  assert by_name[("adam", "llama1.2b", "fuseopt_step[per_leaf]")]["ms"] == in_file[
      ("adam", "llama1.2b", "fuseopt_step")]["ms"]
  assert by_name[("adam", "llama1.2b", "fuseopt_step[int8]")]["label_in_file"] == "fuseopt_step[int8,grouped]"
  assert not by_name[("adam", "llama1.2b_bf16_params", "fuseopt_step[per_leaf]")]["is_default"]
  assert {k[2] for k, r in by_name.items() if r["is_default"]} == {
      "fuseopt", "fuseopt_step", "fuseopt_step[int8]", "fuseopt_muon"}
  assert by_name[("stochastic_round", "268435456", "fuseopt")]["label_in_file"] == "fuseopt[triton]"
  views = {(v["op"], v["case"]): v for v in report.case_views(data)}
  assert views[("adam", "llama1.2b")]["best_peer"]["variant"] == "torch_adamw_fused"
  assert views[("muon", "llama1.2b")]["best_peer"]["variant"] == "optax_muon_bf16"
  assert views[("stochastic_round", "268435456")]["best_peer"]["variant"] == "xla_convert"
  assert report.current_names(mapped) is mapped  # a current suite is left as it is


def _flashoptim():
  """The vendored wheel, as bench/gpu_suite.py puts it on the path."""
  import importlib.util
  spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "bench" / "gpu_suite.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  assert any("flashoptim_jax" in p for p in sys.path)
  return mod


def test_flashoptim_rows_run_and_agree_with_optax():
  """FlashOptim's rows through the suite's calling code, on its jnp path
  (``fused=False``: its kernel is GPU only) on the CPU tree: one step from
  zero moments moves the params as optax's AdamW does."""
  suite = _flashoptim()
  assert suite._peer_versions()["flashoptim-jax"]["version"] == "0.1.0"
  rows = adam_cases.flashoptim_optimizers(fused=False, required=True)
  assert set(rows) == {"flashoptim_adamw", "flashoptim_adamw[fp32_params]"}
  params = workloads.llama_tree_cpu(jnp.float32, seed=0)
  grads = workloads.llama_tree_cpu(jnp.float32, seed=1)
  tx = optax.adamw(LR, weight_decay=WD)
  updates, _ = tx.update(grads, tx.init(params), params)
  want = jax.tree.map(lambda u: u, updates)
  for label, v in rows.items():
    p = jax.tree.map(lambda x: x.astype(v.params), params)
    g = jax.tree.map(lambda x: x.astype(v.params), grads)
    new, state = adam_cases.step_fn(v.tx, v.how)(jax.tree.map(jnp.copy, p), v.tx.init(p), g)
    delta = jax.tree.map(lambda a, b: a.astype(jnp.float32) - b.astype(jnp.float32), new, p)
    err = core.tree_rel_err(delta, want)
    assert err < (0.3 if v.params == jnp.bfloat16 else 1e-3), (label, err)
    assert jax.tree.leaves(state.mu)[0].dtype == jnp.int8
    assert v.stored < 8 and v.moved < 20  # below fuseopt's bf16-moment format either way


def test_flashoptim_kernels_compile_for_the_h200():
  """Its fused kernels (as the suite calls them on a GPU), compiled by the
  real compiler for an H200 without one."""
  from fuseopt import targets
  from fuseopt.benchmarks import compile_harness
  if targets.missing("h200") is not None:
    pytest.skip(targets.missing("h200"))
  _flashoptim()
  t = targets.get("h200")
  for label, v in adam_cases.flashoptim_optimizers(required=True).items():
    struct = workloads.llama_tree_cpu(v.params, abstract=True)
    state = jax.eval_shape(v.tx.init, struct)
    with targets.lowering_for(t, None):
      args = compile_harness._placed(t, (struct, state, struct))  # pylint: disable=protected-access
      lowered = adam_cases.step_fn(v.tx, v.how).trace(*args).lower(lowering_platforms=(t.lowering_platform,))
    compiled = lowered.compile()
    assert compile_harness.kernel_launches(compiled.as_text()) == 21, label  # one per leaf
