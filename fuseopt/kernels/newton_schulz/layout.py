"""How a leaf holds a family of matrices: its axes read as (batch, reduction,
output).

A leaf's reduction axes form a matrix's rows, its output axes the columns,
and every other axis is a batch axis; the family is the leaf transposed to
``batch + reduction + output`` order and reshaped to ``(b, rows, cols)``.
Muon's matrix views and the distributed Newton–Schulz both read leaves this
way.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp


def batch_axes(ndim: int, red: Sequence[int], out: Sequence[int]) -> tuple[int, ...]:
  """The axes of a rank-``ndim`` leaf that are neither reduction nor output axes."""
  return tuple(a for a in range(ndim) if a not in red and a not in out)


def permutation(ndim: int, red: Sequence[int], out: Sequence[int]) -> tuple[int, ...]:
  """The transpose that puts a leaf's axes in (batch, reduction, output) order."""
  return batch_axes(ndim, red, out) + tuple(red) + tuple(out)


def inverse(perm: Sequence[int]) -> tuple[int, ...]:
  """The transpose that undoes ``perm``."""
  return tuple(sorted(range(len(perm)), key=perm.__getitem__))


def is_identity(perm: Sequence[int]) -> bool:
  return tuple(perm) == tuple(range(len(perm)))


class Views(NamedTuple):
  """How a leaf holds its matrices: reduction and output axes, and
  optionally one of them cut along its length into several matrices (views).

  Axis ``axis`` (one of ``red`` or ``out``; ``None``: no views) has length
  ``groups * sum(sizes)``. It is read as ``(groups, sum(sizes))``: the group
  index becomes a batch axis and the second factor is cut into
  ``len(sizes)`` consecutive chunks, one piece of the leaf each. A piece is
  a family of matrices in the *grouped* layout (the leaf's shape with
  ``axis`` replaced by ``(groups, size)``). Without views the leaf is one
  piece, itself. Every function here works on a local shard too, as long as
  the shard holds whole groups along ``axis``: the group count is read from
  the array, not from ``groups``.
  """
  red: tuple[int, ...]
  out: tuple[int, ...]
  axis: int | None = None
  sizes: tuple[int, ...] = ()
  groups: int = 1

  @property
  def period(self) -> int:
    return sum(self.sizes)

  def piece_axes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A piece's ``(reduction axes, output axes)``, in the grouped layout."""
    if self.axis is None:
      return tuple(self.red), tuple(self.out)
    shift = lambda axes: tuple(b + 1 if b >= self.axis else b for b in axes)
    return shift(self.red), shift(self.out)

  def grouped_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
    """``shape`` with ``axis`` read as ``(groups, period)``."""
    shape = tuple(shape)
    if self.axis is None:
      return shape
    a = self.axis
    return shape[:a] + (shape[a] // self.period, self.period) + shape[a + 1:]

  def piece_shapes(self, shape: Sequence[int]) -> list[tuple[int, ...]]:
    """The grouped-layout shape of each piece of an array of ``shape``."""
    g = self.grouped_shape(shape)
    if self.axis is None:
      return [g]
    a = self.axis
    return [g[:a + 1] + (s,) + g[a + 2:] for s in self.sizes]

  def split(self, x) -> list:
    """The pieces of ``x`` (in the grouped layout)."""
    if self.axis is None:
      return [x]
    xg = jnp.reshape(x, self.grouped_shape(x.shape))
    out, offset = [], 0
    for s in self.sizes:
      out.append(jax.lax.slice_in_dim(xg, offset, offset + s, axis=self.axis + 1))
      offset += s
    return out

  def merge(self, parts) -> jax.Array:
    """The inverse of :meth:`split`: pieces back into one array."""
    if self.axis is None:
      return parts[0]
    a = self.axis
    y = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=a + 1)
    return jnp.reshape(y, y.shape[:a] + (y.shape[a] * y.shape[a + 1],) + y.shape[a + 2:])

  def statistic(self) -> "Views":
    """The views of a per-output-column statistic of this leaf (NorMuon's
    column sums, its second moment) kept in the leaf's layout with each
    reduction axis of size 1: a view axis on the output side keeps its
    chunks; one on the reduction side keeps one entry per chunk (each view
    has its own statistic)."""
    if self.axis is None or self.axis in self.out:
      return self
    return self._replace(sizes=(1,) * len(self.sizes))

  def statistic_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
    """The shape of :meth:`statistic`'s array for a leaf of ``shape``."""
    return tuple(
        (self.groups * len(self.sizes) if a == self.axis else 1) if a in self.red else d
        for a, d in enumerate(shape))

  def expand(self, stat) -> jax.Array:
    """A statistic-layout array broadcastable against the leaf: a view axis
    on the reduction side repeats each chunk's entry over the chunk's rows."""
    if self.axis is None or self.axis in self.out:
      return stat
    a = self.axis
    parts = self.statistic().split(stat)
    return self.merge([jnp.broadcast_to(p, p.shape[:a + 1] + (s,) + p.shape[a + 2:])
                       for p, s in zip(parts, self.sizes)])
