"""The learning-rate piece of the drop-in chains, its product rounded.

:func:`optax.scale_by_learning_rate` multiplies the update by ``-lr``;
:func:`optax.apply_updates` adds it to the parameter. In one jit XLA may
contract the two into a fused multiply-add wherever the instruction set has
one, and whether it does depends on how the program is fused -- so a sharded
and an unsharded step could differ in the last bit. The product is rounded
where it stands (:func:`fuseopt.kernels.fp_contract.rounded`): the
parameters' bits do not depend on how the program is fused.
"""

from __future__ import annotations

import jax
import optax

from fuseopt.kernels import fp_contract
from fuseopt.optim import _checks

__all__ = ["scale_by_learning_rate"]


def scale_by_learning_rate(learning_rate: optax.ScalarOrSchedule,
                           flip_sign: bool = True) -> optax.GradientTransformation:
  """:func:`optax.scale_by_learning_rate` (same arguments, same state) with
  each product ``-lr * u`` rounded before any add consumes it; an integer
  update passes as it is (fuseopt's directions give integer leaves zero)."""
  inner = optax.scale_by_learning_rate(learning_rate, flip_sign=flip_sign)

  def update_fn(updates, state, params=None):
    scaled, state = inner.update(updates, state, params)
    # An integer update (an integer leaf's zero from fuseopt's directions)
    # keeps its dtype: a float zero would send the leaf through float32 in
    # apply_updates, which does not hold every int32.
    return jax.tree.map(lambda u, s: u if _checks.passes_through(u) else fp_contract.rounded(s),
                        updates, scaled), state

  return optax.GradientTransformation(inner.init, update_fn)
