"""Muon: momentum orthogonalised by Newton-Schulz, batched across the tree."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import optax


class MuonDimensionNumbers(NamedTuple):
  """Which axes of a weight form the matrix that Muon orthogonalises.

  The same fields as :class:`optax.contrib.MuonDimensionNumbers`: for
  ``y = x W`` the reduction axes are contracted with ``x`` and the output
  axes index ``y``; several axes on one side are flattened into one matrix
  dimension, and every other axis is an implicit batch axis (each index an
  independent matrix). fuseopt's transforms accept optax's instances too.
  """
  reduction_axis: Sequence[int] | int = 0
  output_axis: Sequence[int] | int = 1


DIMENSION_NUMBER_TYPES = (MuonDimensionNumbers, optax.contrib.MuonDimensionNumbers)
