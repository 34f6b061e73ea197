"""A character-level transformer LM in flax nnx, trained with four optimizers.

    python examples/char_lm.py                  # 300 steps each, prints losses and ms/step, writes a PNG
    python examples/char_lm.py --steps 3 --d 16 --layers 1 --seq 16 --no-plot   # a smoke run
    python examples/char_lm.py --bf16-params    # bf16 parameters: how the update is stored
    python examples/char_lm.py --moments fp32,int8 --d 256 --steps 600   # AdamW's moments in fp32 / 8 bits

The corpus is generated (no downloads): sentences from a small seeded grammar,
so the loss has real structure to learn. Every optimizer starts from the same
initial model and sees the same batches:

- ``optax AdamW``: ``optax.adamw`` through ``nnx.Optimizer``;
- ``fuseopt AdamW (bf16, fused)``: ``fuseopt.optim.adamw`` (bf16 moments,
  stochastically rounded) through ``fuseopt.nnx.Optimizer``, whose update is
  the fused ``fuseopt.optim.step``;
- ``optax Muon``: ``optax.contrib.muon`` with the split of
  ``fuseopt.nnx.muon_dimension_numbers`` (matrices from the declared logical
  axes; embedding, LM head, norms and biases to AdamW);
- ``fuseopt builder hybrid``: ``build_optimizer`` on a config (Muon with bf16
  Newton-Schulz and bf16 AdamW moments, the split from the logical axes, the
  AdamW side on its own learning rate, warmup + cosine schedules).

With ``--bf16-params`` the model's parameters are stored in bf16 and AdamW
(learning rate ``--lr-adam``, 3e-4 there by default) runs four ways: fp32
parameters (the reference), bf16 with round-to-nearest (``optax.adamw`` +
``apply_updates``: updates below half a bf16 ulp are lost), bf16 with
fuseopt's stochastic rounding (the default) and bf16 with a mantissa
companion (``fo.track_mantissa(tx)``: the fp32 run's masters).

With ``--moments`` (a comma-separated list of ``fp32``, ``bf16``, ``int8``)
the fused ``fuseopt.optim.adamw`` runs once per moment storage: fp32, bf16
(stochastically rounded) and 8-bit (``moment_dtype="int8"``: blockwise codes,
2.03 bytes of state a parameter; leaves whose last axis does not divide by
256 keep bf16 moments, so use ``--d 256``).

On a CPU the times are only indicative; fuseopt's kernels are for GPUs and
TPUs (on the CPU the plain-jnp references run).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import fuseopt.nnx
import fuseopt.optim as fo

# ------------------------------------------------------------------ corpus --

_WORDS = {
    "det": ["the", "a", "every", "no", "one"],
    "adj": ["quick", "lazy", "red", "small", "quiet", "bright", "old", "clever"],
    "noun": ["fox", "dog", "cat", "bird", "kernel", "matrix", "robot", "river", "tree"],
    "verb": ["jumps over", "sees", "follows", "ignores", "orthogonalises", "rounds", "finds"],
    "adv": ["slowly", "quickly", "twice", "again", "today"],
}


def corpus(n_sentences: int = 4000, seed: int = 0) -> str:
  """Sentences ``det adj noun verb det noun [adv].`` drawn with a seeded RNG."""
  rng = np.random.default_rng(seed)
  pick = lambda k: _WORDS[k][rng.integers(len(_WORDS[k]))]
  out = []
  for _ in range(n_sentences):
    s = f"{pick('det')} {pick('adj')} {pick('noun')} {pick('verb')} {pick('det')} {pick('noun')}"
    if rng.random() < 0.5:
      s += f" {pick('adv')}"
    out.append(s + ".")
  return " ".join(out)


def batches(text: str, batch: int, seq: int, steps: int, seed: int = 0):
  """``steps`` batches of (inputs, targets), the same for every optimizer."""
  vocab = sorted(set(text))
  ids = np.array([vocab.index(c) for c in text], np.int32)
  rng = np.random.default_rng(seed)
  starts = rng.integers(0, len(ids) - seq - 1, size=(steps, batch))
  windows = ids[starts[..., None] + np.arange(seq + 1)]
  return len(vocab), windows[..., :-1], windows[..., 1:]


# ------------------------------------------------------------------- model --
# Logical axis names on every kernel (nnx.with_partitioning): the same names a
# sharding rule reads tell fuseopt which parameters are matrices for Muon.
_P = nnx.with_partitioning
_INIT = nnx.initializers.lecun_normal()


class Block(nnx.Module):

  def __init__(self, d: int, heads: int, rngs: nnx.Rngs, flat_heads: bool = False):
    hd = d // heads
    self.heads, self.flat_heads = heads, flat_heads
    if flat_heads:  # (d, d) projections, the heads split in the forward pass
      proj = lambda names: nnx.Linear(d, d, use_bias=False, rngs=rngs, kernel_init=_P(_INIT, names))
      self.q_proj, self.k_proj, self.v_proj = (proj(("embed", "heads")) for _ in range(3))
      self.o_proj = proj(("heads", "embed"))
    else:
      qkv = lambda: nnx.LinearGeneral(d, (heads, hd), use_bias=False, rngs=rngs,
                                      kernel_init=_P(_INIT, ("embed", "heads", "head_dim")))
      self.q_proj, self.k_proj, self.v_proj = qkv(), qkv(), qkv()
      self.o_proj = nnx.LinearGeneral((heads, hd), d, axis=(-2, -1), use_bias=False, rngs=rngs,
                                      kernel_init=_P(_INIT, ("heads", "head_dim", "embed")))
    self.norm1 = nnx.RMSNorm(d, rngs=rngs)
    self.norm2 = nnx.RMSNorm(d, rngs=rngs)
    self.up = nnx.Linear(d, 4 * d, rngs=rngs, kernel_init=_P(_INIT, ("embed", "mlp")))
    self.down = nnx.Linear(4 * d, d, rngs=rngs, kernel_init=_P(_INIT, ("mlp", "embed")))

  def __call__(self, x):
    h = self.norm1(x)
    q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
    if self.flat_heads:
      q, k, v = (t.reshape(*t.shape[:-1], self.heads, -1) for t in (q, k, v))
    a = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    if self.flat_heads:
      a = a.reshape(*a.shape[:-2], -1)
    x = x + self.o_proj(a)
    return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class CharLM(nnx.Module):

  def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int, rngs: nnx.Rngs,
               flat_heads: bool = False):
    self.embed = nnx.Embed(vocab, d, rngs=rngs, embedding_init=_P(nnx.initializers.normal(0.02), ("vocab", "embed")))
    self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq, d)))
    self.blocks = nnx.List([Block(d, heads, rngs, flat_heads) for _ in range(layers)])
    self.norm = nnx.RMSNorm(d, rngs=rngs)
    self.head = nnx.Linear(d, vocab, use_bias=False, rngs=rngs, kernel_init=_P(_INIT, ("embed", "vocab")))

  def __call__(self, ids):
    x = self.embed(ids) + self.pos[: ids.shape[-1]]
    for block in self.blocks:
      x = block(x)
    return self.head(self.norm(x))


def loss_fn(model, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


# -------------------------------------------------------------- optimizers --

def optimizers(model, steps: int, lr_adam: float, lr_muon: float):
  """name -> (optimizer class, transformation). Same schedules everywhere."""
  warmup = max(1, steps // 10)
  sched = lambda peak: optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(steps, warmup + 1))
  dims = fuseopt.nnx.muon_dimension_numbers(model)
  config = fo.OptimConfig(
      optimizer="muon", weight_decay=0.01, moment_dtype="bfloat16", muon_logical_axes=True,
      schedule={"kind": "cosine", "peak": lr_muon, "warmup_steps": warmup},
      adam_schedule={"kind": "cosine", "peak": lr_adam, "warmup_steps": warmup},
      optimizer_kwargs={"ns_coeffs": "polar_express"})
  return {
      "optax AdamW": (nnx.Optimizer, optax.adamw(sched(lr_adam), weight_decay=0.01)),
      "fuseopt AdamW (bf16, fused)": (fuseopt.nnx.Optimizer, fo.adamw(sched(lr_adam), weight_decay=0.01)),
      "optax Muon": (nnx.Optimizer, optax.contrib.muon(
          sched(lr_muon), adam_learning_rate=sched(lr_adam), weight_decay=0.01, adam_weight_decay=0.01,
          muon_weight_dimension_numbers=dims)),
      "fuseopt builder hybrid": (fuseopt.nnx.Optimizer, fo.build_optimizer(config, steps)),
  }


def bf16_optimizers(model, steps: int, lr_adam: float, lr_muon: float):
  """name -> (optimizer class, transformation, parameter dtype): how bf16
  parameters take AdamW's update."""
  del model, lr_muon
  warmup = max(1, steps // 10)
  sched = optax.warmup_cosine_decay_schedule(0.0, lr_adam, warmup, max(steps, warmup + 1))
  fused = lambda **kw: fo.adamw(sched, weight_decay=0.01, moment_dtype=jnp.float32, **kw)
  return {
      "fp32 params": (fuseopt.nnx.Optimizer, fused(), jnp.float32),
      "bf16, round to nearest (optax)": (nnx.Optimizer, optax.adamw(sched, weight_decay=0.01),
                                         jnp.bfloat16),
      "bf16, stochastic rounding": (fuseopt.nnx.Optimizer, fused(), jnp.bfloat16),
      "bf16 + mantissa companion": (fuseopt.nnx.Optimizer, fo.track_mantissa(fused()),
                                    jnp.bfloat16),
  }


MOMENTS = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "int8": "int8"}


