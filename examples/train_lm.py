"""A Llama-style decoder trained in plain JAX with one optimizer chosen by name.

    python examples/train_lm.py                                   # fo-adamw, a small model, 200 steps
    python examples/train_lm.py --optimizer fo-master24-int4 --steps 500
    python examples/train_lm.py --d 2048 --ff 8192 --heads 16 --vocab 32000 --layers 8 \\
        --seq 1024 --batch 8 --remat --steps 50 --optimizer fo-int8 --json run.json   # a TPU chip

The model: token embedding, ``--layers`` decoder blocks (RMSNorm, causal
self-attention with rotary position embeddings, RMSNorm, SwiGLU MLP), a final
RMSNorm and an untied LM head. Parameters are stored in fp32 or bf16 (as the
optimizer's memory format asks, below); the forward and backward passes run in
bf16 (norms, softmax and the loss in fp32). The blocks are one
``jax.lax.scan`` over parameters stacked along a leading layer axis, so the
compile time does not grow with depth; ``--remat`` wraps the block in
``jax.checkpoint`` (only each block's input is kept for the backward pass).
The loss is computed over chunks of ``--loss-chunk`` tokens (a checkpointed
scan), so the ``(tokens, vocab)`` logits never exist whole.

Data: real text, no network: ``--text PATH`` (any file), else the text
CPython ships as ``pydoc_data.topics`` (as examples/quality.py), else the
standard library's sources. Tokens are its UTF-8 bytes (ids 0-255); the last
``--heldout`` fraction is never trained on. ``--vocab N`` (e.g. 32000) sizes
the embedding and the head like an LLM's while the ids stay below 256: the
memory and the compute of a real vocabulary, byte-level data.

Optimizers (``--optimizer``; :data:`MODES`), each with warmup (``--warmup``
steps) and cosine decay to 10 % of the peak ``--lr``:

=====================  =================================================================  ======
name                   call                                                               params
=====================  =================================================================  ======
optax-adamw            ``optax.adamw(lr)``: fp32 moments                                  fp32
optax-adamw-bf16mu     ``optax.adamw(lr, mu_dtype=bf16)``                                 fp32
fo-adamw (default)     ``fo.adamw(lr)``: bf16 moments, stochastically rounded             fp32
fo-int8                ``fo.adamw(lr, moment_dtype="int8")``                              fp32
fo-int4                ``fo.adamw(lr, moment_dtype="int4")``                              fp32
fo-master24-int8       ``fo.track_mantissa(fo.adamw(lr, moment_dtype="int8"), 24)``       bf16
fo-master24-int4       ``fo.track_mantissa(fo.adamw(lr, moment_dtype="int4"), 24)``       bf16
fo-muon-int8           ``fo.muon(muon_lr, mu_dtype="int8", moment_dtype="int8")``:         bf16
                       Muon on the blocks' matrices, AdamW (8-bit) on the embedding,
                       the head and the norms; bf16 parameters stochastically rounded
yaml:PATH              ``fo.build_optimizer(fo.OptimConfig.from_yaml(...))`` (pyyaml)     [1]
=====================  =================================================================  ======

[1] bf16 when the file says ``bf16_params: mantissa`` or ``mantissa24``, else
fp32 (``--param-dtype`` overrides). A Muon recipe names the blocks' matrices:
``muon_patterns: ['layers/w*']`` (examples/train_lm_muon.yaml).

One ``jax.jit`` holds the forward pass, the backward pass and the update, with
the parameters and the optimizer state donated: ``fo.step(tx, grads, state,
params)`` for fuseopt's modes and the builder's, ``tx.update`` +
``optax.apply_updates`` for optax's.

Printed (and written by ``--json PATH``): the loss, tokens/s, the step time
split into forward+backward and optimizer, and the device's peak memory. The
split (``--timing full``): the median of the training steps (each timed to
completion, the first two left out) is the step; a separately jitted
forward+backward (returning the loss and the gradients) timed on the last
batch is the forward+backward; their difference is the optimizer's share in
the step. The optimizer alone (a jitted, donated update on those gradients)
is timed too. ``--timing opt`` times only the optimizer alone (one more small
compile); ``none`` neither. Peak memory is ``peak_bytes_in_use`` of
``jax.devices()[0].memory_stats()`` after the training steps (before the
split's extra programs), where the backend reports it (TPU, GPU; not the
CPU), with the compiled step's ``memory_analysis()`` beside it.

A run that runs out of device memory (at compile time or at run time) ends
with status ``oom`` in its JSON and exit code 3 (bench/largest_model.py
reads it); a non-finite loss ends with status ``nonfinite``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fuseopt.optim as fo

F32, BF16 = jnp.float32, jnp.bfloat16
SCHEMA = "fuseopt-train-lm/1"
EXIT_OOM = 3

# ------------------------------------------------------------------ corpus --


def corpus_bytes(path: Optional[str] = None) -> tuple[np.ndarray, dict]:
  """The training text as UTF-8 bytes and where it came from."""
  if path:
    data, source = Path(path).read_bytes(), str(path)
  else:
    try:
      import pydoc_data.topics
      topics = pydoc_data.topics.topics
      data = "\n\n".join(topics[k] for k in sorted(topics)).encode()
      source = "pydoc_data.topics.topics (values, sorted keys, joined by blank lines)"
    except ImportError:  # a Python without its documentation: its own sources
      root = Path(os.__file__).parent
      data = b"\n".join(p.read_bytes() for p in sorted(root.glob("*.py")))
      source = f"the standard library's sources ({root}/*.py, sorted)"
  return np.frombuffer(data, np.uint8).astype(np.int32), {
      "source": source, "python": platform.python_version(), "bytes": len(data),
      "sha256": hashlib.sha256(data).hexdigest()}


def split(ids: np.ndarray, heldout: float) -> tuple[np.ndarray, np.ndarray]:
  cut = int(len(ids) * (1 - heldout))
  return ids[:cut], ids[cut:]


class Batches:
  """Random windows of the training ids, seeded: ``batch(i)`` is step i's
  (inputs, targets), the same for every optimizer of one seed."""

  def __init__(self, ids: np.ndarray, batch: int, seq: int, steps: int, seed: int):
    if len(ids) < seq + 2:
      raise ValueError(f"the text has {len(ids)} training tokens: fewer than --seq {seq} + 2")
    self.ids, self.seq = ids, seq
    self.starts = np.random.default_rng(seed).integers(0, len(ids) - seq - 1, size=(steps, batch))

  def __call__(self, i: int):
    w = self.ids[self.starts[i][:, None] + np.arange(self.seq + 1)]
    return w[:, :-1], w[:, 1:]


def heldout_batches(ids: np.ndarray, batch: int, seq: int, limit: int):
  """Up to ``limit`` batches of non-overlapping held-out windows."""
  n = min((len(ids) - 1) // seq // batch, limit)
  x = ids[: n * batch * seq].reshape(n, batch, seq)
  y = ids[1: n * batch * seq + 1].reshape(n, batch, seq)
  return list(zip(x, y))

# ------------------------------------------------------------------- model --


class Config(NamedTuple):
  d: int
  ff: int
  layers: int
  heads: int
  vocab: int
  seq: int
  remat: str  # "none", "full" (keep each block's input only) or "dots"
  loss_chunk: int


LAYER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")


def param_shapes(cfg: Config) -> dict:
  d, ff, L = cfg.d, cfg.ff, cfg.layers
  layer = {"attn_norm": (L, d), "wq": (L, d, d), "wk": (L, d, d), "wv": (L, d, d),
           "wo": (L, d, d), "mlp_norm": (L, d), "w_gate": (L, d, ff), "w_up": (L, d, ff),
           "w_down": (L, ff, d)}
  return {"embed": (cfg.vocab, d), "layers": layer, "final_norm": (d,), "head": (d, cfg.vocab)}


def init_params(cfg: Config, seed: int, dtype) -> dict:
  """Normal(0.02) embedding, fan-in scaled matrices (the blocks' output
  projections further by 1/sqrt(2 layers)), unit norms; drawn in fp32 and
  stored in ``dtype`` (one jitted program: only ``dtype``'s bytes are kept)."""
  shapes = param_shapes(cfg)

  def make(key):
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda s: isinstance(s, tuple))
    keys = jax.random.split(key, len(leaves))
    paths = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda s: isinstance(s, tuple))[0]]
    out = []
    for k, shape, path in zip(keys, leaves, paths):
      if "norm" in path:
        out.append(jnp.ones(shape, dtype))
        continue
      std = 0.02 if "embed" in path else shape[-2] ** -0.5
      if "wo" in path or "w_down" in path:
        std /= math.sqrt(2 * cfg.layers)
      out.append((std * jax.random.normal(k, shape, F32)).astype(dtype))
    return jax.tree.unflatten(treedef, out)

  return jax.jit(make)(jax.random.key(seed))


