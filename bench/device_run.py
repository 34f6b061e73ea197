"""Everything fuseopt checks and measures on one accelerator, in one command.

  PYTHONPATH=$PWD python bench/device_run.py [OUT_ROOT] [--budget-s 540] [--configs-budget-s 150]
                                             [--parts configs suite] [--resume [JSON]] [--dry-run]

Made for a machine where nothing can be installed and time is short: it
needs only jax (with its CUDA plugin or libtpu), optax and numpy; torch
is used where installed; no pyyaml, matplotlib, tqdm, flax, orbax or
hypothesis (plots are skipped without matplotlib). Under
``OUT_ROOT/<device-kind-slug>/`` (default ``bench/results``; e.g.
``bench/results/nvidia-h200/``) it writes, as it goes:

1. ``device_run.json``: the environment (jax, jaxlib, CUDA plugin and
   NVIDIA wheels, driver and CUDA versions from nvidia-smi, triton, torch,
   device kind, Python), then one record per kernel config of
   ``bench/config_checks.py`` — every block config of the stochastic
   rounding, per-leaf and grouped Adam and Newton–Schulz kernels, each with
   ``status`` (ok / wrong / error / crashed / timeout / skipped), relative
   error against its reference, median ms — rewritten after each record,
   and at the end the suite's status and a summary per kernel family.
   Configs run in a child process, one at a time with a timeout; a config
   that kills the process (segfault, abort) is recorded as ``crashed``, one
   after whose error the device no longer answers as ``error`` with
   ``device_poisoned``, one past its timeout as ``timeout``; a fresh
   process then takes the next config, so one bad config cannot lose the
   others.
2. ``suite.json`` (+ ``bench.png``, ``scaling.png`` with matplotlib):
   ``bench/gpu_suite.py`` in a child process with the rest of the budget —
   the ceilings, every bench case with its baselines (PyTorch's in their own
   process where torch is installed). ``scripts/fuseopt report`` renders
   the README's performance table from it.
3. ``device_run.log``: the stderr of the config-check processes.

The config processes run with ``--xla_gpu_graph_min_graph_size=1``
(``--graph-min-size``): every kernel inside a CUDA graph, as in a training
step, where a block config once failed only at run time.

A second try: ``--resume [DEVICE_RUN_JSON]`` keeps the finished config
records (and the suite's part) of an earlier run (default: the output
directory's ``device_run.json``) and runs only what is missing
(``--retry-failed``: the failed configs too); ``--parts``, ``--families``,
``--ops``, ``--rows`` narrow it.

Time: ``--budget-s`` (default 540 s) bounds the whole run. The config
phase gets ``--configs-budget-s`` (150 s): first each family's heuristic,
the family's check against its plain-jnp reference on the chip
(``kernel_checks`` in the JSON: ok / wrong / error / timeout, what was
compared: bitwise for stochastic rounding, a relative bound elsewhere; the
blockwise 8-bit and 4-bit formats last), each within ``--check-timeout-s``
(150 s); then the search spaces' other configs, fairly shared, each within
``--config-timeout-s`` (60 s); configs not started in time are recorded as
skipped. The suite gets what is left: it starts no new row after
``remaining - --suite-reserve-s`` (100 s) seconds, each row's compile
within ``--compile-budget-s`` (the suite's default, 90 s; past it the row
is ``compile_timeout``), the headline rows (the user's default calls and
optax's) first; it is stopped at ``remaining - 10`` (its JSON holds every
row finished by then). ``--resume`` continues an earlier run: finished
configs and timed suite rows are kept, the rest run.

On a 16 GiB TPU v5e (one chip; results under ``bench/results/tpu-v5-lite/``)::

  PYTHONPATH=$PWD $PY bench/device_run.py $OUT --budget-s 540

This process never starts JAX itself (JAX would preallocate the device
memory its children need); ``--dry-run`` runs the same path on the CPU
(tiny shapes, interpret mode, a short suite) for CI.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import config_checks  # noqa: E402  (bench/ is not a package; stdlib-only at import)

SCHEMA = "fuseopt-device-run/1"
HELLO_TIMEOUT_S = 180.0   # start-up of a config process: imports, backend, environment


def _now() -> float:
  return time.perf_counter()


class Worker:
  """One ``config_checks.py`` process: job ids in on stdin, JSON lines out."""

  def __init__(self, cmd, env, index, log_lines):
    self.index = index
    self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, bufsize=1, env=env,
                                 start_new_session=True)
    self.messages: queue.Queue = queue.Queue()
    self.stderr = collections.deque(maxlen=60)
    self._log = log_lines
    threading.Thread(target=self._read_stdout, daemon=True).start()
    threading.Thread(target=self._read_stderr, daemon=True).start()

  def _read_stdout(self):
    for line in self.proc.stdout:
      if line.startswith(config_checks.PREFIX):
        try:
          self.messages.put(json.loads(line[len(config_checks.PREFIX):]))
        except json.JSONDecodeError:
          self._log.append(f"[worker {self.index} bad line] {line.rstrip()}")
      else:
        self._log.append(f"[worker {self.index} stdout] {line.rstrip()}")
    self.messages.put(None)  # end of stream: the process is gone

  def _read_stderr(self):
    for line in self.proc.stderr:
      self.stderr.append(line.rstrip())
      self._log.append(f"[worker {self.index}] {line.rstrip()}")

  def send(self, text: str) -> bool:
    try:
      self.proc.stdin.write(text + "\n")
      self.proc.stdin.flush()
      return True
    except (BrokenPipeError, OSError, ValueError):
      return False

  def get(self, timeout: float):
    """The next message, None at end of stream, or raises queue.Empty."""
    return self.messages.get(timeout=max(0.0, timeout))

  def death(self) -> str:
    """Why the process ended (waits a moment for its exit status)."""
    try:
      rc = self.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
      return "stopped answering"
    if rc < 0:
      try:
        name = signal.Signals(-rc).name
      except ValueError:
        name = f"signal {-rc}"
      return f"killed by {name} (rc {rc})"
    if rc == config_checks.EXIT_POISONED:
      return f"exited: the device stopped answering after a failed config (rc {rc})"
    return f"exited with rc {rc}"

  def kill(self):
    if self.proc.poll() is None:
      try:
        os.killpg(self.proc.pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        self.proc.kill()
    try:
      self.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
      pass

  def close(self):
    self.send("exit")
    try:
      self.proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
      self.kill()


class Run:
  """State of one device run, saved to ``device_run.json`` after each change."""

  def __init__(self, args):
    self.args = args
    self.t0 = _now()
    self.wall_start = time.time()
    self.log: collections.deque = collections.deque(maxlen=20000)  # (XLA can be verbose)
    self.hello = None
    self.out_dir: Path | None = None
    self.jobs: list[dict] = []
    self.records: dict[str, dict] = {}
    self.parts: dict[str, dict] = {}
    self.budget: dict[str, float] = {}
    self.start_error: dict | None = None
    self.workers = 0

  def elapsed(self) -> float:
    return _now() - self.t0

  def resume(self):
    """Keeps the finished records (and the suite's part) of an earlier run
    (``--resume PATH``, or this directory's ``device_run.json``): only
    configs skipped, pending or new run again."""
    path = Path(self.args.resume) if self.args.resume else self.out_dir / "device_run.json"
    try:
      old = json.loads(path.read_text())
    except (OSError, ValueError):
      print(f"device_run: --resume: no earlier {path}; running everything", flush=True)
      return
    jobs = {j["id"]: j for j in self.jobs}
    kept = 0
    for r in old.get("configs", []):
      j = jobs.get(r.get("id"))
      redo = ("skipped", "pending") + (("error", "crashed", "timeout") if self.args.retry_failed else ())
      if j and r.get("config") == j["config"] and r.get("status") not in redo:
        self.records[r["id"]] = {**r, "resumed": True}
        kept += 1
    if "suite" in old.get("parts", {}):
      self.parts["suite"] = old["parts"]["suite"]
    print(f"device_run: --resume: kept {kept} config records of {path}", flush=True)

  # -------------------------------------------------------------- output --
  def data(self) -> dict:
    h = self.hello or {}
    meta = {"device_kind": h.get("device_kind"), "device_slug": h.get("device_slug"),
            "platform": h.get("platform"), "dry_run": self.args.dry_run,
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]), "env": h.get("env"),
            "config_settings": h.get("settings"), "config_xla_flags": h.get("xla_flags")}
    records = [self.records.get(j["id"], {**j, "status": "pending"}) for j in self.jobs]
    return {"schema": SCHEMA, "meta": meta, "budget": self.budget, "parts": self.parts,
            "wall_s": round(self.elapsed(), 1), "kernel_checks": kernel_checks(self),
            "summary": summarize(records), "configs": records}

  def save(self):
    if self.out_dir is None:
      return
    self.out_dir.mkdir(parents=True, exist_ok=True)
    path = self.out_dir / "device_run.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(self.data(), indent=1, default=repr) + "\n")
    os.replace(tmp, path)  # a reader (or a run cut short) never sees half a file
    self.save_log()

  def save_log(self):
    if self.out_dir is not None and self.log:
      self.out_dir.mkdir(parents=True, exist_ok=True)
      (self.out_dir / "device_run.log").write_text("\n".join(self.log) + "\n")

  # ------------------------------------------------------------- workers --
  def worker_cmd(self) -> list[str]:
    a = self.args
    cmd = [sys.executable, str(HERE / "config_checks.py"),
           "--ns-shape", *map(str, a.ns_shape), "--iters", str(a.iters or 10)]
    if a.ew_layers is not None:
      cmd += ["--ew-layers", str(a.ew_layers)]
    if a.dry_run:
      cmd += ["--dry-run"]
    if a.per_family:
      cmd += ["--per-family", str(a.per_family)]
    return cmd

  def start_worker(self, timeout: float = HELLO_TIMEOUT_S) -> Worker | None:
    self.workers += 1
    self.log.append(f"--- config process {self.workers} at {self.elapsed():.1f} s")
    w = Worker(self.worker_cmd(), child_env(self.args, configs=True), self.workers, self.log)
    try:
      msg = w.get(timeout)
    except queue.Empty:
      msg = None
    if not msg or "hello" not in msg:
      why = w.death() if msg is None else "no hello in time"
      w.kill()
      self.start_error = {"error": f"the config process did not start: {why}",
                          "stderr_tail": list(w.stderr)[-20:]}
      print(f"device_run: {self.start_error['error']}; stderr: {' | '.join(list(w.stderr)[-5:])}",
            flush=True)
      return None
    if self.hello is None:
      self.hello = msg["hello"]
      fams = self.args.families
      self.jobs = [j for j in self.hello["jobs"] if not fams or j["family"] in fams]
      self.out_dir = self.args.out_root / self.hello["device_slug"]
      if self.args.resume is not None:
        self.resume()
      env = self.hello.get("env") or {}
      print(f"device_run: {self.hello['device_kind']} ({self.hello['platform']}), jax {env.get('jax')}, "
            f"jaxlib {env.get('jaxlib')}, driver {(env.get('nvidia_smi') or {}).get('driver_version')}, "
            f"{len(self.jobs)} kernel configs -> {self.out_dir}", flush=True)
    return w


def child_env(args, *, configs: bool = False) -> dict:
  env = dict(os.environ)
  root = str(HERE.parent)
  env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
  if args.dry_run:
    env["JAX_PLATFORMS"] = "cpu"
  if configs and args.graph_min_size:
    # XLA puts a run of at least this many kernels into a CUDA graph. A
    # config check jits one kernel, or a few launches, where
    # a training step has hundreds: 1 puts them into a graph as in training,
    # where the known run-time failure happened (docs/pallas_notes.md).
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_gpu_graph_min_graph_size={args.graph_min_size}").strip()
  return env


def summarize(records: list[dict]) -> dict:
  """Per family: counts by status, the heuristic's and the fastest correct
  config's ms, and the ids that failed."""
  out: dict[str, dict] = {}
  for r in records:
    f = out.setdefault(r["family"], {"kernel": r.get("kernel"), "configs": 0, "status": {},
                                      "failed": [], "heuristic": None, "best": None})
    f["configs"] += 1
    f["status"][r["status"]] = f["status"].get(r["status"], 0) + 1
    if r["status"] in ("wrong", "error", "crashed", "timeout"):
      f["failed"].append(f"{r['id']} {r['config']}: {r['status']}")
    if r["status"] == "ok":
      brief = {"id": r["id"], "config": r["config"], "ms": r.get("ms")}
      if r.get("space_index") is None:
        f["heuristic"] = brief
      elif f["best"] is None or r["ms"] < f["best"]["ms"]:
        f["best"] = brief
  return out


def _describe(rec: dict) -> str:
  if rec["status"] in ("ok", "wrong"):
    rate = (f"{rec['gbps']:.4g} GB/s" if rec.get("gbps") else
            f"{rec['tflops']:.3g} TFLOP/s" if rec.get("tflops") else "")
    return (f"{rec['status']} {rec['ms']:.3f} ms {rate}, rel err {rec.get('rel_err', 0):.1e}, "
            f"compile {rec.get('compile_s', 0):.1f} s")
  return f"{rec['status'].upper()}: {rec.get('error') or rec.get('skipped', '')}"[:300]


BLOCKWISE = ("int8", "int4")   # families whose compiles take longest run their check last


def run_configs(run: Run) -> None:
  """Every config job, in a child process, within the configs budget: first
  each family's heuristic (the family's check against its reference on the
  chip, ``kernel_checks`` in the JSON; blockwise formats last), each with
  ``--check-timeout-s``; then the search spaces' other configs, the budget
  left shared fairly among the families."""
  a = run.args
  start = run.elapsed()
  budget = a.configs_budget_s
  state = {"worker": run.start_worker(), "cannot_start": False}
  if state["worker"] is None:
    run.parts["configs"] = {"status": "failed: the config process did not start",
                            "wall_s": round(run.elapsed() - start, 1), **(run.start_error or {})}
    return
  run.parts["configs"] = {"status": "running"}
  run.save()
  families = list(dict.fromkeys(j["family"] for j in run.jobs))
  done_by_budget = False

  def attempt(job, timeout):
    used = run.elapsed() - start
    if state["worker"] is None and not state["cannot_start"]:
      # A fresh process after a crash: its start-up counts against the budget.
      state["worker"] = run.start_worker(min(HELLO_TIMEOUT_S, max(20.0, budget + timeout - used)))
      state["cannot_start"] = state["worker"] is None  # then the device is gone: no more tries
    if state["worker"] is None:
      run.records[job["id"]] = {**job, "status": "skipped", "ok": False,
                                "skipped": "no config process could start after a crash"}
      return
    # A config may run over its family's share, never past the budget's
    # end by more than its timeout.
    timeout = min(timeout, max(5.0, budget + timeout - used))
    rec, state["worker"] = _run_one(run, state["worker"], job, timeout)
    run.records[job["id"]] = rec
    print(f"  {job['id']:24s} {job['config'][:48]:48s} {_describe(rec)}", flush=True)
    run.save()

  def skip(job):
    run.records[job["id"]] = {**job, "status": "skipped", "ok": False, "skipped": "time budget"}

  # Pass 1: the checks. A family's heuristic runs again when its other
  # configs are to run (the same-run reference for their times and bits).
  todo = {f: [j for j in run.jobs if j["family"] == f and j["id"] not in run.records] for f in families}
  heads = {f: next(j for j in run.jobs if j["family"] == f) for f in families}
  order = sorted(families, key=lambda f: any(b in f for b in BLOCKWISE))
  for fam in order:
    job = heads[fam]
    if job not in todo[fam] and not todo[fam]:
      continue
    if run.elapsed() - start > budget:
      skip(job)
      done_by_budget = True
    else:
      attempt(job, a.check_timeout_s)
    if job in todo[fam]:
      todo[fam].remove(job)
  # Pass 2: the search spaces, fairly.
  left = [f for f in families if todo[f]]
  for k, fam in enumerate(left):
    fam_start = run.elapsed()
    share = max(0.0, budget - (fam_start - start)) / (len(left) - k)
    for job in todo[fam]:
      if run.elapsed() - start > budget or run.elapsed() - fam_start > share:
        skip(job)
        done_by_budget = True
        continue
      attempt(job, a.config_timeout_s)
  if state["worker"] is not None:
    state["worker"].close()
  recs = list(run.records.values())
  counts = collections.Counter(r["status"] for r in recs)
  run.parts["configs"] = {"status": "done" + (" (budget reached)" if done_by_budget else ""),
                          "wall_s": round(run.elapsed() - start, 1), "processes": run.workers,
                          **{k: counts[k] for k in sorted(counts)}}
  run.save()
  run.save_log()


def kernel_checks(run: Run) -> dict:
  """Per family, its heuristic's record: the kernel's output on the device
  against its plain-jnp reference (``ok`` / ``wrong`` / ``error`` /
  ``timeout`` / ``skipped``), what was compared, the error and compile time."""
  out = {}
  for j in run.jobs:
    if j["space_index"] is not None or j["family"] in out:
      continue
    r = run.records.get(j["id"], {"status": "pending"})
    out[j["family"]] = {k: r[k] for k in ("status", "kernel", "check", "rel_err", "bitwise_ref",
                                          "state_differing", "compile_s", "ms", "error", "skipped")
                        if r.get(k) is not None}
  return out


def _run_one(run: Run, worker: Worker, job: dict, timeout: float):
  """(record, worker still usable or None)."""
  t = _now()
  base = {**job, "process": worker.index}
  if not worker.send(job["id"]):
    why = worker.death()
    worker.kill()
    return {**base, "status": "crashed", "ok": False, "error": f"config process gone before start: {why}",
            "stderr_tail": list(worker.stderr)[-20:]}, None
  started = False
  while True:
    try:
      msg = worker.get(timeout - (_now() - t))
    except queue.Empty:
      worker.kill()
      return {**base, "status": "timeout", "ok": False,
              "error": f"no result after {timeout:.0f} s ({'running' if started else 'not started'}); "
                       "process killed", "stderr_tail": list(worker.stderr)[-20:]}, None
    if msg is None:
      why = worker.death()
      worker.kill()
      return {**base, "status": "crashed", "ok": False,
              "error": f"the config process died while running this config: {why}",
              "stderr_tail": list(worker.stderr)[-20:]}, None
    if "start" in msg:
      started = True
    elif "result" in msg:
      rec = {**base, **msg["result"], "wall_s": round(_now() - t, 2)}
      if rec.get("status") == "error":
        rec["stderr_tail"] = list(worker.stderr)[-10:]
      break
  # A failed config may have poisoned the device: the worker checks it and
  # says so (then exits); a fresh process takes the next config.
  if rec.get("status") == "error":
    try:
      msg = worker.get(30.0)
      while msg is not None and "health" not in msg:
        msg = worker.get(30.0)
    except queue.Empty:
      msg = None
    if not (msg and msg["health"]):
      rec["device_poisoned"] = True
      worker.kill()
      return rec, None
  return rec, worker


def run_suite(run: Run) -> None:
  """bench/gpu_suite.py in a child process with what is left of the budget."""
  a = run.args
  remaining = a.budget_s - run.elapsed()
  suite_budget = max(0.0, remaining - a.suite_reserve_s)
  timeout = max(30.0, remaining - 10.0)
  cmd = [sys.executable, str(HERE / "gpu_suite.py"), str(a.out_root), "--budget-s", f"{suite_budget:.0f}"]
  if a.dry_run:
    cmd += ["--size", "quick", "--ops", *(a.ops or ["stochastic_round"]), "--iters", str(a.iters or 2),
            "--torch", "off", "--no-plot"]
  else:
    if a.ops:
      cmd += ["--ops", *a.ops]
    if a.iters:
      cmd += ["--iters", str(a.iters)]
    cmd += ["--torch", a.torch] + (["--no-plot"] if a.no_plot else [])
  if a.rows:
    cmd += ["--rows", *a.rows]
  if a.compile_budget_s is not None:
    cmd += ["--compile-budget-s", f"{a.compile_budget_s:g}"]
  if a.resume is not None:
    cmd += ["--resume"] + (["--retry-failed"] if a.retry_failed else [])
  print(f"device_run: suite, budget {suite_budget:.0f} s, stopped at {timeout:.0f} s: "
        f"{' '.join(cmd[1:])}", flush=True)
  start = run.elapsed()
  run.parts["suite"] = {"status": "running", "command": " ".join(cmd[1:]), "budget_s": round(suite_budget),
                        "timeout_s": round(timeout)}
  run.save()
  proc = subprocess.Popen(cmd, env=child_env(a), start_new_session=True)
  try:
    rc = proc.wait(timeout=timeout)
    status = "done" if rc == 0 else f"done with failures (rc {rc})" if rc == 1 else f"failed (rc {rc})"
  except subprocess.TimeoutExpired:
    try:
      os.killpg(proc.pid, signal.SIGKILL)  # the suite and its torch process, if any
    except (ProcessLookupError, PermissionError):
      proc.kill()
    proc.wait()
    rc, status = None, f"stopped after {timeout:.0f} s (its JSON keeps the cases finished)"
  part = {**run.parts["suite"], "status": status, "rc": rc, "wall_s": round(run.elapsed() - start, 1)}
  slug = (run.hello or {}).get("device_slug")
  if slug is None:
    # No config process told us the device: the suite's own directory.
    fresh = [p for p in a.out_root.glob("*/suite.json") if p.stat().st_mtime >= run.wall_start]
    if fresh:
      slug = max(fresh, key=lambda p: p.stat().st_mtime).parent.name
      run.out_dir = a.out_root / slug
  suite_json = a.out_root / slug / "suite.json" if slug else None
  if suite_json and suite_json.exists():
    try:
      rows = json.loads(suite_json.read_text())["rows"]
      part["json"] = str(suite_json)
      part["rows"] = len(rows)
      part["timed"] = sum("ms" in r for r in rows)
      part["errors"] = sum("error" in r for r in rows)
      part["skipped"] = sum("skipped" in r for r in rows)
    except (ValueError, KeyError, OSError) as e:
      part["json_error"] = repr(e)
  run.parts["suite"] = part
  run.save()


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("out_root", nargs="?", type=Path, default=None,
                  help="results root (default bench/results; bench/out with --dry-run)")
  ap.add_argument("--budget-s", type=float, default=None,
                  help="the whole run's time (default 540; 270 with --dry-run)")
  ap.add_argument("--configs-budget-s", type=float, default=None,
                  help="time for the kernel checks and config search (default 150; 120 with --dry-run)")
  ap.add_argument("--config-timeout-s", type=float, default=60.0, help="one config's time limit")
  ap.add_argument("--check-timeout-s", type=float, default=150.0,
                  help="time limit of each family's heuristic, its check on the device (compiles "
                       "included; the blockwise formats' are the slowest)")
  ap.add_argument("--compile-budget-s", type=float, default=None,
                  help="suite: one row's compile (default: the suite's, 90 s on a GPU/TPU); a row "
                       "past it is recorded as compile_timeout")
  ap.add_argument("--suite-reserve-s", type=float, default=None,
                  help="seconds of the suite's share kept for its last row and plots (default 100; 20 with --dry-run)")
  ap.add_argument("--parts", nargs="+", choices=("configs", "suite"), default=("configs", "suite"))
  ap.add_argument("--dry-run", action="store_true",
                  help="the same path on the CPU: tiny shapes, interpret mode, a short suite")
  ap.add_argument("--ew-layers", type=int, default=None,
                  help="layers of the Llama tree for the elementwise configs (default: 1 on a GPU, "
                       "13 leaves; 0 on a TPU; 16: 147, then give --config-timeout-s and "
                       "--configs-budget-s more time)")
  ap.add_argument("--ns-shape", type=int, nargs=3, default=(1, 2048, 8192), metavar=("B", "M", "N"))
  ap.add_argument("--per-family", type=int, default=None, help="only the first N configs of each family")
  ap.add_argument("--retry-failed", action="store_true",
                  help="with --resume: also run again the configs that failed (error, crashed, timeout)")
  ap.add_argument("--graph-min-size", type=int, default=1,
                  help="XLA's --xla_gpu_graph_min_graph_size for the config checks (default 1: every "
                       "kernel inside a CUDA graph, as in a training step; 0: XLA's default)")
  ap.add_argument("--families", nargs="+", default=None,
                  help="only these config families (stochastic_round adam adam_group adam_int8 adam_int8_group "
                       "ns_poly ns_gram "
                       "ns_update ns_fused; on an sm_90 GPU also stochastic_round_mosaic_gpu "
                       "adam_mosaic_gpu adam_group_mosaic_gpu ns_poly_mosaic_gpu "
                       "ns_gram_mosaic_gpu ns_update_mosaic_gpu ns_fused_mosaic_gpu)")
  ap.add_argument("--resume", nargs="?", const="", default=None, metavar="DEVICE_RUN_JSON",
                  help="keep the finished config records (and the suite part) of an earlier run's "
                       "device_run.json (default: OUT_ROOT/<device>/device_run.json) and run only "
                       "what is missing; the suite keeps the timed rows of its suite.json")
  ap.add_argument("--iters", type=int, default=None, help="timed calls per config and per suite variant")
  ap.add_argument("--ops", nargs="+", default=None, help="suite: only these ops")
  ap.add_argument("--rows", nargs="+", default=None, help="suite: only cases whose id contains one of these")
  ap.add_argument("--torch", choices=("auto", "on", "off"), default="auto", help="suite: PyTorch baselines")
  ap.add_argument("--no-plot", action="store_true", help="suite: no PNGs")
  args = ap.parse_args(argv)
  dry = args.dry_run
  args.out_root = args.out_root or Path("bench/out" if dry else "bench/results")
  args.budget_s = args.budget_s if args.budget_s is not None else (270.0 if dry else 540.0)
  args.configs_budget_s = min(args.budget_s, args.configs_budget_s if args.configs_budget_s is not None
                              else (120.0 if dry else 150.0))
  args.suite_reserve_s = args.suite_reserve_s if args.suite_reserve_s is not None else (20.0 if dry else 100.0)

  run = Run(args)
  run.budget = {k: getattr(args, k) for k in ("budget_s", "configs_budget_s", "config_timeout_s",
                                               "check_timeout_s", "compile_budget_s", "suite_reserve_s")}
  print(f"device_run: budget {args.budget_s:.0f} s (configs {args.configs_budget_s:.0f} s, then the suite)"
        + (" [dry run on the CPU]" if dry else ""), flush=True)
  if "configs" in args.parts:
    run_configs(run)
  else:
    w = run.start_worker()  # the environment record and the device's directory
    if w is not None:
      w.close()
    # Config records only where --resume brought them from the earlier run.
    run.jobs = [j for j in run.jobs if j["id"] in run.records]
    run.save()
  if run.hello is None:
    print("device_run: no config process started (see above); the suite still runs", flush=True)
    run.parts.setdefault("configs", {"status": "failed: the config process did not start",
                                     **(run.start_error or {})})
  if "suite" in args.parts:
    run_suite(run)
  run.save()
  s = run.parts.get("configs", {})
  bad = [f for fam in summarize(list(run.records.values())).values() for f in fam["failed"]]
  print(f"device_run: {run.elapsed():.0f} s; configs: "
        + ", ".join(f"{k} {v}" for k, v in s.items() if isinstance(v, int) and k != "processes")
        + f"; suite: {run.parts.get('suite', {}).get('status', 'not run')} -> {run.out_dir}", flush=True)
  for b in bad:
    print(f"  failed config: {b}", flush=True)
  checks = kernel_checks(run)
  if checks:
    print("device_run: kernel checks against the references: "
          + ", ".join(f"{f} {c['status']}" for f, c in checks.items()), flush=True)
  if run.hello is None:
    return 3
  suite_rc = run.parts.get("suite", {}).get("rc", 0)
  return 0 if suite_rc == 0 else 1


if __name__ == "__main__":
  sys.exit(main())