def moment_optimizers(steps: int, lr_adam: float, kinds):
  """name -> (optimizer class, transformation): the fused AdamW with its
  moments stored as ``kinds`` (keys of :data:`MOMENTS`)."""
  warmup = max(1, steps // 10)
  sched = optax.warmup_cosine_decay_schedule(0.0, lr_adam, warmup, max(steps, warmup + 1))
  return {f"fuseopt AdamW, {k} moments": (fuseopt.nnx.Optimizer, fo.adamw(
      sched, weight_decay=0.01, moment_dtype=MOMENTS[k])) for k in kinds}


def cast_params(model, dtype):
  """``model`` with every floating parameter stored in ``dtype``."""
  state = nnx.state(model, nnx.Param)
  nnx.update(model, jax.tree.map(lambda x: x.astype(dtype), state))
  return model


def train(make_model, cls, tx, xs, ys):
  """Losses and per-step wall-clock ms (after the compiling first step)."""
  model = make_model()
  opt = cls(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, opt, x, y):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    opt.update(model, grads)
    return loss

  losses, ms = [], []
  for x, y in zip(xs, ys):
    t = time.perf_counter()
    loss = float(step(model, opt, x, y))  # float() waits for the step
    ms.append(1e3 * (time.perf_counter() - t))
    losses.append(loss)
  return losses, ms[1:] or ms


def plot(results: dict, path: Path, title: str) -> Path:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4.2))
  for name, (losses, ms) in results.items():
    k = max(1, len(losses) // 50)  # light smoothing for readability
    smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
    ax.plot(np.arange(len(smooth)) + k - 1, smooth, label=f"{name} ({statistics.median(ms):.1f} ms/step)")
  ax.set_xlabel("step")
  ax.set_ylabel("train loss (nats/char)")
  ax.set_title(title, fontsize=9)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=300)
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--seq", type=int, default=64)
  ap.add_argument("--d", type=int, default=64)
  ap.add_argument("--layers", type=int, default=2)
  ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--lr-adam", type=float, default=None,
                  help="AdamW's peak rate (default 3e-3; 3e-4 with --bf16-params)")
  ap.add_argument("--lr-muon", type=float, default=0.02)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", type=Path, default=Path("examples/out/char_lm.png"))
  ap.add_argument("--no-plot", action="store_true")
  ap.add_argument("--bf16-params", action="store_true",
                  help="compare how bf16 parameters are stored (round to nearest, stochastic, "
                       "mantissa companion) against fp32 parameters")
  ap.add_argument("--moments", type=str, default=None,
                  help="compare AdamW's moment storage instead: a comma-separated list of "
                       + ", ".join(MOMENTS))
  args = ap.parse_args(argv)
  kinds = None if args.moments is None else args.moments.split(",")
  if kinds is not None and (not kinds or any(k not in MOMENTS for k in kinds)):
    ap.error(f"--moments: a comma-separated list of {', '.join(MOMENTS)}, got {args.moments!r}")
  if args.lr_adam is None:
    args.lr_adam = 3e-4 if args.bf16_params else 3e-3

  vocab, xs, ys = batches(corpus(seed=args.seed), args.batch, args.seq, args.steps, seed=args.seed)
  xs, ys = jnp.asarray(xs), jnp.asarray(ys)
  title = (f"char-level LM, d={args.d}, {args.layers} layers, seq {args.seq}, batch {args.batch}, "
           f"{jax.devices()[0].device_kind}"
           + (f", AdamW lr {args.lr_adam:g}" if args.bf16_params else ""))
  print(f"{title}; vocab {vocab}, {args.steps} steps")
  with nnx.use_eager_sharding(False):  # the axis names stay metadata: no mesh here
    make_model = lambda: CharLM(vocab, args.d, args.layers, args.heads, args.seq, nnx.Rngs(args.seed))
    model = make_model()
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(f"{n_params} parameters")
    results = {}
    if kinds is not None:
      runs = moment_optimizers(args.steps, args.lr_adam, kinds)
    else:
      runs = (bf16_optimizers if args.bf16_params else optimizers)(model, args.steps,
                                                                   args.lr_adam, args.lr_muon)
    for name, (cls, tx, *dtype) in runs.items():
      make = make_model if not dtype else (lambda d=dtype[0]: cast_params(make_model(), d))
      losses, ms = train(make, cls, tx, xs, ys)
      results[name] = (losses, ms)
      tail = losses[-max(1, len(losses) // 10):]
      print(f"{name:30s} first {losses[0]:.3f}  last-10% mean {statistics.mean(tail):.3f}  "
            f"{statistics.median(ms):7.2f} ms/step")
  if not args.no_plot:
    try:
      print(f"saved {plot(results, args.out, title)}")
    except ImportError:
      print("matplotlib not installed: no plot (pip install matplotlib)")
  return results


if __name__ == "__main__":
  main(sys.argv[1:])
