"""Exact bf16 parameters: a uint16 companion per parameter in the optimizer state.

``bf16_params="mantissa"`` on :func:`~fuseopt.optim.adam`,
:func:`~fuseopt.optim.adamw`, :func:`~fuseopt.optim.muon` and
:func:`~fuseopt.optim.normuon` wraps the optimizer in :func:`track_mantissa`:
the bf16 parameters the model reads are the top half of an fp32 master, and
the bottom half lives in the optimizer state as a uint16 tree shaped like the
params (:class:`MantissaState`; checkpoints keep it). Every update is computed
on the fp32 master and split again (:mod:`fuseopt.kernels.mantissa`), so the
masters follow an fp32 run of the same optimizer bit for bit, at 2 bytes per
parameter more than bf16 parameters with stochastic rounding
(``bf16_params="stochastic"``, the default) and 2 less than an fp32 master
copy. The idea is modded-nanogpt's "mantissa tracking" (speedrun record #57,
2025).

The visible bf16 half is the master truncated toward zero (within one bf16
ulp, see :mod:`fuseopt.kernels.mantissa`). :func:`master_params` returns the
fp32 masters of a state.

In :func:`fuseopt.optim.step` the solver's kernels read and write both halves
in the one pass they make over the parameter: the rules below hand each solver
its parameters as :class:`Tracked` pairs.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fuseopt.kernels import mantissa as bits
from fuseopt.optim import fusion

__all__ = ["BF16_PARAMS", "MantissaState", "Tracked", "check_bf16_params", "master_params",
           "track_mantissa", "with_bf16_params"]

BF16_PARAMS = ("stochastic", "mantissa")


class MantissaState(NamedTuple):
  """The wrapped optimizer's state and the params' uint16 companions."""
  inner_state: Any
  companion: Any


@jax.tree_util.register_pytree_node_class
class Tracked:
  """A bf16 parameter leaf with its companion, as the in-place rules see it."""

  __slots__ = ("hi", "lo")

  def __init__(self, hi, lo):
    self.hi, self.lo = hi, lo

  def tree_flatten(self):
    return (self.hi, self.lo), None

  @classmethod
  def tree_unflatten(cls, aux, children):
    del aux
    return cls(*children)

  def __repr__(self):
    return f"Tracked({self.hi!r}, {self.lo!r})"


def is_tracked(x) -> bool:
  return isinstance(x, Tracked)


def halves(leaves):
  """Leaves that may be :class:`Tracked` as ``(bf16 halves, companions or None)``."""
  return ([x.hi if is_tracked(x) else x for x in leaves],
          [x.lo if is_tracked(x) else None for x in leaves])


def pair(hi_leaves, lo_leaves):
  """The inverse of :func:`halves`."""
  return [h if lo is None else Tracked(h, lo) for h, lo in zip(hi_leaves, lo_leaves)]


def visible(tree):
  """``tree`` with every :class:`Tracked` pair replaced by its bf16 half."""
  return jax.tree.map(lambda x: x.hi if is_tracked(x) else x, tree, is_leaf=is_tracked)


def master_of(x) -> jax.Array:
  """A leaf's fp32 value: the master of a pair, the leaf widened otherwise."""
  return bits.join(x.hi, x.lo) if is_tracked(x) else x.astype(jnp.float32)


def store(x32, like):
  """fp32 ``x32`` into the storage of ``like``: a new pair for a pair."""
  if is_tracked(like):
    return Tracked(*bits.split_once(x32))
  return x32.astype(like.dtype)


def check_bf16_params(owner: str, params) -> None:
  """Every floating parameter must be bfloat16: the companion completes a
  bf16 half to fp32 and means nothing for another dtype."""
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    dtype = jnp.result_type(x)
    if jnp.issubdtype(dtype, jnp.floating) and dtype != jnp.bfloat16:
      raise ValueError(
          f"{owner}: bf16_params='mantissa' needs bfloat16 parameters, but the leaf at "
          f"{jax.tree_util.keystr(path) or '<root>'} is {dtype}; cast the params to bfloat16, "
          f"or keep bf16_params='stochastic' (fp32 parameters need no companion)")


