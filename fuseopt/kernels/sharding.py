"""Running fuseopt's elementwise kernels shard-local under ``jax.sharding``.

A Pallas kernel is a custom call, and XLA does not partition custom calls: fed
a sharded array, it gathers the whole array onto every device first. So on a
mesh of more than one device every elementwise op of :mod:`fuseopt.kernels`
runs inside :func:`jax.shard_map`, on the local shard, and the counter hash
still sees each element's row-major flat index in the **global** array. That
index is rebuilt inside the kernel from the shard's local flat index with a
static *index map* and a traced *base*:

* the index map lists ``(extent, global_stride)`` terms, outermost first, for
  the local shard's axes after merging every unsharded axis into the axis
  before it: a leaf sharded along its first axis (FSDP rows) or not at all has
  one term ``(local_size, 1)``, so ``global = base + local``; a leaf sharded
  along a later axis has one term per sharded axis (plus one in front when
  the first axis is not sharded), and ``global = base + sum_j ((local //
  L_j) % E_j) * S_j`` with ``L_j`` the product of the later extents;
* the base is ``sum_a shard_index_a * local_extent_a * global_stride_a``, from
  :func:`jax.lax.axis_index` of the mesh axes that shard axis ``a``.

All of it is uint32 arithmetic with wrap-around, as the hash itself: the bits
equal the unsharded run's for every even PartitionSpec (1-D and 2-D meshes,
first, middle or last axis, several mesh axes on one array axis, replicated
leaves).

Where the sharding comes from:

* Explicit mesh axes (sharding in types): ``jax.typeof(x).sharding``;
  nothing to pass.
* Auto mesh axes: the type carries the mesh but not the placement, so the
  caller passes it (``sharding=`` / ``shardings=``: a
  :class:`~jax.sharding.NamedSharding`, or a
  :class:`~jax.sharding.PartitionSpec` together with a mesh from
  :func:`jax.set_mesh` or the array's type). Without it, fuseopt never feeds
  such an array to a kernel: it runs the op's plain-jnp reference, which XLA
  partitions like any other elementwise code, and warns once.

A leaf whose shape does not divide evenly by its mesh axes runs the reference
outside ``shard_map`` (XLA partitions it), bitwise the same.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

# (extent, global stride) terms, outermost first.
IndexMap = tuple[tuple[int, int], ...]


def is_contiguous(index_map: IndexMap | None) -> bool:
  return index_map is None or (len(index_map) <= 1 and all(s == 1 for _, s in index_map))


def global_index(local: jax.Array, index_map: IndexMap | None, base) -> jax.Array:
  """uint32 global flat indices of local flat indices ``local`` (uint32)."""
  base = jnp.asarray(base).astype(jnp.uint32) if not isinstance(base, int) else jnp.uint32(
      base & 0xFFFFFFFF)
  if is_contiguous(index_map):
    return base + local
  out = None
  inner = math.prod(e for e, _ in index_map)
  for j, (extent, stride) in enumerate(index_map):
    inner //= extent
    # Powers of two (the usual sizes) take shifts and masks, which every
    # backend has; Mosaic has no vector integer division (see needs_division).
    if inner == 1:
      coord = local
    elif _pow2(inner):
      coord = local >> jnp.uint32(inner.bit_length() - 1)
    else:
      coord = local // jnp.uint32(inner)
    if j:  # the first coordinate is already below its extent
      coord = (coord & jnp.uint32(extent - 1)) if _pow2(extent) else coord % jnp.uint32(extent)
    term = coord if stride == 1 else coord * jnp.uint32(stride & 0xFFFFFFFF)
    out = term if out is None else out + term
  return base + out


def _pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def needs_division(index_map: IndexMap | None) -> bool:
  """Whether :func:`global_index` divides by a non-power of two for this map
  (Mosaic TPU kernels cannot: such shards run the shard-local reference)."""
  if is_contiguous(index_map):
    return False
  inner = math.prod(e for e, _ in index_map)
  for j, (extent, _) in enumerate(index_map):
    inner //= extent
    if not _pow2(inner) or (j and not _pow2(extent)):
      return True
  return False


def _strides(shape: Sequence[int]) -> list[int]:
  strides, acc = [], 1
  for d in reversed(shape):
    strides.append(acc)
    acc *= int(d)
  return strides[::-1]


def index_map_of(global_shape: Sequence[int], local_shape: Sequence[int]) -> IndexMap:
  """The index map of a shard of ``local_shape`` inside ``global_shape``."""
  strides = _strides(global_shape)
  terms: list[list[int]] = []
  for d, l, s in zip(global_shape, local_shape, strides):
    if terms and l == d:
      terms[-1][0] *= l   # an unsharded axis continues the term before it
      terms[-1][1] = s
    else:
      terms.append([l, s])
  terms = [t for t in terms if t[0] != 1] or [[1, 1]]
  return tuple((e, s) for e, s in terms)


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where a leaf lives: its mesh and its PartitionSpec (one entry per axis)."""
  mesh: Any
  spec: PartitionSpec

  def axis_names(self, a: int) -> tuple[str, ...]:
    entry = self.spec[a]
    if entry is None:
      return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)

  def shards(self, a: int) -> int:
    return math.prod(self.mesh.shape[n] for n in self.axis_names(a))

  def local_shape(self, shape) -> tuple[int, ...]:
    return tuple(d // self.shards(a) for a, d in enumerate(shape))

  def is_even(self, shape) -> bool:
    return all(d % self.shards(a) == 0 for a, d in enumerate(shape))

  def dividing_spec(self, shape) -> PartitionSpec:
    """This spec without the mesh axes that do not divide ``shape`` (an array
    laid out like the leaf but smaller, e.g. an 8-bit moment's scales)."""
    spec = tuple(self.spec) + (None,) * (len(shape) - len(self.spec))
    return PartitionSpec(*(e if d % Placement(self.mesh, spec).shards(a) == 0 else None
                           for a, (e, d) in enumerate(zip(spec, shape))))

  def base(self, shape) -> jax.Array:
    """The global flat index of the local shard's first element (inside shard_map)."""
    strides = _strides(shape)
    local = self.local_shape(shape)
    base = jnp.uint32(0)
    for a in range(len(shape)):
      names = self.axis_names(a)
      if not names:
        continue
      k = jax.lax.axis_index(names if len(names) > 1 else names[0]).astype(jnp.uint32)
      base = base + k * jnp.uint32((local[a] * strides[a]) & 0xFFFFFFFF)
    return base


# Outcomes of :func:`placement_of` besides a Placement.
UNSHARDED = "unsharded"   # one device, or no mesh: call the kernel directly
UNKNOWN = "unknown"       # a multi-device Auto mesh and no placement given

_warned: set[str] = set()


def warn_unknown(op: str, argument: str):
  """Warns once per op that the reference runs for want of a placement."""
  if op in _warned:
    return
  _warned.add(op)
  warnings.warn(
      f"fuseopt.{op}: an input lives on a multi-device mesh with Auto axes and its "
      f"PartitionSpec is unknown, so the plain-jnp reference runs instead of the kernel "
      f"(XLA partitions it; a kernel would make XLA gather the whole array onto every "
      f"device). Pass {argument} (NamedShardings or PartitionSpecs of the arrays) to run "
      f"the kernels shard-local, or use Explicit mesh axes.", stacklevel=4)


def _mesh_size(mesh) -> int:
  return math.prod(mesh.shape.values()) if mesh is not None and mesh.shape else 1


def _normalize_spec(spec: PartitionSpec, ndim: int, mesh, what: str) -> PartitionSpec:
  entries = tuple(spec)
  if len(entries) > ndim:
    raise ValueError(f"{what}: PartitionSpec {spec} has {len(entries)} entries but the array "
                     f"has {ndim} dimensions")
  names = set(mesh.axis_names) if mesh is not None else set()
  used = []
  for e in entries:
    for n in (e if isinstance(e, (tuple, list)) else (e,)):
      if n is None:
        continue
      if n is PartitionSpec.UNCONSTRAINED:
        raise ValueError(f"{what}: PartitionSpec {spec} is UNCONSTRAINED; fuseopt needs the "
                         f"placement")
      if n not in names:
        raise ValueError(f"{what}: PartitionSpec {spec} names mesh axis {n!r}, which is not "
                         f"in the mesh (axes {tuple(mesh.axis_names) if mesh is not None else ()})")
      if n in used:
        raise ValueError(f"{what}: PartitionSpec {spec} uses mesh axis {n!r} twice")
      used.append(n)
  return PartitionSpec(*(entries + (None,) * (ndim - len(entries))))


def placement_of(x, sharding=None, *, what: str = "array"):
  """Where ``x`` lives: a :class:`Placement`, :data:`UNSHARDED` or :data:`UNKNOWN`.

  Args:
    x: an array or tracer.
    sharding: ``None`` (read the type), a ``NamedSharding`` or a
      ``PartitionSpec`` (mesh from :func:`jax.set_mesh` or ``x``'s type), or
      an answer of this function (a placement resolved before: returned as
      it is).
    what: the leaf's name, for error messages.
  """
  if _is_resolved(sharding):
    return sharding
  aval_sharding = getattr(jax.typeof(x), "sharding", None)
  type_mesh = getattr(aval_sharding, "mesh", None)
  if isinstance(sharding, NamedSharding):
    mesh, spec = sharding.mesh, sharding.spec
  elif isinstance(sharding, PartitionSpec):
    mesh = jax.sharding.get_abstract_mesh()
    if _mesh_size(mesh) <= 1 or not mesh.shape:
      mesh = type_mesh
    if mesh is None or not mesh.shape:
      concrete = getattr(x, "sharding", None)
      mesh = getattr(concrete, "mesh", None) if not isinstance(x, jax.core.Tracer) else None
    if mesh is None or not mesh.shape:
      if all(e is None for e in sharding):
        return UNSHARDED
      raise ValueError(f"{what}: PartitionSpec {sharding} needs a mesh: pass a NamedSharding, "
                       f"or call under jax.set_mesh(mesh)")
    spec = sharding
  elif sharding is None:
    if type_mesh is None or not type_mesh.shape:
      return UNSHARDED
    types = dict(zip(type_mesh.axis_names, type_mesh.axis_types))
    # Inside a shard_map the Manual axes are already split: the array is local.
    free = [n for n in type_mesh.axis_names
            if types[n] != jax.sharding.AxisType.Manual and type_mesh.shape[n] > 1]
    if not free:
      return UNSHARDED
    if any(types[n] == jax.sharding.AxisType.Auto for n in free):
      return UNKNOWN
    mesh, spec = type_mesh, aval_sharding.spec
  else:
    raise TypeError(f"{what}: sharding must be a NamedSharding, a PartitionSpec or None, got "
                    f"{type(sharding).__name__}")
  if _mesh_size(mesh) <= 1:
    return UNSHARDED
  return Placement(mesh, _normalize_spec(spec, jnp.ndim(x), mesh, what))


def resolve_placements(arrays: Sequence[Any], shardings, *, op: str, argument: str) -> list:
  """:func:`placement_of` for a list of leaves; ``shardings`` None or one per leaf.

  Warns once per op (naming ``argument``) when any leaf is :data:`UNKNOWN`.
  """
  n = len(arrays)
  if shardings is None:
    shardings = [None] * n
  elif len(shardings) != n:
    raise ValueError(f"{op}: {argument} has {len(shardings)} entries, expected one per leaf ({n})")
  out = [placement_of(a, s, what=f"{op}: {argument} of leaf {i}")
         for i, (a, s) in enumerate(zip(arrays, shardings))]
  if any(p is UNKNOWN for p in out):
    warn_unknown(op, argument)
  return out


def shard_local(fn: Callable, mesh, in_specs, out_specs):
  """``jax.shard_map`` of ``fn`` over every axis of ``mesh``.

  ``check_vma=False``: the kernels' out_shape structs carry no manual axes
  (and the Triton interpreter rejects them when they do).
  """
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def same_mesh(a, b) -> bool:
  return (tuple(a.axis_names) == tuple(b.axis_names)
          and tuple(a.shape.values()) == tuple(b.shape.values()))


def _type_spec(x):
  sh = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sh, "mesh", None)
  if mesh is None or not mesh.shape or jax.sharding.AxisType.Explicit not in mesh.axis_types:
    return None
  return _normalize_spec(sh.spec, jnp.ndim(x), mesh, "array")


