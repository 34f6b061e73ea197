"""bf16 parameters with a master: a companion per parameter in the optimizer state.

:func:`track_mantissa` wraps any of fuseopt's optimizers
(``track_mantissa(adamw(...))``, ``track_mantissa(muon(...), master_bits=24)``;
the builder's ``bf16_params="mantissa"`` / ``"mantissa24"`` does the same):
the bf16 parameters the model reads are the value nearest a master, and the
difference lives in the optimizer state as a companion tree shaped like the
params (:class:`MantissaState`; checkpoints keep it). Every update is
computed on the master in fp32 and split again
(:mod:`fuseopt.kernels.mantissa`):

- ``master_bits=32``: an int16 companion; the masters follow an fp32 run of
  the same optimizer bit for bit, at 2 bytes a parameter more than bf16
  parameters with stochastic rounding (the default: :func:`fuseopt.optim.step`
  writes bf16 parameters with the counter-hash stochastic rounding) and 2
  less than an fp32 master copy ("mantissa tracking", modded-nanogpt speedrun
  record #57, 2025);
- ``master_bits=24``: an int8 companion, 1 byte a parameter; each step's
  master is its fp32 result rounded to 15 mantissa bits (FlashOptim,
  arXiv 2602.23349, keeps an 8-bit error term beside bf16 weights). With
  8-bit moments: 3 + 2.03 bytes of parameters and state a parameter.

:func:`master_params` returns the fp32 masters of a state.

Gradients: bf16 parameters have bf16 gradients. Through ``update`` the
wrapped optimizer gets them widened to fp32 (:func:`widen`), each leaf made
once in memory, so its pass is the very program an fp32 run compiles for fp32
gradients of the same values (a compiler that contracts ``a*b + c*d`` into a
fused multiply-add picks which product to fuse per program, so a pass that
widens in registers may round a rare element otherwise); updates of a tracked
leaf are fp32 whatever the gradients' dtype (see :func:`track_mantissa`). In
:func:`fuseopt.optim.step` the Adam kernels widen a tracked leaf's gradient
in registers, and once in memory where XLA compiles the pass (the ``xla``
reference, interpret mode), :func:`fuseopt.kernels.adam_update`.

Composition: the wrapper runs inside :func:`optax.partition`,
:func:`optax.masked`, :func:`optax.chain` and the builder's ``frozen=`` /
``trainable=`` and parameter groups (a masked leaf is an
:class:`optax.MaskedNode` in the companion tree); the companion is created
with its parameter's sharding, so a sharded step treats it as the parameter.

In :func:`fuseopt.optim.step` the solver's kernels read and write both halves
in the one pass they make over the parameter: the rules below hand each solver
its parameters as :class:`Tracked` pairs.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fuseopt.kernels import mantissa as bits
from fuseopt.optim import _checks
from fuseopt.optim import fusion

__all__ = ["MASTER_BITS", "MantissaState", "Tracked", "check_bf16_params", "master_params",
           "track_mantissa"]

class MantissaState(NamedTuple):
  """The wrapped optimizer's state and the params' companions (int16 or int8)."""
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
  """fp32 ``x32`` into the storage of ``like``: a new pair for a pair (its
  companion's width kept)."""
  if is_tracked(like):
    return Tracked(*bits.split_once(x32, like.lo.dtype))
  return x32.astype(like.dtype)


# ``master_bits`` -> the companion that keeps such a master.
MASTER_BITS = {32: bits.EXACT, 24: bits.MASTER24}


_MASTER_BITS_VALUES = (f"one of {tuple(MASTER_BITS)} (32: an fp32 master, an int16 companion; "
                       f"24: a 24-bit master, an int8 companion)")


def companion_dtype_of(owner: str, master_bits) -> jnp.dtype:
  """The companion dtype of ``master_bits`` (32 or 24), checked: a Python
  int, or a concrete NumPy / jax integer scalar taken as its int. Anything
  else is a ``TypeError`` (a bool, a float, a list, an array that is not a
  scalar, a traced value), an int outside the two a ``ValueError``, each
  naming ``master_bits`` and both accepted values."""
  value = master_bits
  if isinstance(value, (jax.Array, np.ndarray, np.generic)) and not isinstance(
      value, (jax.core.Tracer, np.bool_)) and np.ndim(value) == 0 and jnp.issubdtype(
          jnp.result_type(value), jnp.integer):
    value = int(value)
  if isinstance(value, bool) or not isinstance(value, int):
    raise TypeError(f"{owner}: master_bits must be {_MASTER_BITS_VALUES}, a static int, got "
                    f"{master_bits!r}")
  if value not in MASTER_BITS:
    raise ValueError(f"{owner}: master_bits must be {_MASTER_BITS_VALUES}, got {master_bits!r}")
  return MASTER_BITS[value]


def _check_inner(owner: str, tx) -> None:
  """``tx`` must be an optax transformation that is not itself wrapped: a
  second companion would complete the first wrapper's fp32 masters, which
  are no bf16 parameters."""
  if not isinstance(tx, optax.GradientTransformation):
    raise TypeError(f"{owner}: tx must be an optax GradientTransformation (e.g. "
                    f"fuseopt.optim.adamw(...), fuseopt.optim.muon(...)), got {tx!r}")
  rule = fusion.in_place_rule(tx)
  if rule is not None and rule.name == "mantissa":
    raise ValueError(f"{owner}: tx is a track_mantissa(...) already; wrap the optimizer once "
                     f"(master_bits=32 for an fp32 master, 24 for a 24-bit one)")


def check_bf16_params(owner: str, params) -> None:
  """Every floating parameter must be bfloat16: the companion completes a
  bf16 half to fp32 and means nothing for another dtype."""
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    dtype = jnp.result_type(x)
    if jnp.issubdtype(dtype, jnp.floating) and dtype != jnp.bfloat16:
      raise ValueError(
          f"{owner}: exact bf16 parameters (a mantissa companion) need bfloat16 parameters, "
          f"but the leaf at {jax.tree_util.keystr(path) or '<root>'} is {dtype}; cast the "
          f"params to bfloat16, "
          f"or leave the optimizer unwrapped (fp32 parameters need no companion)")


def _idle(x) -> bool:
  """An integer or bool parameter: it has no companion (an
  :class:`optax.MaskedNode` in the companion tree) and passes through."""
  return not isinstance(x, optax.MaskedNode) and _checks.passes_through(x)


def _masters(params, companion):
  return jax.tree.map(lambda p, lo: p if _idle(p) else bits.join(p, lo), params, companion)


def widen(grads):
  """``grads`` with every floating leaf narrower than fp32 widened to fp32,
  each made once in memory (:func:`fuseopt.kernels.mantissa.widen_once`),
  so the wrapped optimizer's ``update`` is the program an fp32 run compiles
  for fp32 gradients of the same values."""
  return jax.tree.map(bits.widen_once, grads)


def _split(tree, companion_dtype):
  """fp32 masters as ``(bf16 halves, companions)``, two trees of the same
  structure (an integer leaf as it is, a MaskedNode for its companion)."""
  pairs = jax.tree.map(lambda x: x if _idle(x) else Tracked(*bits.split_once(x, companion_dtype)),
                       tree)
  return (jax.tree.map(lambda t: t.hi if is_tracked(t) else t, pairs, is_leaf=is_tracked),
          jax.tree.map(lambda t: t.lo if is_tracked(t) else optax.MaskedNode(), pairs,
                       is_leaf=is_tracked))


def _companions(params, companion_dtype):
  """Zero companions of ``params`` (each placed like its parameter: zeros_like
  keeps the sharding); a MaskedNode for an integer leaf."""
  return jax.tree.map(lambda p: optax.MaskedNode() if _idle(p)
                      else jnp.zeros_like(p, dtype=companion_dtype), params)


def track_mantissa(tx, master_bits: int = 32,
                   owner: str = "track_mantissa") -> fusion.FusedTransformation:
  """``tx`` run on fp32-class masters of bf16 parameters held as (bf16, companion) pairs.

  ``master_bits`` sets the companion's width (:mod:`fuseopt.kernels.mantissa`):

  - ``32`` (default): an int16 companion, 2 bytes a parameter; the masters
    are fp32 and follow an fp32 run of ``tx`` bit for bit;
  - ``24``: an int8 companion, 1 byte a parameter; each step's master is its
    fp32 result rounded to nearest (even) at 15 mantissa bits, within
    :math:`2^{-16}` of it relative (half a bf16 ulp / 256). An update below
    that is lost (round to nearest needs no seed, so every program that
    computes the same fp32 value stores the same master).

  The bf16 half the model reads is the value nearest the master. An integer
  or bool leaf (a step counter kept among the params) has no companion (an
  :class:`optax.MaskedNode` in the companion tree) and passes through: no
  update, ``tx``'s state for it as ``tx.init`` made it.

  ``init(params)`` (bf16 params) initialises ``tx`` on the params widened to
  fp32 (so its state is an fp32 run's) and zero companions, each placed like
  its parameter. ``update`` gives ``tx`` the masters as its params and the
  gradients widened to fp32 (:func:`widen`), applies its fp32 updates to the
  masters (:func:`optax.apply_updates`) and splits the result: the new
  companion goes into the state, and the returned update of each leaf is the
  fp32 difference ``new bf16 half - param``, whatever the gradients' dtype
  (not optax's "updates in the gradients' dtype": a bf16 update would round
  the step). :func:`optax.apply_updates` (and
  :func:`fuseopt.optim.apply_updates`) adds it back to the bf16 param exactly
  (both are bf16 values, so the fp32 difference is exact unless one step
  changes the parameter's magnitude by a factor of 2**16 or more), giving the
  new bf16 half; joined with the companion in the state it is the fp32
  master. The wrapper must therefore be the last piece to touch the updates
  (a piece after it would scale the difference). In
  :func:`fuseopt.optim.step` the solver's kernels do all of it in their own
  pass.
  """

  _check_inner(owner, tx)
  companion_dtype = companion_dtype_of(owner, master_bits)

  def init_fn(params):
    check_bf16_params(owner, params)
    wide = jax.tree.map(lambda p: p if _idle(p) else p.astype(jnp.float32), params)
    # zeros_like keeps the parameter's sharding (as the moments' zeros do), so
    # a sharded step finds the companion where its parameter is.
    return MantissaState(inner_state=tx.init(wide),
                         companion=_companions(params, companion_dtype))

  def update_fn(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError(f"{owner}: exact bf16 parameters need params; pass params= to update()")
    check_bf16_params(owner, params)
    masters = _masters(params, state.companion)
    u, inner = tx.update(widen(updates), state.inner_state, masters, **extra_args)
    hi, lo = _split(optax.apply_updates(masters, u), companion_dtype)
    # p + (hi - p) in fp32 is hi (both are bf16 values), and apply_updates'
    # cast back to bf16 keeps it.
    diff = jax.tree.map(lambda h, p: jnp.zeros_like(p) if _idle(p)
                        else h.astype(jnp.float32) - p.astype(jnp.float32), hi, params)
    return diff, MantissaState(inner_state=inner, companion=lo)

  def apply(grads, state, params, ctx):
    rule = fusion.require_apply(tx, owner)
    check_bf16_params(owner, params)
    tracked = jax.tree.map(lambda p, lo: p if _idle(p) else Tracked(p, lo), params,
                           state.companion)
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


def master_params(params, state):
  """The fp32 master parameters of ``params`` under optimizer ``state``.

  Finds every :class:`MantissaState` in ``state`` (at any depth: inside a
  chain, a partition's groups, ``optax.masked``, a ``skip_nonfinite`` or
  ``MultiSteps`` wrapper...) and joins each parameter to its companion. A
  leaf that no companion covers (an :class:`optax.MaskedNode` in every
  companion tree: a frozen leaf, another group's) and an integer or bool leaf
  are returned as they are.
  Without any (an optimizer not wrapped in :func:`track_mantissa`) the float
  params are returned widened to fp32.

  Raises:
    ValueError: ``params`` does not match a companion tree (naming the leaves
      one has and the other lacks, or the leaf whose shapes differ), or two
      companions cover the same leaf.
  """
  found = [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, MantissaState))
           if isinstance(s, MantissaState)]
  if not found:
    return jax.tree.map(lambda p: p if _idle(p) else jnp.asarray(p).astype(jnp.float32), params)
  p_paths, p_leaves = _paths(params)
  treedef = jax.tree.structure(params, is_leaf=_is_masked)
  covers = [_companion_leaves(p_paths, treedef, s.companion) for s in found]
  out = []
  for i, (path, p) in enumerate(zip(p_paths, p_leaves)):
    los = [] if _idle(p) else [c[i] for c in covers if not _is_masked(c[i])]
    if len(los) > 1:
      raise ValueError(f"master_params: {len(los)} companions in the state cover the leaf at "
                       f"{path}; pass the state of the optimizer that owns these params")
    if not los:
      out.append(p)
      continue
    (lo,) = los
    if jnp.shape(lo) != jnp.shape(p):
      raise ValueError(f"master_params: the leaf at {path} has shape {jnp.shape(p)}, its "
                       f"companion in the state {jnp.shape(lo)}; pass the params this state "
                       f"was made for")
    out.append(bits.join(p, lo))
  return treedef.unflatten(out)


