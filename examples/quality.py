"""Training quality of AdamW's storage formats: held-out loss on real text, several seeds.

    python examples/quality.py                       # the study: every mode, seeds 0,1,2
    python examples/quality.py --modes fp32,int8 --seeds 0 --steps 200   # a quick look
    python examples/quality.py --json bench/results/quality/char_lm_quality.json   # record it

The task: examples/char_lm.py's transformer (flax nnx) on real English text
that CPython ships, the values of ``pydoc_data.topics.topics`` (the
interpreter's documentation of its keywords and statements, joined in key
order), not a generated corpus: the last ``--heldout`` fraction of the
characters is never trained on, and the loss printed is the mean over all of
its non-overlapping windows. Every matrix's last axis is a multiple of 256
(``--d 256``, q/k/v/o as ``(d, d)`` matrices, the vocabulary padded to 256
slots), so with ``--d 256`` every parameter holds 8-bit moments where a mode
asks for them. Every mode of one seed starts from the same initial model
(bf16 modes: its values rounded to nearest bf16) and sees the same batches;
AdamW everywhere, one learning-rate schedule (warmup, cosine decay).

Modes (``--modes``, a comma-separated list; see :data:`MODES`): AdamW's
moments in fp32 (the reference), bf16 (the default) and 8 bits; bf16
parameters with an fp32 master (``fo.track_mantissa``), with a 24-bit master
(``master_bits=24``) and with stochastic rounding alone (``fo.step`` on bf16
parameters); the peer ``flashoptim-jax`` AdamW (its unfused jnp path,
``fused=False``, which runs on a CPU: 8-bit moments and 24-bit masters on bf16
parameters, its defaults); and the formats another build may have (4-bit
moments, a 24-bit master with 8-bit moments): a mode whose optimizer cannot be
built, initialised or traced here prints "not available in this build" and the
study goes on.

The verdict of a mode: whether its mean over the seeds lies within the
seed-to-seed spread of the reference, i.e. within one standard deviation
(over seeds) of the reference's mean. ``--json`` writes the results;
``python -m fuseopt.cli report`` renders them into docs/adam.md
(``fuseopt.benchmarks.quality_report``).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.util
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import fuseopt.optim as fo
from fuseopt.benchmarks import quality_report

_HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("char_lm", _HERE / "char_lm.py")
char_lm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(char_lm)

VOCAB_SLOTS = 256  # the embedding and LM head rows: a multiple of 8-bit moments' block

# ------------------------------------------------------------------ corpus --


def topics_text() -> tuple[str, dict]:
  """The topics' text (English prose) and where it came from."""
  import pydoc_data.topics
  topics = pydoc_data.topics.topics
  text = "\n\n".join(topics[k] for k in sorted(topics))
  return text, {"source": "pydoc_data.topics.topics (values, sorted keys, joined by blank lines)",
                "topics": len(topics)}


# Single-file modules of the standard library that every supported Python
# (3.11-3.13) has: Python source code, a second task unlike the topics' prose.
SOURCE_MODULES = ("argparse", "ast", "dataclasses", "difflib", "enum", "fractions", "functools",
                  "inspect", "shlex", "statistics", "string", "textwrap", "tokenize", "typing")


def source_text() -> tuple[str, dict]:
  """The source of :data:`SOURCE_MODULES` as this interpreter ships it."""
  import sysconfig
  lib = Path(sysconfig.get_paths()["stdlib"])
  text = "\n\n".join((lib / f"{m}.py").read_text(encoding="utf-8") for m in SOURCE_MODULES)
  return text, {"source": "the standard library's " + ", ".join(f"{m}.py" for m in SOURCE_MODULES)
                + " (joined by blank lines)", "modules": len(SOURCE_MODULES)}


CORPORA = {"topics": topics_text, "source": source_text}


def corpus_text(name: str = "topics") -> tuple[str, dict]:
  """The text of corpus ``name`` (:data:`CORPORA`) and where it came from."""
  text, source = CORPORA[name]()
  return text, {**source, "corpus": name, "python": platform.python_version(), "chars": len(text),
                "sha256": hashlib.sha256(text.encode()).hexdigest()}


