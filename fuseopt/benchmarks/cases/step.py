"""Whole training-recipe steps: optax chain vs fuseopt fallback vs fuseopt fused.

The recipes a config runs, on the Llama-shaped tree (the 1.20 B tree on a
GPU/TPU whose memory holds it, else the most layers that fit:
:func:`fuseopt.benchmarks.workloads.tree_dims`;
:func:`fuseopt.benchmarks.workloads.llama_tree_cpu` on the CPU), fp32
params and grads, one call a whole step with params and state donated
(params first), each step's outputs the next step's inputs:

- ``adamw_recipe``: global-norm clip 1.0, then two groups under
  ``partition``: the norms without weight decay, the rest with 0.1; cosine
  schedule (peak 1e-3, 100 warm-up steps of 1000);
- ``hybrid_recipe``: the same clip, then Muon (Jordan's coefficients, lr
  0.02 on a cosine schedule, weight decay 0.1) for the layers' matrices and
  AdamW for the embedding, LM head and norms.

Variants:

- ``optax_chain`` (baseline): the recipe in optax (``optax.clip_by_global_norm``,
  ``optax.partition`` of ``optax.adamw`` / ``optax.contrib.muon``), fp32 state;
- ``fuseopt_fallback``: fuseopt's transforms (bf16 Adam moments) through
  ``tx.update`` + ``optax.apply_updates``;
- ``fuseopt_step``: the same transforms through :func:`fuseopt.optim.step`
  with no further argument (the default call): fused in-place passes.

The check compares each variant's parameter change with the optax chain's
(relative Frobenius error).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fuseopt.optim as fo
from fuseopt.benchmarks import core, workloads
from fuseopt.benchmarks.cases import adam as adam_cases
from fuseopt.benchmarks.cases import muon as muon_cases
from fuseopt.benchmarks.core import Case
from fuseopt.optim import fusion, safeguards

F32, BF16 = jnp.float32, jnp.bfloat16
STEPS = 1000
CLIP = 1.0
WD = 0.1


def _is_norm(path, x):
  return len(x.shape) == 1


def _labels(params):
  return jax.tree_util.tree_map_with_path(
      lambda path, x: "no_decay" if _is_norm(path, x) else "rest", params)


def _cosine(peak):
  return optax.warmup_cosine_decay_schedule(0.0, peak, 100, STEPS)


def recipes() -> dict:
  """recipe -> {label: (transformation, fused?)}."""
  adam_lr = _cosine(1e-3)
  fuse_adamw = fusion.chain(
      safeguards.clip_by_global_norm(CLIP),
      fusion.partition({"no_decay": fo.adamw(adam_lr, weight_decay=0.0),
                        "rest": fo.adamw(adam_lr, weight_decay=WD)}, _labels))
  optax_adamw = optax.chain(
      optax.clip_by_global_norm(CLIP),
      optax.partition({"no_decay": optax.adamw(adam_lr, weight_decay=0.0),
                       "rest": optax.adamw(adam_lr, weight_decay=WD)}, _labels))
  muon_lr = _cosine(muon_cases.LR)
  fuse_hybrid = fusion.chain(
      safeguards.clip_by_global_norm(CLIP),
      fo.muon(muon_lr, weight_decay=WD, adam_weight_decay=WD, ns_coeffs="jordan",
              muon_weight_dimension_numbers=muon_cases.muon_dims))
  optax_hybrid = optax.chain(
      optax.clip_by_global_norm(CLIP),
      optax.contrib.muon(muon_lr, weight_decay=WD, adam_weight_decay=WD,
                         ns_coeffs=muon_cases.COEFFS,
                         muon_weight_dimension_numbers=muon_cases.muon_dims))
  return {
      "adamw_recipe": {"optax_chain": (optax_adamw, False), "fuseopt_fallback": (fuse_adamw, False),
                       "fuseopt_step": (fuse_adamw, True)},
      "hybrid_recipe": {"optax_chain": (optax_hybrid, False),
                        "fuseopt_fallback": (fuse_hybrid, False),
                        "fuseopt_step": (fuse_hybrid, True)},
  }


# (params, state, grads) -> (params', state'), donated: update + apply, or step.
step_fn = adam_cases.step_fn


def cases(size: str, platform: str):
  struct = workloads.tree_for(platform, size, F32, abstract=True)
  n = workloads.tree_params(struct)
  td = workloads.TreeData(struct)

  def variant(tx, fused):
    def build():
      grads = td.grads(F32)
      params = td.params(F32)
      return core.Loop(step_fn(tx, fused), (params, tx.init(params), grads), adam_cases.feed)
    return build

  def check(outs):
    params = td.start(F32)
    delta = {k: jax.tree.map(lambda a, b: a.astype(F32) - b, v[0], params) for k, v in outs.items()}
    # The first step has zero moments: AdamW agrees to rounding; bf16
    # Newton-Schulz is a few percent off optax's fp32 one.
    figures = core.checks_against(delta, "optax_chain", tol=0.1)
    if "fuseopt_fallback" in delta and "fuseopt_step" in delta:
      figures["fused_vs_fallback_rel_err"] = core.tree_rel_err(delta["fuseopt_step"],
                                                                delta["fuseopt_fallback"])
    return figures

  def state_bytes(tx):
    st = jax.eval_shape(tx.init, struct)
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(st)))

  prefix = workloads.tree_name(workloads.tree_dims(platform, size), platform)
  out = []
  for recipe, opts in recipes().items():
    out.append(Case(
        op="step", name=f"{recipe}_{prefix}",
        variants={k: variant(tx, fused) for k, (tx, fused) in opts.items()},
        baseline="optax_chain", default="fuseopt_step", params=n,
        # The AdamW recipe's floor: 20 B/param for the update + 4 for the
        # clip's read of g (docs/fused_step.md); the hybrid's has NS on top.
        bytes=24 * n if recipe == "adamw_recipe" else None,
        state_bytes={k: state_bytes(tx) for k, (tx, _) in opts.items()}, check=check,
        reduce=lambda label, o: workloads.sample(o), release=td.release))
  return out


def compiled_figures(recipe: str, label: str, struct, *, grads_dtype=None) -> dict:
  """Compile-only figures of one variant over the abstract tree ``struct``:
  CPU ``cost_analysis`` bytes accessed and ``memory_analysis`` temp bytes
  per parameter (params and state donated), and the Pallas kernel launches
  of the same step lowered for an H200 with how many of their outputs alias
  an input (in place)."""
  import re

  from fuseopt.benchmarks import regression
  tx, fused = recipes()[recipe][label]
  grads = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, grads_dtype or s.dtype), struct)
  state = jax.eval_shape(tx.init, struct)
  fn = step_fn(tx, fused)
  stats = core.stats_of(core.compile_fn(fn, (struct, state, grads), regression.FAST_COMPILE))
  n = workloads.tree_params(struct)
  text = regression.h200_lowering_text(fn, (struct, state, grads))
  calls = [line for line in text.splitlines() if re.search(regression._TRITON_CALL, line)]  # pylint: disable=protected-access
  return {"params": n, "cost_bytes_per_param": stats["cost_bytes"] / n,
          "temp_bytes": stats["temp_bytes"], "alias_bytes": stats["alias_bytes"],
          "h200_kernels": len(calls),
          "h200_aliased_outputs": sum(c.count("output_operand_alias<") for c in calls)}


if __name__ == "__main__":  # python -m fuseopt.benchmarks.cases.step
  for dtype in (F32, BF16):
    tree = workloads.llama_tree_cpu(dtype, abstract=True)
    for recipe, opts in recipes().items():
      for label in opts:
        print(jnp.dtype(dtype).name, recipe, label, compiled_figures(recipe, label, tree))