def _rms_norm(x, scale):
  x32 = x.astype(F32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
  return (y * scale.astype(F32)).astype(BF16)


def _rope(x, positions):
  """Rotary embedding on ``(..., seq, heads, head_dim)`` (the halves rotated)."""
  half = x.shape[-1] // 2
  freq = 10000.0 ** (-jnp.arange(half, dtype=F32) / half)
  angle = positions[:, None].astype(F32) * freq  # (seq, half)
  cos, sin = jnp.cos(angle)[:, None, :], jnp.sin(angle)[:, None, :]
  x1, x2 = x[..., :half].astype(F32), x[..., half:].astype(F32)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(BF16)


def _block(cfg: Config, x, p):
  b, s, d = x.shape
  hd = d // cfg.heads
  w = lambda k: p[k].astype(BF16)  # noqa: E731
  pos = jnp.arange(s)
  h = _rms_norm(x, p["attn_norm"])
  q, k, v = ((h @ w(n)).reshape(b, s, cfg.heads, hd) for n in ("wq", "wk", "wv"))
  q, k = _rope(q, pos), _rope(k, pos)
  a = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, s, d)
  x = x + a @ w("wo")
  h = _rms_norm(x, p["mlp_norm"])
  return x + (jax.nn.silu(h @ w("w_gate")) * (h @ w("w_up"))) @ w("w_down")


