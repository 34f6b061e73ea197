"""Adam's moments in 4 bits: the packed blockwise format and its block arithmetic.

A moment is stored as a :class:`PackedMoment`: one 4-bit code per element,
two codes a byte, and one fp32 scale per block of :data:`BLOCK` elements
(the blocks of :mod:`.blocks`' blocked view: along the last axis, or the
trailing axes taken together). State bytes per parameter:
``2 * (1/2 + 4 / BLOCK)`` = 1.0625 for both moments (8-bit: 2.03; bf16: 4).

Layout. The blocked view is cut into rows of :data:`ROW` = two blocks; byte
``t`` of a row holds element ``t`` (low nibble) and element ``t + BLOCK``
(high nibble). A kernel reading a row reads its two halves and one byte
vector, each contiguous, on every backend; a row is the same 256 elements
the 8-bit format's kernels read, so the two formats share the row grid.

- ``mu`` (signed, square-root companded): :math:`\\mu = \\mathrm{sgn}(c)\\,
  (|c| \\cdot fl(1/7))^2\\, s` with :math:`c \\in [-7, 7]` (two's complement in
  the nibble) and :math:`s = \\max_{block} |\\mu|`. The levels are dense near
  0: a block whose values spread over two decades keeps most of them off the
  zero code (Dettmers et al. 2022, Li et al. 2023, "Memory Efficient
  Optimizers with 4-bit States", arXiv 2309.01507: a linear 4-bit map rounds
  most of such a block to 0).
- ``nu`` (no zero code): :math:`\\nu = ((c + 1)\\, s)^2` with
  :math:`c \\in [0, 15]` and :math:`s = \\sqrt{\\max_{block} \\nu} \\cdot 1/16`: 16
  levels from :math:`\\max/256` to :math:`\\max`. Li et al. show that a zero
  level for the second moment is what breaks 4-bit Adam (an element whose
  ``nu`` reads 0 takes a step of ``lr * m / eps``); here a stored ``nu`` is 0
  only in an all-zero block. Values below the first level read as it
  (rounded up: a smaller step, never a larger one). The scale is at least
  :data:`NU_SCALE_FLOOR`, ``2**-63``, so the first level is never below the
  smallest normal fp32 (a subnormal level is flushed to zero by XLA and the
  GPUs: it read as ``nu = 0`` in blocks whose largest value was below 3e-36).

Rounding. ``nu`` is written with the counter-hash stochastic rounding of the
8-bit format (:mod:`.quantized`): the nu stream's seed, element ``i`` (its
flat index in the whole leaf) rounding up with probability ``frac``, drawn
from the top 16 bits of ``hash_bits(i, seed)`` (:func:`.blocks.uniform16`),
so the codes do not depend on a kernel's block, its grid or the leaf's
sharding. ``frac`` is the value's position between its two
neighbouring levels in ``sqrt(nu)``'s domain, where the levels are evenly
spaced: the stored ``sqrt(nu)`` is unbiased. A step moves ``nu`` by ``1 - b2``
(0.1 %) of the way to ``g^2``, far less than half a level's gap: rounded to
nearest it would never move (on the quality study, docs/adam.md, nearest
``nu`` costs 0.06-0.09 nats a character). Rounded stochastically, the stored
value carries noise of the order of a level's gap, whatever the domain; the
domain sets its bias. Unbiased in ``nu`` itself, the step's
``1/sqrt(nu)`` is biased up by that noise (Jensen's inequality), most in
the elements far below their block's largest value, where the levels are
coarsest relative to the value: in a simulated block whose variances spread
over a decade, elements below 5 % of the largest took steps 1.4 times
fp32's on average. Unbiased in ``sqrt(nu)``, the mean step is within 1-2 %
of fp32's at every level, with fewer operations (no squared levels, no
division); the quality study (docs/adam.md) sees the same loss within its
seeds' resolution. ``mu`` is rounded to the nearest level, deterministically (its ``bits`` are
not read). Stochastic rounding of ``mu`` is unbiased in ``mu`` but not in
``|mu|``: a value between 0 and the first level (``max/49``) reads as 0 or
that level, so the magnitudes, and with them the steps, grow on average;
and its noise enters the step directly, with nothing to average it but
``b1``. On the quality study (docs/adam.md) nearest ``mu`` halves 4-bit
moments' distance to fp32 moments. Its cost: an element whose ``mu`` would
decay by ``b1`` alone (a gradient near 0) while another element holds its
block's largest value keeps its level (a 10 % decay is under half a
level's gap) until its gradient moves it or the block's largest value
falls. No rank-1 normalisation (Li et al.'s second moment): it needs a
second pass and, sharded, a reduction across shards.

Non-finite values: as the 8-bit format, a block meeting a NaN or Inf gets a
non-finite scale and codes 0. The functions below are plain ``jnp`` on
half-rows ``(..., BLOCK)`` with their scale ``(..., 1)``, shared by the
reference and the kernels.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fuseopt.kernels.adam import blocks

BLOCK = 128
ROW = 2 * BLOCK
MU_LEVELS = 7          # |c| <= 7
NU_LEVELS = 16         # c + 1 in [1, 16]
CODE_DTYPE = jnp.dtype(jnp.uint8)
SCALE_DTYPE = jnp.dtype(jnp.float32)
MOMENT_DTYPE_NAME = "int4"   # the ``moment_dtype`` that asks for this format
BYTES_PER_ELEMENT = 0.5 + SCALE_DTYPE.itemsize / BLOCK


class PackedMoment(NamedTuple):
  """One leaf's moment in 4 bits: ``codes`` (uint8, two a byte: the blocked
  view with its last axis halved) and ``scales`` (fp32, the blocked view with
  its last axis divided by :data:`BLOCK`). A pytree; the value is
  :func:`fuseopt.kernels.adam.blocks.dequantize`."""
  codes: jax.Array
  scales: jax.Array


def is_packed(x) -> bool:
  return isinstance(x, PackedMoment)


# --------------------------------------------------------------- nibbles --
def pack(lo, hi):
  """Two int32 nibble arrays (values 0..15) → one uint8 array."""
  return (lo | (hi << 4)).astype(CODE_DTYPE)


def unpack(byte):
  """uint8 ``byte`` → its ``(low, high)`` nibbles as int32 (0..15)."""
  b = byte.astype(jnp.int32)
  return b & 15, b >> 4


def _signed(nibble):
  """A mu nibble (two's complement) → its code in [-8, 7] (int32)."""
  return (nibble ^ 8) - 8


# -------------------------------------------------------------- the math --
_MU_STEP = 1.0 / MU_LEVELS
_NU_STEP = 1.0 / NU_LEVELS


def _no_fence(x):
  return x


def dequantize_mu(nibble, scale):
  """fp32 ``mu`` of the int32 nibbles ``(..., B)`` with ``scale`` ``(..., 1)``."""
  q = _signed(nibble).astype(jnp.float32) * jnp.float32(_MU_STEP)
  return q * jnp.abs(q) * scale


def dequantize_nu(nibble, scale):
  """fp32 ``nu`` of the int32 nibbles ``(..., B)`` with ``scale`` ``(..., 1)``."""
  a = (nibble + 1).astype(jnp.float32) * scale
  return a * a


def mu_scale(x, axis=-1):
  """A block's ``mu`` scale, ``max |x|`` (reduced over ``axis``, kept as size 1; ``axis=None``: a scalar)."""
  return jnp.max(jnp.abs(x), axis=axis, keepdims=axis is not None)


# The smallest scale of a block holding a positive nu: 2**-63, whose square
# (the first level) is the smallest normal fp32, 2**-126. Below it the first
# level would be subnormal, which XLA and the GPUs flush to zero, and an
# element at that level would read nu = 0.
NU_SCALE_FLOOR = 2.0 ** -63


def nu_scale(x, axis=-1):
  """A block's ``nu`` scale, ``sqrt(max x) · 1/16``, at least
  :data:`NU_SCALE_FLOOR` where the block holds a positive value (a block whose
  largest nu is below ``256 · 2**-126``, 3.0e-36, has its levels from
  ``2**-126`` up: every level normal, none read as 0); 0 for an all-zero block."""
  top = jnp.max(x, axis=axis, keepdims=axis is not None)
  scale = jnp.sqrt(top) * jnp.float32(_NU_STEP)
  return jnp.where(top > 0, jnp.maximum(scale, jnp.float32(NU_SCALE_FLOOR)), scale)


def quantize_mu(x, bits, scale=None, fence=_no_fence, *, floor=jnp.floor):
  """fp32 ``x`` ``(..., B)`` → ``(int32 nibbles, scale (..., 1))``: the
  magnitude rounded to the nearer of its neighbouring levels ``(k/7)^2 s``
  and ``((k+1)/7)^2 s`` (a tie: up), the sign kept. ``bits`` is not read
  (the rounding is deterministic, module docstring); it keeps the one
  signature every format's ``quantize_mu`` has, through which the kernels
  call it, and the hash no one reads is dead code to each compiler.
  ``fence``: :func:`fuseopt.kernels.fp_contract.rounded` where XLA compiles
  the arithmetic (no product contracted into the subtraction after it);
  ``floor`` as in :func:`.quantized.quantize_mu`. The tie test ``frac >=
  1/2`` is ``2 (a - below) >= above - below``: exact, and no division (on a
  TPU a reciprocal and its Newton steps)."""
  scale = mu_scale(x) if scale is None else scale
  a = fence(jnp.abs(x) * blocks.inverse(scale))
  t = jnp.clip(jnp.sqrt(a) * jnp.float32(MU_LEVELS), 0.0, MU_LEVELS - 1)
  k = floor(t)
  q0 = k * jnp.float32(_MU_STEP)
  q1 = (k + 1.0) * jnp.float32(_MU_STEP)
  below, above = fence(q0 * q0), fence(q1 * q1)
  mag = k + jnp.where(2.0 * (a - below) >= above - below, 1.0, 0.0)
  code = jnp.where(x < 0, -mag, mag)
  code = jnp.where(blocks.finite(a) & blocks.finite(scale), code, 0.0)
  return blocks.integral_to_int32(code) & 15, scale


def quantize_nu(x, bits, scale=None, fence=_no_fence, *, floor=jnp.floor):
  """fp32 ``x >= 0`` ``(..., B)`` → ``(int32 nibbles, scale (..., 1))``: the
  multiplier ``c + 1`` rounded stochastically between ``k`` and ``k + 1``,
  unbiased in ``sqrt(nu)`` (``t = sqrt(x) / s`` rounds up with probability
  ``t - k``: the stored ``sqrt(nu)``, whose inverse is the step's, has the
  fp32 one's mean; the module docstring says why not ``nu``'s), at least 1
  (no zero code: values below ``s^2`` read as ``s^2``). ``floor`` as in
  :func:`.quantized.quantize_mu`."""
  scale = nu_scale(x) if scale is None else scale
  t = fence(jnp.sqrt(x) * blocks.inverse(scale))
  # floor(t + u), u uniform in [0, 1): up with probability t - floor(t), as
  # in quantized.quantize_mu (t is at most NU_LEVELS; clipped to [1, 16]
  # and u of 16 bits, blocks.uniform16, the multiplier stays there)
  m = floor(jnp.clip(t, 1.0, NU_LEVELS) + blocks.uniform16(bits))
  code = jnp.where(blocks.finite(t) & blocks.finite(scale), m - 1.0, 0.0)
  return blocks.integral_to_int32(code), scale


# ------------------------------------------------------------- a leaf --
def fits(shape) -> bool:
  """Whether a leaf of ``shape`` can hold 4-bit moments: quantisation
  blocks (:func:`.blocks.fits`) and an even last axis (the codes are the
  leaf's shape with its last axis halved, so they shard as the leaf)."""
  return blocks.fits(shape) and shape[-1] % 2 == 0


def codes_shape(shape) -> tuple[int, ...]:
  return tuple(shape[:-1]) + (shape[-1] // 2,)


def scales_shape(shape) -> tuple[int, ...]:
  return blocks.per_block_shape(shape, BLOCK)


def leaf_shape(codes_shape_) -> tuple[int, ...]:
  """The leaf's shape from its codes'."""
  return tuple(codes_shape_[:-1]) + (2 * codes_shape_[-1],)


def zeros(shape) -> PackedMoment:
  """A zero moment (either sign: 0 codes and scales) of a leaf of ``shape``."""
  if not fits(shape):
    raise ValueError(f"4-bit moments need an even last axis and trailing axes whose product "
                     f"divides by {ROW}, got shape {tuple(shape)}")
  return PackedMoment(jnp.zeros(codes_shape(shape), CODE_DTYPE),
                      jnp.zeros(scales_shape(shape), SCALE_DTYPE))


def zeros_like(p) -> PackedMoment:
  """:func:`zeros` placed like the leaf ``p`` (:func:`.blocks.place_like`)."""
  z = zeros(jnp.shape(p))
  return PackedMoment(*blocks.place_like(p, z.codes, z.scales))


def check(name: str, m, shape, *, owner: str = "adam_update") -> PackedMoment:
  """A :class:`PackedMoment` of a leaf of ``shape``; errors name ``name``."""
  if not is_packed(m):
    raise TypeError(f"{owner}: {name} must be a PackedMoment like the other moment, got "
                    f"{type(m).__name__}")
  codes, scales = jnp.asarray(m.codes), jnp.asarray(m.scales)
  if codes.dtype != CODE_DTYPE:
    raise TypeError(f"{owner}: {name}.codes must be uint8 (two 4-bit codes a byte), got "
                    f"{codes.dtype}")
  if scales.dtype != SCALE_DTYPE:
    raise TypeError(f"{owner}: {name}.scales must be float32, got {scales.dtype}")
  if not fits(shape):
    raise ValueError(f"{owner}: 4-bit moments need an even last axis and trailing axes whose "
                     f"product divides by {ROW}, the gradient has shape {tuple(shape)}")
  if tuple(codes.shape) != codes_shape(shape):
    raise ValueError(f"{owner}: {name}.codes has shape {codes.shape}, expected "
                     f"{codes_shape(shape)} (the gradient's {tuple(shape)}, two codes a byte)")
  if tuple(scales.shape) != scales_shape(shape):
    raise ValueError(f"{owner}: {name}.scales has shape {scales.shape}, expected "
                     f"{scales_shape(shape)} (one per block of {BLOCK})")
  return PackedMoment(codes, scales)


def nbytes(m: PackedMoment) -> int:
  return m.codes.size * m.codes.dtype.itemsize + m.scales.size * m.scales.dtype.itemsize


def row_view(shape) -> tuple[int, ...]:
  """A leaf of ``shape`` as ``(..., R, 2, BLOCK)``: its blocked view's rows,
  each as its two blocks."""
  b = blocks.blocked_shape(shape)
  return b[:-1] + (b[-1] // ROW, 2, BLOCK)


def halves(x, shape):
  """A leaf-shaped (or flat) array as the two halves of its rows, each
  ``(..., R, BLOCK)``."""
  r = x.reshape(row_view(shape))
  return r[..., 0, :], r[..., 1, :]


def scale_halves(scales, shape):
  """A leaf's scales as the two halves' ``(..., R, 1)`` columns."""
  s = scales.reshape(row_view(shape)[:-1])
  return s[..., 0:1], s[..., 1:2]


def join_halves(lo, hi, shape):
  """Two ``(..., R, B)`` halves (or ``(..., R, 1)`` columns) back as one
  array: the leaf's shape for elements, its scales' for columns."""
  both = jnp.stack([lo, hi], axis=-2)
  return both.reshape(shape if lo.shape[-1] == BLOCK else scales_shape(shape))


def dequantize(m: PackedMoment, *, signed: bool) -> jax.Array:
  """The fp32 value of a whole leaf's moment (conversion, tests, inspection)."""
  shape = leaf_shape(m.codes.shape)
  lo, hi = unpack(m.codes.reshape(row_view(shape)[:-2] + (BLOCK,)))
  s_lo, s_hi = scale_halves(m.scales, shape)
  f = dequantize_mu if signed else dequantize_nu
  return join_halves(f(lo, s_lo), f(hi, s_hi), shape)


def quantize(x, bits, *, signed: bool, fence=_no_fence) -> PackedMoment:
  """A whole leaf's fp32 moment ``x`` in 4 bits, rounded with the uint32
  ``bits`` (one per element, the leaf's shape)."""
  shape = x.shape
  (x_lo, x_hi), (b_lo, b_hi) = halves(x, shape), halves(bits, shape)
  f = quantize_mu if signed else quantize_nu
  (c_lo, s_lo), (c_hi, s_hi) = f(x_lo, b_lo, fence=fence), f(x_hi, b_hi, fence=fence)
  return PackedMoment(pack(c_lo, c_hi).reshape(codes_shape(shape)),
                      join_halves(s_lo, s_hi, shape))
