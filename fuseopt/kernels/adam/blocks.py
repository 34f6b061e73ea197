"""Quantisation blocks of a leaf: the layout every blockwise moment format shares,
and the arithmetic their codes share.

Blocks lie along the leaf's **blocked view**: its ``k`` trailing axes taken
together, ``k`` the fewest whose product divides into whole rows of
:data:`ROW` elements (``k = 1`` wherever the last axis divides, so such a
leaf's blocks are those along its last axis). A flax nnx attention kernel
``(d, heads, 64)`` is blocked over ``heads * 64``; a leaf no trailing
product of which divides (its size not a multiple of :data:`ROW`) has no
blocked view and keeps dense moments. A kernel runs on rows of :data:`ROW`
consecutive elements of the blocked view, the same rows for every format.

Sharded, a block must lie inside one shard (its scale is its absmax): the
axes inside the blocked group after its first are whole in every shard, and
the first one's shard holds whole rows (:func:`shard_fits`). Then the scales
(and packed codes) of a shard are those of its part of the leaf, placed by
:func:`blocked_spec`; a leaf whose placement splits rows runs with those axes
gathered (:mod:`.tree`).

The arithmetic helpers are written for every backend: a floor by truncation,
finiteness by comparison (Mosaic GPU lowers neither ``floor`` nor
``is_finite``), reciprocals multiplied in rather than divisions.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from fuseopt.kernels import sharding as sharding_lib

ROW = 256


def trailing_axes(shape) -> int:
  """``k``: the fewest trailing axes of ``shape`` whose product divides into
  rows of :data:`ROW` (0: none does)."""
  size = 1
  for k in range(1, len(shape) + 1):
    size *= int(shape[-k])
    if size == 0:
      return 0
    if size % ROW == 0:
      return k
  return 0


def fits(shape) -> bool:
  """Whether a leaf of ``shape`` has a blocked view."""
  return trailing_axes(shape) > 0


def blocked_shape(shape) -> tuple[int, ...]:
  """The blocked view's shape: ``shape`` with its blocked trailing axes merged."""
  k = trailing_axes(shape)
  if not k:
    raise ValueError(f"a leaf of shape {tuple(shape)} has no quantisation blocks: no product "
                     f"of its trailing axes divides by {ROW}")
  return tuple(shape[:-k]) + (math.prod(shape[-k:]),)


