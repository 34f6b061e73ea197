"""One optimizer step, fused in place where fuseopt knows the transform."""

from __future__ import annotations

from typing import Any

import jax
import optax

from fuseopt.kernels import sharding as kernel_sharding
from fuseopt.optim import fusion
from fuseopt.optim import _checks


def step(tx: Any, grads: Any, state: Any, params: Any, *, group: bool = False,
         shardings: Any = None, **extra_args: Any) -> tuple[Any, Any]:
  """Applies one update of ``tx`` to ``params``; returns ``(params, state)``.

  For :func:`fuseopt.optim.adam` / :func:`fuseopt.optim.adamw` it runs fused
  kernels that read p, g, mu, nu once and write p, mu, nu once (in place
  under ``jit`` with ``params`` and ``state`` donated): 20 bytes per
  parameter for fp32 params and grads with bf16 moments, 14 with bf16 params
  and grads (bf16 params are written with stochastic rounding, seed
  ``derive_seed(seed, t, i, STREAM_PARAM)``). The result equals
  ``tx.update`` + ``optax.apply_updates`` up to fp32 rounding of the fused
  arithmetic, with bitwise the same moment rounding seeds; the returned state
  has exactly ``tx.init``'s structure. On a GPU (``triton``) the default
  ``group=False`` runs one launch per leaf, the faster measured on an H200
  inside XLA's CUDA graphs (docs/measurements.md); ``group=True`` shares a
  launch among the leaves of one dtype signature (up to 16 a launch, 11
  launches instead of 147 on the 1.2 B Llama tree), which saves launches
  where no CUDA graph does. Both give the same bits. On TPU it is one kernel
  per leaf either way.

  The same holds for what :func:`fuseopt.optim.build_optimizer` returns and
  for every composition of pieces that declare an in-place rule
  (:mod:`fuseopt.optim.fusion`): fuseopt's global-norm clip (its factor is a
  scalar of the Adam kernel, scaling g in registers, and comes from the same
  single reduction pass over the gradients as ``skip_nonfinite``'s finiteness
  flag), ``fusion.partition`` groups (each with its learning rate, schedule
  and weight decay), ``skip_nonfinite`` (a skipped step keeps params and
  state by a select inside the same passes), ``freeze``, ``fusion.multi_steps``
  and :func:`fuseopt.optim.muon` (one elementwise pass for the momentum and
  the Newton-Schulz input, one for ``p - lr (scale O + wd p)``; its AdamW
  leaves as above). ``extra_args`` are the ``update`` extra arguments (e.g.
  MuonClip's ``qk_stats``).

  Any other transformation, or a composition with a piece that has no rule
  (``optax.chain(optax.clip_by_global_norm(1.0), fo.adamw(...))``: optax's
  clip has none, and neither has what :func:`optax.inject_hyperparams`
  returns), falls back to ``tx.update(grads, state, params)`` +
  :func:`optax.apply_updates`, so ``step`` is safe to call on anything; the
  piece that forced the fallback is logged at debug level on the ``"fuseopt"``
  logger.

  A ``state`` whose tree structure, leaf shapes or dtypes differ from
  ``tx.init(params)``'s raises a ``ValueError`` naming the first difference.

  Example::

    tx = fuseopt.optim.adamw(1e-3, weight_decay=0.1)
    state = tx.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def update(params, state, grads):
      return fuseopt.optim.step(tx, grads, state, params)

    params, state = update(params, state, grads)

  Sharded training: on a multi-device mesh the kernels run shard-local (no
  gather), bitwise the unsharded step. With Explicit mesh axes nothing is
  needed; with Auto axes pass ``shardings`` (a tree of ``NamedSharding`` /
  ``PartitionSpec`` shaped like ``params``, or a prefix), here or on the
  transform; without it the fused update runs the plain-jnp reference, which
  XLA partitions, and warns once. See docs/scaling.md.

  Put ``params`` before ``state`` in the donated signature: JAX pairs donated
  inputs with outputs of the same shape and dtype first come, first served,
  so where a moment and its parameter share both (bf16 params with bf16
  moments), ``jit(step, donate_argnums=(2, 3))`` would hand the moment's
  buffer to the new parameter and XLA would copy every such leaf.
  """
  _checks.check_state("step", tx, state, params)
  if shardings is not None:
    # The whole tree: every entry must name a parameter. Each leaf's placement
    # is resolved here, once; the rules below take it as it is.
    leaves = kernel_sharding.flatten_shardings(shardings, params, owner="step", strict=True,
                                               resolve=True)
    shardings = jax.tree.structure(params).unflatten(leaves)
  rule = fusion.in_place_rule(tx)
  reason = None
  if rule is None or rule.apply is None:
    reason = "it declares no in-place rule"
    if isinstance(state, (optax.InjectStatefulHyperparamsState, optax.InjectHyperparamsState)):
      # inject_hyperparams builds its inner transformation inside update(),
      # from the state's hyperparameters: no rule is reachable from tx.
      reason = ("optax.inject_hyperparams hides the inner transformation's in-place rule "
                "(a fuseopt transform fuses with a schedule given as its learning_rate)")
  if reason is None:
    try:
      return rule.apply(grads, state, params,
                        fusion.Context(group=group, shardings=shardings,
                                       extra_args=dict(extra_args)))
    except fusion.NotFusable as e:
      reason = str(e)
  fusion.logger.debug("fuseopt.optim.step: %s runs tx.update + optax.apply_updates: %s",
                      fusion.describe(tx), reason)
  updates, state = tx.update(grads, state, params, **extra_args)
  return optax.apply_updates(params, updates), state
