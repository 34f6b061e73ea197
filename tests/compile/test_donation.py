"""The fused Muon step donated on a TPU: its new parameters are pinned to the
leaves' row-major layout (``muon_store.in_leaf_layout``), and the pinned
outputs must still take the donated parameters' buffers. On jax 0.10.2 a bare
``with_layout_constraint`` as a donated output raised ("Input layout being
donated was None while output layout was AUTO"); ``compat.pin_layout`` keeps
the pin and the donation on every release (docs/compatibility.md)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fuseopt.optim as fo
from fuseopt import targets
from fuseopt.benchmarks import compile_harness, user_step

F32 = jnp.float32


def _tree():
  # A tall matrix alone in its Newton-Schulz call (the case the pin is for),
  # a wide one, a bf16 one, and a vector on the AdamW side.
  return {"down": jax.ShapeDtypeStruct((1024, 256), F32), "up": jax.ShapeDtypeStruct((256, 1024), F32),
          "attn": jax.ShapeDtypeStruct((512, 512), jnp.bfloat16),
          "norm": jax.ShapeDtypeStruct((256,), F32)}


@pytest.mark.parametrize("make", [lambda: fo.muon(0.02), lambda: fo.adamw(1e-3)],
                         ids=["muon", "adamw"])
def test_the_donated_fused_step_compiles_in_place_for_a_tpu(make):
  why = targets.missing("v5e")
  if why:
    pytest.skip(why)
  tree = _tree()

  def build(t):
    tx = make()
    return user_step.step_fn(tx, True), (tree, jax.eval_shape(tx.init, tree), tree), (0, 1)

  figures = compile_harness.compile_case("v5e", compile_harness.Case("donated", build, kind="step"))
  params = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
  # Parameters and state are written into the donated buffers (the step
  # counts and other scalars aside).
  assert figures["alias_bytes"] >= params
  assert figures["output_bytes"] - figures["alias_bytes"] < 4096, figures