def per_block_shape(shape, per: int) -> tuple[int, ...]:
  """The blocked view with its last axis divided by ``per`` (the scales of
  blocks of ``per`` elements; packed codes, ``per`` codes a byte)."""
  b = blocked_shape(shape)
  return b[:-1] + (b[-1] // per,)


def rows(shape) -> int:
  """The kernel rows of a leaf."""
  return math.prod(shape) // ROW


def _entries(spec, ndim):
  return tuple(spec) + (None,) * (ndim - len(spec))


def blocked_spec(spec, shape):
  """The ``PartitionSpec`` of an array laid out as ``shape``'s blocked view
  (scales, packed codes) of a leaf placed by ``spec``: the leading axes' and
  the blocked group's first axis's entries (the others are whole,
  :func:`shard_fits`)."""
  k = trailing_axes(shape)
  entries = _entries(spec, len(shape))
  return jax.sharding.PartitionSpec(*entries[:len(shape) - k + 1])


def shard_fits(shape, local_shape) -> bool:
  """Whether shards of ``local_shape`` hold whole blocks of the leaf's
  blocked view: the group's inner axes whole, its first axis's shard whole rows."""
  k = trailing_axes(shape)
  if not k:
    return False
  inner = math.prod(shape[len(shape) - k + 1:])
  return (tuple(local_shape[len(shape) - k + 1:]) == tuple(shape[len(shape) - k + 1:])
          and local_shape[-k] * inner % ROW == 0)


def gathered_spec(spec, shape):
  """``spec`` with the blocked group's axes whole (a leaf whose shards would
  split its rows runs so)."""
  k = trailing_axes(shape) or 1
  entries = _entries(spec, len(shape))
  return jax.sharding.PartitionSpec(*entries[:len(shape) - k], *(None,) * k)


def place_like(p, codes, scales):
  """A leaf's zero ``codes`` and ``scales`` placed like the leaf ``p``: each
  takes ``p``'s ``PartitionSpec`` (the scales its blocked one,
  :func:`blocked_spec`) where that divides it (an axis whose shards would
  split it stays whole), for a committed sharded array and, traced, on
  Explicit axes under ``jax.set_mesh``. Otherwise under ``jit`` (Auto axes,
  or no mesh set), as optax's own moments, the placement is XLA's to
  propagate."""
  traced = isinstance(p, jax.core.Tracer)
  # (traced: the type's sharding, on Explicit axes only; concrete: the array's)
  sharding = getattr(jax.typeof(p) if traced else p, "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if (not isinstance(sharding, jax.sharding.NamedSharding) or not mesh.shape or mesh.size <= 1
      or (traced and (jax.sharding.AxisType.Explicit not in mesh.axis_types
                      or all(e is None for e in sharding.spec)
                      # (a jit creating sharded arrays needs the mesh set)
                      or not jax.sharding.get_abstract_mesh().shape))):
    return codes, scales
  shape = jnp.shape(p)
  fitted = lambda spec, a: jax.sharding.NamedSharding(
      mesh, sharding_lib.Placement(mesh, spec).dividing_spec(a.shape))
  # (under jit, zeros leave their result's type unsharded)
  place = jax.sharding.reshard if traced else jax.device_put
  return (place(codes, sharding if codes.shape == shape else fitted(sharding.spec, codes)),
          place(scales, fitted(blocked_spec(sharding.spec, shape), scales)))


# ----------------------------------------------------------- the arithmetic --
def uniform(bits: jax.Array) -> jax.Array:
  """fp32 uniform in [0, 1) from 32 hash bits: the top 24, exactly (a 24-bit
  integer is an fp32; through int32, since not every backend converts
  unsigned integers to floats)."""
  return (bits >> 8).astype(jnp.int32).astype(jnp.float32) * jnp.float32(2.0 ** -24)


def uniform16(bits: jax.Array) -> jax.Array:
  """fp32 uniform in [0, 1) from the top 16 of 32 hash bits, for a
  stochastic code ``floor(y + u)``: ``u <= 1 - 2**-16`` keeps ``y + u``
  below ``n + 1`` for every ``y <= n`` under 128 (the sum's ulp there is at
  most ``2**-17``), so the top code stays the top code (with 24 bits, ``127 +
  (1 - 2**-24)`` rounds to 128)."""
  return (bits >> 16).astype(jnp.int32).astype(jnp.float32) * jnp.float32(2.0 ** -16)


def inverse(scale):
  """``1 / scale`` per block (1 where the scale is 0 or NaN: those codes are
  overwritten), multiplied into the elements rather than dividing them: XLA
  rewrites a division by a broadcast into a multiplication by its reciprocal
  in some programs and not in others, which would round the codes of a
  sharded step differently from the unsharded one's."""
  return jnp.float32(1.0) / jnp.where(scale > 0, scale, jnp.ones_like(scale))


# 1.5 * 2**23 and its fp32 bit pattern: an integer ``n`` with ``|n| < 2**22``
# added to it lands in the low mantissa bits of the sum (whose ulp is 1), so
# the sum's bits minus the pattern are ``n``.
_INT_BIAS = 12582912.0
_INT_BIAS_BITS = 0x4B400000


def integral_to_int32(y):
  """fp32 ``y`` holding integers with ``|y| < 2**22`` (codes: no NaN, no
  fraction) as int32, exactly: one addition and one integer subtraction on
  the sum's bits. ``astype(int32)`` truncates toward zero, which a TPU does
  as a floor, a ceiling, a select and a conversion (libtpu's bundles: a
  blockwise Adam kernel converts two codes an element)."""
  biased = jax.lax.bitcast_convert_type(y + jnp.float32(_INT_BIAS), jnp.int32)
  return biased - jnp.int32(_INT_BIAS_BITS)


def floor(y):
  """``floor(y)`` of fp32 ``y`` with ``|y| < 2**31``, written as a truncation
  through int32 and a correction (exact, so the same bits as ``jnp.floor``):
  Mosaic GPU lowers no ``floor``."""
  t = y.astype(jnp.int32).astype(jnp.float32)
  return t - jnp.where(t > y, 1.0, 0.0)


def finite(x):
  """``isfinite(x)`` as a comparison (false for NaN and ±Inf): Mosaic GPU
  lowers no ``is_finite``."""
  return jnp.abs(x) < jnp.float32(jnp.inf)


def kept_on_skip(keep_old, new, old):
  """A skipped step's stored moment: the old codes or scales as they were
  (``keep_old`` true, a scalar or a block), else the new. The step's
  arithmetic keeps the dequantised values on a skip, but quantising them
  again reduces a new scale from them, which can move by an ulp: the stored
  state is selected instead, so a skipped step leaves it untouched."""
  return jnp.where(keep_old, old, new)
