"""AdamW, one update of the Llama-shaped tree of docs/measurements.md.

On a GPU/TPU ("full" and "quick") the 1.20 B tree (d=2048, ff=8192, 16
layers, vocab 32000; 147 leaves) where the device's memory holds optax's
fp32 AdamW step on it, else the most layers that fit
(:func:`fuseopt.benchmarks.workloads.tree_dims`: 6 layers, 0.53 B, case
``llama0.53b``, on a 16 GiB TPU v5e); on the CPU the scaled-down tree of
:func:`fuseopt.benchmarks.workloads.llama_tree_cpu`. One call is a whole
step ``(params, state, grads) -> (params', state')`` with params and state
donated (params first: see :func:`fuseopt.optim.step` on donation order),
timed as training runs it: each step's outputs are the next step's inputs
(:class:`fuseopt.benchmarks.core.Loop`). lr 1e-3, weight decay 0.1 on
every leaf, b1 0.9, b2 0.999.

Row names (docs/benchmarks.md, "Row names"): an untagged fuseopt row is the
default call, ``fo.step(tx, grads, state, params)`` with
``tx = fo.adamw(lr, weight_decay=wd)`` (``moment_dtype="int8"`` for the
``[int8]`` rows: the format is the workload); a tag names what a variant
passes besides, and passes it explicitly, so a tagged row keeps its meaning
when a default changes.

Case ``llama1.2b`` (fp32 params and grads; bytes = 20 B/param, the fused
step's minimal traffic: read p, g 4+4, mu, nu 2+2, write p 4, mu, nu 2+2):

- ``optax_adamw_fp32`` (baseline), ``optax_adamw_mu_bf16`` (``mu_dtype=bf16``);
- ``fuseopt_step``: the default call;
- ``fuseopt_step[group]``, ``fuseopt_step[per_leaf]`` (accelerators):
  ``step(..., group=True)`` (leaves of one dtype signature share launches)
  and ``group=False`` (one launch per leaf); one of them is the default's
  own program, recorded as ``same_program_as`` and not timed twice;
- ``fuseopt_step[xla]`` (accelerators): ``fo.adamw(..., execution=fo.Execution(implementation="xla"))``,
  the plain-jnp reference as a step;
- ``fuseopt_adamw[drop_in]``: ``tx.update`` + ``optax.apply_updates``;
- ``fuseopt_step[int8]``: the default call with 8-bit moments
  (``moment_dtype="int8"``), and ``[int8,group]``, ``[int8,per_leaf]``;
- ``flashoptim_adamw[fp32_params]`` (a GPU with ``flashoptim_jax``
  importable, see :func:`flashoptim_optimizers`): FlashOptim's fused 8-bit
  AdamW on the same fp32 params (``master_weight_bits=None``).

Case ``llama1.2b_bf16_params`` (bf16 params and grads; 14 B/param): the
default call, its ``[group]``, ``[per_leaf]`` and ``[xla]`` variants, against
optax fp32 measured again in that case and ``optax_adamw_bf16_params``
(``optax.adamw`` on the same bf16 params and grads: bf16 moments too, as
optax keeps them in the params' dtype), and ``flashoptim_adamw``
(FlashOptim's default: bf16 params with an 8-bit error-correction companion,
24-bit master weights, 8-bit moments).

Every row says what it stores and moves per parameter (``meta``:
``stores``, ``stored_bytes_per_param`` = params + state,
``moved_bytes_per_param`` = the least one step of that format reads and
writes).

``check`` figures: each variant's parameter change against optax fp32's
(relative Frobenius error: after one step from zero moments the direction
is the same, so fp32 params agree to fp32 rounding and bf16 params to their
rounding); the kernel's moments against the xla reference's (the fraction of
bf16 moments that differ, which must be tiny, and at most one ulp); the
bytes each variant moves per parameter.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

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
INT8_SCALES = 2 * 4 / 256          # one fp32 scale per 256 elements, for each moment
INT4_SCALES = 2 * 4 / 128          # one fp32 scale per 128 elements, for each moment
INT4_BOUND = 0.3
FLASH_SCALES = 2 * 2 / 32          # one fp16 scale per 32 elements, for each moment
DEFAULT = "fuseopt_step"           # the default call's label in both cases
INT8 = "fuseopt_step[int8]"        # the default call on 8-bit moments


@dataclasses.dataclass(frozen=True)
class Variant:
  """One row of an Adam case.

  ``how``: ``"update"`` (``tx.update`` + ``optax.apply_updates``), ``"step"``
  (``fo.step(tx, grads, state, params)``, no further argument), ``"group"`` /
  ``"per_leaf"`` (the same with ``group=True`` / ``group=False``) or
  ``"flash"`` (``tx.step(params, state, grads)`` of a FlashOptim optimizer).
  ``params``: the dtype the row keeps its parameters in. ``stores``: what it
  keeps per parameter, in words; ``stored``: its bytes (params + state);
  ``moved``: the bytes one step of that format must read and write.
  """
  tx: Any
  how: Any
  params: Any
  stores: str
  stored: float
  moved: float
  calls: str

  def meta(self) -> dict:
    return {"stores": self.stores, "stored_bytes_per_param": self.stored,
            "moved_bytes_per_param": self.moved, "calls": self.calls}


def _accel(platform):
  return platform in ("gpu", "tpu")


def _step_variants(tags: tuple[str, ...], tx, params, stores, stored, moved, platform,
                   calls) -> dict:
  """The default call (``fuseopt_step`` with ``tags``, e.g. ``("int8",)``
  for the 8-bit format) and, on an accelerator, its two launch layouts passed
  explicitly (``...[group]``: ``group=True``, ``...[per_leaf]``: ``group=False``)."""
  def label(*more):
    t = tags + more
    return DEFAULT + (f"[{','.join(t)}]" if t else "")
  out = {label(): Variant(tx, "step", params, stores, stored, moved,
                          f"fo.step(tx, grads, state, params); tx = {calls}")}
  if _accel(platform):
    for tag, flag in (("group", True), ("per_leaf", False)):
      out[label(tag)] = Variant(tx, tag, params, stores, stored, moved,
                                f"fo.step(tx, grads, state, params, group={flag}); tx = {calls}")
  return out


def optimizers(platform: str) -> dict[str, Variant]:
  """label -> :class:`Variant` of case ``llama1.2b`` (fp32 params)."""
  wd = f"fo.adamw({LR}, weight_decay={WD}"
  bf16 = "p fp32, mu and nu bf16"
  out = {
      "optax_adamw_fp32": Variant(optax.adamw(LR, weight_decay=WD), "update", F32,
                                  "p, mu and nu fp32", 12, 28,
                                  f"optax.adamw({LR}, weight_decay={WD})"),
      "optax_adamw_mu_bf16": Variant(optax.adamw(LR, weight_decay=WD, mu_dtype=BF16), "update", F32,
                                     "p and nu fp32, mu bf16", 10, 24,
                                     f"optax.adamw({LR}, weight_decay={WD}, mu_dtype=bf16)"),
  }
  out.update(_step_variants((), fo.adamw(LR, weight_decay=WD), F32, bf16, 8, 20, platform,
                            wd + ")"))
  if _accel(platform):
    out["fuseopt_step[xla]"] = Variant(
        fo.adamw(LR, weight_decay=WD, execution=fo.Execution(implementation="xla")), "step", F32,
        bf16, 8, 20, f"fo.step(tx, grads, state, params); tx = {wd}, "
        f"execution=fo.Execution(implementation='xla'))")
  out["fuseopt_adamw[drop_in]"] = Variant(
      fo.adamw(LR, weight_decay=WD), "update", F32, bf16, 8, 20,
      f"tx.update + optax.apply_updates; tx = {wd})")
  # 8-bit moments (docs/adam.md): codes of 1 byte and one fp32 scale per
  # 256 elements of each moment, read and written.
  out.update(_step_variants(("int8",), fo.adamw(LR, weight_decay=WD, moment_dtype="int8"),
                            F32, "p fp32, mu and nu 8-bit (fp32 scale per 256)",
                            4 + 2 + INT8_SCALES, 16 + 2 * INT8_SCALES, platform,
                            wd + ", moment_dtype='int8')"))
  # 4-bit moments: two codes a byte and one fp32 scale per 128 elements.
  out[DEFAULT + "[int4]"] = Variant(
      fo.adamw(LR, weight_decay=WD, moment_dtype="int4"), "step", F32,
      "p fp32, mu and nu 4-bit (fp32 scale per 128)", 4 + 1 + INT4_SCALES,
      14 + 2 * INT4_SCALES, f"fo.step(tx, grads, state, params); tx = {wd}, moment_dtype='int4')")
  if platform == "gpu":
    out.update({k: v for k, v in flashoptim_optimizers().items() if v.params == F32})
  return out


def bf16_optimizers(platform: str) -> dict[str, Variant]:
  """label -> :class:`Variant` of case ``llama1.2b_bf16_params``."""
  wd = f"fo.adamw({LR}, weight_decay={WD}"
  stores = "p, mu and nu bf16"
  out = {"optax_adamw_fp32": Variant(optax.adamw(LR, weight_decay=WD), "update", F32,
                                     "p, mu and nu fp32 (fp32 params)", 12, 28,
                                     f"optax.adamw({LR}, weight_decay={WD}) on fp32 params"),
         # optax on the same bf16 params: its moments take the params' dtype.
         "optax_adamw_bf16_params": Variant(optax.adamw(LR, weight_decay=WD), "update", BF16,
                                            "p, mu and nu bf16", 6, 14,
                                            f"optax.adamw({LR}, weight_decay={WD}) on bf16 params")}
  out.update(_step_variants((), fo.adamw(LR, weight_decay=WD), BF16, stores, 6, 14, platform,
                            wd + ")"))
  if _accel(platform):
    out["fuseopt_step[xla]"] = Variant(
        fo.adamw(LR, weight_decay=WD, execution=fo.Execution(implementation="xla")), "step",
        BF16, stores, 6, 14, f"fo.step(tx, grads, state, params); tx = {wd}, "
        f"execution=fo.Execution(implementation='xla'))")
  # bf16 params with a 24-bit master (an int8 companion) on blockwise moments:
  # p 2 + companion 1 + g 2 + the moments, read; p, companion, moments written.
  for fmt, moments, scales in (("int8", 2, INT8_SCALES), ("int4", 1, INT4_SCALES)):
    out[f"{DEFAULT}[master24,{fmt}]"] = Variant(
        fo.track_mantissa(fo.adamw(LR, weight_decay=WD, moment_dtype=fmt), master_bits=24),
        "step", BF16, f"p bf16 + int8 companion (24-bit master), mu and nu {fmt[3:]}-bit",
        3 + moments + scales, 8 + 2 * moments + 2 * scales,
        f"fo.step(tx, grads, state, params); tx = fo.track_mantissa({wd}, "
        f"moment_dtype={fmt!r}), master_bits=24)")
  if platform == "gpu":
    out.update({k: v for k, v in flashoptim_optimizers().items() if v.params == BF16})
  return out


def flashoptim(required: bool = False):
  """The ``flashoptim_jax`` module, or None where it does not import
  (``bench/gpu_suite.py`` puts the wheel vendored under ``bench/vendor`` on
  the path; it is never a dependency of fuseopt)."""
  try:
    return importlib.import_module("flashoptim_jax")
  except ImportError:
    if required:
      raise
    return None


def flashoptim_optimizers(*, fused: bool = True, required: bool = False) -> dict[str, Variant]:
  """FlashOptim's fused 8-bit AdamW (``flashoptim_jax.flash_adamw``, a
  Pallas-Triton kernel per leaf; GPU only, ``fused=False`` runs its jnp path),
  the JAX peer of 8-bit moments: ``flashoptim_adamw`` is its default (bf16
  params with an int8 error-correction companion, i.e. 24-bit master
  weights), ``flashoptim_adamw[fp32_params]`` the same kernel on fp32 params
  (``master_weight_bits=None``: its default refuses fp32 params). Both keep
  int8 mu, uint8 nu (of sqrt(nu)) and an fp16 scale per 32 elements of each.
  Empty where ``flashoptim_jax`` does not import (unless ``required``)."""
  flash = flashoptim(required)
  if flash is None:
    return {}
  moments = f"mu int8, nu uint8 (fp16 scale per 32 each){'' if fused else ', unfused'}"
  call = f"flash_adamw({LR}, weight_decay={WD}" + ("" if fused else ", fused=False")
  extra = {} if fused else {"fused": False}
  return {
      "flashoptim_adamw": Variant(
          flash.flash_adamw(LR, weight_decay=WD, **extra), "flash", BF16,
          f"p bf16 + int8 companion (24-bit master), {moments}", 2 + 1 + 2 + FLASH_SCALES,
          2 * (2 + 1 + 1 + 1) + 2 + 2 * FLASH_SCALES,
          f"tx.step(params, state, grads); tx = {call})"),
      "flashoptim_adamw[fp32_params]": Variant(
          flash.flash_adamw(LR, weight_decay=WD, master_weight_bits=None, **extra), "flash", F32,
          f"p fp32, {moments}", 4 + 2 + FLASH_SCALES, 2 * (4 + 1 + 1) + 4 + 2 * FLASH_SCALES,
          f"tx.step(params, state, grads); tx = {call}, master_weight_bits=None)"),
  }


def step_fn(tx, fused):
  """The jitted, donating step of one row. ``fused``: False or ``"update"``
  (update + apply), True or ``"step"`` (``fuseopt.optim.step`` with no
  further argument: whatever its default is), ``"group"`` / ``"per_leaf"``
  (``group=True`` / ``group=False``), ``"flash"`` (a FlashOptim optimizer's
  ``step``)."""
  how = {False: "update", True: "step"}.get(fused, fused) if isinstance(fused, bool) else fused
  if how == "step":
    def step(params, state, grads):
      return fo.step(tx, grads, state, params)
  elif how in ("group", "per_leaf"):
    def step(params, state, grads):
      return fo.step(tx, grads, state, params, group=how == "group")
  elif how == "flash":
    def step(params, state, grads):
      return tx.step(params, state, grads)
  elif how == "update":
    def step(params, state, grads):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state
  else:
    raise ValueError(f"step_fn: unknown form {fused!r}")
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


def feed(args, out):
  """The next step's ``(params, state, grads)``: this step's outputs, the same grads."""
  return out[0], out[1], args[2]


# The suite's first pass (core.plan): the user's default calls and optax's
# rows, then the blockwise formats, whose compiles take longest.
HEADLINE = (("optax_adamw_fp32", "optax_adamw_mu_bf16", DEFAULT, "fuseopt_adamw[drop_in]"),
            (INT8, DEFAULT + "[int4]"))
HEADLINE_BF16 = (("optax_adamw_bf16_params", DEFAULT), ())


def cases(size: str, platform: str):
  struct = workloads.tree_for(platform, size, F32, abstract=True)
  n = workloads.tree_params(struct)
  td = workloads.TreeData(struct)

  def variant(v: Variant):
    def build():  # grads in the params' dtype; params drawn afresh (donated)
      grads = td.grads(v.params)
      params = td.params(v.params)
      return core.Loop(step_fn(v.tx, v.how), (params, v.tx.init(params), grads), feed)
    return build

  def reduce(label, out):
    return workloads.sample(out)

  def make_check(variants: dict[str, Variant], baseline):
    def check(outs):
      base_params = td.start(F32)
      ref = outs.get(baseline)
      figures = {}
      ref_delta = (jax.tree.map(lambda a, b: a.astype(F32) - b, ref[0], base_params)
                   if ref is not None else None)
      for label, (p, _) in outs.items():
        v = variants[label]
        figures[f"bytes_per_param[{label}]"] = v.moved
        start = td.start(v.params)
        delta = jax.tree.map(lambda a, b: a.astype(F32) - b.astype(F32), p, start)
        finite = all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(delta))
        figures[f"finite[{label}]"] = finite
        if ref_delta is not None and label != baseline:
          e = core.tree_rel_err(delta, ref_delta)
          figures[f"rel_err_vs_optax[{label}]"] = e
          # bf16 params: their rounding is the error (lr 1e-3 against a bf16
          # ulp of ~1e-4 at |p| ~ 0.02). 8-bit moments: one step from zero
          # moments moves each parameter by about lr * sign(g); the codes'
          # rounding is the error.
          bound = (0.3 if v.params == BF16 else INT8_BOUND if "int8" in label
                   else INT4_BOUND if "int4" in label else 1e-3)
          figures[f"ok[{label}]"] = bool(finite and np.isfinite(e) and e < bound)
      if DEFAULT in outs and "fuseopt_step[xla]" in outs:
        frac, worst = _moment_mismatch(outs[DEFAULT][1][0], outs["fuseopt_step[xla]"][1][0])
        figures["kernel_vs_xla_moment_bits_differ_fraction"] = frac
        figures["kernel_vs_xla_moment_max_ulp"] = worst
        figures["ok[kernel_vs_xla_moments]"] = bool(frac < 1e-3 and worst <= 1)
        figures["kernel_vs_xla_param_rel_err"] = core.tree_rel_err(
            outs[DEFAULT][0], outs["fuseopt_step[xla]"][0])
      return figures
    return check

  def state_bytes(v: Variant):
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, v.params), struct)
    st = jax.eval_shape(v.tx.init, params)
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(st)))

  def make_case(name, variants, bytes_per_param, headline):
    return Case(
        op="adam", name=name, variants={k: variant(v) for k, v in variants.items()},
        baseline="optax_adamw_fp32", default=tuple(k for k in (DEFAULT, INT8) if k in variants),
        bytes=bytes_per_param * n, params=n,
        state_bytes={k: state_bytes(v) for k, v in variants.items()},
        meta={k: v.meta() for k, v in variants.items()},
        check=make_check(variants, "optax_adamw_fp32"), headline=headline, reduce=reduce,
        release=td.release)

  prefix = workloads.tree_name(workloads.tree_dims(platform, size), platform)
  return [make_case(prefix, optimizers(platform), 20, HEADLINE),
          make_case(f"{prefix}_bf16_params", bf16_optimizers(platform), 14, HEADLINE_BF16)]