def _chunk_loss(x, head, y):
  logits = (x @ head.astype(BF16)).astype(F32)
  return (jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, y[:, None], -1)[:, 0]).sum()


def loss_fn(cfg: Config, params, ids, targets):
  """Mean next-token cross-entropy (nats a token)."""
  x = jnp.take(params["embed"], ids, axis=0).astype(BF16)
  block = lambda x, p: (_block(cfg, x, p), None)  # noqa: E731
  if cfg.remat == "full":
    block = jax.checkpoint(block, prevent_cse=False)
  elif cfg.remat == "dots":
    block = jax.checkpoint(block, prevent_cse=False,
                           policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
  x, _ = jax.lax.scan(block, x, params["layers"])
  x = _rms_norm(x, params["final_norm"])
  tokens = x.shape[0] * x.shape[1]
  x, y = x.reshape(tokens, -1), targets.reshape(tokens)
  chunks = max(1, tokens // max(1, cfg.loss_chunk))
  while tokens % chunks:
    chunks -= 1
  if chunks == 1:
    return _chunk_loss(x, params["head"], y) / tokens
  body = jax.checkpoint(lambda tot, xy: (tot + _chunk_loss(xy[0], params["head"], xy[1]), None),
                        prevent_cse=False)
  total, _ = jax.lax.scan(body, jnp.zeros((), F32),
                          (x.reshape(chunks, tokens // chunks, -1), y.reshape(chunks, -1)))
  return total / tokens

# -------------------------------------------------------------- optimizers --


class Mode(NamedTuple):
  label: str
  params: Any  # the parameters' dtype
  fused: bool  # fo.step, else tx.update + optax.apply_updates
  call: str


MODES = {
    "optax-adamw": Mode("optax AdamW, fp32 moments", F32, False, "optax.adamw(lr)"),
    "optax-adamw-bf16mu": Mode("optax AdamW, mu in bf16", F32, False,
                               "optax.adamw(lr, mu_dtype=jnp.bfloat16)"),
    "fo-adamw": Mode("fuseopt AdamW, bf16 moments (default)", F32, True, "fo.adamw(lr)"),
    "fo-int8": Mode("fuseopt AdamW, 8-bit moments", F32, True, 'fo.adamw(lr, moment_dtype="int8")'),
    "fo-int4": Mode("fuseopt AdamW, 4-bit moments", F32, True, 'fo.adamw(lr, moment_dtype="int4")'),
    "fo-master24-int8": Mode("bf16 params + 24-bit master, 8-bit moments", BF16, True,
                             'fo.track_mantissa(fo.adamw(lr, moment_dtype="int8"), master_bits=24)'),
    "fo-master24-int4": Mode("bf16 params + 24-bit master, 4-bit moments", BF16, True,
                             'fo.track_mantissa(fo.adamw(lr, moment_dtype="int4"), master_bits=24)'),
    "fo-muon-int8": Mode("Muon, 8-bit momentum; AdamW side 8-bit; bf16 params", BF16, True,
                         'fo.muon(muon_lr, mu_dtype="int8", moment_dtype="int8", '
                         'adam_learning_rate=lr)'),
}
DEFAULT_MODE = "fo-adamw"


def muon_dims(params) -> dict:
  """Muon for the blocks' matrices (each stacked ``(layers, in, out)``:
  batched over the layers), AdamW for the embedding, the head and the norms."""
  mdn = fo.MuonDimensionNumbers(reduction_axis=1, output_axis=2)
  return {"embed": None, "final_norm": None, "head": None,
          "layers": {k: (mdn if k.startswith("w") else None) for k in params["layers"]}}


def schedule(peak: float, warmup: int, steps: int):
  return optax.warmup_cosine_decay_schedule(0.0, peak, max(1, warmup), max(steps, warmup + 1),
                                            end_value=0.1 * peak)


def make_optimizer(name: str, args) -> tuple[Any, Mode]:
  """The transformation and its mode (for ``yaml:PATH``: one made up)."""
  lr = schedule(args.lr, args.warmup, args.steps)
  wd, b1, b2 = args.weight_decay, 0.9, 0.95
  if name.startswith("yaml:"):
    config = fo.OptimConfig.from_yaml(Path(name[5:]).read_text())  # needs pyyaml
    bf16 = config.bf16_params in ("mantissa", "mantissa24")
    return fo.build_optimizer(config, steps=args.steps), Mode(
        f"builder recipe {name[5:]}", BF16 if bf16 else F32, True,
        f"fo.build_optimizer(fo.OptimConfig.from_yaml(open({name[5:]!r}).read()))")
  if name not in MODES:
    raise SystemExit(f"--optimizer: one of {', '.join(MODES)} or yaml:PATH, got {name!r}")
  mode = MODES[name]
  seed = args.seed
  if name == "optax-adamw":
    tx = optax.adamw(lr, b1, b2, weight_decay=wd)
  elif name == "optax-adamw-bf16mu":
    tx = optax.adamw(lr, b1, b2, weight_decay=wd, mu_dtype=BF16)
  elif name == "fo-muon-int8":
    tx = fo.muon(schedule(args.muon_lr, args.warmup, args.steps), weight_decay=wd,
                 mu_dtype="int8", moment_dtype="int8", adam_b1=b1, adam_b2=b2,
                 adam_weight_decay=wd, adam_learning_rate=lr, muon_weight_dimension_numbers=muon_dims)
  else:
    moments = {"fo-adamw": "bfloat16", "fo-int8": "int8", "fo-int4": "int4"}.get(
        name, name.rpartition("-")[2])
    tx = fo.adamw(lr, b1, b2, weight_decay=wd, moment_dtype=moments, seed=seed)
    if "master24" in name:
      tx = fo.track_mantissa(tx, master_bits=24)
  return tx, mode


def apply_fn(tx, mode: Mode) -> Callable:
  """``(grads, state, params) -> (params, state)``."""
  if mode.fused:
    return lambda g, s, p: fo.step(tx, g, s, p)

  def apply(g, s, p):
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s
  return apply


def _nbytes(tree) -> int:
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def byte_model(cfg: Config, tx, param_dtype) -> dict:
  """Parameters, gradients (the parameters' dtype) and optimizer state in
  bytes, from ``jax.eval_shape`` (exact; nothing is allocated)."""
  import warnings
  shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, param_dtype), param_shapes(cfg),
                        is_leaf=lambda s: isinstance(s, tuple))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # leaves without quantisation blocks keep bf16
    state = jax.eval_shape(tx.init, shapes)
  n = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
  p, s = _nbytes(shapes), _nbytes(state)
  return {"parameters": n, "param_bytes": p, "grad_bytes": p, "state_bytes": s,
          "training_bytes": 2 * p + s, "bytes_per_param": (2 * p + s) / n}

# ---------------------------------------------------------------- training --


def is_oom(e: BaseException) -> bool:
  text = str(e)
  return any(s in text for s in ("RESOURCE_EXHAUSTED", "Ran out of memory", "Out of memory",
                                 "out of memory", "OOM"))


def memory_stats() -> dict:
  try:
    stats = jax.devices()[0].memory_stats() or {}
  except Exception:  # noqa: BLE001  (a backend without it)
    stats = {}
  return {k: stats[k] for k in ("peak_bytes_in_use", "bytes_in_use", "bytes_limit") if k in stats}


def _analysis(compiled) -> dict:
  try:
    m = compiled.memory_analysis()
    return {k: int(getattr(m, k + "_in_bytes")) for k in
            ("temp_size", "argument_size", "output_size", "alias_size") if m is not None}
  except Exception:  # noqa: BLE001
    return {}


def compile_for(target, train_step, tx, abstract, xs) -> dict:
  """The donated train step compiled for ``target`` (a :mod:`fuseopt.targets`
  device) without one: its ``memory_analysis()``. The chip's compiler refuses
  a program that does not fit its memory at compile time (RESOURCE_EXHAUSTED,
  the bytes it needed), as it would on the device."""
  from fuseopt import targets
  with targets.lowering_for(target):
    args = targets.avals(target, (abstract, jax.eval_shape(tx.init, abstract), xs, xs))
    return _analysis(jax.jit(train_step, donate_argnums=(0, 1)).lower(*args).compile())


def _timed(fn, *args):
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return out, time.perf_counter() - t0


class Progress:
  """tqdm when importable and the run is long, else a line every tenth."""

  def __init__(self, steps: int, quiet: bool):
    self.steps, self.quiet, self.bar = steps, quiet, None
    if not quiet and steps >= 50:
      try:
        from tqdm import tqdm
        self.bar = tqdm(total=steps, unit="step", dynamic_ncols=True)
      except ImportError:
        pass

  def update(self, i: int, loss: float, ms: float):
    if self.bar is not None:
      self.bar.update(1)
      self.bar.set_postfix(loss=f"{loss:.4f}", ms=f"{ms:.1f}")
    elif not self.quiet and (i == 0 or (i + 1) % max(1, self.steps // 10) == 0):
      print(f"  step {i + 1:>6}/{self.steps}  loss {loss:.4f}  {ms:.1f} ms", flush=True)

  def close(self):
    if self.bar is not None:
      self.bar.close()


def train_seed(args, cfg, mode, tx, step, seed, train_ids, held, evaluate):
  """One seed's run: its initial model, its batches; the loss of each step,
  each step's seconds, the held-out loss; and what is needed for the timing
  split afterwards (the parameters, state and last batch)."""
  params = init_params(cfg, seed, mode.params)
  state = jax.jit(tx.init)(params)
  batches = Batches(train_ids, args.batch, cfg.seq, args.steps, seed)
  losses, secs = [], []
  bar = Progress(args.steps, args.quiet)
  try:
    for i in range(args.steps):
      x, y = batches(i)
      (params, state, loss), s = _timed(step, params, state, x, y)
      losses.append(float(loss))
      secs.append(s)
      bar.update(i, losses[-1], 1e3 * s)
      if not math.isfinite(losses[-1]):
        break
  finally:
    bar.close()
  run = {"seed": seed, "losses": losses, "step_s": secs}
  if held and all(map(math.isfinite, losses)):
    run["heldout_loss"] = float(np.mean([float(evaluate(params, x, y)) for x, y in held]))
  return run, params, state, (x, y)


def timing_split(args, cfg, mode, tx, params, state, batch, step_ms) -> dict:
  """Forward+backward alone and the optimizer alone (see the docstring)."""
  out, reps = {}, max(3, min(10, args.steps))
  x, y = batch
  grad_fn = jax.jit(jax.value_and_grad(lambda p, a, b: loss_fn(cfg, p, a, b)))
  if args.timing == "full":
    grad_fn = grad_fn.lower(params, x, y).compile()
    times = [_timed(grad_fn, params, x, y)[1] for _ in range(reps + 1)][1:]
    out["fwd_bwd_ms"] = 1e3 * statistics.median(times)
    out["opt_in_step_ms"] = step_ms - out["fwd_bwd_ms"]
    out["opt_share"] = out["opt_in_step_ms"] / step_ms
    grads = grad_fn(params, x, y)[1]
  else:  # gradients of the right dtypes and a plausible scale, without the model's program
    grads = jax.jit(lambda p: jax.tree.map(lambda a: (1e-3 * a).astype(a.dtype), p))(params)
  apply = jax.jit(apply_fn(tx, mode), donate_argnums=(1, 2))
  times = []
  for _ in range(reps + 1):
    (params, state), s = _timed(apply, grads, state, params)
    times.append(s)
  out["opt_alone_ms"] = 1e3 * statistics.median(times[1:])
  out["opt_alone_share"] = out["opt_alone_ms"] / step_ms
  out["method"] = ("step: median of the training steps (each timed to completion, the first two "
                   "left out); fwd_bwd: a separately jitted value_and_grad timed on the last batch; "
                   "opt_in_step = step - fwd_bwd; opt_alone: the jitted, donated update on those "
                   "gradients, timed alone" if args.timing == "full" else
                   "step: median of the training steps; opt_alone: the jitted, donated update "
                   "timed alone on gradients of the parameters' shapes")
  return out


def run(args) -> dict:
  """Trains (per seed of ``args.seeds``) and returns the record."""
  t_start = time.perf_counter()
  cfg = Config(args.d, args.ff, args.layers, args.heads, args.vocab, args.seq,
               args.remat, args.loss_chunk)
  if args.d % args.heads or (args.d // args.heads) % 2:
    raise SystemExit("--d must be a multiple of --heads, with an even head dimension")
  if args.vocab < 256:
    raise SystemExit("--vocab must be at least 256 (byte-level ids)")
  tx, mode = make_optimizer(args.optimizer, args)
  if args.param_dtype != "auto":
    mode = mode._replace(params=jnp.dtype(args.param_dtype))
  ids, source = corpus_bytes(args.text)
  train_ids, held_ids = split(ids, args.heldout)
  held = heldout_batches(held_ids, args.batch, args.seq, args.eval_batches)
  if args.compile_for:
    from fuseopt import targets  # the compile tier's deviceless compilers (the compile extra)
    target = targets.get(args.compile_for)
    dev = argparse.Namespace(device_kind=target.device_kind, platform=target.platform)
  else:
    dev = jax.devices()[0]
  record = {"schema": SCHEMA, "status": "running", "argv": list(args.argv),
            "config": {k: v for k, v in vars(args).items() if k not in ("argv", "json")},
            "optimizer": {"name": args.optimizer, "label": mode.label, "call": mode.call,
                          "params": jnp.dtype(mode.params).name, "fused": mode.fused},
            "device": {"kind": dev.device_kind, "platform": dev.platform,
                       "count": jax.device_count()},
            "versions": {"python": platform.python_version(), "jax": jax.__version__,
                         "optax": getattr(optax, "__version__", None)},
            "corpus": dict(source, train_tokens=len(train_ids), heldout_tokens=len(held_ids),
                           heldout_batches=len(held)),
            "tokens_per_step": args.batch * args.seq}
  record["bytes"] = byte_model(cfg, tx, mode.params)
  say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
  b = record["bytes"]
  say(f"{mode.label} [{args.optimizer}]: {b['parameters'] / 1e6:.1f} M parameters "
      f"({jnp.dtype(mode.params).name}), params + grads + state {b['training_bytes'] / 2**30:.2f} GiB "
      f"({b['bytes_per_param']:.2f} B/param); d={args.d} ff={args.ff} layers={args.layers} "
      f"heads={args.heads} vocab={args.vocab} (ids < 256: bytes), {args.batch} x {args.seq} "
      f"tokens a step, remat {args.remat}; {dev.device_kind}")
  phase = "compile"
  try:
    apply = apply_fn(tx, mode)

    def train_step(params, state, x, y):
      loss, grads = jax.value_and_grad(lambda p: loss_fn(cfg, p, x, y))(params)
      params, state = apply(grads, state, params)
      return params, state, loss

    abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, mode.params), param_shapes(cfg),
                            is_leaf=lambda s: isinstance(s, tuple))
    xs = jax.ShapeDtypeStruct((args.batch, args.seq), jnp.int32)
    t0 = time.perf_counter()
    if args.compile_for:
      record["compiled_memory"] = compile_for(target, train_step, tx, abstract, xs)
      record["compile_s"] = time.perf_counter() - t0
      record["status"] = "compiled"
      record["wall_s"] = time.perf_counter() - t_start
      _write(args, record)
      say(f"compiled for {target.device_kind} in {record['compile_s']:.1f} s: "
          f"{record['compiled_memory']}")
      return record
    step = jax.jit(train_step, donate_argnums=(0, 1)).lower(
        abstract, jax.eval_shape(tx.init, abstract), xs, xs).compile()
    record["compile_s"] = time.perf_counter() - t0
    record["compiled_memory"] = _analysis(step)
    evaluate = jax.jit(lambda p, x, y: loss_fn(cfg, p, x, y))
    record["runs"] = []
    for seed in args.seeds:
      phase = f"train (seed {seed})"
      run_, params, state, last = train_seed(args, cfg, mode, tx, step, seed, train_ids, held,
                                             evaluate)
      record["runs"].append(run_)
      record["memory"] = memory_stats()
    losses = record["runs"][0]["losses"]
    secs = record["runs"][0]["step_s"][2:] or record["runs"][0]["step_s"]
    record["step_ms"] = 1e3 * statistics.median(secs)
    record["tokens_per_s"] = args.batch * args.seq / (record["step_ms"] / 1e3)
    record["loss_first"], record["loss_last"] = losses[0], losses[-1]
    finite = all(math.isfinite(l) for r in record["runs"] for l in r["losses"])
    record["status"] = "ok" if finite else "nonfinite"
    if finite and args.timing != "none":
      phase = "timing"
      try:
        record["timing"] = timing_split(args, cfg, mode, tx, params, state, last, record["step_ms"])
      except Exception as e:  # noqa: BLE001  (the split is extra: the run has trained)
        record["timing"] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
  except Exception as e:  # noqa: BLE001
    record["status"] = "oom" if is_oom(e) else "error"
    record["phase"] = phase
    record["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
    record["memory"] = memory_stats()
    if record["status"] != "oom":
      _write(args, record)
      raise
  record["wall_s"] = time.perf_counter() - t_start
  _write(args, record)
  _print_summary(say, record)
  return record


def _write(args, record):
  if args.json:
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record, indent=1, default=str) + "\n")


def _print_summary(say, r):
  if r["status"] == "oom":
    say(f"out of device memory ({r['phase']}): {r['error'][:300]}")
    return
  say(f"loss {r['loss_first']:.4f} -> {r['loss_last']:.4f} (nats a byte)"
      + "".join(f"; seed {x['seed']} held-out {x['heldout_loss']:.4f}"
                for x in r["runs"] if "heldout_loss" in x))
  say(f"step {r['step_ms']:.2f} ms, {r['tokens_per_s']:,.0f} tokens/s; compile {r['compile_s']:.1f} s")
  t = r.get("timing", {})
  if "fwd_bwd_ms" in t:
    say(f"  forward+backward {t['fwd_bwd_ms']:.2f} ms, optimizer in the step "
        f"{t['opt_in_step_ms']:.2f} ms ({100 * t['opt_share']:.1f} %), optimizer alone "
        f"{t['opt_alone_ms']:.2f} ms")
  elif "opt_alone_ms" in t:
    say(f"  optimizer alone {t['opt_alone_ms']:.2f} ms ({100 * t['opt_alone_share']:.1f} % of the step)")
  elif "error" in t:
    say(f"  timing split failed: {t['error'][:200]}")
  m, c = r.get("memory", {}), r.get("compiled_memory", {})
  peak = (f"peak {m['peak_bytes_in_use'] / 2**30:.2f} GiB of {m.get('bytes_limit', 0) / 2**30:.2f}"
          if "peak_bytes_in_use" in m else "peak: not reported by this backend")
  say(f"memory: {peak}; compiled step: temp {c.get('temp_size', 0) / 2**30:.2f} GiB, "
      f"arguments {c.get('argument_size', 0) / 2**30:.2f} GiB")


def parse(argv) -> argparse.Namespace:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--d", type=int, default=512)
  ap.add_argument("--ff", type=int, default=2048)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--vocab", type=int, default=256,
                  help="embedding and head rows (>= 256; the ids are bytes, < 256)")
  ap.add_argument("--seq", type=int, default=256)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--steps", type=int, default=200)
  ap.add_argument("--remat", nargs="?", const="full", default="none",
                  choices=("none", "full", "dots"),
                  help="jax.checkpoint each block: full (alone: keep only its input) or dots")
  ap.add_argument("--optimizer", default=DEFAULT_MODE,
                  help=f"one of {', '.join(MODES)}, or yaml:PATH (the builder's YAML)")
  ap.add_argument("--param-dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                  help="the parameters' storage (auto: as the optimizer's format asks)")
  ap.add_argument("--lr", type=float, default=3e-4, help="AdamW's peak rate")
  ap.add_argument("--muon-lr", type=float, default=0.02, help="Muon's peak rate (fo-muon-int8)")
  ap.add_argument("--weight-decay", type=float, default=0.1)
  ap.add_argument("--warmup", type=int, default=None, help="warmup steps (default: 10 %% of --steps)")
  ap.add_argument("--seed", type=int, default=0, help="the model's and the batches' seed")
  ap.add_argument("--seeds", type=int, nargs="+", default=None,
                  help="several seeds, one after another on one compiled step (overrides "
                       "--seed; each seed its own model and batches, the rounding seed the first's)")
  ap.add_argument("--text", default=None, help="a text file (default: pydoc_data.topics)")
  ap.add_argument("--heldout", type=float, default=0.1, help="the held-out fraction (the end)")
  ap.add_argument("--eval-batches", type=int, default=0,
                  help="held-out loss over up to this many batches after training (0: none)")
  ap.add_argument("--loss-chunk", type=int, default=4096, help="tokens a chunk of the loss")
  ap.add_argument("--timing", default="full", choices=("full", "opt", "none"),
                  help="the step-time split (see the module docstring)")
  ap.add_argument("--compile-for", default=None, metavar="TARGET",
                  help="compile the step for a fuseopt.targets device (v5e, v6e, h200, ...) "
                       "without one and report its memory; no training (the compile extra)")
  ap.add_argument("--quiet", action="store_true", help="no progress and no summary")
  ap.add_argument("--json", default=None, help="write the record here")
  args = ap.parse_args(argv)
  args.argv = list(argv)
  args.warmup = max(1, args.steps // 10) if args.warmup is None else args.warmup
  args.seeds = args.seeds if args.seeds is not None else [args.seed]
  args.seed = args.seeds[0]
  return args


def main(argv=None) -> dict:
  args = parse(sys.argv[1:] if argv is None else argv)
  return run(args)


if __name__ == "__main__":
  record = main()
  sys.exit(0 if record["status"] in ("ok", "compiled") else EXIT_OOM if record["status"] == "oom"
           else 1)
