"""How a leaf holds a family of matrices: its axes read as (batch, reduction,
output).

A leaf's reduction axes form a matrix's rows, its output axes the columns,
and every other axis is a batch axis; the family is the leaf transposed to
``batch + reduction + output`` order and reshaped to ``(b, rows, cols)``.
Muon's matrix views and the distributed Newton–Schulz both read leaves this
way.
"""

from __future__ import annotations

from typing import Sequence


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
