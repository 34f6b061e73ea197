"""``build_optimizer``: one :class:`~fuseopt.optim.config.OptimConfig` -> one optax solver.

The solver a config describes is, from the outside in::

    freeze(                                   # frozen params: zero update, no state
      skip_nonfinite(                         # NaN/Inf gradient: skip, state untouched
        MultiSteps(                           # mean over accumulate_steps micro-steps
          chain(
            clip_by_global_norm(clip_norm),   # every trainable gradient, all groups
            track_mantissa(                   # bf16_params="mantissa"/"mantissa24": a master
              partition({group: optimizer(schedule * multiplier, group decay)})),
          ))))

Each layer is present only when the config asks for it, except the clip,
which always records the global norm (``clip_norm=0`` does not clip). Every
layer carries its in-place rule (:mod:`fuseopt.optim.fusion`), so
:func:`fuseopt.optim.step` runs the whole solver as fused passes for the
fuseopt optimizers (adam, adamw, muon, muonclip, normuon); optax's (lamb, lion,
adafactor) fall back to ``update`` + ``apply_updates``.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from fuseopt.optim import adam_transforms
from fuseopt.optim import muon_transforms
from fuseopt.optim import fusion
from fuseopt.optim import groups as groups_lib
from fuseopt.optim import mantissa
from fuseopt.optim import muon_axes
from fuseopt.optim import normuon_transforms
from fuseopt.optim import qk_clip
from fuseopt.optim import safeguards
from fuseopt.optim import weight_decay as weight_decay_lib
from fuseopt.optim.config import BF16_PARAMS, OptimConfig

__all__ = ["OPTIMIZER_MAP", "build_optimizer", "learning_rate_schedule"]


def learning_rate_schedule(config: OptimConfig, steps: int) -> optax.ScalarOrSchedule:
  """The rate ``config`` names: its schedule over a ``steps``-update run, or its constant rate."""
  config = OptimConfig.from_dict(config)
  if config.schedule is not None:
    return config.schedule.schedule(steps)
  return config.learning_rate


def _scaled(rate: optax.ScalarOrSchedule, multiplier: float) -> optax.ScalarOrSchedule:
  if multiplier == 1.0:
    return rate
  if callable(rate):
    return lambda count: multiplier * rate(count)
  return multiplier * rate


def _moments(config: OptimConfig):
  """The dtype of momentum-like state (lion, Muon's momentum): bf16 or optax's."""
  return jnp.bfloat16 if config.moment_dtype == "bfloat16" else None


def _betas(config: OptimConfig, b1="b1", b2="b2", eps="eps") -> dict[str, Any]:
  out = {}
  for field, kw in (("b1", b1), ("b2", b2), ("eps", eps)):
    v = getattr(config, field)
    if v is not None and kw is not None:
      out[kw] = v
  return out


def _decay(config, rate):
  """The weight-decay rate, cautious where the config says so."""
  return weight_decay_lib.cautious(rate) if config.cautious_weight_decay else rate


def _adam(config, rate, weight_decay):
  kw = {**_betas(config), **config.optimizer_kwargs}
  return adam_transforms.adam(rate, moment_dtype=config.moment_dtype, **kw)


def _adamw(config, rate, weight_decay):
  kw = {**_betas(config), **config.optimizer_kwargs}
  return adam_transforms.adamw(rate, weight_decay=_decay(config, weight_decay),
                               moment_dtype=config.moment_dtype, **kw)


def _keep_state_dtypes(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """``tx`` whose state leaves keep their ``init`` dtypes from step to step.

  optax's lamb, lion and adafactor store moments in the parameters' dtype
  and let the update promote them (bf16 params with fp32 gradients give an
  fp32 moment after the first step): a state whose dtype changes cannot be a
  ``lax.scan`` carry, and a jitted step would recompile once.
  """
  def update_fn(updates, state, params=None):
    new_updates, new_state = tx.update(updates, state, params)
    keep = lambda new, old: new.astype(old.dtype) if hasattr(old, "dtype") else new
    return new_updates, jax.tree.map(keep, new_state, state)

  return optax.GradientTransformation(tx.init, update_fn)


def _lamb(config, rate, weight_decay):
  return _keep_state_dtypes(optax.lamb(rate, weight_decay=weight_decay, **_betas(config),
                                       **config.optimizer_kwargs))


def _lion(config, rate, weight_decay):
  return _keep_state_dtypes(optax.lion(rate, weight_decay=weight_decay, mu_dtype=_moments(config),
                                       **_betas(config, eps=None), **config.optimizer_kwargs))


def _adafactor(config, rate, weight_decay):
  return _keep_state_dtypes(optax.adafactor(rate, weight_decay_rate=weight_decay or None,
                                            **_betas(config, b1=None, b2=None),
                                            **config.optimizer_kwargs))


def pattern_dimension_numbers(patterns):
  """Muon's split by path patterns: a matching parameter of rank >= 2 is a
  stack of matrices over its last two axes (reduction, output); the rest
  take AdamW. The callable form of ``muon_weight_dimension_numbers``."""
  patterns = tuple(patterns)

  def dims(params):
    def one(kp, x):
      if isinstance(x, optax.MaskedNode):
        return x
      ndim = len(getattr(x, "shape", ()))
      if ndim < 2 or not groups_lib.matches_any(groups_lib.path_str(kp), patterns):
        return None
      return muon_transforms.MuonDimensionNumbers(reduction_axis=ndim - 2, output_axis=ndim - 1)
    return jax.tree_util.tree_map_with_path(one, params,
                                            is_leaf=lambda x: isinstance(x, optax.MaskedNode))

  return dims


def _muon_kwargs(config, weight_decay, adam_rate):
  # Muon's b1/b2 are its AdamW side's; its own momentum is optimizer_kwargs["beta"].
  # The AdamW side's moments in moment_dtype; Muon's momentum momentum_dtype's,
  # or (None) bf16 with bf16 moments, else fp32 (8-bit moments are the AdamW side's).
  momentum = (_moments(config) if config.momentum_dtype is None
              else config.momentum_dtype)   # by name, as fuseopt.optim.muon's mu_dtype takes it
  kw = dict(weight_decay=_decay(config, weight_decay),
            adam_weight_decay=_decay(config, weight_decay), mu_dtype=momentum,
            moment_dtype=config.moment_dtype, **_betas(config, b1="adam_b1", b2="adam_b2"))
  extra = dict(config.optimizer_kwargs)
  if adam_rate is not None:
    kw["adam_learning_rate"] = adam_rate
  if config.muon_patterns is not None:
    kw["muon_weight_dimension_numbers"] = pattern_dimension_numbers(config.muon_patterns)
  elif config.muon_logical_axes:
    kw["muon_weight_dimension_numbers"] = muon_axes.logical_axes_dimension_numbers(
        **config.muon_axis_rules)
  return {**kw, **extra}


def _muon(config, rate, weight_decay, adam_rate=None):
  return muon_transforms.muon(rate, **_muon_kwargs(config, weight_decay, adam_rate))


def _normuon(config, rate, weight_decay, adam_rate=None):
  kw = _muon_kwargs(config, weight_decay, adam_rate)
  if config.normuon_b2 is not None:
    kw["b2"] = config.normuon_b2
  return normuon_transforms.normuon(rate, **kw)


def _muonclip(config, rate, weight_decay, adam_rate=None):
  tau = 100.0 if config.qk_clip_tau is None else config.qk_clip_tau
  return qk_clip.muonclip(rate, tau=tau, **_muon_kwargs(config, weight_decay, adam_rate))


# name -> (config, rate, weight_decay) -> GradientTransformation
OPTIMIZER_MAP: dict[str, Callable[..., optax.GradientTransformation]] = {
    "adam": _adam,
    "adamw": _adamw,
    "lamb": _lamb,
    "lion": _lion,
    "adafactor": _adafactor,
    "muon": _muon,
    "muonclip": _muonclip,
    "normuon": _normuon,
}


def build_optimizer(config: OptimConfig | dict, steps: int) -> optax.GradientTransformationExtraArgs:
  """Build the solver ``config`` describes, with its schedule, groups, clip and safeguards.

  Args:
    config: an :class:`OptimConfig` or its dict.
    steps: the run's length in optimizer updates (after accumulation), an
      integer >= 1, which a schedule decays over unless it names its own
      end; a schedule's warmup must end within it.

  ``param_groups`` runs one solver per group under :func:`optax.partition`,
  each on the schedule times its ``learning_rate_multiplier`` and with its own
  weight decay; the global-norm clip still reads every gradient together,
  before the groups split them. The clip's norm is in the state:
  :func:`fuseopt.optim.safeguards.global_norm_of` finds it.
  """
  config = OptimConfig.from_dict(config)
  if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
    # Every schedule needs a run of at least one update (schedules.py states
    # the rule); a constant rate does not read it, but one rule is simpler.
    raise ValueError(f"build_optimizer: steps (the run's length in updates) must be an integer >= 1, "
                     f"got {steps!r}")
  make = OPTIMIZER_MAP[config.optimizer]
  rate = learning_rate_schedule(config, steps)
  # Muon's AdamW side on its own rate, when the config gives one.
  adam_rate = (config.adam_schedule.schedule(steps) if config.adam_schedule is not None
               else config.adam_learning_rate)

  def solver(rate_multiplier, decay):
    extra = {} if adam_rate is None else {"adam_rate": _scaled(adam_rate, rate_multiplier)}
    return make(config, _scaled(rate, rate_multiplier), decay, **extra)

  if config.param_groups:
    solvers = {}
    for g in config.param_groups:
      decay = config.weight_decay if g.weight_decay is None else g.weight_decay
      solvers[g.name] = solver(g.learning_rate_multiplier, decay)
    tx = fusion.partition(solvers, groups_lib.param_labels(config.param_groups),
                          name="param_groups")
  else:
    tx = solver(1.0, config.weight_decay)
  master_bits = BF16_PARAMS[config.bf16_params]
  if master_bits is not None:
    # One companion tree for the whole solver (every group), inside the
    # clip and the safeguards so that they see the bf16 parameters.
    tx = mantissa.track_mantissa(tx, master_bits, owner="build_optimizer")

  tx = fusion.chain(safeguards.clip_by_global_norm(config.clip_norm), tx)
  if config.accumulate_steps > 1:
    # Extra args (MuonClip's qk_stats) reach the solver: not MultiSteps'
    # .gradient_transformation(), a plain GradientTransformation.
    tx = fusion.multi_steps(tx, config.accumulate_steps)
  if config.skip_nonfinite:
    tx = safeguards.skip_nonfinite(tx, config.max_consecutive_skips, config.on_max_skips)
  if config.frozen or config.trainable is not None:
    tx = safeguards.freeze(tx, config.frozen, config.trainable)
  return optax.with_extra_args_support(tx)
