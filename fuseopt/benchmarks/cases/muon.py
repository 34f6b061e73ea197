"""Hybrid Muon + AdamW: one update of the Llama-shaped tree of docs/measurements.md.

The layers' matrices (q/k/v/o, gate/up/down: 112 leaves, stored per layer)
take Muon, the embedding, LM head and norms AdamW. One call is a full
optimizer step, ``(params, grads, state) -> (params', state')``, with params
and state donated, timed as training runs it (each step's outputs are the
next step's inputs). On a GPU/TPU ("full") the 1.20 B tree (d=2048,
ff=8192, 16 layers, vocab 32000) where the device's memory holds it, else
the most layers that fit (:func:`fuseopt.benchmarks.workloads.tree_dims`);
on the CPU the scaled-down tree of
:func:`fuseopt.benchmarks.workloads.llama_tree_cpu`.

Variants (lr 0.02, weight decay 0.1; optax with Jordan's coefficients, 5
steps, which are also fuseopt's default):

- ``optax_muon`` (baseline): ``optax.contrib.muon``, fp32 grads and
  momentum, so NS in fp32 (its time and temporaries: docs/measurements.md);
- ``optax_muon_bf16``: optax's best configuration, bf16 grads and
  ``mu_dtype=bf16`` so NS in bf16;
- ``fuseopt_muon``: the default call, :func:`fuseopt.optim.muon` with the
  workload's arguments only (learning rate, weight decay, which leaves are
  matrices) through ``tx.update`` + ``optax.apply_updates``, fp32 grads and
  momentum: whatever NS path, coefficients and call sizes are the default;
- ``fuseopt_step``: the same transformation through
  ``fo.step(tx, grads, state, params)`` (the fused in-place step), a default
  call too;
- ``fuseopt_muon[gram]`` (accelerators): ``execution=Execution(newton_schulz=NewtonSchulz(gram="auto"))``
  (Gram NS for the 1:4 MLP matrices); ``fuseopt_muon[no_gram]``
  (accelerators): ``NewtonSchulz(gram=False)``; one of them may be the
  default's own program (then recorded ``same_program_as``, not timed twice);
- ``fuseopt_muon[gram,jordan]``: Gram NS on fuseopt's ``"jordan"``
  schedule (``ns_coeffs="jordan"``: Gram restarts where that schedule wants
  them, a different program from the default coefficient table's), the row
  named ``fuseopt_muon[gram]`` in suites written before the rows named their
  default call;
- ``fuseopt_muon[calls<=2^25]``: ``NewtonSchulz(max_elements=2**25)`` (two
  of the 2048x8192 matrices a call);
- ``fuseopt_muon[fp32_adam]``: ``moment_dtype="float32"``, fp32 AdamW
  moments (the default keeps them in bf16, as :func:`fuseopt.optim.adamw`).

The figure that matters besides time is ``temp_bytes`` (XLA's temporary
memory from ``memory_analysis``; target <= 1 GB on the 1.20 B tree). The
check compares each variant's parameter change with optax's fp32 one
(relative Frobenius error; bf16 NS is a few percent off fp32 NS).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fuseopt.optim as fo
from fuseopt.benchmarks import core, user_step, workloads
from fuseopt.benchmarks.core import Case
from fuseopt.kernels.newton_schulz.coefficients import JORDAN
from fuseopt.optim import muon_transforms as fmuon

LR = 0.02
WD = 0.1
COEFFS = JORDAN


def muon_dims(params):
  """Muon for the layers' 2-D matrices, AdamW (None) for the rest."""
  def pick(path, x):
    name = jax.tree_util.keystr(path)
    if len(x.shape) == 2 and "embed" not in name and "lm_head" not in name:
      return fmuon.MuonDimensionNumbers(0, 1)  # optax's class: both Muons accept it
    return None
  return jax.tree_util.tree_map_with_path(pick, params)


def _ns(**fields):
  """fo.Execution whose Newton-Schulz settings are ``fields``."""
  return fmuon.Execution(newton_schulz=fmuon.NewtonSchulz(**fields))


