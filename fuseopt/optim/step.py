"""One optimizer step, fused in place where fuseopt knows the transform."""

from __future__ import annotations

from typing import Any

import jax
import optax

from fuseopt import kernels
from fuseopt.optim import _checks


def _per_leaf_mask(mask, params):
  """The weight-decay mask as one Python bool per leaf of ``params``."""
  if mask is None:
    return [True] * len(jax.tree.leaves(params))
  if callable(mask):
    mask = mask(params)
  full = jax.tree.map(lambda m, sub: jax.tree.map(lambda _: m, sub), mask, params)
  out = []
  for m in jax.tree.leaves(full):
    if isinstance(m, jax.core.Tracer):
      raise TypeError("step: the weight-decay mask must hold Python bools, not traced values")
    out.append(bool(m))
  return out


def _schedule_count(s):
  """The count of a (possibly masked) schedule state."""
  return getattr(s, "inner_state", s).count


def step(tx: Any, grads: Any, state: Any, params: Any, *, group: bool = True
         ) -> tuple[Any, Any]:
  """Applies one update of ``tx`` to ``params``; returns ``(params, state)``.

  For :func:`fuseopt.optim.adam` / :func:`fuseopt.optim.adamw` it runs fused
  kernels that read p, g, mu, nu once and write p, mu, nu once (in place
  under ``jit`` with ``params`` and ``state`` donated): 20 bytes per
  parameter for fp32 params and grads with bf16 moments, 14 with bf16 params
  and grads (bf16 params are written with stochastic rounding, seed
  ``derive_seed(seed, t, i, STREAM_PARAM)``). The result equals
  ``tx.update`` + ``optax.apply_updates`` up to fp32 rounding of the fused
  arithmetic, with bitwise the same moment rounding seeds; the returned state
  has exactly ``tx.init``'s structure. On a GPU (``triton``) the leaves of
  one dtype signature share a kernel launch, up to 16 leaves a launch, each
  read and written where it lies (10 launches instead of 147 on the 1.2 B
  Llama tree); ``group=False`` runs one launch per leaf, for measurement.
  On TPU it is one kernel per leaf either way.

  A ``state`` whose tree structure, leaf shapes or dtypes differ from
  ``tx.init(params)``'s raises a ``ValueError`` naming the first difference.

  Any other transformation (including a fuseopt Adam wrapped in another
  ``optax.chain``) falls back to ``tx.update(grads, state, params)`` +
  :func:`optax.apply_updates`, so ``step`` is safe to call on anything.

  Example::

    tx = fuseopt.optim.adamw(1e-3, weight_decay=0.1)
    state = tx.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def update(params, state, grads):
      return fuseopt.optim.step(tx, grads, state, params)

    params, state = update(params, state, grads)

  Put ``params`` before ``state`` in the donated signature: JAX pairs donated
  inputs with outputs of the same shape and dtype first come, first served,
  so where a moment and its parameter share both (bf16 params with bf16
  moments), ``jit(step, donate_argnums=(2, 3))`` would hand the moment's
  buffer to the new parameter and XLA would copy every such leaf.
  """
  _checks.check_state("step", tx, state, params)
  hp = getattr(tx, "fuseopt_adam", None)
  if hp is None:
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  adam_state = state[0]
  rest = tuple(state[1:])
  count = optax.safe_increment(adam_state.count)
  lr = hp.learning_rate
  if callable(lr):
    lr = lr(_schedule_count(rest[-1]))
  p_leaves, treedef = jax.tree.flatten(params)
  n = len(p_leaves)
  if hp.weight_decay is None:
    wds = [0.0] * n
  else:
    wd = hp.weight_decay
    if callable(wd):
      wd = wd(_schedule_count(rest[0]))
    skip = isinstance(wd, (int, float)) and wd == 0.0
    wds = [wd if (m and not skip) else 0.0 for m in _per_leaf_mask(hp.mask, params)]
  g_leaves = treedef.flatten_up_to(grads)
  mu_leaves = treedef.flatten_up_to(adam_state.mu)
  nu_leaves = treedef.flatten_up_to(adam_state.nu)
  new_p, mu, nu = kernels.adam_update_tree(
      p_leaves, g_leaves, mu_leaves, nu_leaves, count=count, learning_rate=lr,
      b1=hp.b1, b2=hp.b2, eps=hp.eps, eps_root=hp.eps_root, weight_decay=wds,
      nesterov=hp.nesterov, seed=hp.seed, implementation=hp.implementation,
      group=group)
  new_adam = optax.ScaleByAdamState(count=count, mu=treedef.unflatten(mu),
                                    nu=treedef.unflatten(nu))
  # The other states of the chain (weight-decay and learning-rate schedules,
  # masks) hold only step counters, all advanced once per update.
  new_rest = tuple(jax.tree.map(optax.safe_increment, s) for s in rest)
  return treedef.unflatten(new_p), (new_adam,) + new_rest
