"""bench/device_run.py, the one command for an accelerator machine: its CPU
dry run end to end (config checks in child processes that may crash or hang,
then the suite), without the optional modules a bare machine lacks; and the
config checks' device steps lowered for an H200 from the CPU."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest

from fuseopt.benchmarks import report

ROOT = Path(__file__).resolve().parents[1]
# What the accelerator machine may lack; nothing on the device path may need them.
MISSING = ("yaml", "matplotlib", "tqdm", "flax", "orbax", "hypothesis")


def _blocker(tmp_path) -> Path:
  """A sitecustomize that makes MISSING unimportable in every process that
  has its directory on PYTHONPATH (children inherit it), and notes each
  process it ran in."""
  d = tmp_path / "site"
  d.mkdir(exist_ok=True)
  (d / "sitecustomize.py").write_text(textwrap.dedent(f"""
      import os, sys
      MISSING = {MISSING!r}

      class _Block:
        def find_spec(self, name, path=None, target=None):
          if name.split(".")[0] in MISSING:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
          return None

      sys.meta_path.insert(0, _Block())
      with open(os.environ["BLOCKER_LOG"], "a") as f:
        f.write(f"{{os.getpid()}}\\n")
  """))
  return d


def _env(tmp_path, **extra):
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(_blocker(tmp_path)), str(ROOT)])
  env["BLOCKER_LOG"] = str(tmp_path / "blocked_pids")
  env["XLA_FLAGS"] = ""  # one CPU device, as a plain machine has
  env.pop("JAX_PLATFORMS", None)
  env.update(extra)
  return env


def test_dry_run_survives_a_crash_and_an_error(tmp_path):
  faults = "abort:adam/heuristic,raise:ns_gram/heuristic"
  proc = subprocess.run(
      [sys.executable, "bench/device_run.py", str(tmp_path / "out"), "--dry-run"],
      cwd=ROOT, env=_env(tmp_path, FUSEOPT_CONFIG_FAULT=faults), capture_output=True, text=True, timeout=330)
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0, out[-4000:]
  data = json.loads((tmp_path / "out" / "cpu" / "device_run.json").read_text())
  assert data["schema"] == "fuseopt-device-run/1" and data["meta"]["dry_run"]
  env = data["meta"]["env"]
  assert env["jax"] == jax.__version__ and env["jaxlib"] and env["python"] and env["device_kind"] == "cpu"
  # The config processes started with it, so this XLA knows the flag (an unknown one is fatal).
  assert "--xla_gpu_graph_min_graph_size=1" in data["meta"]["config_xla_flags"]
  recs = {r["id"]: r for r in data["configs"]}
  families = {r["family"] for r in recs.values()}
  assert families == {"stochastic_round", "adam", "adam_bf16", "adam_group", "adam_int8", "adam_int4",
                      "adam_int8_group", "ns_poly", "ns_gram", "ns_update", "ns_fused"}
  # Every family: the heuristic and one search-space config (--dry-run keeps 2).
  assert len(recs) == 2 * len(families)
  crashed, raised = recs["adam/heuristic"], recs["ns_gram/heuristic"]
  assert crashed["status"] == "crashed" and "SIGABRT" in crashed["error"]
  assert raised["status"] == "error" and "injected fault" in raised["error"]
  assert "device_poisoned" not in raised  # the process went on: the device still answered
  for k, r in recs.items():
    if k not in ("adam/heuristic", "ns_gram/heuristic"):
      assert r["status"] == "ok", r
      assert r["ms"] > 0 and r["rel_err"] < 2e-2 and r["compile_s"] >= 0
  # The config after the crash ran in a fresh process, the one after the error in the same.
  assert recs["adam/7"]["process"] == crashed["process"] + 1 == 2
  from fuseopt.kernels.newton_schulz import sym as gram   # the family runs its search space last config first
  assert recs[f"ns_gram/{len(gram.triton.SEARCH_SPACE) - 1}"]["process"] == raised["process"] == 2
  assert data["parts"]["configs"]["processes"] == 2
  assert recs["stochastic_round/7"]["bitwise_vs_heuristic"] is True
  summary = data["summary"]["adam"]
  assert summary["status"] == {"crashed": 1, "ok": 1} and summary["best"]["id"] == "adam/7"
  # Every family's check against its reference (its heuristic), the blockwise formats included.
  checks = data["kernel_checks"]
  assert set(checks) == families
  assert checks["adam"]["status"] == "crashed" and checks["ns_gram"]["status"] == "error"
  for fam in ("stochastic_round", "adam_int8", "adam_int4", "ns_fused"):
    assert checks[fam]["status"] == "ok" and checks[fam]["check"], checks[fam]
  assert "bitwise" in checks["stochastic_round"]["check"] and checks["stochastic_round"]["bitwise_ref"]
  # The checks ran first: every heuristic before any other config, the blockwise formats last.
  order = [line.split()[0] for line in proc.stdout.splitlines()
           if line.startswith("  ") and line.split()[0] in recs]
  heads = [i for i in order if i.endswith("/heuristic")]
  assert order[:len(heads)] == heads and len(heads) == len(families), order
  assert {h.split("/")[0] for h in heads[-2:]} == {"adam_int8", "adam_int4"} or \
      "int8_group" in heads[-1], heads
  assert "kernel checks against the references" in proc.stdout
  # Then the suite, with its environment record.
  assert data["parts"]["suite"]["rc"] == 0 and data["parts"]["suite"]["timed"] > 0
  suite = json.loads((tmp_path / "out" / "cpu" / "suite.json").read_text())
  report.validate(suite)
  assert suite["meta"]["env"]["jaxlib"] and suite["rows"]
  # The blocker ran in this run's processes: the run, 2 config processes, the suite.
  assert len((tmp_path / "blocked_pids").read_text().split()) >= 4
  assert "failed config: adam/heuristic" in proc.stdout


def test_imports_without_the_optional_modules(tmp_path):
  code = textwrap.dedent("""
      import sys
      sys.path.insert(0, "bench")
      import device_run
      assert "jax" not in sys.modules  # the parent leaves the device's memory to its children
      import config_checks, gpu_suite, ns_configs, torch_baselines
      import fuseopt.optim, fuseopt.kernels
      from fuseopt.benchmarks import core, environment, regression, report, workloads
      from fuseopt.benchmarks.cases import all_cases
      errors = {}
      assert all_cases("quick", "cpu", errors=errors) and not errors, errors
      assert all_cases("full", "gpu", errors=errors) and not errors, errors
      cfg = fuseopt.optim.OptimConfig(learning_rate=1e-3)
      try:
        cfg.to_yaml()
      except ImportError as e:
        assert "pyyaml" in str(e), e
      else:
        raise AssertionError("to_yaml worked without yaml")
      print("imports ok")
  """)
  proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(tmp_path), capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 0 and "imports ok" in proc.stdout, proc.stdout + proc.stderr[-3000:]


def _bench_module(name):
  if name in sys.modules:
    return sys.modules[name]
  spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
  mod = importlib.util.module_from_spec(spec)
  sys.modules[name] = mod  # (its dataclasses look their module up)
  spec.loader.exec_module(mod)
  return mod


@pytest.mark.parametrize("platform", ["gpu"])
def test_config_check_steps_lower_for_the_device(platform):
  """The steps the config checks jit on a GPU (interpret off), for the
  heuristic and the largest config of each search space, lower for
  an H200 with a Pallas kernel in them."""
  from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
  cc = _bench_module("config_checks")
  st = cc.Settings("triton", False, dict(d=32, ff=64, layers=0, vocab=64), ((13, 7),), (1, 64, 128),
                   (2, 32, 64), 1, None)
  mesh = AbstractMesh((), (), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132,
                                                             platform="gpu"))
  jobs = cc.jobs_of(cc.families(st))
  assert len({j["id"] for j in jobs}) == len(jobs)
  states = {}
  for fam in cc.families(st):
    space = list(fam.space)
    for cfg in (None, space[-1]):
      if fam.setup not in states:
        states[fam.setup] = fam.setup()  # references: XLA on the CPU
      call = fam.run(states[fam.setup], cfg)
      structs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), call.args)
      with use_abstract_mesh(mesh):
        text = call.jitted.trace(*structs).lower(lowering_platforms=("cuda",)).as_text()
      assert "__gpu$xla.gpu.triton" in text, (fam.name, cfg)


def test_a_hanging_config_is_killed_and_recorded():
  """The parent's side of a hang, with a stand-in process that speaks the
  protocol: starts the config, then never answers."""
  dr = _bench_module("device_run")
  prefix = dr.config_checks.PREFIX
  script = textwrap.dedent(f"""
      import json, sys, time
      for line in sys.stdin:
        print({prefix!r} + json.dumps({{"start": line.strip()}}), flush=True)
        time.sleep(600)
  """)
  log = []
  w = dr.Worker([sys.executable, "-c", script], dict(os.environ), 1, log)
  job = {"id": "ns_poly/3", "family": "ns_poly", "config": "TritonConfig(...)", "space_index": 3}
  rec, worker = dr._run_one(None, w, job, timeout=1.5)
  assert worker is None and w.proc.poll() is not None  # killed
  assert rec["status"] == "timeout" and "running" in rec["error"] and rec["ok"] is False
  assert rec["id"] == "ns_poly/3" and rec["process"] == 1


def test_resume_runs_only_what_is_missing(tmp_path):
  """A second try reads the first run's records from another directory and
  runs only the configs not finished there (and the heuristic again); a
  third runs the suite alone."""
  run = lambda out, *extra: subprocess.run(
      [sys.executable, "bench/device_run.py", str(out), "--dry-run", "--parts", "configs",
       "--families", "ns_fused", *extra], cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True,
      timeout=120)
  first = run(tmp_path / "a", "--per-family", "2")
  assert first.returncode == 0, first.stdout + first.stderr[-3000:]
  earlier = tmp_path / "a" / "cpu" / "device_run.json"
  second = run(tmp_path / "b", "--per-family", "3", "--resume", str(earlier))
  assert second.returncode == 0, second.stdout + second.stderr[-3000:]
  recs = {r["id"]: r for r in json.loads((tmp_path / "b" / "cpu" / "device_run.json").read_text())["configs"]}
  assert set(recs) == {"ns_fused/heuristic", "ns_fused/1", "ns_fused/0"}
  assert recs["ns_fused/1"]["resumed"] and "resumed" not in recs["ns_fused/0"]
  assert "resumed" not in recs["ns_fused/heuristic"]  # the same-run reference, again
  assert all(r["status"] == "ok" for r in recs.values())
  # The suite alone, after the environment record.
  third = subprocess.run([sys.executable, "bench/device_run.py", str(tmp_path / "c"), "--dry-run", "--parts",
                          "suite"], cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=120)
  assert third.returncode == 0, third.stdout + third.stderr[-3000:]
  data = json.loads((tmp_path / "c" / "cpu" / "device_run.json").read_text())
  assert data["configs"] == [] and data["meta"]["env"]["jaxlib"] and data["parts"]["suite"]["rc"] == 0


@pytest.mark.parametrize("healthy", [True, False])
def test_an_error_then_a_health_check(healthy):
  """After a config's error the process reports whether the device still
  answers; when it does not, the parent records it and drops the process."""
  dr = _bench_module("device_run")
  prefix = dr.config_checks.PREFIX
  script = textwrap.dedent(f"""
      import json, sys
      say = lambda m: print({prefix!r} + json.dumps(m), flush=True)
      for line in sys.stdin:
        if line.strip() == "exit":
          break
        say({{"start": line.strip()}})
        say({{"result": {{"id": line.strip(), "ok": False, "status": "error", "error": "XlaRuntimeError: x"}}}})
        say({{"health": {healthy!r}}})
        if not {healthy!r}:
          sys.exit(3)
  """)
  w = dr.Worker([sys.executable, "-c", script], dict(os.environ), 1, [])
  job = {"id": "adam/7", "family": "adam", "config": "TritonConfig(block=4096, num_warps=8)", "space_index": 7}
  rec, worker = dr._run_one(None, w, job, timeout=30)
  assert rec["status"] == "error" and "XlaRuntimeError" in rec["error"]
  if healthy:
    assert worker is w and "device_poisoned" not in rec
    w.close()
  else:
    assert worker is None and rec["device_poisoned"] and w.proc.poll() is not None


def test_the_suite_runs_when_no_config_process_starts(tmp_path):
  proc = subprocess.run([sys.executable, "bench/device_run.py", str(tmp_path), "--dry-run"], cwd=ROOT,
                        env=_env(tmp_path, FUSEOPT_CONFIG_FAULT="abort:start"), capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 3, proc.stdout + proc.stderr[-3000:]
  data = json.loads((tmp_path / "cpu" / "device_run.json").read_text())
  assert "SIGABRT" in data["parts"]["configs"]["error"]
  assert data["parts"]["suite"]["rc"] == 0 and data["parts"]["suite"]["timed"] > 0
  report.validate(json.loads((tmp_path / "cpu" / "suite.json").read_text()))


# ----------------------------------------------------------- the suite's new rules --
def test_the_tree_is_sized_from_the_device_memory():
  """The 1.2 B tree where optax's fp32 AdamW step fits, else the most layers
  of the same d and ff that do: 6 on a 16 GiB v5e."""
  from fuseopt.benchmarks import workloads as w
  assert w.llama_params(**w.LLAMA_1B) == 1_204_881_408
  assert w.adamw_step_bytes(1) == 28
  v5e = w.fitting_dims(int(15.7 * 2**30))
  assert v5e == {**w.LLAMA_1B, "layers": 6} and w.llama_params(**v5e) == 533_751_808
  assert w.tree_name(v5e, "tpu") == "llama0.53b" and w.tree_name(w.LLAMA_1B, "gpu") == "llama1.2b"
  assert w.fitting_dims(None) == w.LLAMA_1B              # the limit unknown
  assert w.fitting_dims(int(0.75 * 141e9)) == w.LLAMA_1B  # an H200
  assert w.fitting_dims(10**6)["layers"] == 1             # nothing fits: the smallest
  for limit in (8 * 2**30, 15.7 * 2**30, 32 * 2**30):
    dims = w.fitting_dims(int(limit))
    assert w.adamw_step_bytes(w.llama_params(**dims)) <= w.MEMORY_HEADROOM * limit
    if dims["layers"] < 16:
      more = {**dims, "layers": dims["layers"] + 1}
      assert w.adamw_step_bytes(w.llama_params(**more)) > w.MEMORY_HEADROOM * limit
  assert w.llama_params(**w.LLAMA_CPU) == w.tree_params(w.llama_tree_cpu())
  info = w.tree_info("cpu")
  assert info["name"] == "llama_cpu_196928" and info["params"] == 196_928


class _SlowLowered:
  """A lowered program whose compile takes ``seconds``."""

  def __init__(self, seconds):
    self.seconds = seconds

  def as_text(self):
    return f"slow {id(self)}"

  def compile(self):
    import time
    time.sleep(self.seconds)
    raise AssertionError("never used")


class _SlowFn:
  def __init__(self, seconds):
    self.seconds = seconds

  def lower(self, *args):
    return _SlowLowered(self.seconds)


def _ceilings():
  return {"copy_gbps": 10.0, "matmul_tflops": 1.0, "spec_gbps": 20.0}


def test_a_compile_past_its_budget_is_recorded_and_the_next_row_runs():
  import jax.numpy as jnp
  from fuseopt.benchmarks import core

  def loop(lr):
    def build():
      fn = jax.jit(lambda p, s, g: (p - lr * g, s + 1), donate_argnums=(0, 1))
      return core.Loop(fn, (jnp.ones((256,)), jnp.zeros((256,)), jnp.ones((256,))),
                       lambda a, o: (o[0], o[1], a[2]))
    return build

  case = core.Case(op="adam", name="tiny", baseline="base", default="fuseopt", params=256, bytes=256 * 12,
                   variants={"slow": lambda: (_SlowFn(5.0), (jnp.ones(3),)), "base": loop(0.1),
                             "fuseopt": loop(0.2)},
                   meta={"fuseopt": {"moved_bytes_per_param": 12}},
                   check=lambda outs: {"ok[fuseopt]": bool(jnp.all(outs["fuseopt"][0] < 1))})
  recs = {r["variant"]: r for r in core.run_case(case, _ceilings(), iters=2, compile_budget_s=0.5)}
  slow = recs["slow"]
  assert slow["status"] == "compile_timeout" and "compile_timeout" in slow["error"] and "ms" not in slow
  assert slow["compile_s"] == 0.5 and core.ABANDONED_COMPILES
  for label in ("base", "fuseopt"):
    r = recs[label]
    assert r["status"] == "ok" and r["ms"] > 0 and r["compile_s"] >= 0 and r["runs"] >= 10, r
  # The spec floor from the row's own bytes; the check saw the first step's outputs.
  assert recs["fuseopt"]["fraction_of_spec_floor"] > 0 and "spec_floor_ms" not in recs["base"]
  assert recs["fuseopt"]["check"] == {"ok[fuseopt]": True}
  report.validate(report.make_results({"device_kind": "x", "platform": "cpu", "size": "quick",
                                       "jax": "0"}, _ceilings(), list(recs.values())))


def test_a_failed_case_never_breaks_the_next():
  """A case whose shared setup fails (as an out-of-memory error would) is
  recorded as errors, its release still runs, and a later case that uses
  the same data holder starts clean (no half-set entry: the KeyError: 'grads'
  class of failure)."""
  import jax.numpy as jnp
  from fuseopt.benchmarks import core, workloads

  struct = {"w": jax.ShapeDtypeStruct((64, 32), jnp.float32)}
  td = workloads.TreeData(struct)
  calls = {"n": 0, "released": 0}
  real = workloads.materialize

  def flaky(tree, **kw):
    calls["n"] += 1
    if calls["n"] == 2:   # the grads of the first case: RESOURCE_EXHAUSTED, say
      raise RuntimeError("RESOURCE_EXHAUSTED: out of memory (injected)")
    return real(tree, **kw)

  def variant():
    g = td.grads()
    p = td.params()
    step = lambda p, g: (jax.tree.map(lambda a, b: a - b, p, g), g)
    return core.Loop(jax.jit(step, donate_argnums=(0,)), (p, g),
                     lambda a, o: (o[0], a[1]))

  def release():
    calls["released"] += 1
    td.release()

  def case(name):
    return core.Case(op="adam", name=name, variants={"base": variant, "fuseopt": variant},
                     baseline="base", default="fuseopt", params=64 * 32, release=release)

  td.params()  # draw 1
  import unittest.mock as mock
  with mock.patch.object(workloads, "materialize", flaky):
    recs = core.run_suite([case("first"), case("second")], _ceilings(), iters=2)
  by = {(r["case"], r["variant"]): r for r in recs}
  first = by[("first", "base")]
  assert first["status"] == "error" and "RESOURCE_EXHAUSTED" in first["error"]
  for key in (("first", "fuseopt"), ("second", "base")):
    assert by[key]["status"] == "ok" and by[key]["ms"] > 0, by[key]
  assert by[("second", "fuseopt")]["same_program_as"] == "base"   # (the same builder)
  assert calls["released"] == 2


def test_plan_runs_the_headline_rows_first_and_resume_leaves_out_what_is_done():
  from fuseopt.benchmarks import core
  from fuseopt.benchmarks.cases import adam as adam_cases, muon as muon_cases
  cases = adam_cases.cases("quick", "cpu") + muon_cases.cases("quick", "cpu")
  first, rest = core.plan(cases)
  labels = [(c.name, tuple(c.variants)) for c in first]
  fp32, bf16 = cases[0].name, cases[1].name
  assert labels[0] == (fp32, ("optax_adamw_fp32", "optax_adamw_mu_bf16", "fuseopt_step",
                              "fuseopt_adamw[drop_in]"))
  assert labels[1] == (bf16, ("optax_adamw_bf16_params", "fuseopt_step"))
  assert labels[2][1] == ("optax_muon", "optax_muon_bf16", "fuseopt_muon", "fuseopt_step")
  assert labels[3] == (fp32, ("fuseopt_step[int8]", "fuseopt_step[int4]"))
  assert cases[2].defaults == ("fuseopt_muon", "fuseopt_step")
  everything = {(c.op, c.name, k) for c in cases for k in c.variants}
  planned = [(c.op, c.name, k) for c in first + rest for k in c.variants]
  assert sorted(planned) == sorted(everything)   # each row once
  done = {("adam", fp32, "optax_adamw_fp32"), ("muon", cases[2].name, "fuseopt_step")}
  first2, rest2 = core.plan(cases, done=done)
  left = {(c.op, c.name, k) for c in first2 + rest2 for k in c.variants}
  assert left == everything - done


def test_the_tpu_table_renders_default_calls_first_against_optax(tmp_path):
  from fuseopt.benchmarks import tpu_report
  assert "pending" in tpu_report.tpu_markdown(None) and "pending" in tpu_report.tpu_status(None)
  assert tpu_report.tpu_results(tmp_path) is None
  row = lambda v, ms, **kw: {"op": "adam", "case": "llama0.53b", "variant": v, "is_baseline": False,
                             "is_default": False, "ms": ms, "compile_s": 3.0, **kw}
  rows = [row("optax_adamw_fp32", 24.4, is_baseline=True, moved_bytes_per_param=28),
          row("optax_adamw_mu_bf16", 21.2),
          row("fuseopt_adamw[drop_in]", 21.7),
          row("fuseopt_step", 18.7, is_default=True, fraction_of_spec_floor=0.8, moved_bytes_per_param=20),
          {**row("fuseopt_step[int4]", 0), "status": "compile_timeout", "error": "compile_timeout: ..."}]
  for r in rows:
    r.pop("ms") if r.get("error") else r.setdefault("baseline_ms", 24.4)
    if "ms" in r:
      r["ratio_to_baseline"] = r["ms"] / 24.4
  meta = {"device_kind": "TPU v5 lite", "device_slug": "tpu-v5-lite", "platform": "tpu", "size": "full",
          "jax": "0.10.2", "time_utc": "2026-12-07T10:00:00Z", "compile_budget_s": 90.0,
          "tree": {"name": "llama0.53b", "layers": 6, "params": 533_751_808, "full_tree": False}}
  report.save_json(report.make_results(meta, {"copy_gbps": 700.0, "spec_gbps": 819.0}, rows),
                   tmp_path / "tpu-v5-lite" / "suite.json")
  res = tpu_report.tpu_results(tmp_path)
  table = tpu_report.tpu_markdown(res)
  lines = [l for l in table.splitlines() if l.startswith("| adam")]
  assert "**`fuseopt_step`** default" in lines[0] and "1.30× faster" in lines[0] and "80%" in lines[0]
  assert lines[-2].split("|")[3].strip() == "`optax_adamw_fp32`" and "compile timeout" in table
  assert "819 GB/s" in table and "533,751,808" in table
  status = tpu_report.tpu_status(res)
  assert "`fuseopt_step` (adam) 18.7 ms, 1.30× faster than optax" in status
  page = tmp_path / "page.md"
  page.write_text(f"x\n{tpu_report.TPU_START}\nold\n{tpu_report.TPU_END}\n")
  assert tpu_report.render_tpu(tmp_path, None, page) and "1.30× faster" in page.read_text()


def test_tpu_sweep_dry_run_records_every_row_and_renders(tmp_path):
  """bench/tpu_sweep.py (the TPU defaults' measurements) runs its stochastic
  rounding part at CPU size in interpret mode, records each row with its
  compile time, and `fuseopt report`'s TPU renderer turns such a file into
  the table and the README's line."""
  from fuseopt.benchmarks import tpu_report
  out = tmp_path / tpu_report.TPU_SLUG / "sweep.json"
  out.parent.mkdir()
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
  subprocess.run([sys.executable, str(ROOT / "bench" / "tpu_sweep.py"), str(out), "--dry-run",
                  "--parts", "sr"], check=True, env=env, cwd=ROOT, timeout=300)
  doc = json.loads(out.read_text())
  rows = [r for r in doc["rows"] if r["part"] == "sr"]
  assert {r["name"] for r in rows} >= {"default", "xla", "xla convert"}
  assert all(r["status"] == "ok" and r["compile_s"] >= 0 and r["ms"] > 0 for r in rows)
  doc["rows"] += [dict(part="tree", name="optax_adamw", status="ok", ms=2.0, params=10, bytes=280,
                       pct_floor=70.0, compile_s=1.0),
                  dict(part="tree", name="fo_step", status="ok", ms=1.5, params=10, bytes=200,
                       pct_floor=65.0, compile_s=1.0)]
  out.write_text(json.dumps(doc))
  readme, page = tmp_path / "README.md", tmp_path / "benchmarks.md"
  readme.write_text(f"x\n{tpu_report.TPU_STATUS_START}\n{tpu_report.TPU_STATUS_END}\n")
  page.write_text(f"y\n{tpu_report.TPU_START}\n{tpu_report.TPU_END}\n")
  assert tpu_report.render_tpu(tmp_path, readme, page)
  assert "0.75 × optax_adamw" in page.read_text()
  assert "`fo.step(fo.adamw)` 1.5 ms (0.75 × optax)" in readme.read_text()
