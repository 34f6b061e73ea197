"""NorMuon's per-neuron normalisation of an orthogonalised update.

NorMuon (Li et al. 2025, "NorMuon: Making Muon more efficient and scalable",
arXiv 2510.05491) keeps, for every output neuron of a matrix (an output
column of the ``(rows = fan-in, cols = fan-out)`` matrix, one row of the
paper's ``W`` in ``y = W x``), an exponential average of the mean square of
its row of the Newton-Schulz output ``O``:

.. math::
  v_j \\leftarrow \\beta_2 v_j + (1-\\beta_2)\\,\\tfrac{1}{\\text{rows}}\\textstyle\\sum_i O_{ij}^2,
  \\qquad \\hat O_{ij} = O_{ij} / (\\sqrt{v_j} + \\varepsilon)

and rescales :math:`\\hat O` so that its Frobenius norm is that of an exactly
orthogonal matrix of the same shape, :math:`\\sqrt{\\min(\\text{rows}, \\text{cols})}`:
the update then has Muon's RMS, and Muon's width scaling (or
``consistent_rms``) applies unchanged. With ``consistent_rms=0.2`` this is
the paper's ``0.2 sqrt(mn) / ||Ô||_F``.

Only the column sums of squares are read from the matrix (computed where the
matrix is whole, with the Newton-Schulz result); the norm of :math:`\\hat O`
follows from them (:math:`\\sum_j \\text{colsum}_j / (\\sqrt{v_j}+\\varepsilon)^2`),
so the normalisation is one per-column factor folded into the pass that
writes the parameter.

Layouts: the statistics are ``(batch, cols)`` in the Newton-Schulz layout
(:func:`fuseopt.optim.matrix_views.split`'s); the state ``v`` of a leaf has
the leaf's shape without its reduction axes (``(cols,)`` for a 2-D weight,
``(layers, cols)`` for a stacked one). A leaf of matrix views keeps one
``v_j`` per output neuron of each view: views cut along an output axis share
the leaf's layout (each column belongs to one view); views cut along a
reduction axis keep that axis with one entry per view (``groups *
len(sizes)``), since every view has all the leaf's output neurons.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from fuseopt.kernels import fp_contract
from fuseopt.kernels.newton_schulz import layout

__all__ = ["column_sums", "from_matrix", "normalize", "normalize_views", "state_shape",
           "to_matrix"]


def column_sums(y) -> jax.Array:
  """fp32 sums of squares over the rows of each ``(batch, rows, cols)`` matrix.

  Summed as a fixed pairwise tree (the lower half of the rows added to the
  upper half, elementwise, until one row is left; an odd count gets a zero
  row), not by a reduction: XLA tiles a reduction by the whole shape, so the
  same matrix's sums came out differently in a batch of 8 and a batch of 2
  on the CPU. The tree's order is the matrix's own, whatever the batch, so
  the sharded step (a few matrices a device) sums as the unsharded one."""
  s = y.astype(jnp.float32)
  return _pairwise_sum(fp_contract.rounded(s * s), axis=1)


def _pairwise_sum(s, axis: int):
  """Sum over ``axis`` as a fixed pairwise tree of elementwise adds. The
  caller rounds product terms first (:func:`fuseopt.kernels.fp_contract.rounded`),
  so no compiler fuses a product into an add (a fused multiply-add rounds
  once, and XLA may fuse in one program and not in another)."""
  s = jnp.moveaxis(s, axis, 0)
  while s.shape[0] > 1:
    if s.shape[0] % 2:
      s = jnp.concatenate([s, jnp.zeros_like(s[:1])], axis=0)
    half = s.shape[0] // 2
    s = s[:half] + s[half:]
  return s[0]


def state_shape(shape, views: layout.Views) -> tuple[int, ...]:
  """The shape of a leaf's ``v``: the leaf's without its reduction axes (a
  view axis among them stays, one entry per view)."""
  stat = views.statistic_shape(shape)
  return tuple(d for a, d in enumerate(stat) if a not in views.red or a == views.axis)


def _keepdims_shape(shape, red):
  return tuple(1 if a in red else d for a, d in enumerate(shape))


def to_matrix(x, shape, red, out) -> jax.Array:
  """A per-neuron array in the leaf's layout (``shape`` with the reduction
  axes removed, or kept at size 1) as ``(batch, cols)``."""
  ndim = len(shape)
  x = jnp.reshape(x, _keepdims_shape(shape, red))
  perm = layout.permutation(ndim, red, out)
  if not layout.is_identity(perm):
    x = jnp.transpose(x, perm)
  batch = math.prod(shape[a] for a in layout.batch_axes(ndim, red, out))
  return jnp.reshape(x, (batch, math.prod(shape[a] for a in out)))


def from_matrix(m, shape, red, out, *, keepdims: bool) -> jax.Array:
  """The inverse of :func:`to_matrix`: ``(batch, cols)`` back to the leaf's
  layout, the reduction axes of size 1 (``keepdims``) or removed."""
  ndim = len(shape)
  perm = layout.permutation(ndim, red, out)
  kshape = _keepdims_shape(shape, red)
  x = jnp.reshape(m, tuple(kshape[a] for a in perm))
  if not layout.is_identity(perm):
    x = jnp.transpose(x, layout.inverse(perm))
  return x if keepdims else jnp.reshape(x, state_shape(shape, red))


def normalize(colsum, v_old, *, rows: int, cols: int, b2, eps):
  """``(scale, v_new)``, both ``(batch, cols)`` fp32: the per-column factor
  that turns the NS output ``O`` into NorMuon's update (``O * scale``, before
  Muon's width scaling) and the new second moment."""
  # Each product rounded before its add (fp_contract), and the norm summed as
  # a fixed tree: the same bits in the sharded step's replicated computation
  # as in the unsharded step's, whatever each compiler fuses (_pairwise_sum).
  r_ = fp_contract.rounded
  v_new = r_(b2 * v_old.astype(jnp.float32)) + r_((1 - b2) * (colsum / rows))
  d = 1.0 / (jnp.sqrt(v_new) + eps)
  norm2 = _pairwise_sum(r_(colsum * (d * d)), axis=1)[:, None]
  # A zero matrix has a zero update whatever the factor: keep it finite.
  tiny = jnp.finfo(jnp.float32).tiny
  r = math.sqrt(min(rows, cols)) * jax.lax.rsqrt(jnp.maximum(norm2, tiny))
  return d * r, v_new


def normalize_views(stat, v_old, *, views: layout.Views, shape, b2, eps):
  """:func:`normalize` for every view of a leaf of ``shape``: ``stat`` (the
  column sums of squares) and ``v_old`` in the statistic layout of
  :class:`~fuseopt.kernels.newton_schulz.layout.Views`; returns ``(scale,
  v_new)`` in that layout. Each view is normalised as the matrix it is."""
  sv = views.statistic()
  red, out = views.piece_axes()
  scales, moments = [], []
  for c, v, pshape in zip(sv.split(stat), sv.split(v_old), views.piece_shapes(shape)):
    rows = math.prod(pshape[a] for a in red)
    cols = math.prod(pshape[a] for a in out)
    s, vn = normalize(to_matrix(c, pshape, red, out), to_matrix(v, pshape, red, out),
                      rows=rows, cols=cols, b2=b2, eps=eps)
    scales.append(from_matrix(s, pshape, red, out, keepdims=True))
    moments.append(from_matrix(vn, pshape, red, out, keepdims=True))
  return sv.merge(scales), sv.merge(moments)
