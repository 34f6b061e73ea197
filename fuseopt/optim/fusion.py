"""In-place steps that compose: the protocol behind :func:`fuseopt.optim.step`.

A transformation that can apply itself to the parameters in place carries an
:class:`InPlace` rule (attribute ``fuseopt_in_place`` of a
:class:`FusedTransformation`), declared next to its definition: fuseopt's
:func:`~fuseopt.optim.adamw` and Muon, the global-norm clip, ``skip_nonfinite``,
``freeze``, and the combinators below, which are :func:`optax.chain`,
:func:`optax.partition` and :class:`optax.MultiSteps` with a rule attached.
The transformation itself is unchanged (same ``init``/``update``, same state),
so it runs anywhere an optax transformation runs.

A rule is one of two kinds:

* ``apply(grads, state, params, ctx) -> (new_params, new_state)`` moves the
  parameters (a solver, or a wrapper that hands its solver the step);
* ``prepare(grads, state, ctx) -> (ctx, new_state)`` acts on the gradient
  alone (the clip: its factor joins ``ctx.grad_scale``), a piece that can
  precede a solver in a chain; ``identity=True`` says it passes updates
  through unchanged, so it may also follow the solver (MuonClip's clip when no
  ``qk_stats`` are given).

A rule that finds its piece cannot run in place (a transformation without a
rule, an argument it does not handle) raises :class:`NotFusable` naming the
piece; :func:`fuseopt.optim.step` then falls back to ``tx.update`` +
:func:`optax.apply_updates` and logs the reason at debug level on the
``"fuseopt"`` logger.

The :class:`Context` carries what wrappers hand down: the gradient scale (a
clip factor), the apply flag (False on a skipped step: every piece below
keeps its parameters and state, by a select inside the pass that would have
written them) and one memoised reduction over the gradients giving both
their squared global norm and whether they are all finite.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Hashable, Mapping, Optional

import jax
import jax.numpy as jnp
import optax

logger = logging.getLogger("fuseopt")

__all__ = [
    "Context",
    "FusedTransformation",
    "InPlace",
    "NotFusable",
    "chain",
    "grad_stats",
    "in_place_rule",
    "multi_steps",
    "partition",
    "per_leaf_mask",
    "with_in_place",
]


class NotFusable(Exception):
  """A piece of the transformation cannot run in place; the message names it."""


@dataclasses.dataclass(frozen=True)
class InPlace:
  """The in-place rule of one transformation (see the module docstring)."""
  name: str
  apply: Optional[Callable] = None
  prepare: Optional[Callable] = None
  identity: bool = False


class FusedTransformation(optax.GradientTransformationExtraArgs):
  """An optax transformation that also carries its in-place rule
  (``fuseopt_in_place``); it behaves exactly as the ``init``/``update`` it holds."""


def with_in_place(tx, rule: InPlace) -> FusedTransformation:
  """``tx`` (its ``init`` and ``update``, with extra-args support) carrying ``rule``."""
  tx = optax.with_extra_args_support(tx)
  out = FusedTransformation(tx.init, tx.update)
  out.fuseopt_in_place = rule
  return out


def in_place_rule(tx) -> Optional[InPlace]:
  """The rule ``tx`` declares, or None."""
  return getattr(tx, "fuseopt_in_place", None)


def describe(tx) -> str:
  """A name for a transformation in a log line."""
  rule = in_place_rule(tx)
  if rule is not None:
    return rule.name
  init = getattr(tx, "init", None)
  name = getattr(init, "__qualname__", None) or type(tx).__name__
  return name.split(".<locals>")[0]


def require_apply(tx, where: str) -> InPlace:
  rule = in_place_rule(tx)
  if rule is None or rule.apply is None:
    raise NotFusable(f"{where}: {describe(tx)} has no in-place rule")
  return rule


def per_leaf_mask(mask, params) -> list[bool]:
  """A weight-decay mask (a prefix tree of bools, or a callable of ``params``
  returning one) as one Python bool per leaf of ``params``."""
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


# ------------------------------------------------------------- the context --
def grad_stats(tree) -> tuple[jax.Array, jax.Array]:
  """``(sum of g**2 in fp32, all finite)`` over every leaf, one pass a leaf.

  One variadic reduction reads each leaf once for both figures, so a clip
  and a non-finite check of the same gradients cost one read of them.
  """
  total, finite = jnp.float32(0.0), jnp.bool_(True)
  for x in jax.tree.leaves(tree):
    x = jnp.asarray(x)
    x32 = x.astype(jnp.float32)
    sq, ok = jax.lax.reduce(
        (x32 * x32, jnp.isfinite(x)), (jnp.float32(0.0), jnp.bool_(True)),
        lambda a, b: (a[0] + b[0], jnp.logical_and(a[1], b[1])), tuple(range(x.ndim)))
    total, finite = total + sq, jnp.logical_and(finite, ok)
  return total, finite


@dataclasses.dataclass(frozen=True)
class Context:
  """What the wrappers above a piece hand down to it.

  Attributes:
    grad_scale: fp32 scalar the gradients are to be multiplied by (a clip
      factor), or None for 1.
    apply: bool scalar, or None for True; False keeps params and state.
    group: forwarded to the Adam kernels (one launch for many leaves).
    shardings: the params' placement given to :func:`fuseopt.optim.step`
      (wins over the transforms' own ``shardings``), or None.
    extra_args: the ``update`` extra arguments (``qk_stats``...).
  """
  grad_scale: Any = None
  apply: Any = None
  group: bool = False
  shardings: Any = None
  extra_args: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  _memo: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

  def scaled(self, factor) -> "Context":
    scale = factor if self.grad_scale is None else self.grad_scale * factor
    return dataclasses.replace(self, grad_scale=scale)

  def gated(self, flag) -> "Context":
    apply = flag if self.apply is None else jnp.logical_and(self.apply, flag)
    return dataclasses.replace(self, apply=apply)

  def unscaled(self) -> "Context":
    return dataclasses.replace(self, grad_scale=None)

  def keep(self, new, old):
    """``new`` where the step applies, else ``old`` (leaf by leaf, same dtypes)."""
    if self.apply is None:
      return new
    return jax.tree.map(lambda n, o: jnp.where(self.apply, n, o).astype(o.dtype), new, old)

  def stats(self, grads):
    """:func:`grad_stats` of ``grads``, computed once for the same leaves."""
    leaves = jax.tree.leaves(grads)
    key = tuple(id(x) for x in leaves)
    if key not in self._memo:
      # The leaves stay referenced by the memo, so their ids stay theirs.
      self._memo[key] = (leaves, grad_stats(leaves))
    return self._memo[key][1]

  def scale_grads(self, grads):
    """The gradients times ``grad_scale`` in their dtype, as the clip returns them."""
    if self.grad_scale is None:
      return grads
    return jax.tree.map(lambda g: (g * self.grad_scale).astype(g.dtype), grads)


# ------------------------------------------------------------ combinators --
def chain(*transforms) -> FusedTransformation:
  """:func:`optax.chain` with an in-place rule: gradient pieces (``prepare``)
  then one solver (``apply``), then pieces that pass updates through."""
  tx = optax.chain(*transforms)

  def apply(grads, state, params, ctx):
    rules = [in_place_rule(t) for t in transforms]
    solvers = [i for i, r in enumerate(rules) if r is not None and r.apply is not None]
    if len(solvers) != 1:
      missing = [describe(t) for t, r in zip(transforms, rules) if r is None]
      raise NotFusable(f"chain: {', '.join(missing) or 'no single solver'} has no in-place rule"
                       if missing else f"chain: {len(solvers)} solvers")
    (k,) = solvers
    new_state = list(state)
    for i, (t, r) in enumerate(zip(transforms, rules)):
      if i == k:
        continue
      if r is None or r.prepare is None or (i > k and not r.identity):
        raise NotFusable(f"chain: {describe(t)} cannot run {'after' if i > k else 'before'} "
                         "an in-place solver")
      if i < k:
        ctx, new_state[i] = r.prepare(grads, state[i], ctx)
    params, new_state[k] = rules[k].apply(grads, state[k], params, ctx)
    for i in range(k + 1, len(transforms)):
      _, new_state[i] = rules[i].prepare(grads, state[i], ctx)
    return params, tuple(new_state)

  return with_in_place(tx, InPlace("chain", apply=apply))


def _mask_tree(tree, mask):
  # optax.masked's masking: a MaskedNode where the mask (a prefix) is False.
  return jax.tree.map(lambda m, x: x if m else optax.MaskedNode(), mask, tree)


def partition(transforms: Mapping[Hashable, Any], param_labels,
              name: str = "partition") -> FusedTransformation:
  """:func:`optax.partition` with an in-place rule: each label's rule runs
  on its masked share of the tree, as optax's masked update sees it."""
  tx = optax.partition(transforms, param_labels)

  def apply(grads, state, params, ctx):
    labels = param_labels(grads) if callable(param_labels) else param_labels
    new_params, inner = params, {}
    for group, t in transforms.items():
      rule = require_apply(t, f"{name} group {group!r}")
      mask = jax.tree.map(lambda label: label == group, labels)
      sub_params, sub_state = rule.apply(_mask_tree(grads, mask), state.inner_states[group].inner_state,
                                         _mask_tree(params, mask), ctx)
      new_params = jax.tree.map(lambda m, new, old: new if m else old, mask, sub_params, new_params)
      inner[group] = optax.MaskedState(inner_state=sub_state)
    return new_params, type(state)(inner)

  return with_in_place(tx, InPlace(name, apply=apply))


def multi_steps(tx, every_k: int) -> FusedTransformation:
  """:class:`optax.MultiSteps` (mean of ``every_k`` micro-step gradients,
  fp32 accumulator) with an in-place rule.

  As optax does, the inner step runs every micro-step on the running mean and
  only the last micro-step's result is kept: here by the apply flag, so the
  kernels select the old values rather than a second pass doing it.
  """
  multi = optax.MultiSteps(tx, every_k_schedule=every_k)
  k = int(every_k)

  def apply(grads, state, params, ctx):
    rule = require_apply(tx, "MultiSteps")
    grads, ctx = ctx.scale_grads(grads), ctx.unscaled()
    acc = jax.tree.map(lambda g, a: a + (g - a) / (state.mini_step + 1), grads, state.acc_grads)
    emit = state.mini_step == (k - 1)
    params, inner = rule.apply(optax.tree.cast_like(acc, grads), state.inner_opt_state, params,
                               ctx.gated(emit))
    new = optax.MultiStepsState(
        mini_step=optax.safe_increment(state.mini_step) % k,
        gradient_step=emit * optax.safe_increment(state.gradient_step)
        + (1 - emit) * state.gradient_step,
        inner_opt_state=inner,
        acc_grads=jax.tree.map(lambda a: jnp.astype((1 - emit) * a, jnp.float32), acc),
        skip_state=state.skip_state)
    # The inner state already honours the flag; the counters and accumulator here.
    kept = ctx.keep(new._replace(inner_opt_state=state.inner_opt_state),
                    state._replace(inner_opt_state=state.inner_opt_state))
    return params, kept._replace(inner_opt_state=inner)

  return with_in_place(optax.GradientTransformationExtraArgs(multi.init, multi.update),
                       InPlace("MultiSteps", apply=apply))
