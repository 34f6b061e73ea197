"""Matrix views: one stored tensor that holds several independent matrices.

Muon orthogonalises whole matrices, so a tensor that packs several of them
(gate and up projections side by side, MLA's ``kv_b_proj`` with each head's
key rows next to its value rows) must be split before Newton-Schulz and put
back afterwards. A view is only an index map: the parameter and its
optimizer state stay one stored tensor; the split happens on the momentum
inside the jitted update (XLA fuses the slices into the producer of the
Newton-Schulz input) and the pieces of the update are written back into one
leaf.

Three ways to say "k matrices in one tensor":

* A packed leading axis, e.g. gate/up stored as ``(2, rows, cols)``: nothing
  to declare, an axis that is neither a reduction nor an output axis of the
  :class:`~fuseopt.optim.muon.MuonDimensionNumbers` is a batch axis and each
  index along it is orthogonalised on its own
  (``MuonDimensionNumbers(reduction_axis=1, output_axis=2)``).
* Matrices concatenated along one matrix axis, e.g. ``[gate | up]`` stored as
  ``(rows, 2 * cols)``: ``MatrixViews(MuonDimensionNumbers(0, 1), axis=1,
  sizes=(cols, cols))``.
* A periodic split, e.g. MLA's ``kv_b_proj`` of shape
  ``(kv_lora_rank, heads * (qk_nope_head_dim + v_head_dim))`` where the
  output axis runs over heads and, within a head, key columns then value
  columns: ``mla_kv_b_proj_views(heads, qk_nope_head_dim, v_head_dim)`` views
  it as ``2 * heads`` matrices (one key block and one value block per head).

Shared projections (MLA's latent down-projections ``q_a_proj``/``kv_a_proj``,
the output projection) are plain matrices and stay whole.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

import optax

from fuseopt.kernels.newton_schulz import layout


# optax's own class, re-exported: a tree of dimension numbers then plugs into
# optax.contrib.muon (which checks isinstance) and fuseopt's Muon alike. For
# ``y = x W`` the reduction axes are contracted with ``x`` and the output axes
# index ``y``; several axes on one side are flattened into one matrix
# dimension; every other axis is an implicit batch axis.
MuonDimensionNumbers = optax.contrib.MuonDimensionNumbers

DIMENSION_NUMBER_TYPES = (MuonDimensionNumbers,)


class MatrixViews(NamedTuple):
  """Declares that a weight holds several independent matrices.

  Axis ``axis`` (one of the reduction or output axes of
  ``dimension_numbers``) has length ``groups * sum(sizes)``; it is read as
  ``(groups, sum(sizes))`` and cut into ``len(sizes)`` consecutive chunks of
  the given sizes. Every (group, chunk) pair, times every index of the batch
  axes, is one matrix that Muon orthogonalises on its own; its fan-in and
  fan-out (for the width or consistent-RMS scaling) are those of the chunk.

  Attributes:
    dimension_numbers: the weight's :class:`MuonDimensionNumbers` (optax's
      are accepted too).
    axis: the axis to split.
    sizes: the chunk lengths within one group.
    groups: how many times the ``sizes`` pattern repeats along ``axis`` (for
      example the number of heads); the group index becomes a batch axis.
  """
  dimension_numbers: MuonDimensionNumbers = MuonDimensionNumbers()
  axis: int = 1
  sizes: tuple[int, ...] = ()
  groups: int = 1


class Experts(NamedTuple):
  """Declares that a weight is a stack of expert matrices (mixture of experts).

  ``spec`` (:class:`MuonDimensionNumbers` or :class:`MatrixViews`) cuts the
  weight into matrices as it would alone; each index of its batch axes is
  one expert. An expert whose gradient is all zero this step -- one no token
  was routed to -- is frozen: it keeps its momentum (and NorMuon's second
  moment) and gets no update and no weight decay. optax's rule decays the
  momentum and the weight of such an expert; a weight not declared
  ``Experts`` keeps optax's rule.
  """
  spec: MuonDimensionNumbers | MatrixViews = MuonDimensionNumbers()


def mla_kv_b_proj_views(num_heads: int, qk_nope_head_dim: int, v_head_dim: int, *,
                        reduction_axis: int = 0, output_axis: int = 1) -> MatrixViews:
  """Views of MLA's ``kv_b_proj`` (DeepSeek-V2/V3): per head, the key rows
  (``qk_nope_head_dim`` outputs) and the value rows (``v_head_dim`` outputs)
  are separate matrices. The output axis must run over heads, each head's key
  outputs before its value outputs, as in DeepSeek's reference code.
  """
  return MatrixViews(MuonDimensionNumbers(reduction_axis, output_axis), axis=output_axis,
                     sizes=(qk_nope_head_dim, v_head_dim), groups=num_heads)


def _norm_axes(axes, ndim: int, what: str) -> tuple[int, ...]:
  axes = (axes,) if isinstance(axes, int) else tuple(axes)
  out = []
  for a in axes:
    if not -ndim <= a < ndim:
      raise ValueError(f"{what}: axis {a} is out of range for a rank-{ndim} weight")
    out.append(a % ndim)
  return tuple(out)


def normalize_dimension_numbers(dims, shape: Sequence[int], path: str = "") -> tuple[tuple[int, ...], tuple[int, ...]]:
  """``(reduction_axes, output_axes)`` as non-negative ints, validated."""
  ndim = len(shape)
  where = f"weight {path} of shape {tuple(shape)}" if path else f"weight of shape {tuple(shape)}"
  if ndim < 2:
    raise ValueError(f"Muon: {where} has rank {ndim}; Muon needs rank >= 2 (use AdamW for it)")
  red = _norm_axes(dims.reduction_axis, ndim, f"{where}: reduction_axis")
  out = _norm_axes(dims.output_axis, ndim, f"{where}: output_axis")
  if not red or not out:
    raise ValueError(f"Muon: {where}: reduction_axis and output_axis must be non-empty, got {dims}")
  if set(red) & set(out) or len(set(red)) != len(red) or len(set(out)) != len(out):
    raise ValueError(f"Muon: {where}: reduction axes {red} and output axes {out} must be distinct")
  return red, out


class Piece(NamedTuple):
  """One family of matrices read from a leaf: ``(batch, rows, cols)``."""
  matrix: jax.Array
  unflatten: Callable[[jax.Array], jax.Array]  # (batch, rows, cols) -> the piece's own layout


def _flatten(x, red, out) -> Piece:
  batch = layout.batch_axes(x.ndim, red, out)
  perm = layout.permutation(x.ndim, red, out)
  size = lambda axes: math.prod(x.shape[a] for a in axes)
  flat_shape = (size(batch), size(red), size(out))
  perm_shape = tuple(x.shape[a] for a in perm)
  inv = layout.inverse(perm)
  identity = layout.is_identity(perm)
  matrix = jnp.reshape(x if identity else jnp.transpose(x, perm), flat_shape)

  def unflatten(y):
    y = jnp.reshape(y, perm_shape)
    return y if identity else jnp.transpose(y, inv)
  return Piece(matrix, unflatten)


def geometry(spec, shape: Sequence[int], path: str = "") -> layout.Views:
  """How a leaf of ``shape`` declared with ``spec`` (dimension numbers or
  :class:`MatrixViews`) holds its matrices, validated: the reduction and
  output axes as non-negative ints and the view cut, if any. The
  distributed Newton-Schulz reads the same geometry to split each shard."""
  if isinstance(spec, DIMENSION_NUMBER_TYPES):
    return layout.Views(*normalize_dimension_numbers(spec, shape, path))
  if not isinstance(spec, MatrixViews):
    raise TypeError(f"Muon: weight {path}: expected MuonDimensionNumbers or MatrixViews, got {spec!r}")
  shape = tuple(shape)
  red, out = normalize_dimension_numbers(spec.dimension_numbers, shape, path)
  ndim = len(shape)
  a = spec.axis % ndim if -ndim <= spec.axis < ndim else None
  if a is None or (a not in red and a not in out):
    raise ValueError(f"Muon: weight {path}: MatrixViews.axis={spec.axis} must be one of the "
                     f"reduction axes {red} or output axes {out}")
  sizes = tuple(int(s) for s in spec.sizes)
  if not sizes or min(sizes) <= 0 or spec.groups <= 0:
    raise ValueError(f"Muon: weight {path}: MatrixViews needs positive sizes and groups, "
                     f"got sizes={spec.sizes}, groups={spec.groups}")
  period = sum(sizes)
  if shape[a] != spec.groups * period:
    raise ValueError(f"Muon: weight {path} of shape {shape}: axis {a} has length {shape[a]}, "
                     f"expected groups*sum(sizes) = {spec.groups}*{period}")
  return layout.Views(red, out, a, sizes, int(spec.groups))


def split(x: jax.Array, spec, path: str = "") -> tuple[list[Piece], Callable[[list[jax.Array]], jax.Array]]:
  """Cuts ``x`` into matrix families by ``spec`` (dimension numbers or
  :class:`MatrixViews`); returns the pieces and a function that puts the
  pieces' results (in the pieces' own layouts) back into ``x``'s shape."""
  views = geometry(spec, x.shape, path)
  red, out = views.piece_axes()
  return [_flatten(p, red, out) for p in views.split(x)], views.merge


def unwrap_experts(spec):
  """``(spec, is_experts)``: the cut of a leaf's spec, and whether it was
  declared :class:`Experts`."""
  if isinstance(spec, Experts):
    if not isinstance(spec.spec, DIMENSION_NUMBER_TYPES + (MatrixViews,)):
      raise TypeError(f"Muon: Experts.spec must be MuonDimensionNumbers or MatrixViews, got "
                      f"{spec.spec!r}")
    return spec.spec, True
  return spec, False


def base_dimension_numbers(spec):
  """The dimension numbers under a spec (views or not)."""
  return spec.dimension_numbers if isinstance(spec, MatrixViews) else spec


def active(x: jax.Array, spec) -> jax.Array:
  """For each matrix of ``x`` (each index of its batch axes under ``spec``),
  True where its entries are not all zero; the matrix axes kept at size 1.
  On a gradient: the experts of an :class:`Experts` leaf that a token
  reached this step; on an update: those that moved."""
  red, out = normalize_dimension_numbers(base_dimension_numbers(spec), (1,) * x.ndim)
  return jnp.any(x != 0, axis=red + out, keepdims=True)