def check_mode(owner: str, bf16_params) -> str:
  if bf16_params not in BF16_PARAMS:
    raise ValueError(f"{owner}: bf16_params must be one of {BF16_PARAMS}, got {bf16_params!r}")
  return bf16_params


def _masters(params, companion):
  return jax.tree.map(bits.join, params, companion)


def track_mantissa(tx, owner: str = "track_mantissa") -> fusion.FusedTransformation:
  """``tx`` run on fp32 masters of bf16 parameters held as (bf16, uint16) halves.

  ``init(params)`` (bf16 params) initialises ``tx`` on the params widened to
  fp32 (so its state is an fp32 run's) and zero companions. ``update``
  gives ``tx`` the masters as its params, applies its updates to them in fp32
  (:func:`optax.apply_updates`) and splits the result: the new companion goes
  into the state, and the returned updates are the fp32 differences
  ``new bf16 half - param``, which :func:`optax.apply_updates` adds back to
  the bf16 params exactly. In :func:`fuseopt.optim.step` the solver's kernels
  do all of it in their own pass.
  """

  def init_fn(params):
    check_bf16_params(owner, params)
    wide = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    return MantissaState(inner_state=tx.init(wide),
                         companion=jax.tree.map(
                             lambda p: jnp.zeros(jnp.shape(p), bits.COMPANION_DTYPE), params))

  def update_fn(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError(f"{owner}: bf16_params='mantissa' needs params; pass params= to update()")
    check_bf16_params(owner, params)
    masters = _masters(params, state.companion)
    u, inner = tx.update(updates, state.inner_state, masters, **extra_args)
    new_masters = optax.apply_updates(masters, u)
    split = jax.tree.map(bits.split_once, new_masters)
    hi = jax.tree.map(lambda s: s[0], split, is_leaf=lambda x: isinstance(x, tuple))
    lo = jax.tree.map(lambda s: s[1], split, is_leaf=lambda x: isinstance(x, tuple))
    # p + (hi - p) in fp32 is hi (both are bf16 values), and apply_updates'
    # cast back to bf16 keeps it.
    diff = jax.tree.map(lambda h, p: h.astype(jnp.float32) - p.astype(jnp.float32), hi, params)
    return diff, MantissaState(inner_state=inner, companion=lo)

  def apply(grads, state, params, ctx):
    rule = fusion.require_apply(tx, owner)
    check_bf16_params(owner, params)
    tracked = jax.tree.map(Tracked, params, state.companion)
    new, inner = rule.apply(grads, state.inner_state, tracked, ctx)
    hi = jax.tree.map(lambda x: x.hi if is_tracked(x) else x, new, is_leaf=is_tracked)
    lo = jax.tree.map(lambda x, c: x.lo if is_tracked(x) else c, new, state.companion,
                      is_leaf=is_tracked)
    return hi, MantissaState(inner_state=inner, companion=lo)

  out = fusion.with_in_place(optax.GradientTransformationExtraArgs(init_fn, update_fn),
                             fusion.InPlace("mantissa", apply=apply))
  # What the wrapped transform carries for inspection stays reachable.
  for attr in ("fuseopt_adam",):
    if hasattr(tx, attr):
      setattr(out, attr, getattr(tx, attr))
  out.fuseopt_inner = tx
  return out


def with_bf16_params(tx, bf16_params: str, owner: str):
  """``tx`` as it is (``"stochastic"``) or wrapped in :func:`track_mantissa`."""
  check_mode(owner, bf16_params)
  return tx if bf16_params == "stochastic" else track_mantissa(tx, owner)


def master_params(params, state):
  """The fp32 master parameters of ``params`` under optimizer ``state``.

  Finds the :class:`MantissaState` in ``state`` (at any depth: inside a
  chain, a ``skip_nonfinite`` or ``MultiSteps`` wrapper...) and joins its
  companions to ``params``. Without one (``bf16_params="stochastic"``) the
  params are returned widened to fp32.
  """
  found = [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, MantissaState))
           if isinstance(s, MantissaState)]
  if not found:
    return jax.tree.map(lambda p: jnp.asarray(p).astype(jnp.float32), params)
  if len(found) > 1:
    raise ValueError("master_params: the state holds several MantissaStates; pass the one "
                     "of the optimizer that owns these params")
  return _masters(params, found[0].companion)
