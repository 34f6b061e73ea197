"""flax nnx: an optimizer that takes fuseopt's fused step, and Muon's split from a model.

``nnx.Optimizer.update`` always runs ``tx.update`` and ``optax.apply_updates``
(an updates tree the size of the parameters, then a second pass to add it).
:class:`Optimizer` is the same class with ``update`` running
:func:`fuseopt.optim.step` instead: for :func:`fuseopt.optim.adam` /
:func:`fuseopt.optim.adamw` one pass per leaf that reads p, g, mu, nu once and
writes p, mu, nu once; any other transformation falls back to
``tx.update`` + ``optax.apply_updates``, so it takes every optax or fuseopt
transformation, the builder's solvers included::

  model = MyModel(nnx.Rngs(0))
  optimizer = fuseopt.nnx.Optimizer(model, fuseopt.optim.adamw(3e-4), wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss

Its state is ``nnx.Optimizer``'s (``step``, ``opt_state``), so checkpoints of
one restore into the other. Parameter-group patterns
(:func:`fuseopt.optim.param_labels`) see nnx paths without the ``.value`` of
a ``Variable``, and :func:`fuseopt.optim.logical_axes` reads the names
``nnx.with_partitioning`` stores; :func:`muon_dimension_numbers` returns
Muon's split for a model. Requires flax (``pip install flax``; tested with
0.12). See docs/nnx.md.
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from flax import nnx

from fuseopt.optim import muon_axes
from fuseopt.optim.step import step as fused_step

__all__ = ["Optimizer", "muon_dimension_numbers"]


class Optimizer(nnx.Optimizer):
  """``nnx.Optimizer`` whose :meth:`update` takes :func:`fuseopt.optim.step`.

  Constructed exactly as ``nnx.Optimizer(model, tx, wrt=...)``.
  """

  def update(self, model, grads, /, **kwargs) -> None:  # pylint: disable=arguments-differ
    """Updates ``model``'s parameters and the optimizer state in place.

    Args:
      model: the module whose ``wrt`` variables are updated.
      grads: the gradients from ``nnx.grad`` (same ``wrt`` filter).
      **kwargs: extra arguments of ``tx.update`` (e.g. MuonClip's
        ``qk_stats=``); with any, the step runs ``tx.update`` +
        ``optax.apply_updates`` (the fused step takes none).

    Unlike ``nnx.Optimizer.update`` it returns None: the fused step never
    builds an updates tree.
    """
    graph = getattr(self, "graph", None)
    params = nnx.as_pure(nnx.state(model, self.wrt, graph=graph))
    grads = nnx.as_pure(nnx.state(grads, self.wrt, graph=graph))
    opt_state = nnx.as_pure(self.opt_state)
    if kwargs:
      updates, new_state = self.tx.update(grads, opt_state, params, **nnx.as_pure(kwargs))
      new_params = optax.apply_updates(params, updates)
    else:
      new_params, new_state = fused_step(self.tx, grads, opt_state, params)
    nnx.update(model, new_params)
    # Leaf by leaf: nnx.state would turn NamedTuples inside the state (8-bit
    # moments' QuantizedMoment) into dicts.
    jax.tree.map(lambda var, x: var.set_value(x), self.opt_state, new_state,
                 is_leaf=lambda v: isinstance(v, nnx.Variable))
    self.step[...] += 1


def muon_dimension_numbers(model, wrt: Any = nnx.Param, **rules):
  """Muon's split of ``model``'s parameters, from the logical axis names they declare.

  Reads the names ``nnx.with_partitioning`` (Variable metadata
  ``out_sharding``) stored on each parameter and applies the rules of
  :func:`fuseopt.optim.muon_weight_dimension_numbers` (``rules``: its
  ``selection_axes``, ``batch_axes``, ``layer_axes``, ``head_axes``). The
  result (an ``nnx.State`` of ``MuonDimensionNumbers`` / None) goes to
  ``muon_weight_dimension_numbers=`` of :func:`fuseopt.optim.muon` (or
  ``optax.contrib.muon``).
  """
  return muon_axes.muon_weight_dimension_numbers(nnx.state(model, wrt), **rules)