def to_spec(x, placement: Placement):
  """``x`` resharded to ``placement`` when its type says otherwise (Explicit
  axes: shard_map takes only operands whose type matches its in_specs). The
  target names its mesh, so no mesh context (``jax.set_mesh``) is needed."""
  spec = _type_spec(x)
  if spec is None or spec == placement.spec:
    return x
  return jax.sharding.reshard(x, jax.sharding.NamedSharding(placement.mesh, placement.spec))


def like(y, x):
  """``y`` (computed with another operand's placement) back in ``x``'s typed sharding."""
  spec = _type_spec(x)
  if spec is None or spec == _type_spec(y):
    return y
  # (x's own mesh named: no mesh context, jax.set_mesh, is needed)
  return jax.sharding.reshard(y, NamedSharding(jax.typeof(x).sharding.mesh, spec))


def put_back(y, x, given: Placement):
  """``y``, computed on another placement than ``x``'s (a leaf run with an
  axis gathered), back where ``x`` lies: its typed sharding on Explicit axes,
  else (Auto) ``given``'s spec fitted to ``y``'s shape."""
  spec = _type_spec(x)
  if spec is not None:
    if spec == _type_spec(y):
      return y
    return jax.sharding.reshard(y, NamedSharding(given.mesh, spec))
  return jax.lax.with_sharding_constraint(
      y, NamedSharding(given.mesh, given.dividing_spec(y.shape)))


