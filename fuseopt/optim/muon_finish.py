r"""The finish stage of Muon's step: a leaf's orthogonalised matrices to its
update, one arithmetic whatever the layout the results come in.

.. math::
  u = \mathbb{1}[\text{active}]\;\cdot\; s \cdot d \cdot P(O)

with :math:`O` the Newton-Schulz result, :math:`P` an :class:`UpdatePiece`
(NorMuon's per-neuron normalisation; the identity without one), :math:`d`
optax's adaptive dual norm :math:`\langle \hat m, O \rangle` over the whole
leaf (``adaptive``; else 1), :math:`s` the width factor of each matrix
(:func:`width_scale`; ``shape_scaling``) and the mask zero on the matrices
of a stack of experts that no token reached.

A result comes in one of two layouts, each a small value that knows how its
parts sum, scale and merge back into the leaf: :class:`PiecesResult`, the
``(batch, rows, cols)`` pieces of batched calls on one device, and
:class:`LeafResult`, one array in the leaf's own layout from the all-to-all.
:func:`finish` and a piece's :meth:`UpdatePiece.finish` are written once,
against those few operations.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Protocol

import jax.numpy as jnp

from fuseopt.kernels import fp_contract
from fuseopt.optim import neuron_norm

__all__ = ["LeafResult", "PiecesResult", "UpdatePiece", "finish", "width_scale"]


class UpdatePiece(Protocol):
  """What acts on a Muon leaf's orthogonalised update before Muon's own
  finish (NorMuon's :class:`~fuseopt.optim.normuon_transforms.NeuronNorm`),
  with a state of its own beside Muon's momentum (a tree like it, in the
  field ``state_field`` of the direction's state).

  Its one hook, :meth:`finish`, sees a leaf's result through the operations
  of :class:`PiecesResult` and :class:`LeafResult`, whatever the layout.
  """

  state_field: str

  def init_state(self, count, mu, ns_coeffs, params, cuts):
    """The direction's state: ``count``, ``mu`` and ``ns_coeffs`` (Muon's)
    and the piece's field for ``params``, cut into matrices by ``cuts``
    (one a leaf, None where Muon passes it through)."""

  def wrap_ns(self, ns):
    """``ns``, returning beside each result what the piece reads of it where
    the matrices are whole (NorMuon: the column sums of squares)."""

  def finish(self, result, state, *, active, count, leaf_index):
    """``(parts, new state leaf)``: the result's parts with the piece
    applied (fp32), and the leaf's piece state after this step."""


class PiecesResult:
  """A leaf's results of batched calls: one ``(batch, rows, cols)`` result
  per piece (:func:`~fuseopt.optim.matrix_views.split`'s), the Newton-Schulz
  inputs beside them.

  Attributes:
    parts: the orthogonalised pieces.
    extras: what a piece's Newton-Schulz returned beside each part, or None.
    views: the leaf's geometry; ``shape`` its shape; ``placement`` None.
  """
  placement = None

  def __init__(self, pieces, merge, outputs, views, shape, extras=None):
    self._pieces, self._merge = pieces, merge
    self.parts, self.extras, self.views, self.shape = outputs, extras, views, shape

  def inner(self, ys):
    """:math:`\\langle \\hat m, y \\rangle` over the whole leaf."""
    return sum(jnp.sum(p.matrix * y) for p, y in zip(self._pieces, ys))

  def width_factor(self, k, y, width):
    """The width factor of part ``k`` (``y``), one scalar for its matrices."""
    return width(*y.shape[1:])

  def merge(self, ys):
    """The parts back in the leaf's layout."""
    return self._merge([p.unflatten(y) for p, y in zip(self._pieces, ys)])

  def statistic(self):
    """The column sums (``extras``) in the statistic layout of ``views``."""
    sv, (red, out) = self.views.statistic(), self.views.piece_axes()
    return sv.merge([neuron_norm.from_matrix(c, s, red, out, keepdims=True)
                     for c, s in zip(self.extras, self._statistic_shapes())])

  def per_neuron(self, factor):
    """Each part times ``factor`` (statistic layout), in fp32."""
    red, out = self.views.piece_axes()
    factors = self.views.statistic().split(factor)
    return [y.astype(jnp.float32) * neuron_norm.to_matrix(f, s, red, out)[:, None, :]
            for y, f, s in zip(self.parts, factors, self._statistic_shapes())]

  def _statistic_shapes(self):
    return self.views.statistic().piece_shapes(self.views.statistic_shape(self.shape))


