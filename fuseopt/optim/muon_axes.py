"""Which parameters Muon takes, and which of their axes form the matrix.

The hybrid Muon + AdamW split the labs converged on (Moonlight, Kimi K2,
Keller Jordan's modded-nanogpt): AdamW takes the embeddings, the LM head, the
router, the norms and the biases; Muon takes the hidden matrices. The split
and each matrix's reduction/output sides are read off the logical axis names
a module declares (the same names its sharding rules read), so one
declaration answers both questions.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from fuseopt.optim import groups as groups_lib
# optax's class (fuseopt re-exports it), so the result plugs into
# optax.contrib.muon and fuseopt.optim.muon alike.
from fuseopt.optim.matrix_views import MuonDimensionNumbers

__all__ = [
    "SELECTION_AXES",
    "BATCH_AXES",
    "LAYER_AXES",
    "HEAD_AXES",
    "MuonDimensionNumbers",
    "logical_axes",
    "muon_weight_dimension_numbers",
]

# Axes that index a discrete set (the vocabulary, the model's output space):
# a parameter with one of them is a lookup table or a classifier, not a
# linear map between hidden spaces, and AdamW takes it.
SELECTION_AXES = frozenset({"vocab", "output"})
# Axes that hold independent matrices (experts): each slice is
# orthogonalised on its own. A parameter whose *last* axis is one of these
# maps into the expert choice (a router) and AdamW takes it.
BATCH_AXES = frozenset({"exp"})
# Layer-stack axes (flax ``nn.scan`` / ``nn.vmap`` over layers): batch axes
# too, but a stack axis that happens to come last does not make a router.
LAYER_AXES = frozenset({"layers", "layer", "stack"})
# Axes that together form one side of a matrix: a kernel stored
# [embed, heads, head_dim] is the matrix [embed, heads * head_dim].
HEAD_AXES = frozenset({"heads", "head_dim", "kv"})


# optax.contrib.muon calls a callable spec with its masked updates, so
# optax.MaskedNode shows up among the leaves there.
_is_masked = groups_lib.is_masked


def _path_str(path) -> str:
  return groups_lib.path_str(path) or "<root>"


def _is_box(x) -> bool:
  """A flax-like metadata box (``nn.Partitioned``, ``LogicallyPartitioned``)."""
  return hasattr(x, "names") and hasattr(x, "value") and not isinstance(x, tuple)


def _is_names(x) -> bool:
  """An axes leaf: None, a tuple of axis names, a PartitionSpec of logical
  names, or an object carrying ``.names``."""
  if x is None or isinstance(x, jax.sharding.PartitionSpec):
    return True
  if hasattr(x, "names") and not isinstance(x, tuple):
    return True
  return isinstance(x, (tuple, list)) and all(n is None or isinstance(n, str) for n in x)


def _names_of(x, path) -> tuple[str | None, ...] | None:
  if x is None:
    return None
  if isinstance(x, jax.sharding.PartitionSpec):
    x = tuple(x)
  elif not isinstance(x, (tuple, list)):
    x = x.names
    if x is None:
      return None
  names = tuple(x)
  if not all(n is None or isinstance(n, str) for n in names):
    raise TypeError(f"muon_weight_dimension_numbers: axes at {path} must be a tuple of axis "
                    f"names (str or None), got {x!r}")
  return names


def logical_axes(params):
  """The logical axis names of a flax-like parameter tree with boxed metadata.

  Each leaf boxed in an object with ``.names`` and ``.value`` (flax's
  ``nn.Partitioned`` / ``nn.LogicallyPartitioned``, from
  ``nn.with_logical_partitioning``) becomes its ``names`` tuple; an unboxed
  leaf becomes None (undeclared). The result has the structure of the
  *unboxed* tree, the one an optimizer sees, so it can be passed as ``axes``
  to :func:`muon_weight_dimension_numbers`. flax itself is not imported.
  """
  return jax.tree.map(lambda x: tuple(x.names) if _is_box(x) else None, params, is_leaf=_is_box)


def _unbox(params):
  return jax.tree.map(lambda x: x.value if _is_box(x) else x, params, is_leaf=_is_box)


def _side(axes: list[int]):
  return axes[0] if len(axes) == 1 else tuple(axes)


def _dimension_numbers(path: str, leaf_name: str, shape, names, *, selection_axes,
                       batch_axes, layer_axes, head_axes):
  ndim = len(shape)
  if ndim < 2 or leaf_name == "bias":
    return None
  if names is None:
    if ndim == 2:  # Linen's kernel convention: x @ W contracts axis 0 into axis 1
      return MuonDimensionNumbers(reduction_axis=0, output_axis=1)
    raise ValueError(
        f"muon_weight_dimension_numbers: parameter {path} of shape {tuple(shape)} has rank {ndim} "
        "and declares no logical axes, so its matrix axes cannot be inferred; declare its axes "
        "(e.g. nn.with_logical_partitioning) or pass them in `axes`")
  if len(names) != ndim:
    raise ValueError(f"muon_weight_dimension_numbers: parameter {path} of shape {tuple(shape)} "
                     f"declares {len(names)} axes {names}, expected one name per axis ({ndim})")
  if any(n in selection_axes for n in names):
    return None
  if names[-1] in batch_axes:  # maps into the expert choice: a router
    return None
  stacked = batch_axes | layer_axes
  matrix = [i for i, n in enumerate(names) if n not in stacked]
  if len(matrix) < 2:  # a stack of vectors (per-layer norm scales, per-expert biases)
    return None
  sides: list[list[int]] = []
  for i in matrix:
    if sides and names[i] in head_axes and names[sides[-1][-1]] in head_axes:
      sides[-1].append(i)
    else:
      sides.append([i])
  if len(sides) != 2:
    raise ValueError(
        f"muon_weight_dimension_numbers: parameter {path} with axes {names} resolves to "
        f"{len(sides)} matrix sides {[tuple(names[i] for i in s) for s in sides]}, expected exactly "
        f"two (reduction, output) once batch axes {sorted(stacked)} are set aside and consecutive "
        f"head axes {sorted(head_axes)} are merged")
  return MuonDimensionNumbers(reduction_axis=_side(sides[0]), output_axis=_side(sides[1]))


def _as_frozenset(name, value) -> frozenset[str]:
  if isinstance(value, str) or not isinstance(value, Iterable):
    raise TypeError(f"muon_weight_dimension_numbers: {name} must be a collection of axis names, "
                    f"got {value!r}")
  return frozenset(value)


def muon_weight_dimension_numbers(
    params,
    axes: Any = None,
    *,
    selection_axes: Iterable[str] = SELECTION_AXES,
    batch_axes: Iterable[str] = BATCH_AXES,
    layer_axes: Iterable[str] = LAYER_AXES,
    head_axes: Iterable[str] = HEAD_AXES,
):
  """Build a MuonDimensionNumbers per parameter, None where AdamW steps in.

  The result plugs into ``muon_weight_dimension_numbers=`` of
  :func:`optax.contrib.muon` and :func:`fuseopt.optim.muon`. Rules, in order,
  for a parameter at ``path`` with logical axis names ``names``:

  1. rank < 2, or a leaf named ``bias`` -> None (AdamW);
  2. undeclared (``names`` None): rank 2 -> reduction 0, output 1 (Linen's
     kernel convention, ``y = x @ W``); higher rank -> ValueError naming the
     path, since the matrix axes cannot be guessed and orthogonalising the
     wrong pair only shows up as a worse loss curve;
  3. any axis in ``selection_axes`` (vocabulary, output space) -> AdamW
     (embeddings, LM head);
  4. a last axis in ``batch_axes`` (it maps into the expert choice: a
     router) -> AdamW;
  5. axes in ``batch_axes`` or ``layer_axes`` are batch axes: each slice is
     orthogonalised independently, they are neither reduction nor output.
     Fewer than two axes left (a stack of norm scales) -> AdamW;
  6. the remaining axes, in storage order, form sides: consecutive axes in
     ``head_axes`` merge into one side, every other axis is a side of its own,
     so [embed, heads, head_dim] is the matrix [embed, heads * head_dim] and
     [heads, head_dim, embed] is [heads * head_dim, embed]. Exactly two sides
     -> reduction = the first, output = the second; otherwise ValueError
     naming the path and the axes.

  A one-axis side is an int, a merged side a tuple of ints (optax's
  MuonDimensionNumbers takes both).

  References: Jordan et al., "Muon" (2024); Liu et al., "Muon is Scalable
  for LLM Training", arXiv 2502.16982; Kimi Team, "Kimi K2", arXiv
  2507.20534.

  Args:
    params: the parameter tree (arrays or anything with ``.shape``; flax
      boxes are unboxed). The result has its (unboxed) structure.
    axes: a tree shaped like ``params`` whose leaves are axis-name tuples
      or a ``PartitionSpec`` of logical names, None (undeclared), or
      flax-style boxes with a ``.names`` attribute. None reads the names off
      boxes in ``params`` (see :func:`logical_axes`).
    selection_axes, batch_axes, layer_axes, head_axes: the axis-name sets of
      the rules above; ``layer_axes`` names the layer-stack axes of a scanned
      model (default :data:`LAYER_AXES`).

  Returns:
    A tree of ``MuonDimensionNumbers`` / None with the structure of
    ``params``. Pass it as is, or pass
    ``functools.partial(muon_weight_dimension_numbers, axes=axes)`` as the
    callable form (optax's masked placeholders pass through).
  """
  rules = dict(selection_axes=_as_frozenset("selection_axes", selection_axes),
               batch_axes=_as_frozenset("batch_axes", batch_axes),
               layer_axes=_as_frozenset("layer_axes", layer_axes),
               head_axes=_as_frozenset("head_axes", head_axes))
  if axes is None:
    axes = logical_axes(params)
  params = _unbox(params)
  leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_masked)
  try:
    axes_leaves = treedef.flatten_up_to(axes)
  except (ValueError, TypeError) as e:
    raise ValueError(
        "muon_weight_dimension_numbers: `axes` must have the structure of `params` (one axis-name "
        f"tuple, box with .names, or None per parameter): {e}") from None
  out = []
  for (path, leaf), names in zip(leaves_with_path, axes_leaves):
    if _is_masked(leaf):
      out.append(leaf)
      continue
    path_s = _path_str(path)
    if not _is_names(names):
      raise ValueError(f"muon_weight_dimension_numbers: axes at {path_s} must be a tuple of axis "
                       f"names, a box with .names, or None (the structure of `params`), got {names!r}")
    names = _names_of(names, path_s)
    leaf_name = groups_lib.key_name(path[-1]) if path else ""
    shape = tuple(leaf.shape) if hasattr(leaf, "shape") else np.shape(leaf)
    out.append(_dimension_numbers(path_s, leaf_name, shape, names, **rules))
  return treedef.unflatten(out)
