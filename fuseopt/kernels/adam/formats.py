"""The moment format of a leaf, as a type: how Adam's moments are stored.

The Adam update runs one driver (:mod:`.tree`) whatever the format; what
differs between formats is held here, in one value per format:

- :data:`DENSE`: one fp32 or bf16 value an element (the array's dtype says
  which; bf16 is written with the counter-hash stochastic rounding);
- :data:`INT8`: the blockwise 8-bit codes and scales of :mod:`.quantized`
  (a :class:`~.quantized.QuantizedMoment`, blocks along the last axis).

A format says whether a leaf (or one of its shards) can hold it, what part of
a launch's signature it is, how its arrays are laid out for a kernel and put
back, and how they are placed on a mesh like their leaf. Backends keep one
entry point per format (a kernel over flat elements, or over whole
quantisation blocks); :func:`of` picks the format of a moment.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from fuseopt.kernels.adam import quantized


@dataclasses.dataclass(frozen=True)
class MomentFormat:
  """One moment format (:data:`DENSE` or :data:`INT8`)."""
  name: str
  # Elements a quantisation block holds along the last axis (None: per element).
  block: int | None

  @property
  def quantized(self) -> bool:
    return self.block is not None

  def fits(self, shape) -> bool:
    """Whether a leaf (or shard) of ``shape`` can hold this format: blocks
    may not straddle two shards, since a block's scale is its absmax."""
    return not self.quantized or quantized.fits(shape)

  def signature(self, m) -> Any:
    """This moment's part of a launch's dtype signature."""
    return self.name if self.quantized else jax.numpy.dtype(m.dtype)

  def kernel_layout(self, m):
    """``m`` as the kernels take it: flat elements, or ``(R, BLOCK)`` codes
    with ``(R,)`` scales."""
    if not self.quantized:
      return m.reshape(-1)
    return quantized.QuantizedMoment(m.codes.reshape(-1, self.block), m.scales.reshape(-1))

  def leaf_layout(self, a):
    """A leaf's own array (``p``, ``g``) as the kernels take it beside
    moments of this format: flat, or ``(R, BLOCK)`` rows of whole blocks."""
    return a.reshape(-1) if not self.quantized else a.reshape(-1, self.block)

  def restore(self, m, like):
    """A kernel's result ``m`` back in the shapes of ``like``."""
    if not self.quantized:
      return m.reshape(like.shape)
    return quantized.QuantizedMoment(m.codes.reshape(like.codes.shape),
                                     m.scales.reshape(like.scales.shape))

  def spec(self, spec):
    """The ``PartitionSpec`` (tree) of a moment of a leaf placed by ``spec``:
    codes and scales shard as the leaf (a scale a block of its shard)."""
    return quantized.QuantizedMoment(spec, spec) if self.quantized else spec

  def map(self, fn: Callable, m, *others):
    """``fn`` on each array of ``m`` (and the matching arrays of ``others``)."""
    if not self.quantized:
      return fn(m, *others)
    return quantized.QuantizedMoment(fn(m.codes, *(o.codes for o in others)),
                                     fn(m.scales, *(o.scales for o in others)))


DENSE = MomentFormat("dense", None)
INT8 = MomentFormat(quantized.MOMENT_DTYPE_NAME, quantized.BLOCK)


def of(m) -> MomentFormat:
  """The format of the moment ``m``."""
  return INT8 if quantized.is_quantized(m) else DENSE