def _is_masked(x) -> bool:
  return isinstance(x, optax.MaskedNode)


def _paths(tree):
  """``(key paths as strings, leaves)`` of ``tree``, a MaskedNode counting as a leaf."""
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_masked)[0]
  return [jax.tree_util.keystr(k) or "<root>" for k, _ in flat], [x for _, x in flat]


def _companion_leaves(p_paths, treedef, companion):
  """One entry per leaf of ``params``: its companion, or a MaskedNode.

  A tree that does not match raises a ValueError naming the leaves one tree
  has and the other lacks (jax's own error names neither)."""
  c_paths, _ = _paths(companion)
  if c_paths != p_paths:
    missing = [k for k in p_paths if k not in set(c_paths)]
    extra = [k for k in c_paths if k not in set(p_paths)]
    raise ValueError(
        "master_params: params do not match the companion tree in the state: "
        + "; ".join(filter(None, [
            missing and f"params have {', '.join(missing[:5])} that the state lacks",
            extra and f"the state has {', '.join(extra[:5])} that params lack",
            not (missing or extra) and f"params have the leaves {p_paths[:5]}, the state "
            f"{c_paths[:5]} (another order or nesting)"]))
        + "; pass the params this state was made for")
  try:
    return treedef.flatten_up_to(companion)
  except (ValueError, TypeError) as e:
    raise ValueError(f"master_params: params ({treedef}) do not match the companion tree in the "
                     f"state ({jax.tree.structure(companion)}): {e}") from None
