"""Decoupled weight decay, plain or cautious.

Cautious weight decay (Chen et al. 2025, "Cautious Weight Decay", arXiv
2510.12402) decays only the coordinates where the optimizer's update and the
parameter have the same sign:

.. math::
  p \\leftarrow p - \\eta\\,(u + \\lambda\\,\\mathbb{1}[u \\odot p \\ge 0] \\odot p)

so the decay never pushes against the update that is moving a weight away
from zero. It has no hyperparameter of its own (the same :math:`\\lambda`).

It is a piece of the decay, not a flag of the optimizers: a weight-decay
rate given as :func:`cautious` (``weight_decay=fo.cautious(0.1)``) decays
cautiously wherever that rate goes -- :func:`~fuseopt.optim.adamw`'s
``weight_decay``, the Muon family's ``weight_decay`` (its Muon side) and
``adam_weight_decay`` (its AdamW side), each on its own. The fused kernels
apply it as one select on the decay term (:func:`decay_term`);
:func:`add_cautious_decayed_weights` is the optax piece for the unfused chain.
"""

# No `from __future__ import annotations`: optax reads annotations of
# ScalarOrSchedule arguments as objects.
import dataclasses
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import optax

from fuseopt.kernels import fp_contract
from fuseopt.optim import _checks

__all__ = ["CautiousDecay", "add_cautious_decayed_weights", "add_decayed_weights", "cautious", "decay_term", "rate_at",
           "split_rate"]


@dataclasses.dataclass(frozen=True)
class CautiousDecay:
  """A weight-decay rate applied cautiously (:func:`cautious` makes one).

  ``rate`` is what the plain argument takes: a number or an optax schedule.
  Not a number itself, so :func:`optax.inject_hyperparams` keeps it static
  (a rate to trace is given plain).
  """
  rate: Any


def cautious(rate: optax.ScalarOrSchedule) -> CautiousDecay:
  """``rate`` as cautious weight decay: pass it where a weight-decay rate
  goes (``fo.adamw(1e-3, weight_decay=fo.cautious(0.1))``)."""
  if isinstance(rate, CautiousDecay):
    raise TypeError(f"cautious: the rate is cautious already: {rate!r}")
  return CautiousDecay(rate)


def split_rate(value) -> tuple[Any, bool]:
  """``(rate, is_cautious)`` of a weight-decay argument, plain or
  :class:`CautiousDecay`."""
  if isinstance(value, CautiousDecay):
    return value.rate, True
  return value, False


def decay_term(u, p, weight_decay, cautious: bool):
  """``weight_decay * p``, or with ``cautious`` zero where ``u * p < 0``.

  The select is on the parameter, before the multiply, as in the Adam
  kernels: the cautious decay adds a compare and a select, no pass. The
  product is rounded where it stands (:func:`fuseopt.kernels.fp_contract.rounded`):
  no compiler contracts it with the add that follows, so ``u + decay_term``
  has the same bits in every program (sharded or not, cautious or not).
  """
  if not cautious:
    return fp_contract.rounded(weight_decay * p)
  return fp_contract.rounded(weight_decay * jnp.where(u * p < 0, jnp.zeros((), p.dtype), p))


def rate_at(weight_decay, state):
  """``(rate, new state)`` of an :func:`optax.add_decayed_weights` state: a
  schedule read at the state's count and the count advanced, or the number."""
  if callable(weight_decay):
    return weight_decay(state.count), state._replace(count=optax.safe_increment(state.count))
  return weight_decay, state


def add_decayed_weights(
    weight_decay: optax.ScalarOrSchedule = 0.0,
    mask: Optional[Union[Any, Callable[[optax.Params], Any]]] = None,
    *, cautious: bool = False,
    gate: Optional[Callable[[Any], list]] = None,
) -> optax.GradientTransformation:
  """:func:`optax.add_decayed_weights` with its product rounded before the
  add (:func:`decay_term`): ``u + wd * p``, or with ``cautious``
  ``u + wd * 1[u*p >= 0] * p``.

  Same arguments and the same state as :func:`optax.add_decayed_weights`
  (a count where ``weight_decay`` is a schedule), so a chain that uses it has
  optax's structure and checkpoints interoperate. ``u`` is the incoming
  update (the optimizer's direction before the decay). A rate of zero
  returns the updates as they are (optax computes ``u + 0 * p``: the same
  bits for every finite ``p``); an integer parameter is never decayed (its
  update stays as it came: fuseopt's directions give it zero). ``gate``: None, or a function of the updates
  giving, for each of ``jax.tree.leaves(updates)``, None (every element
  decays) or a function of that leaf's update that is True where it decays
  (known only at the update: Muon's frozen experts).
  """
  plain = optax.add_decayed_weights(weight_decay)

  def update_fn(updates, state, params):
    if params is None:
      raise ValueError("add_decayed_weights: weight decay needs params; pass "
                       "params= to update()")
    wd, state = rate_at(weight_decay, state)
    if isinstance(wd, (int, float)) and wd == 0.0:
      return updates, state
    leaves, treedef = jax.tree.flatten(updates, is_leaf=lambda x: x is None)
    gates = iter(gate(updates) if gate is not None else [])
    out = []
    for u, p in zip(leaves, treedef.flatten_up_to(params)):
      if u is None or _checks.passes_through(p):   # an integer leaf: never decayed
        out.append(u)
        continue
      d = decay_term(u, p, wd, cautious)
      g = next(gates, None)
      out.append(u + (d if g is None else jnp.where(g(u), d, jnp.zeros((), p.dtype))))
    return treedef.unflatten(out), state

  tx = optax.GradientTransformation(plain.init, update_fn)
  return tx if mask is None else optax.masked(tx, mask)


def add_cautious_decayed_weights(
    weight_decay: optax.ScalarOrSchedule = 0.0,
    mask: Optional[Union[Any, Callable[[optax.Params], Any]]] = None,
) -> optax.GradientTransformation:
  """:func:`optax.add_decayed_weights`, cautious: ``u + wd * 1[u*p >= 0] * p``.

  Same arguments and the same state as :func:`optax.add_decayed_weights`
  (a count where ``weight_decay`` is a schedule), so a chain that uses it has
  the structure of the plain chain and checkpoints interoperate. ``u`` is the
  incoming update (the optimizer's direction before the decay).
  """
  return add_decayed_weights(weight_decay, mask, cautious=True)