def optimizers(platform: str = "cpu") -> dict:
  """label -> (optax transformation, grads dtype). ``fuseopt_muon`` is the
  default call; a tagged label passes what its tag names, explicitly."""
  common = dict(learning_rate=LR, weight_decay=WD, muon_weight_dimension_numbers=muon_dims)
  out = {
      "optax_muon": (optax.contrib.muon(learning_rate=LR, weight_decay=WD, ns_coeffs=COEFFS,
                                        muon_weight_dimension_numbers=muon_dims), jnp.float32),
      "optax_muon_bf16": (optax.contrib.muon(learning_rate=LR, weight_decay=WD, ns_coeffs=COEFFS,
                                             mu_dtype=jnp.bfloat16,
                                             muon_weight_dimension_numbers=muon_dims), jnp.bfloat16),
      "fuseopt_muon": (fmuon.muon(**common), jnp.float32),
      # The default call through the fused step (``step_fn(tx, "step")``).
      "fuseopt_step": (fmuon.muon(**common), jnp.float32),
  }
  if platform in ("gpu", "tpu"):
    out["fuseopt_muon[gram]"] = (fmuon.muon(**common, execution=_ns(gram="auto")), jnp.float32)
    out["fuseopt_muon[no_gram]"] = (fmuon.muon(**common, execution=_ns(gram=False)), jnp.float32)
  # Gram NS on fuseopt's "jordan" schedule (its restarts where the schedule
  # wants them), the Gram row of the suites before the rows were named by
  # their arguments.
  out["fuseopt_muon[gram,jordan]"] = (
      fmuon.muon(**common, ns_coeffs="jordan", execution=_ns(gram="auto")), jnp.float32)
  out["fuseopt_muon[calls<=2^25]"] = (
      fmuon.muon(**common, execution=_ns(max_elements=1 << 25)), jnp.float32)
  out["fuseopt_muon[fp32_adam]"] = (fmuon.muon(**common, moment_dtype="float32"), jnp.float32)
  return out


CALLS = {
    "optax_muon": "optax.contrib.muon(lr, weight_decay=wd, ns_coeffs=JORDAN, ...)",
    "optax_muon_bf16": "optax.contrib.muon(lr, weight_decay=wd, ns_coeffs=JORDAN, mu_dtype=bf16, ...), bf16 grads",
    "fuseopt_muon": "fo.muon(lr, weight_decay=wd, muon_weight_dimension_numbers=dims)",
    "fuseopt_step": "fo.step(tx, grads, state, params); tx = fo.muon(lr, weight_decay=wd, "
                    "muon_weight_dimension_numbers=dims)",
    "fuseopt_muon[gram]": "fo.muon(..., execution=fo.Execution(newton_schulz=fo.NewtonSchulz(gram='auto')))",
    "fuseopt_muon[no_gram]": "fo.muon(..., execution=fo.Execution(newton_schulz=fo.NewtonSchulz(gram=False)))",
    "fuseopt_muon[gram,jordan]": "fo.muon(..., ns_coeffs='jordan', execution=fo.Execution(newton_schulz=fo.NewtonSchulz(gram='auto')))",
    "fuseopt_muon[calls<=2^25]": "fo.muon(..., execution=fo.Execution(newton_schulz=fo.NewtonSchulz(max_elements=2**25)))",
    "fuseopt_muon[fp32_adam]": "fo.muon(..., moment_dtype='float32')",
}


DEFAULTS = ("fuseopt_muon", "fuseopt_step")
HEADLINE = (("optax_muon", "fuseopt_muon", "fuseopt_step", "optax_muon_bf16"),)


def step_fn(tx, how: str = "update"):
  """The jitted step ``(params, grads, state) -> (params', state')``,
  params and state donated: ``tx.update`` + ``optax.apply_updates``, or
  ``fo.step`` (``how="step"``)."""
  inner = user_step.step_fn(tx, how == "step")

  def step(params, grads, state):
    return inner(params, state, grads)
  return jax.jit(step, donate_argnums=(0, 2))


def feed(args, out):
  """The next step's ``(params, grads, state)``."""
  return out[0], args[1], out[1]


def cases(size: str, platform: str):
  struct = workloads.tree_for(platform, size, jnp.float32, abstract=True)
  n = workloads.tree_params(struct)
  td = workloads.TreeData(struct, grads_scale=1.0)
  opts = optimizers(platform)

  def variant(label):
    def build():
      tx, gdtype = opts[label]
      grads = td.grads(gdtype)
      params = td.params()
      how = "step" if label == "fuseopt_step" else "update"
      return core.Loop(step_fn(tx, how), (params, grads, tx.init(params)), feed)
    return build

  def check(outs):
    params = td.start()
    delta = {k: jax.tree.map(lambda a, b: a - b, v[0], params) for k, v in outs.items()}
    # bf16 NS against fp32 NS: a few percent (Jordan's band is wide).
    return core.checks_against(delta, "optax_muon", tol=0.1)

  name = workloads.tree_name(workloads.tree_dims(platform, size), platform)
  state_bytes, meta = {}, {}
  for label, (tx, _) in opts.items():
    st = jax.eval_shape(tx.init, struct)
    state_bytes[label] = int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(st)))
    # Params fp32 in every row; the state as the transformation builds it.
    meta[label] = {"stores": "p fp32, state as init builds it",
                   "stored_bytes_per_param": 4 + state_bytes[label] / n, "calls": CALLS[label]}
  return [Case(op="muon", name=name, variants={k: variant(k) for k in opts}, baseline="optax_muon",
               default=DEFAULTS, params=n, state_bytes=state_bytes, meta=meta, check=check,
               headline=HEADLINE, reduce=lambda label, out: workloads.sample(out), release=td.release)]
