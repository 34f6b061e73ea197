"""Temporary memory of a hybrid Muon step (memory_analysis, deterministic).

On the scaled-down Llama tree (the 1.20 B tree's structure: 7 Muon
matrices per layer stored per layer, grouped by shape into 3 NS calls),
fuseopt's fused step (fuseopt.optim.step) must not hold more than two fp32
copies of the Muon matrices at once (the batched NS input and its result),
and both it and the update + apply_updates path must stay below
optax.contrib.muon's temp memory.
"""

import math

import jax
import jax.numpy as jnp

import fuseopt.optim as fo
from fuseopt.benchmarks import core, workloads

from fuseopt.benchmarks.cases import muon as cases  # noqa: E402


def _temp_bytes(tx, struct, gdtype=jnp.float32, fused=False):
  state = jax.eval_shape(tx.init, struct)
  grads = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, gdtype), struct)
  fn = (jax.jit(lambda p, g, s: fo.step(tx, g, s, p), donate_argnums=(0, 2)) if fused
        else cases.step_fn(tx))
  return core.memory_stats(fn, (struct, grads, state))["temp_bytes"]


def test_temp_memory_below_optax_and_two_matrix_copies():
  struct = workloads.llama_tree_cpu(jnp.float32, abstract=True)
  opts = cases.optimizers()
  fused = _temp_bytes(opts["fuseopt_muon"][0], struct, fused=True)
  drop_in = _temp_bytes(opts["fuseopt_muon"][0], struct)
  theirs = _temp_bytes(opts["optax_muon"][0], struct)
  matrix_bytes = sum(4 * math.prod(x.shape) for x in workloads.matrices(struct))
  assert fused < drop_in < theirs, (fused, drop_in, theirs)
  assert drop_in <= 2 * matrix_bytes, (drop_in, matrix_bytes)
