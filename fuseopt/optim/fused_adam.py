"""Adam and AdamW with bf16-stored moments, as drop-in optax transforms.

The moments are stored in ``moment_dtype`` (bf16 by default) and widened to
fp32 inside :func:`fuseopt.kernels.adam_update`, which writes them back with
the counter-hash stochastic rounding. The state is optax's
``ScaleByAdamState(count, mu, nu)`` (and :func:`adamw`'s state has the same
structure as :func:`optax.adamw`'s), so checkpoints, sharding rules and
``optax.tree_map_params`` read it as they read fp32 state.

:func:`adam` and :func:`adamw` carry their hyperparameters (attribute
``fuseopt_adam``) and an in-place rule (:mod:`fuseopt.optim.fusion`), which
lets :func:`fuseopt.optim.step` run the whole update (clip factor, moments,
weight decay, learning rate, parameter write) as one fused pass, alone or
inside the wrappers the builder puts around it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax

from fuseopt import kernels
from fuseopt.optim import _checks
from fuseopt.optim import fusion


@dataclasses.dataclass(frozen=True)
class AdamHyperparams:
  """What :func:`fuseopt.optim.step` needs to fuse an :func:`adam`/:func:`adamw`."""
  learning_rate: Any
  b1: Any
  b2: Any
  eps: Any
  eps_root: Any
  weight_decay: Any      # None for adam (no add_decayed_weights in the chain)
  mask: Any
  nesterov: bool
  mu_dtype: Any
  nu_dtype: Any
  seed: int
  implementation: Optional[str]
  interpret: bool = False


class FusedAdamTransformation(fusion.FusedTransformation):
  """An optax transformation that also carries its Adam hyperparameters.

  It behaves exactly like the ``GradientTransformationExtraArgs`` it wraps
  (``init``/``update``); ``fuseopt_adam`` is read by
  :func:`fuseopt.optim.step` to run the fused kernel.
  """


def _canon_dtype(dtype, name):
  if dtype is None:
    return None
  dtype = jnp.dtype(dtype)
  if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
    raise ValueError(f"{name} must be float32, bfloat16 or None, got {dtype}")
  return dtype


def _check_hyper(b1, b2, eps, eps_root, owner="scale_by_adam"):
  _checks.check_decay(owner, "b1", b1)
  _checks.check_decay(owner, "b2", b2)
  _checks.check_nonnegative(owner, "eps", eps)
  _checks.check_nonnegative(owner, "eps_root", eps_root)


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                  eps_root: float = 0.0, mu_dtype: Any = None, *, nesterov: bool = False,
                  moment_dtype: Any = jnp.bfloat16, seed: int = 0,
                  implementation: Optional[str] = None,
                  interpret: bool = False) -> optax.GradientTransformation:
  r"""Drop-in for :func:`optax.scale_by_adam` with moments stored in ``moment_dtype``.

  .. math::
    m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t,\quad
    v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2,\quad
    u_t = \frac{m_t / (1-\beta_1^t)}{\sqrt{v_t/(1-\beta_2^t) + \bar\varepsilon} + \varepsilon}

  (Kingma & Ba 2014, "Adam: A Method for Stochastic Optimization";
  ``nesterov=True``: Dozat 2016, "Incorporating Nesterov Momentum into
  Adam"). All arithmetic is fp32 with fp32 scalars; a bf16 moment is written
  back stochastically rounded (Gupta et al. 2015), so ``nu`` keeps decaying
  with ``b2 = 0.999`` where a round-to-nearest bf16 store would stall. Leaf
  ``i`` (in ``jax.tree.leaves`` order) at step ``t`` rounds mu and nu with
  ``derive_seed(seed, t, i, STREAM_MU / STREAM_NU)``.

  Args:
    b1, b2, eps, eps_root, nesterov: as in :func:`optax.scale_by_adam`.
    mu_dtype: optax's argument: the dtype of ``mu`` alone (default:
      ``moment_dtype``).
    moment_dtype: dtype of both moments, ``jnp.bfloat16`` (default),
      ``jnp.float32``, or ``None`` (the parameters' dtype, as optax).
    seed: integer mixed into the rounding seeds.
    implementation, interpret: forwarded to :func:`fuseopt.kernels.adam_update`.

  Returns:
    An :class:`optax.GradientTransformation` whose state is
    ``optax.ScaleByAdamState(count, mu, nu)``; updates have the gradients'
    dtype.
  """
  _check_hyper(b1, b2, eps, eps_root)
  nu_dtype = _canon_dtype(moment_dtype, "moment_dtype")
  mu_dtype = _canon_dtype(mu_dtype, "mu_dtype") or nu_dtype

  def init_fn(params):
    mu = optax.tree.zeros_like(params, dtype=mu_dtype)
    nu = optax.tree.zeros_like(params, dtype=nu_dtype)
    return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=mu, nu=nu)

  def update_fn(updates, state, params=None):
    del params
    treedef = jax.tree.structure(state.mu)
    g = treedef.flatten_up_to(updates)
    count = optax.safe_increment(state.count)
    u, mu, nu = kernels.adam_update_tree(
        None, g, jax.tree.leaves(state.mu), jax.tree.leaves(state.nu), count=count,
        b1=b1, b2=b2, eps=eps, eps_root=eps_root, nesterov=nesterov, seed=seed,
        implementation=implementation, interpret=interpret)
    return treedef.unflatten(u), optax.ScaleByAdamState(
        count=count, mu=treedef.unflatten(mu), nu=treedef.unflatten(nu))

  return optax.GradientTransformation(init_fn, update_fn)


def bf16_moments(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                 eps_root: float = 0.0, nesterov: bool = False) -> optax.GradientTransformation:
  """:func:`scale_by_adam` with both moments in bf16: a piece for ``optax.chain``."""
  return scale_by_adam(b1, b2, eps, eps_root, nesterov=nesterov, moment_dtype=jnp.bfloat16)


def _schedule_count(s):
  """The count of a (possibly masked) schedule state."""
  return getattr(s, "inner_state", s).count


def _in_place(hp: AdamHyperparams, decay_at: Optional[int], lr_at: int):
  """The rule of the chain ``scale_by_adam [, add_decayed_weights],
  scale_by_learning_rate`` built below (``decay_at``/``lr_at``: where its
  pieces sit in that chain): one kernel pass reads p, g, mu, nu and writes
  p, mu, nu, with the clip factor, learning rate and per-leaf decay in its
  scalars."""

  def apply(grads, state, params, ctx):
    adam_state = state[0]
    count = optax.safe_increment(adam_state.count)
    lr = hp.learning_rate
    if callable(lr):
      lr = lr(_schedule_count(state[lr_at]))
    p_leaves, treedef = jax.tree.flatten(params)
    n = len(p_leaves)
    if decay_at is None:
      wds = [0.0] * n
    else:
      wd = hp.weight_decay
      if callable(wd):
        wd = wd(_schedule_count(state[decay_at]))
      skip = isinstance(wd, (int, float)) and wd == 0.0
      wds = [wd if (m and not skip) else 0.0 for m in fusion.per_leaf_mask(hp.mask, params)]
    new_p, mu, nu = kernels.adam_update_tree(
        p_leaves, treedef.flatten_up_to(grads), treedef.flatten_up_to(adam_state.mu),
        treedef.flatten_up_to(adam_state.nu), count=count, learning_rate=lr, b1=hp.b1,
        b2=hp.b2, eps=hp.eps, eps_root=hp.eps_root, weight_decay=wds, nesterov=hp.nesterov,
        seed=hp.seed, implementation=hp.implementation, interpret=hp.interpret,
        group=ctx.group, grad_scale=1.0 if ctx.grad_scale is None else ctx.grad_scale,
        apply=True if ctx.apply is None else ctx.apply)
    new_adam = optax.ScaleByAdamState(count=ctx.keep(count, adam_state.count),
                                      mu=treedef.unflatten(mu), nu=treedef.unflatten(nu))
    # The chain's other states (weight-decay and learning-rate schedules,
    # masks) hold only step counters, all advanced once per update.
    rest = tuple(ctx.keep(jax.tree.map(optax.safe_increment, s), s) for s in state[1:])
    return treedef.unflatten(new_p), (new_adam,) + rest

  return fusion.InPlace("adamw" if decay_at is not None else "adam", apply=apply)


def _fused(chain, hp: AdamHyperparams, decay_at=None, lr_at=1) -> FusedAdamTransformation:
  tx = FusedAdamTransformation(chain.init, chain.update)
  tx.fuseopt_adam = hp
  tx.fuseopt_in_place = _in_place(hp, decay_at, lr_at)
  return tx


def adam(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
         eps: float = 1e-8, eps_root: float = 0.0, mu_dtype: Any = None, *,
         nesterov: bool = False, moment_dtype: Any = jnp.bfloat16, seed: int = 0,
         implementation: Optional[str] = None, interpret: bool = False) -> FusedAdamTransformation:
  r"""Adam (Kingma & Ba 2014) with bf16-stored moments: drop-in for :func:`optax.adam`.

  ``chain(scale_by_adam(...), scale_by_learning_rate(learning_rate))``, so
  :math:`p_t = p_{t-1} - \alpha_t u_t` with :math:`u_t` of
  :func:`scale_by_adam`; the state has :func:`optax.adam`'s structure. Pass
  it to :func:`fuseopt.optim.step` for the fused in-place update.

  Args:
    learning_rate: a scalar or an optax schedule.
    b1, b2, eps, eps_root, mu_dtype, nesterov: as in :func:`optax.adam`.
    moment_dtype, seed, implementation, interpret: see :func:`scale_by_adam`.
  """
  _checks.check_rate("adam", "learning_rate", learning_rate)
  chain = optax.chain(
      scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov,
                    moment_dtype=moment_dtype, seed=seed, implementation=implementation,
                    interpret=interpret),
      optax.scale_by_learning_rate(learning_rate))
  nu_dtype = _canon_dtype(moment_dtype, "moment_dtype")
  return _fused(chain, AdamHyperparams(
      learning_rate, b1, b2, eps, eps_root, None, None, nesterov,
      _canon_dtype(mu_dtype, "mu_dtype") or nu_dtype, nu_dtype, seed, implementation, interpret))


def adamw(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
          eps: float = 1e-8, eps_root: float = 0.0, mu_dtype: Any = None,
          weight_decay: optax.ScalarOrSchedule = 1e-4,
          mask: Optional[Any | Callable[[optax.Params], Any]] = None, *,
          nesterov: bool = False, moment_dtype: Any = jnp.bfloat16, seed: int = 0,
          implementation: Optional[str] = None, interpret: bool = False) -> FusedAdamTransformation:
  r"""AdamW (Loshchilov & Hutter 2019) with bf16 moments: drop-in for :func:`optax.adamw`.

  :math:`p_t = p_{t-1} - \alpha_t (u_t + \lambda p_{t-1})` with :math:`u_t`
  of :func:`scale_by_adam` and decoupled weight decay :math:`\lambda` applied
  where ``mask`` is True. Same chain, hence same state structure, as
  :func:`optax.adamw`. Pass it to :func:`fuseopt.optim.step` for the fused
  in-place update.

  Args:
    learning_rate, weight_decay: scalars or optax schedules.
    mask: a pytree of bools (prefix of the params) or a callable returning
      one; True where weight decay applies.
    b1, b2, eps, eps_root, mu_dtype, nesterov: as in :func:`optax.adamw`.
    moment_dtype, seed, implementation, interpret: see :func:`scale_by_adam`.
  """
  _checks.check_rate("adamw", "learning_rate", learning_rate)
  _checks.check_rate("adamw", "weight_decay", weight_decay)
  chain = optax.chain(
      scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov,
                    moment_dtype=moment_dtype, seed=seed, implementation=implementation,
                    interpret=interpret),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate))
  nu_dtype = _canon_dtype(moment_dtype, "moment_dtype")
  return _fused(chain, AdamHyperparams(
      learning_rate, b1, b2, eps, eps_root, weight_decay, mask, nesterov,
      _canon_dtype(mu_dtype, "mu_dtype") or nu_dtype, nu_dtype, seed, implementation, interpret),
      decay_at=1, lr_at=2)

