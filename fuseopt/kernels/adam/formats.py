"""The moment format of a leaf, as a type: how Adam's moments are stored.

The Adam update runs one driver (:mod:`.tree`) whatever the format; what
differs between formats is held here, in one value per format:

- :data:`DENSE`: one fp32 or bf16 value an element (the array's dtype says
  which; bf16 is written with the counter-hash stochastic rounding);
- :data:`INT8`: the blockwise 8-bit codes and scales of :mod:`.quantized`
  (a :class:`~.quantized.QuantizedMoment`, a scale per 256 elements);
- :data:`INT4`: the packed 4-bit codes and scales of :mod:`.int4` (a
  :class:`~.int4.PackedMoment`, two codes a byte, a scale per 128 elements).

Both blockwise formats lie on :mod:`.blocks`' blocked view and its rows of
256 elements: a kernel takes a leaf as ``(R, 256)`` rows, its codes as ``(R,
256)`` (8-bit) or ``(R, 128)`` bytes (4-bit) and its scales as ``(R,)`` or
``(R, 2)``. A format says whether a leaf (or one of its shards) can hold it,
what part of a launch's signature it is, how its arrays are laid out for a
kernel and put back, how they are placed on a mesh like their leaf, and how a
moment of a leaf is made, checked, read and written whole. Backends keep one
entry point per format; :func:`of` picks the format of a moment.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from fuseopt.kernels.adam import blocks
from fuseopt.kernels.adam import int4
from fuseopt.kernels.adam import quantized


@dataclasses.dataclass(frozen=True)
class MomentFormat:
  """One moment format (:data:`DENSE`, :data:`INT8` or :data:`INT4`)."""
  name: str
  # Elements a scale (None: per element, no scale).
  block: int | None
  # The moment's type (None: a plain array).
  moment_type: type | None = None
  # State bytes a parameter of one moment (dense: the dtype's).
  bytes_per_element: float | None = None
  # A backend's entry points for this format: ``update_<kernel>`` (one leaf),
  # ``update_<kernel>_group_jit`` (grouped), ``<kernel>_leaf_reason`` (why a
  # leaf runs on the reference).
  kernel: str | None = None

  def entry(self, backend, what: str = "update_{}"):
    """``backend``'s entry point ``what`` for this format, or None."""
    return getattr(backend, what.format(self.kernel), None)

  @property
  def quantized(self) -> bool:
    return self.block is not None

  def fits(self, shape) -> bool:
    """Whether a leaf of ``shape`` can hold this format."""
    if self is INT4:
      return int4.fits(shape)
    return not self.quantized or quantized.fits(shape)

  def shard_fits(self, shape, local_shape) -> bool:
    """Whether shards of ``local_shape`` of a leaf of ``shape`` hold whole
    blocks (a block's scale is its absmax: it may not straddle two shards)."""
    return not self.quantized or blocks.shard_fits(shape, local_shape)

  def signature(self, m) -> Any:
    """This moment's part of a launch's dtype signature."""
    return self.name if self.quantized else jax.numpy.dtype(m.dtype)

  def kernel_layout(self, m):
    """``m`` as the kernels take it: flat elements, or ``(R, ROW)`` codes
    with ``(R,)`` scales (8-bit), ``(R, ROW / 2)`` bytes with ``(R, 2)``
    scales (4-bit)."""
    if not self.quantized:
      return m.reshape(-1)
    if self is INT4:
      return int4.PackedMoment(m.codes.reshape(-1, int4.BLOCK), m.scales.reshape(-1, 2))
    return quantized.QuantizedMoment(m.codes.reshape(-1, self.block), m.scales.reshape(-1))

  def leaf_layout(self, a):
    """A leaf's own array (``p``, ``g``) as the kernels take it beside
    moments of this format: flat, or ``(R, ROW)`` rows."""
    return a.reshape(-1) if not self.quantized else a.reshape(-1, blocks.ROW)

  def restore(self, m, like):
    """A kernel's result ``m`` back in the shapes of ``like``."""
    if not self.quantized:
      return m.reshape(like.shape)
    return self.moment_type(m.codes.reshape(like.codes.shape),
                            m.scales.reshape(like.scales.shape))

  def spec(self, spec, shape):
    """The ``PartitionSpec`` (tree) of a moment of a leaf of ``shape`` placed
    by ``spec``: the codes as the leaf, the scales as its blocked view."""
    if not self.quantized:
      return spec
    return self.moment_type(spec, blocks.blocked_spec(spec, shape))

  def map(self, fn: Callable, m, *others):
    """``fn`` on each array of ``m`` (and the matching arrays of ``others``)."""
    if not self.quantized:
      return fn(m, *others)
    return self.moment_type(fn(m.codes, *(o.codes for o in others)),
                            fn(m.scales, *(o.scales for o in others)))

  # ---------------------------------------------------- a leaf's moment, whole --
  def zeros_like(self, p, *, signed: bool):
    """A zero moment of the leaf ``p``, placed like it."""
    if self is INT4:
      return int4.zeros_like(p)
    return quantized.zeros_like(p, signed=signed)

  def check(self, name, m, shape, *, signed: bool, owner: str = "adam_update"):
    """``m`` checked as this format's moment of a leaf of ``shape``."""
    if self is INT4:
      return int4.check(name, m, shape, owner=owner)
    return quantized.check(name, m, shape, signed=signed, owner=owner)

  def leaf_shape(self, m) -> tuple[int, ...]:
    """The shape of the leaf whose moment ``m`` is."""
    return int4.leaf_shape(m.codes.shape) if self is INT4 else tuple(m.codes.shape)

  def dequantize(self, m, *, signed: bool) -> jax.Array:
    """The fp32 value of a whole leaf's moment."""
    if self is INT4:
      return int4.dequantize(m, signed=signed)
    return quantized.dequantize(m, signed=signed)

  def quantize(self, x, bits, *, signed: bool, fence=lambda v: v):
    """A whole leaf's fp32 moment ``x`` in this format, rounded with the
    uint32 ``bits`` (one per element)."""
    if self is INT4:
      return int4.quantize(x, bits, signed=signed, fence=fence)
    shape = x.shape
    bshape = quantized.scales_shape(shape) + (quantized.BLOCK,)
    if signed:
      codes, scale = quantized.quantize_mu(x.reshape(bshape), bits.reshape(bshape))
    else:
      codes, scale = quantized.quantize_nu(x.reshape(bshape), bits.reshape(bshape), fence=fence)
    return quantized.QuantizedMoment(codes.reshape(shape), scale[..., 0])

  def nbytes(self, m) -> int:
    if not self.quantized:
      return m.size * m.dtype.itemsize
    return sum(a.size * a.dtype.itemsize for a in m)


DENSE = MomentFormat("dense", None)
INT8 = MomentFormat(quantized.MOMENT_DTYPE_NAME, quantized.BLOCK, quantized.QuantizedMoment,
                    1 + quantized.SCALE_DTYPE.itemsize / quantized.BLOCK, "quantized")
INT4 = MomentFormat(int4.MOMENT_DTYPE_NAME, int4.BLOCK, int4.PackedMoment,
                    int4.BYTES_PER_ELEMENT, "int4")
BLOCKWISE = (INT8, INT4)
BY_NAME = {f.name: f for f in BLOCKWISE}


def is_blockwise(m) -> bool:
  """Whether ``m`` is a moment of a blockwise format (8-bit or 4-bit)."""
  return quantized.is_quantized(m) or int4.is_packed(m)


def of(m) -> MomentFormat:
  """The format of the moment ``m``."""
  if int4.is_packed(m):
    return INT4
  return INT8 if quantized.is_quantized(m) else DENSE
