"""The store stage of Muon's step: how a value computed in fp32 is written
back (the momentum, NorMuon's second moment, a bf16 parameter), and the
layout a finished leaf is pinned to.

bf16 values are stochastically rounded with the counter hash, seeded by the
step, the leaf and the stream (:data:`MUON_SEED`, ``STREAM_MU``,
``STREAM_NU``, ``STREAM_PARAM``), so a value's rounding does not depend on
where or how often the step runs (sharded, unsharded, fused or not).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import layout as jax_layout

from fuseopt import kernels
from fuseopt.kernels import counter_hash

__all__ = ["MUON_SEED", "in_leaf_layout", "store"]

# Seed of Muon's stochastic roundings (momentum and, in the fused step,
# bf16 parameters), apart from the Adam side's default seed 0: "Muon".
MUON_SEED = 0x4D756F6E


def store(x32, dtype, count, leaf_index, stream):
  """fp32 ``x32`` in ``dtype``: bf16 with the counter-hash stochastic
  rounding (seed ``derive_seed(MUON_SEED, count, leaf_index, stream)``), plain
  jnp so that XLA fuses it into the pass that computes ``x32``; any other
  dtype by a cast."""
  if jnp.dtype(dtype) == jnp.bfloat16:
    seed = counter_hash.derive_seed(MUON_SEED, count, leaf_index, stream)
    return kernels.stochastic_round_bf16(x32, seed, implementation="xla")
  return x32.astype(dtype)


def in_leaf_layout(x, platform: str):
  """``x`` (a Muon leaf's update or new parameter) pinned to the leaf's
  row-major layout on a TPU.

  Unpinned, libtpu lays out a tall matrix's update as the Newton-Schulz
  call's transposed result is laid out (column-major) when the call holds
  that matrix alone: the fused step then copies the parameter into that
  layout, updates it out of place and copies it back into the donated
  output at the end of the step, so every such leaf's new parameter stays
  live until then (docs/fused_step.md has the measured cost). A layout
  changes no value; on other platforms nothing is pinned, so their programs
  stay as they were.
  """
  if platform != "tpu":
    return x
  # (a mantissa-tracked parameter is a pair: both halves pinned)
  return jax.tree.map(lambda t: jax_layout.with_layout_constraint(
      t, jax_layout.Layout(tuple(range(jnp.ndim(t))))), x)
