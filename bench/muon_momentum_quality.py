"""Muon's momentum format and training quality: fp32 vs bf16 vs 8-bit (not in CI).

A character-level MLP language model (16 characters of context, embedding 32,
two hidden layers of 256 through GELU; the hidden matrices, 84 % of the
parameters, are Muon's, the embedding and head AdamW's) trained on the
stdlib's ``pydoc_data/topics.py`` (real English text, ~0.5 MB; the last 10 %
held out), ``fo.muon(lr=0.02, weight_decay=0.01)`` through the fused step, the
only difference between modes ``mu_dtype`` (the AdamW side keeps its default
bf16 moments). Prints and writes held-out loss (nats/char, mean ± std over
seeds)::

  JAX_PLATFORMS=cpu python bench/muon_momentum_quality.py --steps 600 --seeds 0 1 2 \\
      --out bench/results/quality/muon_momentum.json
"""

import argparse
import json
import pathlib
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pydoc_data.topics

import fuseopt.optim as fo

CTX, EMB, HID, BATCH = 16, 32, 256, 128
MODES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "int8": "int8"}


def corpus():
  text = "\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
  data = np.frombuffer(text.encode("ascii", "replace"), np.uint8).astype(np.int32) & 127
  cut = int(0.9 * len(data))
  return data[:cut], data[cut:]


def init(key):
  k = jax.random.split(key, 4)
  n = lambda kk, s, fan: jax.random.normal(kk, s) / np.sqrt(fan)
  return {"embed": n(k[0], (128, EMB), 1.0), "w1": n(k[1], (CTX * EMB, HID), CTX * EMB),
          "w2": n(k[2], (HID, HID), HID), "head": n(k[3], (HID, 128), HID),
          "b1": jnp.zeros(HID), "b2": jnp.zeros(HID)}


def loss_fn(p, x, y):
  h = p["embed"][x].reshape(x.shape[0], CTX * EMB)
  h = jax.nn.gelu(h @ p["w1"] + p["b1"])
  h = jax.nn.gelu(h @ p["w2"] + p["b2"])
  return optax.softmax_cross_entropy_with_integer_labels(h @ p["head"], y).mean()


def batch(data, rng, n):
  i = rng.integers(0, len(data) - CTX - 1, n)
  idx = i[:, None] + np.arange(CTX)
  return jnp.asarray(data[idx]), jnp.asarray(data[i + CTX])


def run(mode, seed, steps, train, held):
  params = init(jax.random.key(seed))
  dims = {k: (fo.MuonDimensionNumbers(0, 1) if k in ("w1", "w2") else None) for k in params}
  tx = fo.muon(0.02, weight_decay=0.01, mu_dtype=MODES[mode], muon_weight_dimension_numbers=dims)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    state = tx.init(params)

  @jax.jit
  def step(p, s, x, y):
    g = jax.grad(loss_fn)(p, x, y)
    return fo.step(tx, g, s, p)

  rng = np.random.default_rng(seed)
  for _ in range(steps):
    params, state = step(params, state, *batch(train, rng, BATCH))
  x, y = batch(held, np.random.default_rng(12345), 8192)
  return float(jax.jit(loss_fn)(params, x, y))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--steps", type=int, default=600)
  ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  ap.add_argument("--out", type=pathlib.Path)
  a = ap.parse_args()
  train, held = corpus()
  out = {"task": "char MLP LM on pydoc_data/topics.py (10 % held out)", "steps": a.steps,
         "seeds": a.seeds, "jax": jax.__version__, "device": jax.devices()[0].device_kind,
         "modes": {}}
  for mode in MODES:
    t0 = time.time()
    losses = [run(mode, s, a.steps, train, held) for s in a.seeds]
    out["modes"][mode] = {"held_out_loss": losses, "mean": float(np.mean(losses)),
                          "std": float(np.std(losses, ddof=1)) if len(losses) > 1 else 0.0}
    print(f"{mode:9s} held-out {np.mean(losses):.4f} ± {out['modes'][mode]['std']:.4f} "
          f"{[round(x, 4) for x in losses]} ({time.time() - t0:.0f} s)", flush=True)
  if a.out:
    a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
  main()