def split(text: str, heldout: float):
  """Training and held-out ids (the held-out part last); characters of the
  held-out part the training part lacks map to one unknown id."""
  cut = int(len(text) * (1 - heldout))
  vocab = sorted(set(text[:cut]))
  if len(vocab) + 1 > VOCAB_SLOTS:
    raise ValueError(f"{len(vocab)} characters do not fit {VOCAB_SLOTS} slots")
  table = np.full(max(map(ord, text)) + 1, len(vocab), np.int32)
  table[[ord(c) for c in vocab]] = np.arange(len(vocab))
  ids = table[np.frombuffer(text.encode("utf-32-le"), np.uint32)]
  return ids[:cut], ids[cut:], len(vocab) + 1


def batches(ids, batch: int, seq: int, steps: int, seed: int):
  """``steps`` random windows of the training ids: (inputs, targets)."""
  rng = np.random.default_rng(seed)
  starts = rng.integers(0, len(ids) - seq - 1, size=(steps, batch))
  windows = ids[starts[..., None] + np.arange(seq + 1)]
  return windows[..., :-1], windows[..., 1:]


def heldout_windows(ids, seq: int, limit: int | None = None):
  """Every non-overlapping window of the held-out ids (at most ``limit``)."""
  n = (len(ids) - 1) // seq
  n = n if limit is None else min(n, limit)
  x = ids[: n * seq].reshape(n, seq)
  y = ids[1: n * seq + 1].reshape(n, seq)
  return x, y

# ------------------------------------------------------------------- modes --


class Optimizer(NamedTuple):
  """``init(params)`` and ``step(grads, state, params) -> (params, state)``."""
  init: Callable[[Any], Any]
  step: Callable[[Any, Any, Any], tuple[Any, Any]]


def _fused(tx) -> Optimizer:
  return Optimizer(tx.init, lambda g, s, p: fo.step(tx, g, s, p))


def _flashoptim(lr, wd, seed) -> Optimizer:
  del seed  # round to nearest: nothing to seed
  import flashoptim_jax
  opt = flashoptim_jax.flash_adamw(lr, weight_decay=wd, fused=False, master_weight_bits=24)
  return Optimizer(opt.init, lambda g, s, p: opt.step(p, s, g))


class Mode(NamedTuple):
  label: str
  params: Any  # the parameters' dtype
  make: Callable[[Any, float, int], Optimizer]  # (learning rate, weight decay, seed)


def _adamw(moments, master_bits=None):
  def make(lr, wd, seed):
    tx = fo.adamw(lr, weight_decay=wd, moment_dtype=moments, seed=seed)
    return _fused(tx if master_bits is None else fo.track_mantissa(tx, master_bits=master_bits))
  return make


MODES = {
    "fp32": Mode("fp32 moments", jnp.float32, _adamw("float32")),
    "bf16": Mode("bf16 moments (default)", jnp.float32, _adamw("bfloat16")),
    "int8": Mode("8-bit moments", jnp.float32, _adamw("int8")),
    "int4": Mode("4-bit moments", jnp.float32, _adamw("int4")),
    "master32": Mode("bf16 params + fp32 master, bf16 moments", jnp.bfloat16,
                     _adamw("bfloat16", 32)),
    "master24": Mode("bf16 params + 24-bit master, bf16 moments", jnp.bfloat16,
                     _adamw("bfloat16", 24)),
    "master24-int8": Mode("bf16 params + 24-bit master, 8-bit moments", jnp.bfloat16,
                          _adamw("int8", 24)),
    "master24-int4": Mode("bf16 params + 24-bit master, 4-bit moments", jnp.bfloat16,
                          _adamw("int4", 24)),
    "sr": Mode("bf16 params, stochastic rounding, bf16 moments", jnp.bfloat16,
               _adamw("bfloat16")),
    "flashoptim": Mode("flashoptim-jax: bf16 params + 24-bit master, 8-bit moments", jnp.bfloat16,
                       _flashoptim),
}
REFERENCE = "fp32"

# ---------------------------------------------------------------- training --


def make_model(args, vocab_slots: int, seed: int):
  with nnx.use_eager_sharding(False):
    model = char_lm.CharLM(vocab_slots, args.d, args.layers, args.heads, args.seq, nnx.Rngs(seed),
                           flat_heads=True)
  graphdef, params = nnx.split(model, nnx.Param)
  return graphdef, nnx.as_pure(params)


