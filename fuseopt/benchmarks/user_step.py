"""The optimizer step a user writes, as every benchmark, compile case and
sharding test runs it: :func:`fuseopt.optim.step` (fused) or ``tx.update`` +
``optax.apply_updates``. One definition, so that a timed row, a compiled
figure and a bitwise test all measure the same program.
"""

from __future__ import annotations

import optax

import fuseopt.optim as fo


def step_fn(tx, fused):
  """The step ``(params, state, grads) -> (params, state)``:
  :func:`fuseopt.optim.step` (``fused``) or ``tx.update`` +
  ``optax.apply_updates``."""
  if fused:
    def step(params, state, grads):
      return fo.step(tx, grads, state, params)
  else:
    def step(params, state, grads):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state
  return step
