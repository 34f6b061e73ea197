"""Temporary memory of a hybrid Muon step (memory_analysis, deterministic).

On the scaled-down Llama tree (the 1.20 B tree's structure: 7 Muon
matrices per layer stored per layer, grouped by shape into 3 NS calls),
fuseopt's step must not hold more than two fp32 copies of the Muon
matrices at once (the batched NS input and its result), and must stay
below optax.contrib.muon's temp memory.
"""

import math

import jax
import jax.numpy as jnp

from fuseopt.benchmarks import core, workloads

from fuseopt.benchmarks.cases import muon as cases  # noqa: E402


def _temp_bytes(tx, struct, gdtype=jnp.float32):
  state = jax.eval_shape(tx.init, struct)
  grads = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, gdtype), struct)
  return core.memory_stats(cases.step_fn(tx), (struct, grads, state))["temp_bytes"]


def test_temp_memory_below_optax_and_two_matrix_copies():
  struct = workloads.llama_tree_cpu(jnp.float32, abstract=True)
  opts = cases.optimizers()
  ours = _temp_bytes(opts["fuseopt_muon"][0], struct)
  theirs = _temp_bytes(opts["optax_muon"][0], struct)
  matrix_bytes = sum(4 * math.prod(x.shape) for x in workloads.matrices(struct))
  assert ours < theirs, (ours, theirs)
  assert ours <= 2 * matrix_bytes, (ours, matrix_bytes)