class LeafResult:
  """A leaf's result of the all-to-all: one array in the leaf's layout, its
  views merged.

  Attributes:
    parts: ``[result]``.
    extras: ``[column sums in the statistic layout]`` or None.
    views, shape: the leaf's geometry and shape; ``placement`` where the
      leaf lives on the mesh.
  """

  def __init__(self, ns_input, output, views, shape, placement, extra=None):
    self._h = ns_input
    self.parts, self.extras = [output], None if extra is None else [extra]
    self.views, self.shape, self.placement = views, shape, placement

  def inner(self, ys):
    """:math:`\\langle \\hat m, y \\rangle` over the whole leaf."""
    return jnp.sum(self._h * ys[0])

  def width_factor(self, k, y, width):
    """The width factor of the leaf: a scalar where every view has the same
    fans, else each view's factor along the view axis, in ``y``'s dtype (cast
    as a scalar factor would be)."""
    red, out = self.views.piece_axes()
    fans = [(math.prod(p[a] for a in red), math.prod(p[a] for a in out))
            for p in self.views.piece_shapes(self.shape)]
    if len(set(fans)) == 1:
      return width(*fans[0])
    along = jnp.concatenate([jnp.broadcast_to(jnp.asarray(width(*f), y.dtype), (n,))
                             for f, n in zip(fans, self.views.sizes)])
    shape = [1] * y.ndim
    shape[self.views.axis] = y.shape[self.views.axis]
    return jnp.reshape(jnp.tile(along, self.views.groups), shape)

  def merge(self, ys):
    return ys[0]

  def statistic(self):
    return self.extras[0]

  def per_neuron(self, factor):
    f = self.views.expand(factor)
    return [self.parts[0].astype(jnp.float32) * f]


def width_scale(fan_in, fan_out, consistent_rms=None):
  """Muon's width factor of a ``(fan_in, fan_out)`` matrix: optax's
  ``sqrt(max(1, fan_out / fan_in))``, or ``sqrt(max(fan_in, fan_out)) *
  consistent_rms`` (Liu et al. 2025, arXiv 2502.16982)."""
  if consistent_rms is not None:
    return jnp.sqrt(jnp.maximum(fan_in, fan_out)) * consistent_rms
  return jnp.sqrt(jnp.maximum(1, fan_out / fan_in))


def finish(result, *, dtype, active, adaptive: bool, shape_scaling: bool,
           consistent_rms: Optional[Any] = None, piece: Optional[UpdatePiece] = None,
           piece_state=None, count=None, leaf_index=None):
  """A leaf's update from its Newton-Schulz ``result`` (the module
  docstring), in ``dtype``; returns ``(update, the piece's new state leaf)``."""
  new_state = None
  if piece is not None:
    ys, new_state = piece.finish(result, piece_state, active=active, count=count,
                                 leaf_index=leaf_index)
  else:
    ys = result.parts
  ys = [y.astype(dtype) for y in ys]
  if adaptive:
    # optax's dual-norm scale <mu_hat, NS(mu_hat)> over the whole leaf, before shape scaling.
    dual = result.inner(ys)
    ys = [fp_contract.rounded(dual * y) for y in ys]
  if shape_scaling:
    width = lambda fan_in, fan_out: width_scale(fan_in, fan_out, consistent_rms)
    # (rounded: the decay's add follows; fp_contract)
    ys = [fp_contract.rounded(result.width_factor(k, y, width) * y) for k, y in enumerate(ys)]
  u = result.merge(ys)
  if active is not None:
    u = jnp.where(active, u, jnp.zeros((), u.dtype))
  return u, new_state
