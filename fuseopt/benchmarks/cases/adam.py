"""AdamW, one update of the Llama-shaped tree of docs/measurements.md.

On a GPU/TPU ("full" and "quick") the 1.20 B tree (d=2048, ff=8192, 16
layers, vocab 32000; 147 leaves); on the CPU the scaled-down tree of
:func:`fuseopt.benchmarks.workloads.llama_tree_cpu`. One call is a whole
step ``(params, state, grads) -> (params', state')`` with params and state
donated (params first: see :func:`fuseopt.optim.step` on donation order).
lr 1e-3, weight decay 0.1 on every leaf, b1 0.9, b2 0.999.

Case ``llama1.2b`` (fp32 params and grads; bytes = 20 B/param, the fused
step's minimal traffic: read p, g 4+4, mu, nu 2+2, write p 4, mu, nu 2+2):

- ``optax_adamw_fp32`` (baseline; 28 B/param, 11.44 ms on the H200, docs/measurements.md);
- ``optax_adamw_mu_bf16``: ``mu_dtype=bf16`` (nu stays fp32; 24 B/param);
- ``fuseopt_adamw[drop_in]``: :func:`fuseopt.optim.adamw` through
  ``update`` + ``optax.apply_updates`` (the update leaves the kernel as an
  fp32 tree, then XLA applies weight decay and lr: more traffic);
- ``fuseopt_step``: :func:`fuseopt.optim.step` with ``group=False``, the
  fused in-place kernel, one launch per leaf, measured fastest on the H200
  (target <= 0.63x the baseline, about 7.2 ms there);
- ``fuseopt_step[xla]`` (accelerators): the same forced to the plain-jnp
  implementation, to choose the default implementation per platform;
- ``fuseopt_step[grouped]`` (accelerators): ``step(group=True)``, the
  default, the leaves of one dtype signature in shared launches;
- ``fuseopt_step[int8]``, ``fuseopt_step[int8,grouped]``: the same with
  8-bit moments (``moment_dtype="int8"``).

Case ``llama1.2b_bf16_params`` (bf16 params and grads; 14 B/param): the
fused step (target <= 0.44x optax fp32) and its xla form, against the same
optax fp32 baseline measured again in that case.

``check`` figures: each variant's parameter change against optax fp32's
(relative Frobenius error: after one step from zero moments the direction
is the same, so fp32 params agree to fp32 rounding and bf16 params to their
stochastic rounding); the kernel's moments against the xla reference's (the
fraction of bf16 moments that differ, which must be tiny, and at most one
ulp); the bytes each variant moves per parameter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fuseopt.optim as fo
from fuseopt.benchmarks import core, workloads
from fuseopt.benchmarks.core import Case

LR = 1e-3
WD = 0.1
F32, BF16 = jnp.float32, jnp.bfloat16
INT8_BOUND = 0.1

BYTES_PER_PARAM = {
    "optax_adamw_fp32": 28, "optax_adamw_mu_bf16": 24, "fuseopt_adamw[drop_in]": 20,
    "fuseopt_step": 20, "fuseopt_step[xla]": 20, "fuseopt_step[grouped]": 20,
    # 8-bit moments: p 4 + g 4 + codes 2 read, p 4 + codes 2 written, plus
    # one fp32 scale per 256 elements of each moment read and written.
    "fuseopt_step[int8]": 16 + 16 / 256, "fuseopt_step[int8,grouped]": 16 + 16 / 256,
}


def _accel(platform):
  return platform in ("gpu", "tpu")


def _optimizers(platform):
  """label -> (transformation, fused?)."""
  opts = {
      "optax_adamw_fp32": (optax.adamw(LR, weight_decay=WD), False),
      "optax_adamw_mu_bf16": (optax.adamw(LR, weight_decay=WD, mu_dtype=BF16), False),
      "fuseopt_adamw[drop_in]": (fo.adamw(LR, weight_decay=WD), False),
      "fuseopt_step": (fo.adamw(LR, weight_decay=WD), True),
  }
  if _accel(platform):
    opts["fuseopt_step[xla]"] = (fo.adamw(LR, weight_decay=WD, implementation="xla"), True)
    # Grouped launches instead of one per leaf: measures what grouping buys.
    opts["fuseopt_step[grouped]"] = (fo.adamw(LR, weight_decay=WD), "grouped")
  # 8-bit moments (docs/adam.md): one launch per leaf, and grouped (the
  # leaves with 8-bit moments run per leaf, the others grouped).
  int8 = fo.adamw(LR, weight_decay=WD, moment_dtype="int8")
  opts["fuseopt_step[int8]"] = (int8, True)
  if _accel(platform):
    opts["fuseopt_step[int8,grouped]"] = (int8, "grouped")
  return opts


def step_fn(tx, fused):
  """``fused``: False (update + apply), True (fuseopt.optim.step) or
  ``"grouped"`` (fuseopt.optim.step with grouped launches)."""
  if fused:
    def step(params, state, grads):
      return fo.step(tx, grads, state, params, group=fused == "grouped")
  else:
    def step(params, state, grads):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state
  return jax.jit(step, donate_argnums=(0, 1))


def _moment_mismatch(a, b):
  """(fraction of elements whose bits differ, largest difference in ulps)."""
  diff = n = 0
  worst = 0
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    if x.dtype != BF16:
      continue
    d = jnp.abs(jax.lax.bitcast_convert_type(x, jnp.int16).astype(jnp.int32)
                - jax.lax.bitcast_convert_type(y, jnp.int16).astype(jnp.int32))
    diff += int(jnp.sum(d != 0))
    worst = max(worst, int(jnp.max(d, initial=0)))
    n += x.size
  return diff / max(n, 1), worst


def cases(size: str, platform: str):
  struct = workloads.tree_for(platform, size, F32, abstract=True)
  n = workloads.tree_params(struct)
  cache = {}

  def data(dtype):
    if dtype not in cache:
      if F32 not in cache:
        cache[F32] = (workloads.materialize(struct, seed=0), workloads.materialize(struct, seed=1))
      if dtype != F32:
        cache[dtype] = jax.tree.map(lambda x: x.astype(dtype), cache[F32])
    return cache[dtype]

  def variant(tx, fused, dtype):
    def build():
      params, grads = data(dtype)

      def refresh():  # params and state are donated: fresh buffers per call
        p = jax.tree.map(jnp.copy, params)
        return p, tx.init(p), grads
      return step_fn(tx, fused), refresh(), refresh
    return build

  def make_check(baseline, dtype):
    def check(outs):
      params, _ = data(dtype)
      base_params, _ = data(F32)
      ref = outs.get(baseline)
      figures = {}
      ref_delta = (jax.tree.map(lambda a, b: a.astype(F32) - b, ref[0], base_params)
                   if ref is not None else None)
      for label, (p, state) in outs.items():
        figures[f"bytes_per_param[{label}]"] = (
            14 if dtype == BF16 and label.startswith("fuseopt") else BYTES_PER_PARAM[label])
        start = base_params if label == baseline else params
        delta = jax.tree.map(lambda a, b: a.astype(F32) - b.astype(F32), p, start)
        finite = all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(delta))
        figures[f"finite[{label}]"] = finite
        if ref_delta is not None and label != baseline:
          e = core.tree_rel_err(delta, ref_delta)
          figures[f"rel_err_vs_optax[{label}]"] = e
          # bf16 params: the stochastic rounding of p is the error (lr 1e-3
          # against a bf16 ulp of ~1e-4 at |p| ~ 0.02).
          # 8-bit moments: one step from zero moments moves each parameter
          # by about lr * sign(g); the codes' rounding is the error.
          bound = (0.3 if (dtype == BF16 and label.startswith("fuseopt"))
                   else INT8_BOUND if "int8" in label else 1e-3)
          figures[f"ok[{label}]"] = bool(finite and np.isfinite(e) and e < bound)
      if "fuseopt_step" in outs and "fuseopt_step[xla]" in outs:
        frac, worst = _moment_mismatch(outs["fuseopt_step"][1][0],
                                       outs["fuseopt_step[xla]"][1][0])
        figures["kernel_vs_xla_moment_bits_differ_fraction"] = frac
        figures["kernel_vs_xla_moment_max_ulp"] = worst
        figures["ok[kernel_vs_xla_moments]"] = bool(frac < 1e-3 and worst <= 1)
        figures["kernel_vs_xla_param_rel_err"] = core.tree_rel_err(
            outs["fuseopt_step"][0], outs["fuseopt_step[xla]"][0])
      return figures
    return check

  def state_bytes(tx):
    st = jax.eval_shape(tx.init, struct)
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(st)))

  prefix = "llama1.2b" if _accel(platform) else f"llama_cpu_{n}"
  opts = _optimizers(platform)
  fp32_case = Case(
      op="adam", name=prefix,
      variants={k: variant(tx, fused, F32) for k, (tx, fused) in opts.items()},
      baseline="optax_adamw_fp32", bytes=20 * n, params=n,
      state_bytes={k: state_bytes(tx) for k, (tx, _) in opts.items()},
      check=make_check("optax_adamw_fp32", F32))

  bf16_opts = {"optax_adamw_fp32": (opts["optax_adamw_fp32"], F32),
               "fuseopt_step": ((fo.adamw(LR, weight_decay=WD), True), BF16)}
  if _accel(platform):
    bf16_opts["fuseopt_step[xla]"] = ((fo.adamw(LR, weight_decay=WD, implementation="xla"), True),
                                      BF16)
  bf16_case = Case(
      op="adam", name=f"{prefix}_bf16_params",
      variants={k: variant(tx, fused, dt) for k, ((tx, fused), dt) in bf16_opts.items()},
      baseline="optax_adamw_fp32", bytes=14 * n, params=n,
      state_bytes={k: state_bytes(tx) for k, ((tx, _), _) in bf16_opts.items()},
      check=make_check("optax_adamw_fp32", BF16))
  return [fp32_case, bf16_case]
