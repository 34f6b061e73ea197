"""Which parameters Muon takes, and which of their axes form the matrix.

The hybrid Muon + AdamW split the labs converged on (Moonlight, Kimi K2,
Keller Jordan's modded-nanogpt): AdamW takes the embeddings, the LM head, the
router, the norms and the biases; Muon takes the hidden matrices. The split
and each matrix's reduction/output sides are read off the logical axis names
a module declares (the same names its sharding rules read), so one
declaration answers both questions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from fuseopt.kernels.sharding import longest_prefix
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
    "align_to",
    "logical_axes",
    "logical_axes_dimension_numbers",
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


def _is_variable(x) -> bool:
  """A flax nnx ``Variable`` (``nnx.Param``...): a box whose metadata may hold
  the logical axis names. Recognised by its API, so flax is never imported."""
  return (callable(getattr(type(x), "get_metadata", None)) and hasattr(x, "get_value")
          and not isinstance(x, tuple))


def _is_box(x) -> bool:
  """A flax-like metadata box (``nn.Partitioned``, ``LogicallyPartitioned``)
  or an nnx ``Variable``."""
  if _is_variable(x):
    return True
  return hasattr(x, "names") and hasattr(x, "value") and not isinstance(x, tuple)


# Where nnx keeps a Variable's logical axis names: ``out_sharding`` (flax
# 0.12, set by ``nnx.with_partitioning``), ``sharding_names`` and
# ``sharding`` (earlier releases).
_NNX_SHARDING_KEYS = ("out_sharding", "sharding_names", "sharding")


def _box_names(x):
  """A box's axis names as a tuple, or None when it declares none."""
  if _is_variable(x):
    meta = x.get_metadata()
    names = next((meta[k] for k in _NNX_SHARDING_KEYS if meta.get(k) is not None), None)
    if names is None:
      return None
    names = getattr(names, "spec", names)  # a NamedSharding: its PartitionSpec
    return tuple(names)
  return None if x.names is None else tuple(x.names)


def _box_value(x):
  return x.get_value() if _is_variable(x) else x.value


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

  flax nnx: the state of a model (``nnx.state(model, nnx.Param)``) holds
  ``Variable`` leaves; the names are those ``nnx.with_partitioning`` (or
  ``nnx.with_metadata(..., out_sharding=...)``) stored in their metadata.
  """
  return jax.tree.map(lambda x: _box_names(x) if _is_box(x) else None, params, is_leaf=_is_box)


def _unbox(params):
  return jax.tree.map(lambda x: _box_value(x) if _is_box(x) else x, params, is_leaf=_is_box)


def _path_key(path) -> tuple[str, ...]:
  """A key path as a tuple of strings, without the trailing ``.value`` of an
  nnx Variable, so that a Variable-holding state and its pure arrays (the
  two forms ``nnx.Optimizer`` hands to ``init`` and ``update``) agree."""
  keys = [groups_lib.key_name(k) for k in path]
  if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and keys[-1] == "value":
    keys.pop()
  return tuple(keys)


def align_to(specs, tree, is_leaf: Callable[[Any], bool]):
  """``specs`` (a tree or a prefix of one) laid out with ``tree``'s containers.

  A plain dict of per-parameter specs (dimension numbers, axis names) and an
  ``nnx.State`` (or any other mapping-like pytree) with the same keys are
  different pytrees to jax; this matches them by key path instead, so a
  dict written by hand works on nnx state. A spec at a path applies to every
  leaf below it (optax's prefix rule). ``specs`` already shaped like
  ``tree`` comes back unchanged; a leaf of ``tree`` without a spec, or a
  spec below a leaf of ``tree``, raises a ``ValueError`` naming its path.
  """
  if is_leaf(specs):
    return specs
  try:
    jax.tree.map(lambda s, _: s, specs, tree, is_leaf=is_leaf)
    return specs
  except (ValueError, TypeError, KeyError):
    pass
  table = {_path_key(kp): s for kp, s in
           jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_leaf)[0]}
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_masked)
  out, used = [], set()
  for kp, leaf in leaves:
    if _is_masked(leaf):
      out.append(leaf)
      continue
    key = _path_key(kp)
    prefix = longest_prefix(table, key)
    if prefix is None:
      raise ValueError(f"no entry for parameter {'/'.join(key) or '<root>'}")
    used.add(prefix)
    out.append(table[prefix])
  extra = sorted("/".join(k) for k in table if k not in used and not any(
      _path_key(kp)[:len(k)] == k for kp, _ in leaves))
  if extra:
    raise ValueError(f"entries {extra} match no parameter (or lie below one)")
  return treedef.unflatten(out)


def _is_axes_leaf(x) -> bool:
  return _is_names(x) and not _is_variable(x)


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
        "(linen: nn.with_logical_partitioning; nnx: nnx.with_partitioning, read from the state "
        "tx.init receives) or pass them in `axes`")
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
    axes = align_to(axes, params, _is_axes_leaf)
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


class logical_axes_dimension_numbers:  # pylint: disable=invalid-name
  """The callable form of :func:`muon_weight_dimension_numbers` for boxed trees.

  ``muon(..., muon_weight_dimension_numbers=logical_axes_dimension_numbers())``
  reads the logical axis names off the parameters the first time it sees
  them boxed (``tx.init`` on linen's boxed params or on an nnx state of
  ``Variable`` objects, which is what ``nnx.Optimizer`` passes) and remembers them
  by path, so ``update``, which sees plain arrays, splits the same way.
  Keyword arguments are the axis-name rules of
  :func:`muon_weight_dimension_numbers` (``selection_axes``, ``batch_axes``,
  ``layer_axes``, ``head_axes``).
  """

  def __init__(self, **rules):
    unknown = set(rules) - {"selection_axes", "batch_axes", "layer_axes", "head_axes"}
    if unknown:
      raise TypeError(f"logical_axes_dimension_numbers: unknown rule(s) {sorted(unknown)}; expected "
                      "selection_axes, batch_axes, layer_axes or head_axes")
    self.rules = rules
    self.names: dict[tuple[str, ...], Any] = {}

  def __call__(self, params):
    seen = jax.tree_util.tree_flatten_with_path(logical_axes(params), is_leaf=_is_axes_leaf)[0]
    boxed = any(_is_box(x) for x in jax.tree.leaves(params, is_leaf=_is_box))
    if boxed:
      self.names.update({_path_key(kp): n for kp, n in seen})
    axes = jax.tree_util.tree_map_with_path(
        lambda kp, _: self.names.get(_path_key(kp)), _unbox(params), is_leaf=_is_masked)
    return muon_weight_dimension_numbers(params, axes, **self.rules)
