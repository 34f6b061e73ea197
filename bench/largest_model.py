"""The largest model each optimizer format trains on one device; its speed at a fixed size; its quality.

  PYTHONPATH=$PWD python bench/largest_model.py [OUT_ROOT] [--modes M ...] [--budget-s 540] [--resume]
  PYTHONPATH=$PWD python bench/largest_model.py [OUT_ROOT] --fixed-layers 6 [--steps 20]
  PYTHONPATH=$PWD python bench/largest_model.py [OUT_ROOT] --quality 800 --seeds 0 1 2
  python bench/largest_model.py OUT_ROOT --dry-run          # the same path on the CPU, tiny

Every run is examples/train_lm.py in a child process (a fresh process a
trial, one at a time: a failed allocation cannot poison the next, and the
chip takes one process at a time); this process never starts JAX on the
device. Under ``OUT_ROOT/<device-kind-slug>/`` (default ``bench/results``,
e.g. ``bench/results/tpu-v5-lite/``) it writes, rewritten after every trial:

1. ``largest_model.json`` (the default): for each mode (:data:`MODES`, the
   formats of train_lm.py), the largest number of layers of the family
   (``--d 2048 --ff 8192 --heads 16 --vocab 32000``, ``--seq 1024 --batch 8``,
   remat on) that **trains**: ``--steps`` (10) steps without running out of
   device memory (RESOURCE_EXHAUSTED at compile or run time: the child
   reports ``oom``) and a finite loss whose mean over the last three steps
   lies below the first step's. Found by bisection on the layers, the
   first guess from a byte model (parameters + gradients + optimizer state from
   ``jax.eval_shape`` of each mode's ``init``, exact, plus an estimate of the
   activations kept with remat; once a trial has run, the measured peak less
   the training state), tried first and then walked from, so a mode takes
   two to four trials. Per
   mode: the layers, parameters, peak memory, tokens/s and the optimizer's
   share of the step (the update alone, timed on its own, over the step) of
   the largest model that trains, and the smallest that does not.
2. ``speed_fixed.json`` (``--fixed-layers N``): every mode at N layers of the
   family, one run each (``--steps``, default 20): tokens/s, step time, the
   forward+backward and the optimizer in it (train_lm.py's ``--timing full``).
3. ``quality.json`` (``--quality STEPS``): every mode trained for STEPS
   steps on each of ``--seeds`` (the same initial model and batches for every
   mode of a seed), the held-out loss after training; ``optax-adamw`` (fp32)
   over the seeds is the yardstick: a mode is within it when its mean lies
   within one standard deviation (over seeds) of optax's mean. A smaller
   family by default (d 512, 4 layers, byte vocabulary, 256 x 8 tokens).

Time: ``--budget-s`` (540) bounds the whole command; a trial gets at most
``--trial-timeout-s`` (300) and none starts with less than ``--min-trial-s``
(60) left. ``--resume`` (with no path: the output file) keeps the finished
trials of an earlier run and runs what is missing, so the same command run
again goes on where the last one stopped. ``--dry-run``: CPU, a tiny family,
the device's memory replaced by ``--memory-limit`` bytes (a trial whose byte
model exceeds it counts as out of memory without running), for CI.
``python -m fuseopt.cli report`` renders the three files into docs/training.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TRAIN_LM = ROOT / "examples" / "train_lm.py"
SCHEMA = "fuseopt-largest-model/1"
MODES = ("optax-adamw", "optax-adamw-bf16mu", "fo-adamw", "fo-int8", "fo-int4",
         "fo-master24-int8", "fo-master24-int4", "fo-muon-int8")
REFERENCE = "optax-adamw"
FILES = {"largest": "largest_model.json", "fixed": "speed_fixed.json", "quality": "quality.json",
         "compiled": "largest_compiled.json"}
FAMILY = {"d": 2048, "ff": 8192, "heads": 16, "vocab": 32000, "seq": 1024, "batch": 8}
QUALITY_FAMILY = {"d": 512, "ff": 2048, "heads": 4, "vocab": 256, "seq": 256, "batch": 8,
                  "layers": 4}
DRY_FAMILY = {"d": 64, "ff": 256, "heads": 2, "vocab": 256, "seq": 32, "batch": 2, "layers": 2}


def _now() -> float:
  return time.perf_counter()

# ------------------------------------------------------------- the probe --


def probe_main(argv) -> int:
  """Child entry (``--probe``): the device and each mode's bytes at 1 and 2
  layers (``jax.eval_shape``: nothing allocated), as one JSON line."""
  import importlib.util
  spec = importlib.util.spec_from_file_location("train_lm", TRAIN_LM)
  train_lm = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(train_lm)
  import jax
  a = json.loads(argv[0])
  if a.get("compile_for"):
    from fuseopt import targets
    t = targets.get(a["compile_for"])
    kind, platform, stats = t.device_kind, t.platform, {}
  else:
    dev = jax.devices()[0]
    try:
      stats = dev.memory_stats() or {}
    except Exception:  # noqa: BLE001
      stats = {}
    kind, platform = (dev.device_kind if dev.platform != "cpu" else "cpu"), dev.platform
  out = {"device_kind": kind, "platform": platform, "bytes_limit": stats.get("bytes_limit"),
         "jax": jax.__version__, "python": sys.version.split()[0], "bytes": {}}
  if a.get("compile_for"):
    from fuseopt.benchmarks import environment
    out["libtpu"] = environment.versions()["runtime_packages"].get("libtpu")
  for mode in a["modes"]:
    out["bytes"][mode] = {}
    for layers in (1, 2):
      args = train_lm.parse(_train_args(a["family"], layers, mode, 10))
      cfg = train_lm.Config(args.d, args.ff, layers, args.heads, args.vocab, args.seq, "full",
                            args.loss_chunk)
      tx, m = train_lm.make_optimizer(mode, args)
      out["bytes"][mode][str(layers)] = train_lm.byte_model(cfg, tx, m.params)
  print("PROBE " + json.dumps(out), flush=True)
  return 0


def _train_args(family: dict, layers: int, mode: str, steps: int) -> list[str]:
  out = []
  for k in ("d", "ff", "heads", "vocab", "seq", "batch"):
    out += [f"--{k}", str(family[k])]
  return out + ["--layers", str(layers), "--optimizer", mode, "--steps", str(steps)]


def slug(kind: str) -> str:
  import re
  return re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-") or "unknown"

# ------------------------------------------------------------ byte model --


def activation_bytes(f: dict, layers: int) -> float:
  """What remat keeps besides the training state, estimated: each block's
  input (bf16), one block's recomputed forward and its backward, the
  attention scores of one block, one chunk of the loss (fp32 logits, their
  gradient), the embedding's gradient gather."""
  tokens = f["batch"] * f["seq"]
  kept = layers * tokens * f["d"] * 2
  block = tokens * (24 * f["d"] + 10 * f["ff"])
  scores = 12 * f["batch"] * f["heads"] * f["seq"] ** 2
  loss = 10 * min(tokens, 4096) * f["vocab"] + 8 * tokens * f["d"]
  return kept + block + scores + loss