def longest_prefix(table, key: tuple):
  """The longest prefix of ``key`` (a leaf's key path, as a tuple) that
  ``table`` has an entry for, or None: how a tree given as a prefix of
  another applies an entry to every leaf below it (optax's prefix rule)."""
  return next((key[:k] for k in range(len(key), -1, -1) if key[:k] in table), None)


def _is_resolved(x) -> bool:
  """An answer of :func:`placement_of`."""
  return isinstance(x, Placement) or (isinstance(x, str) and x in (UNSHARDED, UNKNOWN))


def _is_sharding_leaf(x) -> bool:
  return x is None or isinstance(x, (PartitionSpec, NamedSharding)) or _is_resolved(x)


def flatten_shardings(shardings, tree, *, owner: str, argument: str = "shardings",
                      strict: bool = False, resolve: bool = False) -> list | None:
  """One sharding per leaf of ``tree`` from a tree of shardings.

  ``shardings`` is ``None``, one ``NamedSharding``/``PartitionSpec`` for every
  leaf, or a tree whose structure is ``tree``'s or a prefix of it (an entry
  applies to every leaf under it; ``None`` entries mean "unknown"). Leaves are
  matched by key path, so masked trees (``optax.MaskedNode`` where another
  transform owns a leaf, as inside ``optax.partition``) take the same tree.
  ``strict``: also reject entries that match no leaf of ``tree`` and no
  leafless position of it (a ``MaskedNode``: a parameter another transform
  owns; a ``None`` parameter), so a misspelt key raises instead of being
  ignored. ``resolve``: return each entry of a tree resolved against its
  leaf (:func:`placement_of`'s answer; ``None`` entries stay ``None``; one
  entry for every leaf is returned as it is), so that later stages take the
  placement as it is instead of resolving it again. Entries may themselves
  be such answers.

  Raises:
    ValueError: naming the leaf that has no entry (or the entry with no leaf).
  """
  leaves_with_paths = jax.tree_util.tree_flatten_with_path(tree)[0]
  if shardings is None:
    return None
  if _is_sharding_leaf(shardings):
    return [shardings] * len(leaves_with_paths)
  entries = jax.tree_util.tree_flatten_with_path(shardings, is_leaf=_is_sharding_leaf)[0]
  for path, value in entries:
    if not _is_sharding_leaf(value):
      raise TypeError(f"{owner}: {argument}{jax.tree_util.keystr(path)} must be a NamedSharding, "
                      f"a PartitionSpec or None, got {type(value).__name__}")
  by_path = {tuple(path): value for path, value in entries}
  used = set()
  out = []
  for path, leaf in leaves_with_paths:
    path = tuple(path)
    prefix = longest_prefix(by_path, path)
    if prefix is None:
      raise ValueError(f"{owner}: {argument} has no entry for the leaf at "
                       f"{jax.tree_util.keystr(path)!r}; give it a tree shaped like the "
                       f"parameters (or a prefix of them)")
    entry = by_path[prefix]
    used.add(prefix)
    if entry is not None:   # validates the rank and the axis names, naming the leaf
      placed = placement_of(leaf, entry, what=f"{owner}: {argument} of the leaf at "
                                              f"{jax.tree_util.keystr(path)!r}")
      entry = placed if resolve else entry
    out.append(entry)
  if strict:
    unused = [path for path in by_path if path not in used]
    if unused:
      holes = [tuple(p) for p, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_hole)[0]
               if _is_hole(x)]
      for path in unused:
        # A masked position may stand for a whole subtree, or lie under a
        # prefix entry: either way the entry names a parameter of the model.
        if not any(h[:len(path)] == path or path[:len(h)] == h for h in holes):
          raise ValueError(f"{owner}: {argument}{jax.tree_util.keystr(path)} matches no "
                           f"parameter leaf (a misspelt key?); the leaves here: "
                           f"{_some_paths(leaves_with_paths)}")
  return out


def _is_hole(x) -> bool:
  """A position that holds no array and no subtree: ``optax.MaskedNode()``,
  ``None``, an empty container (not a dict of MaskedNodes, which has keys)."""
  treedef = jax.tree_util.tree_structure(x)
  return treedef.num_leaves == 0 and treedef.num_nodes == 1


def _some_paths(leaves_with_paths, k: int = 5) -> str:
  paths = [jax.tree_util.keystr(p) for p, _ in leaves_with_paths[:k]]
  more = len(leaves_with_paths) - k
  return ", ".join(paths) + (f" (+{more} more)" if more > 0 else "")