def _loss(graphdef, params, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(
      nnx.merge(graphdef, params)(x).astype(jnp.float32), y).mean()


def prepare(mode: Mode, opt: Optimizer, graphdef, params, x, y):
  """The training step compiled for ``mode``, its parameters and state: an
  optimizer that cannot run here raises, before any training."""
  params = jax.tree.map(lambda p: p.astype(mode.params), params)
  state = opt.init(params)

  def step(params, state, x, y):
    loss, grads = jax.value_and_grad(lambda p: _loss(graphdef, p, x, y))(params)
    params, state = opt.step(grads, state, params)
    return params, state, loss

  return jax.jit(step).lower(params, state, x, y).compile(), params, state


def train(step, params, state, xs, ys, evaluate, hx, hy, eval_batch: int):
  """The held-out loss after training and the mean training loss of the last
  10 % of steps."""
  losses = []
  for x, y in zip(xs, ys):
    params, state, loss = step(params, state, x, y)
    losses.append(loss)
  losses = [float(l) for l in losses]
  total = sum(float(evaluate(params, hx[i:i + eval_batch], hy[i:i + eval_batch]))
              for i in range(0, len(hx), eval_batch))
  return total / hx.size, statistics.mean(losses[-max(1, len(losses) // 10):])


def summarise(runs: dict, reference: str = REFERENCE) -> dict:
  """Per mode: mean and std over seeds, the mean paired difference to the
  reference, and the verdict (within one reference std of its mean)."""
  ref = runs.get(reference, {}).get("heldout")
  ref_mean = statistics.mean(ref.values()) if ref else None
  ref_std = statistics.stdev(ref.values()) if ref and len(ref) > 1 else None
  for name, r in runs.items():
    if not r.get("available") or not r.get("heldout"):
      continue
    vals = list(r["heldout"].values())
    r["mean"] = statistics.mean(vals)
    r["std"] = statistics.stdev(vals) if len(vals) > 1 else None
    if ref_mean is None or name == reference:
      continue
    diffs = [r["heldout"][s] - ref[s] for s in r["heldout"] if s in ref]
    r["delta"] = r["mean"] - ref_mean
    r["paired_delta"] = statistics.mean(diffs) if diffs else None
    r["paired_delta_std"] = statistics.stdev(diffs) if len(diffs) > 1 else None
    if ref_std is not None:
      r["within_reference_spread"] = abs(r["delta"]) <= ref_std
  return {"reference": reference, "reference_mean": ref_mean, "reference_std": ref_std}


def _git_commit() -> str | None:
  try:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(fo.__file__).parent, capture_output=True, text=True,
                          check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return None


def _versions() -> dict:
  from importlib import metadata
  out = {"python": platform.python_version(), "jax": jax.__version__}
  for pkg in ("jaxlib", "flax", "optax", "flashoptim-jax"):
    try:
      out[pkg] = metadata.version(pkg)
    except metadata.PackageNotFoundError:
      out[pkg] = None
  return out


def parse(argv):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--modes", default=",".join(MODES),
                  help=f"comma-separated, from {', '.join(MODES)} (default: all)")
  ap.add_argument("--seeds", default="0,1,2")
  ap.add_argument("--steps", type=int, default=1000)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--seq", type=int, default=64)
  ap.add_argument("--d", type=int, default=256)
  ap.add_argument("--layers", type=int, default=2)
  ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--corpus", default="topics", choices=sorted(CORPORA),
                  help="topics: CPython's statement documentation (English prose; the study); "
                       "source: Python source of the standard library")
  ap.add_argument("--lr", type=float, default=3e-3, help="AdamW's peak rate (warmup, then cosine to 0)")
  ap.add_argument("--warmup", type=int, default=None, help="warmup steps (default: 10 %% of --steps)")
  ap.add_argument("--weight-decay", type=float, default=0.1)
  ap.add_argument("--heldout", type=float, default=0.1, help="the held-out fraction (the end)")
  ap.add_argument("--eval-windows", type=int, default=None, help="at most this many held-out windows")
  ap.add_argument("--eval-batch", type=int, default=64)
  ap.add_argument("--json", type=Path, default=None, help="write the results here")
  args = ap.parse_args(argv)
  args.mode_list = args.modes.split(",")
  if not args.mode_list or any(m not in MODES for m in args.mode_list):
    ap.error(f"--modes: a comma-separated list of {', '.join(MODES)}, got {args.modes!r}")
  args.seed_list = [int(s) for s in args.seeds.split(",")]
  return args


def main(argv=None) -> dict:
  args = parse(argv)
  t_start, cpu_start, commit = time.perf_counter(), time.process_time(), _git_commit()
  text, source = corpus_text(args.corpus)
  train_ids, held_ids, vocab = split(text, args.heldout)
  hx, hy = heldout_windows(held_ids, args.seq, args.eval_windows)
  warmup = max(1, args.steps // 10) if args.warmup is None else args.warmup
  if not 1 <= warmup < args.steps:
    raise SystemExit(f"--warmup: between 1 and --steps - 1 ({args.steps - 1}), got {warmup}")
  lr = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.steps)
  models = {seed: make_model(args, VOCAB_SLOTS, seed) for seed in args.seed_list}
  graphdef = models[args.seed_list[0]][0]
  n_params = sum(x.size for x in jax.tree.leaves(models[args.seed_list[0]][1]))
  print(f"{source['source']}, Python {source['python']}: {len(train_ids):,} training and "
        f"{len(held_ids):,} held-out characters, {vocab} ids; model d={args.d}, {args.layers} layers, "
        f"{n_params:,} parameters; {args.steps} steps of {args.batch} x {args.seq}; "
        f"seeds {args.seed_list}; {jax.devices()[0].device_kind}")
  data = {seed: tuple(map(jnp.asarray, batches(train_ids, args.batch, args.seq, args.steps, seed)))
          for seed in args.seed_list}
  hx, hy = jnp.asarray(hx), jnp.asarray(hy)
  evaluate = jax.jit(lambda p, x, y: _loss(graphdef, p, x, y) * x.size)
  runs = {}
  for name in args.mode_list:
    mode = MODES[name]
    r = runs[name] = {"label": mode.label, "available": True, "heldout": {}, "train_last10": {},
                      "seconds": {}}
    for seed in args.seed_list:
      t0 = time.perf_counter()
      xs, ys = data[seed]
      try:
        step, params, state = prepare(mode, mode.make(lr, args.weight_decay, seed), *models[seed],
                                      xs[0], ys[0])
      except Exception as e:  # pylint: disable=broad-except
        if r["heldout"]:
          raise  # it ran on an earlier seed: a failure, not a missing format
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        runs[name] = {"label": mode.label, "available": False, "reason": why}
        print(f"{name:14s} {mode.label}: not available in this build ({why})", flush=True)
        break
      held, tail = train(step, params, state, xs, ys, evaluate, hx, hy, args.eval_batch)
      secs = time.perf_counter() - t0
      r["heldout"][str(seed)], r["train_last10"][str(seed)], r["seconds"][str(seed)] = held, tail, secs
      print(f"{name:14s} seed {seed}: held-out {held:.4f}  train (last 10 %) {tail:.4f}  {secs:.0f} s",
            flush=True)
  summary = summarise(runs)
  for name, r in runs.items():
    r["verdict"] = quality_report.verdict(name, r, summary, markdown=False)
  print(f"\nheld-out loss (nats/char), mean ± std over seeds {args.seed_list}:")
  for name, r in runs.items():
    if r["available"]:
      std = "" if r["std"] is None else f" ± {r['std']:.4f}"
      seeds = ", ".join(f"{v:.4f}" for v in r["heldout"].values())
      print(f"{name:14s} {r['mean']:.4f}{std}  [{seeds}]  {r['verdict']}")
    else:
      print(f"{name:14s} {r['verdict']}")
  result = {
      "command": "python examples/quality.py " + " ".join(sys.argv[1:] if argv is None else argv),
      "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
      "versions": _versions(), "fuseopt_commit": commit,
      "device": jax.devices()[0].device_kind, "platform": jax.devices()[0].platform,
      "corpus": dict(source, train_chars=len(train_ids), heldout_chars=len(held_ids), ids=vocab,
                     heldout_windows=len(hx)),
      "settings": {k: v for k, v in vars(args).items() if k not in ("json", "mode_list", "seed_list")}
                  | {"parameters": n_params, "vocab_slots": VOCAB_SLOTS, "optimizer": "AdamW",
                     "schedule": f"warmup {warmup} steps + cosine to 0", "b1": 0.9, "b2": 0.999, "eps": 1e-8},
      "summary": summary, "modes": runs, "wall_s": time.perf_counter() - t_start,
      "cpu_s": time.process_time() - cpu_start,
  }
  if args.json is not None:
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.json} (python -m fuseopt.cli report renders it into docs/adam.md)")
  return result


if __name__ == "__main__":
  main(sys.argv[1:])