def estimate(bytes_: dict, f: dict, layers: int) -> float:
  """Training state (exact; linear in the layers) + activations (estimated)."""
  one, two = bytes_["1"]["training_bytes"], bytes_["2"]["training_bytes"]
  return one + (two - one) * (layers - 1) + activation_bytes(f, layers)


def guess(bytes_: dict, f: dict, limit: float, max_layers: int,
          overhead: float | None = None) -> int:
  """The most layers whose estimate fits ``limit``: the training state plus
  the measured ``overhead`` when a trial has measured one, else the
  activations' estimate (with 8 % of the memory kept free)."""
  one, two = bytes_["1"]["training_bytes"], bytes_["2"]["training_bytes"]
  fits = ((lambda n: one + (two - one) * (n - 1) + overhead <= 0.98 * limit) if overhead is not None
          else (lambda n: estimate(bytes_, f, n) <= 0.92 * limit))
  n = 0
  while n < max_layers and fits(n + 1):
    n += 1
  return n


# ---------------------------------------------------------------- trials --


class Run:
  def __init__(self, args, kind: str):
    self.args, self.kind, self.t0 = args, kind, _now()
    self.data: dict = {}
    self.path: Path | None = None

  def remaining(self) -> float:
    return self.args.budget_s - (_now() - self.t0)

  def save(self):
    self.data["elapsed_s"] = self.data.get("elapsed_s_before", 0.0) + (_now() - self.t0)
    self.path.parent.mkdir(parents=True, exist_ok=True)
    tmp = self.path.with_suffix(".tmp")
    tmp.write_text(json.dumps(self.data, indent=1) + "\n")
    tmp.replace(self.path)

  def child_env(self) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    if self.args.dry_run or self.args.compile_for:
      env["JAX_PLATFORMS"] = "cpu"
    return env

  def child(self, argv: list[str], timeout: float) -> tuple[int | None, str]:
    """Runs ``argv`` in a fresh process group; (exit code or None on timeout, stderr tail)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=self.child_env(), cwd=ROOT, start_new_session=True)
    try:
      out, err = proc.communicate(timeout=max(1.0, timeout))
      return proc.returncode, (out or "") + (err or "")
    except subprocess.TimeoutExpired:
      import signal
      try:
        os.killpg(proc.pid, signal.SIGKILL)
      except OSError:
        pass
      out, err = proc.communicate()
      return None, (out or "") + (err or "")

  def train(self, family: dict, layers: int, mode: str, extra: list[str]) -> dict:
    """One train_lm.py run; its record, with ``status`` ok / oom / nonfinite /
    error / crashed / timeout / skipped."""
    timeout = min(self.args.trial_timeout_s, self.remaining() - 5)
    if timeout < self.args.min_trial_s:
      return {"status": "skipped", "why": "budget"}
    with tempfile.TemporaryDirectory() as tmp:
      out = Path(tmp) / "run.json"
      argv = [sys.executable, str(TRAIN_LM)] + _train_args(family, layers, mode, self.args.steps)
      argv += ["--quiet", "--json", str(out), "--seed", "0"] + extra
      if self.args.compile_for:
        argv += ["--compile-for", self.args.compile_for]
      t0 = _now()
      code, text = self.child(argv, timeout)
      wall = _now() - t0
      rec = json.loads(out.read_text()) if out.exists() else None
    if rec is None:
      rec = {"status": "timeout" if code is None else "crashed",
             "error": text[-2000:], "exit_code": code}
    elif code is None:
      rec["status"], rec["error"] = "timeout", text[-2000:]
    rec["trial_wall_s"] = wall
    print(f"  {mode} layers={layers}: {rec['status']}"
          + (f", {rec['tokens_per_s']:,.0f} tok/s" if "tokens_per_s" in rec else "")
          + f" ({wall:.0f} s)", flush=True)
    return rec

# --------------------------------------------------------------- largest --


def trains(rec: dict) -> bool:
  """Whether a trial trained (or, compiled deviceless, compiled)."""
  if rec.get("status") == "compiled":
    return True
  if rec.get("status") != "ok":
    return False
  losses = rec["runs"][0]["losses"]
  tail = losses[-3:]
  return all(map(math.isfinite, losses)) and statistics.mean(tail) < losses[0]


def trial_summary(layers: int, rec: dict) -> dict:
  keep = ("status", "phase", "optimizer", "tokens_per_s", "step_ms", "loss_first", "loss_last", "compile_s",
          "trial_wall_s", "memory", "compiled_memory", "timing", "bytes", "why")
  out = {"layers": layers, **{k: rec[k] for k in keep if k in rec}}
  out["trains"] = trains(rec)
  if "error" in rec:
    out["error"] = rec["error"][:600]
  return out


def search(known: dict, run_trial, guess: int, max_layers: int) -> tuple[int | None, bool]:
  """The largest layer count that trains: from the byte model's ``guess``,
  steps of 1, 2, 4, ... up (while it trains) or down (while it fails) until
  the answer is bracketed, then bisection. ``known``: layers -> trains
  (bool) of finished trials; a count at or below one that trains trains, one
  at or above one that failed fails. ``run_trial(layers)`` returns trains
  (bool) or None (out of budget). Returns (largest or None, complete)."""
  def ok(n):
    if any(v and m >= n for m, v in known.items()):
      return True
    if any((not v) and m <= n for m, v in known.items()):
      return False
    r = run_trial(n)
    if r is not None:
      known[n] = r
    return r

  guess, step = min(max(1, guess), max_layers), 1
  r = ok(guess)
  if r is None:
    return None, False
  lo, hi = (guess, None) if r else (None, guess)
  while lo is None:  # walk down until one trains
    n = hi - step
    if n < 1:
      lo = 0
      break
    r = ok(n)
    if r is None:
      return None, False
    lo, hi = (n, hi) if r else (None, n)
    step *= 2
  while hi is None:  # walk up until one fails
    n = min(lo + step, max_layers + 1)
    if n > max_layers:
      return lo, True
    r = ok(n)
    if r is None:
      return lo, False
    lo, hi = (n, None) if r else (lo, n)
    step *= 2
  while hi - lo > 1:
    mid = (lo + hi) // 2
    r = ok(mid)
    if r is None:
      return lo or None, False
    lo, hi = (mid, hi) if r else (lo, mid)
  return lo or None, True


def measured_overhead(data: dict) -> float | None:
  """Peak memory less the training state, the largest over the trials that
  trained with a reported peak: the activations and temporaries as measured.
  A peak below the training state is no measurement of them (a TPU's
  ``peak_bytes_in_use`` leaves the program's temporaries out, the gradients
  among them) and is not used."""
  out = [t["memory"]["peak_bytes_in_use"] - t["bytes"]["training_bytes"]
         for m in data.get("modes", {}).values() for t in m.get("trials", [])
         if t.get("trains") and "peak_bytes_in_use" in t.get("memory", {}) and "bytes" in t]
  out = [v for v in out if v > 0]
  return max(out) if out else None


def compiled_bounds(run: Run, probe: dict, family: dict) -> dict:
  """Per mode, ``(largest that compiled, smallest refused)`` from the
  deviceless search (``--compile-for``'s ``largest_compiled.json`` beside
  this run's file) where it compiled this family with this run's jax: the
  chip's compiler refuses at compile time what does not fit, so a count it
  refused is not tried on the chip, and the largest it took is the first
  guess. Else {}."""
  path = run.path.with_name(FILES["compiled"])
  if run.args.compile_for or not path.exists():
    return {}
  c = json.loads(path.read_text())
  if c.get("family") != family or c.get("versions", {}).get("jax") != probe["jax"]:
    print(f"{path}: another family or jax release; not used", flush=True)
    return {}
  return {mode: (m.get("largest_layers"), m.get("first_failing_layers"))
          for mode, m in c.get("modes", {}).items() if m.get("complete")}


class Broken(Exception):
  """A trial failed for another reason than memory (an error, a crash)."""


def run_largest(run: Run, probe: dict, family: dict) -> None:
  a = run.args
  limit = a.memory_limit or probe.get("bytes_limit")
  if not limit:
    raise SystemExit("the device reports no bytes_limit: pass --memory-limit BYTES")
  d = run.data
  d.setdefault("modes", {})
  d["memory_limit_bytes"] = limit
  bounds = compiled_bounds(run, probe, family)
  for mode in a.modes:
    m = d["modes"].setdefault(mode, {"trials": []})
    if m.get("complete"):
      continue
    overhead = measured_overhead(d)
    est = guess(probe["bytes"][mode], family, limit, a.max_layers, overhead)
    compiled_ok, refused = bounds.get(mode, (None, None))
    first, source = ((a.start[mode], "--start") if mode in a.start else
                     (compiled_ok, FILES["compiled"]) if compiled_ok else (est, "byte model"))
    m["byte_model"] = {"estimated_layers": est, "overhead_bytes": overhead,
                       "overhead_from": "measured peak less training state" if overhead is not None
                       else "activation estimate",
                       "per_layer_bytes": probe["bytes"][mode]["2"]["training_bytes"]
                       - probe["bytes"][mode]["1"]["training_bytes"],
                       "bytes_per_param": probe["bytes"][mode]["2"]["bytes_per_param"]}
    m["first_guess"] = {"layers": first, "from": source}
    print(f"{mode}: first guess {first} layers ({source}; byte model {est}"
          + ("" if overhead is None else f", measured overhead {overhead / 2**30:.2f} GiB")
          + ")", flush=True)
    known = {t["layers"]: t["trains"] for t in m["trials"]}
    if refused is not None:
      known.setdefault(refused, False)
      m["compiled"] = {"largest_layers": compiled_ok, "refused_layers": refused,
                       "from": FILES["compiled"]}

    def run_trial(layers, mode=mode, m=m):
      if a.dry_run and estimate(probe["bytes"][mode], family, layers) > limit:
        rec = {"status": "oom", "phase": "emulated: the byte model exceeds --memory-limit"}
        print(f"  {mode} layers={layers}: oom (emulated)", flush=True)
      else:
        rec = run.train(family, layers, mode, ["--remat", "full", "--warmup", "2",
                                                "--timing", "opt" if not a.dry_run else "none"])
      if rec["status"] in ("skipped",):
        return None
      m["trials"].append(trial_summary(layers, rec))
      run.save()
      if rec["status"] in ("error", "crashed"):
        raise Broken(rec.get("error", "")[-600:])
      return m["trials"][-1]["trains"]

    try:
      largest, complete = search(known, run_trial, first, a.max_layers)
    except Broken as e:  # not a memory limit: bisecting would only repeat it
      m.update(complete=True, largest_layers=None, first_failing_layers=None,
               error=f"the mode fails for another reason than memory: {e}")
      print(f"{mode}: {m['error'][:300]}", flush=True)
      run.save()
      continue
    m["complete"] = complete
    m["largest_layers"] = largest
    best = [t for t in m["trials"] if t["layers"] == largest and t["trains"]]
    if best:
      t = best[-1]
      m["largest"] = {"layers": largest, "parameters": t.get("bytes", {}).get("parameters"),
                      "training_bytes": t.get("bytes", {}).get("training_bytes"),
                      "peak_bytes": t.get("memory", {}).get("peak_bytes_in_use"),
                      "tokens_per_s": t.get("tokens_per_s"), "step_ms": t.get("step_ms"),
                      "opt_share": t.get("timing", {}).get("opt_alone_share")}
    fails = sorted([t["layers"] for t in m["trials"] if not t["trains"]]
                   + ([refused] if refused is not None else []))
    m["first_failing_layers"] = next((n for n in fails if largest is None or n > largest), None)
    run.save()
    if not complete:
      print(f"{mode}: out of budget; run again with --resume", flush=True)
      return

# ------------------------------------------------------- fixed / quality --


def run_fixed(run: Run, family: dict) -> None:
  a = run.args
  d = run.data
  d.setdefault("modes", {})
  for mode in a.modes:
    if mode in d["modes"] and d["modes"][mode].get("status") != "skipped":
      continue
    rec = run.train(family, a.fixed_layers, mode,
                    ["--remat", "full", "--timing", "full" if not a.dry_run else "opt"])
    d["modes"][mode] = trial_summary(a.fixed_layers, rec)
    run.save()
    if rec["status"] == "skipped":
      print("out of budget; run again with --resume", flush=True)
      return


def summarise_quality(modes: dict, reference: str = REFERENCE) -> dict:
  ref = modes.get(reference, {}).get("heldout", {})
  ref_vals = list(ref.values())
  ref_mean = statistics.mean(ref_vals) if ref_vals else None
  ref_std = statistics.stdev(ref_vals) if len(ref_vals) > 1 else None
  for name, r in modes.items():
    vals = list(r.get("heldout", {}).values())
    if not vals:
      continue
    r["mean"] = statistics.mean(vals)
    r["std"] = statistics.stdev(vals) if len(vals) > 1 else None
    if ref_mean is not None and name != reference:
      r["delta"] = r["mean"] - ref_mean
      diffs = [v - ref[s] for s, v in r["heldout"].items() if s in ref]
      r["paired_delta"] = statistics.mean(diffs) if diffs else None
      if ref_std is not None:
        r["within_reference_spread"] = abs(r["delta"]) <= ref_std
  return {"reference": reference, "reference_mean": ref_mean, "reference_std": ref_std}


def run_quality(run: Run, family: dict) -> None:
  a = run.args
  d = run.data
  d.setdefault("modes", {})
  for mode in a.modes:
    if mode in d["modes"] and d["modes"][mode].get("status") not in ("skipped", None):
      continue
    rec = run.train(family, family["layers"], mode,
                    ["--seeds", *map(str, a.seeds), "--eval-batches", str(a.eval_batches),
                     "--timing", "none"])
    r = trial_summary(family["layers"], rec)
    r["heldout"] = {str(x["seed"]): x["heldout_loss"] for x in rec.get("runs", [])
                    if "heldout_loss" in x}
    r["train_last"] = {str(x["seed"]): x["losses"][-1] for x in rec.get("runs", []) if x["losses"]}
    d["modes"][mode] = r
    d["summary"] = summarise_quality(d["modes"])
    run.save()
    if rec["status"] == "skipped":
      print("out of budget; run again with --resume", flush=True)
      return

# ------------------------------------------------------------------ main --


def parse(argv):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("out_root", nargs="?", type=Path, default=ROOT / "bench" / "results")
  kind = ap.add_mutually_exclusive_group()
  kind.add_argument("--fixed-layers", type=int, default=None, metavar="N",
                    help="speed at N layers for every mode (speed_fixed.json)")
  kind.add_argument("--quality", type=int, default=None, metavar="STEPS",
                    help="held-out loss after STEPS steps for every mode and seed (quality.json)")
  ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
  for k in ("d", "ff", "heads", "vocab", "seq", "batch", "layers"):
    ap.add_argument(f"--{k}", type=int, default=None,
                    help="the family (defaults: the module docstring)" if k == "d" else None)
  ap.add_argument("--steps", type=int, default=None,
                  help="steps a trial (largest: 10; fixed: 20; quality: --quality)")
  ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  ap.add_argument("--eval-batches", type=int, default=32, help="held-out batches (quality)")
  ap.add_argument("--max-layers", type=int, default=256)
  ap.add_argument("--memory-limit", type=float, default=None,
                  help="bytes of device memory (default: the device's bytes_limit)")
  ap.add_argument("--budget-s", type=float, default=540.0)
  ap.add_argument("--trial-timeout-s", type=float, default=300.0)
  ap.add_argument("--min-trial-s", type=float, default=60.0)
  ap.add_argument("--resume", nargs="?", const=True, default=None,
                  help="keep the finished trials of this JSON (no path: the output file)")
  ap.add_argument("--dry-run", action="store_true", help="CPU, a tiny family (for CI)")
  ap.add_argument("--start", nargs="+", default=[], metavar="MODE=LAYERS",
                  help="the first layer count to try for a mode (else the byte model's guess)")
  ap.add_argument("--compile-for", default=None, metavar="TARGET",
                  help="the largest search compiled for a fuseopt.targets device (v5e, ...) "
                       "without one (largest_compiled.json; needs --memory-limit or an earlier "
                       "device run's bytes_limit for the first guess)")
  a = ap.parse_args(argv)
  a.kind = "fixed" if a.fixed_layers is not None else "quality" if a.quality is not None else "largest"
  if a.compile_for and a.kind != "largest":
    ap.error("--compile-for runs the largest search only")
  try:
    a.start = {m: int(n) for m, _, n in (x.partition("=") for x in a.start)}
  except ValueError:
    ap.error(f"--start: MODE=LAYERS pairs (LAYERS an integer), got {a.start}")
  if set(a.start) - set(MODES):
    ap.error(f"--start: modes must be among {', '.join(MODES)}, got {sorted(set(a.start) - set(MODES))}")
  family = dict(QUALITY_FAMILY if a.kind == "quality" else FAMILY)
  if a.dry_run:
    family = dict(DRY_FAMILY)
    a.max_layers = min(a.max_layers, 4)
    a.memory_limit = a.memory_limit or 3e6
    a.min_trial_s = min(a.min_trial_s, 5.0)
    a.eval_batches = min(a.eval_batches, 2)
  for k in family:
    v = getattr(a, k)
    family[k] = family[k] if v is None else v
  a.family = family
  a.steps = a.steps or {"largest": 10, "fixed": 20, "quality": a.quality}[a.kind]
  if a.dry_run:
    a.steps = min(a.steps, 3 if a.kind != "largest" else 4)
  return a


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if argv and argv[0] == "--probe":
    return probe_main(argv[1:])
  a = parse(argv)
  run = Run(a, a.kind)
  family = a.family
  code, text = run.child([sys.executable, str(Path(__file__).resolve()), "--probe",
                          json.dumps({"family": family, "modes": a.modes,
                                     "compile_for": a.compile_for})],
                         min(300.0, max(30.0, run.remaining())))
  line = next((l for l in text.splitlines() if l.startswith("PROBE ")), None)
  if code != 0 or line is None:
    print(f"the probe failed (exit {code}):\n{text[-3000:]}", file=sys.stderr)
    return 1
  probe = json.loads(line[len("PROBE "):])
  run.path = a.out_root / slug(probe["device_kind"]) / FILES["compiled" if a.compile_for else a.kind]
  if a.compile_for and not a.memory_limit:
    device_run = run.path.with_name(FILES["largest"])
    if device_run.exists():
      probe["bytes_limit"] = json.loads(device_run.read_text()).get("device", {}).get("bytes_limit")
  if a.resume:
    earlier = run.path if a.resume is True else Path(a.resume)
    if earlier.exists():
      run.data = json.loads(earlier.read_text())
      run.data["elapsed_s_before"] = run.data.get("elapsed_s", 0.0)
      if run.data.get("family") != family or run.data.get("steps") != a.steps:
        print(f"--resume: {earlier} ran another family or step count; starting afresh",
              flush=True)
        run.data = {}
  run.data.update({"schema": SCHEMA, "kind": a.kind, "family": family, "steps": a.steps,
                   "modes_requested": a.modes, "remat": a.kind != "quality",
                   "device": {k: probe[k] for k in ("device_kind", "platform", "bytes_limit")},
                   "versions": {"jax": probe["jax"], "python": probe["python"],
                                **({"libtpu": probe["libtpu"]} if probe.get("libtpu") else {})},
                   "compile_for": a.compile_for,
                   "dry_run": a.dry_run, "date": time.strftime("%Y-%m-%d", time.gmtime()),
                   "command": "python bench/largest_model.py " + " ".join(argv)})
  if a.kind == "fixed":
    run.data["layers"] = a.fixed_layers
  if a.kind == "quality":
    run.data["seeds"] = a.seeds
  print(f"{probe['device_kind']}: {a.kind} -> {run.path}; family {family}; "
        f"budget {a.budget_s:.0f} s", flush=True)
  {"largest": lambda: run_largest(run, probe, family), "fixed": lambda: run_fixed(run, family),
   "quality": lambda: run_quality(run, family)}[a.kind]()
  run.save()
  left = [m for m in a.modes if m not in run.data.get("modes", {})
          or run.data["modes"][m].get("status") == "skipped"
          or (a.kind == "largest" and not run.data["modes"][m].get("complete"))]
  print(f"wrote {run.path} ({run.remaining():.0f} s of the budget left); "
        + (f"modes left: {' '.join(left)}: run the same command again (with --resume)" if left
           else "every mode done"), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
