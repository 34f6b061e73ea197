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


def test_fused_step_temp_is_one_call_not_the_tree():
  """The fused step runs one NS call at a time (each call's leaves get their
  momentum pass just before it and their parameter update just after): its
  temp memory is a call's working set, so four times the layers (four times
  the Muon matrices and NS calls) cost no more; the drop-in update, which
  returns every leaf's update at once, grows with the tree."""
  def temps(layers):
    struct = workloads.llama_tree_cpu(jnp.float32, abstract=True, layers=layers)
    tx = fo.muon(1e-2, ns_coeffs="jordan", muon_weight_dimension_numbers=cases.muon_dims, execution=fo.Execution(newton_schulz=fo.NewtonSchulz(max_elements=2 * 64 * 256)))
    return _temp_bytes(tx, struct, fused=True), _temp_bytes(tx, struct)
  (fused2, drop_in2), (fused8, drop_in8) = temps(2), temps(8)
  assert fused8 <= fused2 * 1.05, (fused2, fused8)
  assert drop_in8 >= 2 * drop_in2, (drop_in2, drop_in8)
