"""Safeguards around a solver: global-norm clipping, non-finite skips, frozen parameters.

Each is an optax transform (or a wrapper of one) the builder composes:

* :func:`clip_by_global_norm` clips by the norm of *every* gradient it is
  given and keeps that norm in its state, so a trainer can log it;
* :func:`skip_nonfinite` drops a step whose gradient holds a NaN or Inf
  without touching the wrapped solver's state (its step count, and so its
  schedule, stays put);
* :func:`freeze` gives frozen parameters a zero update and no optimizer state.

Each also declares its in-place rule (:mod:`fuseopt.optim.fusion`), so
:func:`fuseopt.optim.step` runs a solver wrapped in them as fused passes: the
clip's factor and the non-finite flag come from one reduction over the
gradients (:func:`fuseopt.optim.fusion.grad_stats`), the factor scales g
inside the solver's pass and a skipped step is a select in the same passes.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import math

import jax
import jax.numpy as jnp
import optax

from fuseopt.optim import fusion
from fuseopt.optim import groups as groups_lib

__all__ = [
    "ClipByGlobalNormState",
    "SkipNonfiniteState",
    "clip_by_global_norm",
    "freeze",
    "frozen_labels",
    "global_norm_of",
    "skip_nonfinite",
]


class ClipByGlobalNormState(NamedTuple):
  """The global norm of the last gradient the clip saw (before clipping)."""
  global_norm: jax.Array


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
  r"""Scale all updates by ``min(1, max_norm / ||g||)`` with ``||g||`` over every leaf.

  .. math:: g \leftarrow g \cdot \min\left(1, \frac{c}{\|g\|_2}\right),
     \quad \|g\|_2 = \sqrt{\textstyle\sum_{\text{leaves}} \sum g^2}

  Pascanu et al. 2013, "On the difficulty of training recurrent neural
  networks", arXiv 1211.5063. Unlike :func:`optax.clip_by_global_norm` the
  norm is kept in the state (``ClipByGlobalNormState.global_norm``), and
  ``max_norm == 0`` or ``max_norm == inf`` disables the clip while still
  reporting the norm (``inf / max(norm, inf)`` would be NaN). A NaN
  ``max_norm`` raises. Put it before any :func:`optax.partition` so the norm
  covers every group.
  """
  if (isinstance(max_norm, bool) or not isinstance(max_norm, (int, float))
      or math.isnan(max_norm) or max_norm < 0):
    raise ValueError(f"clip_by_global_norm: max_norm must be a number >= 0 (0 or inf disables), "
                     f"got {max_norm!r}")
  max_norm = float(max_norm)
  clips = 0 < max_norm < math.inf

  def init_fn(params):
    del params
    return ClipByGlobalNormState(global_norm=jnp.zeros([], jnp.float32))

  def factor(norm):
    # Divide by max(norm, c), not norm: a zero gradient stays zero, no 0/0.
    return max_norm / jnp.maximum(norm, max_norm)

  def update_fn(updates, state, params=None):
    del params, state
    # The sum of squares in fp32 by the same one-pass reduction the fused
    # step shares with skip_nonfinite, so both paths clip by the same factor.
    norm = jnp.sqrt(fusion.grad_stats(updates)[0])
    if clips:
      scale = factor(norm)
      updates = jax.tree.map(lambda g: (g * scale).astype(g.dtype), updates)
    return updates, ClipByGlobalNormState(global_norm=norm)

  def prepare(grads, state, ctx):
    norm = jnp.sqrt(ctx.stats(grads)[0])
    if ctx.grad_scale is not None:
      norm = norm * ctx.grad_scale
    new_state = ctx.keep(ClipByGlobalNormState(global_norm=norm), state)
    return (ctx.scaled(factor(norm)) if clips else ctx), new_state

  return fusion.with_in_place(optax.GradientTransformation(init_fn, update_fn),
                              fusion.InPlace("clip_by_global_norm", prepare=prepare))


class SkipNonfiniteState(NamedTuple):
  """State of :func:`skip_nonfinite`.

  Attributes:
    inner_state: the wrapped solver's state, untouched by a skipped step.
    consecutive_skips: skipped steps since the last applied one.
    total_skips: skipped steps over the run.
    last_finite: whether the last gradient was finite.
  """
  inner_state: Any
  consecutive_skips: jax.Array
  total_skips: jax.Array
  last_finite: jax.Array


def _all_finite(tree) -> jax.Array:
  return fusion.grad_stats(tree)[1]


def _raise_if(flag, limit):
  if flag:
    raise FloatingPointError(
        f"skip_nonfinite: {limit} consecutive non-finite gradients; the run is diverging "
        "(lower the learning rate, or pass on_max_skips='apply' to apply such steps)")


def skip_nonfinite(inner: optax.GradientTransformation, max_consecutive_skips: int | None = 10,
                   on_max_skips: str = "raise") -> optax.GradientTransformationExtraArgs:
  """Skip a step whose gradient holds a NaN or an Inf, as if it never happened.

  A non-finite gradient (any leaf) makes the update all zeros and leaves
  ``inner``'s state exactly as it was: its step count does not advance, so
  neither do its schedule, its bias corrections or its accumulation. This is
  what a PyTorch AMP ``GradScaler`` does with an overflowing fp16 step; it
  differs from :func:`optax.apply_if_finite` only in what the limit does.

  ``max_consecutive_skips`` bounds a run of skipped steps (None: no bound).
  A non-finite gradient arriving once that many steps in a row were skipped:

  * ``on_max_skips="raise"`` raises ``FloatingPointError`` from a host callback,
    surfacing as a ``JaxRuntimeError`` when the step's results are read
    (the step itself is still skipped);
  * ``on_max_skips="apply"`` applies that gradient (optax.apply_if_finite's
    behaviour), which spreads the NaN into the parameters for the trainer's
    own checks to catch, and resets the count.

  The state (:class:`SkipNonfiniteState`) counts consecutive and total skips.
  """
  if max_consecutive_skips is not None and (isinstance(max_consecutive_skips, bool)
                                            or not isinstance(max_consecutive_skips, int)
                                            or max_consecutive_skips < 1):
    raise ValueError(f"skip_nonfinite: max_consecutive_skips must be an integer >= 1 or None, "
                     f"got {max_consecutive_skips!r}")
  if on_max_skips not in ("raise", "apply"):
    raise ValueError(f"skip_nonfinite: on_max_skips must be 'raise' or 'apply', got {on_max_skips!r}")
  inner_tx = inner
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return SkipNonfiniteState(inner_state=inner.init(params),
                              consecutive_skips=jnp.zeros([], jnp.int32),
                              total_skips=jnp.zeros([], jnp.int32),
                              last_finite=jnp.array(True))

  def apply_flag(finite, state):
    if max_consecutive_skips is None:
      return finite
    at_limit = jnp.logical_and(~finite, state.consecutive_skips >= max_consecutive_skips)
    if on_max_skips == "apply":
      return jnp.logical_or(finite, at_limit)
    # Inside a cond so a healthy step makes no host round trip.
    jax.lax.cond(at_limit, lambda: jax.debug.callback(_raise_if, True, max_consecutive_skips),
                 lambda: None)
    return finite

  def counters(apply, finite, state):
    skipped = (~apply).astype(jnp.int32)
    return dict(consecutive_skips=(state.consecutive_skips + 1) * skipped,
                total_skips=state.total_skips + skipped, last_finite=finite)

  def in_place(grads, state, params, ctx):
    rule = fusion.require_apply(inner_tx, "skip_nonfinite")
    finite = ctx.stats(ctx.scale_grads(grads) if ctx.grad_scale is not None else grads)[1]
    apply = apply_flag(finite, state)
    # The inner pieces keep their params and state where apply is False.
    params, inner_state = rule.apply(grads, state.inner_state, params, ctx.gated(apply))
    own = counters(apply, finite, state)
    if ctx.apply is not None:  # a skip above this one leaves these alone too
      own = dict(zip(own, ctx.keep(tuple(own.values()), tuple(getattr(state, k) for k in own))))
    return params, SkipNonfiniteState(inner_state=inner_state, **own)

  def update_fn(updates, state, params=None, **extra_args):
    finite = _all_finite(updates)
    new_updates, new_inner = inner.update(updates, state.inner_state, params, **extra_args)
    apply = apply_flag(finite, state)
    keep = lambda new, old: jnp.where(apply, new, old)
    inner_state = jax.tree.map(keep, new_inner, state.inner_state)
    new_updates = jax.tree.map(lambda u: jnp.where(apply, u, jnp.zeros_like(u)), new_updates)
    return new_updates, SkipNonfiniteState(inner_state=inner_state, **counters(apply, finite, state))

  return fusion.with_in_place(optax.GradientTransformationExtraArgs(init_fn, update_fn),
                              fusion.InPlace("skip_nonfinite", apply=in_place))


def frozen_labels(frozen: Sequence[str] = (), trainable: Sequence[str] | None = None):
  """Labeller for :func:`freeze`: ``'frozen'`` where a path matches ``frozen``
  or (when ``trainable`` is given) matches none of ``trainable``; else ``'trainable'``.

  A pattern that matches no parameter path raises a ``ValueError`` naming it
  (and showing a few paths): with nested parameters, ``'lora_*'`` matches
  nothing (the path is ``'layer_0/lora_a'``), and a ``trainable`` list that
  matches nothing would silently freeze the whole model.
  """
  if isinstance(frozen, str):
    frozen = (frozen,)
  if isinstance(trainable, str):
    trainable = (trainable,)
  frozen, trainable = tuple(frozen), None if trainable is None else tuple(trainable)

  def labels(params):
    paths = jax.tree_util.tree_map_with_path(lambda kp, _: groups_lib.path_str(kp), params)
    flat = jax.tree.leaves(paths)
    for name, patterns in (("frozen", frozen), ("trainable", trainable or ())):
      for p in patterns:
        if not any(groups_lib.matches_any(path, (p,)) for path in flat):
          shown = ", ".join(repr(x) for x in flat[:5]) + (", ..." if len(flat) > 5 else "")
          raise ValueError(
              f"freeze: {name} pattern {p!r} matches no parameter. Patterns are "
              f"fnmatch patterns over the whole '/'-joined path, where '*' also crosses "
              f"'/' (e.g. '*lora_*' or '*/lora_*' for nested keys); paths: {shown or 'none'}")

    def label(path):
      if groups_lib.matches_any(path, frozen):
        return "frozen"
      if trainable is not None and not groups_lib.matches_any(path, trainable):
        return "frozen"
      return "trainable"

    return jax.tree.map(label, paths)

  return labels


def freeze(inner: optax.GradientTransformation, frozen: Sequence[str] = (),
           trainable: Sequence[str] | None = None) -> optax.GradientTransformationExtraArgs:
  """Run ``inner`` on the trainable parameters only; frozen ones get zero updates and no state.

  Frozen: a path matching a ``frozen`` pattern, or, when ``trainable`` is
  given, one matching none of its patterns (``trainable=('*lora_*',)``
  trains only LoRA adapters, as a LoRA fine-tune freezes its base). Built on
  :func:`optax.partition` with :func:`optax.set_to_zero`, so ``inner`` sees
  (and its clip norm and non-finite check cover) the trainable leaves only,
  and its state holds ``optax.MaskedNode`` where a frozen leaf would be.
  """
  frozen_part = fusion.with_in_place(
      optax.set_to_zero(),
      fusion.InPlace("frozen", apply=lambda grads, state, params, ctx: (params, state)))
  return fusion.partition({"trainable": inner, "frozen": frozen_part},
                          frozen_labels(frozen, trainable), name="freeze")


def global_norm_of(state) -> jax.Array | None:
  """The global norm :func:`clip_by_global_norm` recorded somewhere in a solver's state (None if absent)."""
  found = []

  def visit(x):
    if isinstance(x, ClipByGlobalNormState):
      found.append(x.global_norm)
    return x

  jax.tree.map(visit, state, is_leaf=lambda x: isinstance(x, ClipByGlobalNormState))
  return found[0] if found else None
