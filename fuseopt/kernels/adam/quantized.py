"""Adam's moments in 8 bits: the blockwise format and its block arithmetic.

A moment of a leaf with quantisation blocks (:mod:`.blocks`: along the last
axis, or the trailing axes taken together where the last alone does not
divide) is stored as a :class:`QuantizedMoment`: one 8-bit code per element
(the leaf's shape) and one fp32 scale per block of :data:`BLOCK` contiguous
elements of the blocked view (the scales have the blocked view's shape with
its last axis divided by :data:`BLOCK`; the leaf's shape so divided wherever
its last axis divides, so codes and scales shard with the leaf's
``PartitionSpec``). State bytes per parameter: ``2 + 2 * 4 / BLOCK`` = 2.03
(bf16 moments: 4; fp32: 8).

- ``mu`` (int8, signed, linear): :math:`\\mu = c\\, s` with
  :math:`c \\in [-127, 127]` and :math:`s = \\max_{block} |\\mu| \\cdot fl(1/127)`.
- ``nu`` (uint8, square-root companding): :math:`\\nu = (c\\, s)^2` with
  :math:`c \\in [0, 255]` and :math:`s = \\sqrt{\\max_{block} \\nu} \\cdot fl(1/255)`.
  Codes are linear in :math:`\\sqrt\\nu`, the quantity Adam divides by, so a
  block's small second moments keep resolution: the smallest non-zero value is
  :math:`\\max/65025` (a linear map: :math:`\\max/255`). ``c >= 1`` wherever the
  fp32 :math:`\\nu > 0`, so a stored second moment is 0 only where the fp32 one is
  (no division blow-up in :math:`u = \\hat m / (\\sqrt{\\hat v} + \\varepsilon)`).
  The scale is at least :data:`NU_SCALE_FLOOR`, so code 1 never stands for a
  subnormal value (which XLA and the GPUs flush to 0).

Codes are written with stochastic rounding from the counter hash
(:mod:`fuseopt.kernels.counter_hash`): element ``i`` (its flat index in the
whole leaf) rounds up with probability ``frac``, drawn from
``hash_bits(i, seed)`` (mu: its top 16 bits, :func:`.blocks.uniform16`; nu:
its top 24, :func:`.blocks.uniform`) with the seeds of the bf16 moments
(``derive_seed(seed, step, leaf, STREAM_MU / STREAM_NU)``; each moment its
own hash, unlike two bf16 moments, which share one: Triton lays the two
moments' arithmetic out differently and would move a shared hash between
the layouts through shared memory), so the codes are the same whatever the
block size of a kernel, its grid or the leaf's sharding. ``frac`` is the
position of the fp32 value between its two neighbouring representable
values, in the value's own domain (for ``nu``: between :math:`(k s)^2` and
:math:`((k+1) s)^2`), so the expected stored value is the fp32 value (up to
fp32 rounding and the uniform's resolution, 2**-16 for mu and 2**-24 for
nu), except where ``nu``'s floor of one code lifts it.

Non-finite values: a block whose new moment holds a NaN (or, for ``mu``,
an Inf) gets a non-finite scale and codes 0, so every element of that block
reads back as NaN on the next step (blockwise scales cannot keep the other
elements); the step that meets the non-finite gradient computes with the fp32
moments, as with bf16 moments. A ``nu`` of ``+Inf`` beside finite values (a
finite gradient whose square overflows fp32, ``|g| > 1.8e19``) is kept
element by element, as optax keeps it: the block's scale is stored negated
(``-sqrt(finite max) * fl(1/254)``, or -1 where every finite value is 0),
its finite values take codes 0..254 and its ``+Inf`` ones code 255, which
reads back as ``+Inf``; so that element's step stays 0 (``mu / Inf``, as in
optax) and the block's other elements keep their own second moments. Skipping
non-finite steps is the builder's job.

Every function below is plain ``jnp`` on blocks laid out ``(..., BLOCK)``
with their scale ``(..., 1)``, so the reference and the kernels (which hold
whole blocks in registers / VMEM) share it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fuseopt.kernels.adam import blocks
from fuseopt.kernels.adam.blocks import finite as _finite
from fuseopt.kernels.adam.blocks import inverse as _inverse
from fuseopt.kernels.adam.blocks import kept_on_skip  # noqa: F401 (the kernels' name)
from fuseopt.kernels.adam.blocks import uniform, uniform16

BLOCK = blocks.ROW
MU_CODE_MAX = 127
NU_CODE_MAX = 255
MU_CODE_DTYPE = jnp.dtype(jnp.int8)
NU_CODE_DTYPE = jnp.dtype(jnp.uint8)
SCALE_DTYPE = jnp.dtype(jnp.float32)
MOMENT_DTYPE_NAME = "int8"   # the ``moment_dtype`` that asks for this format


class QuantizedMoment(NamedTuple):
  """One leaf's moment in 8 bits: ``codes`` (the leaf's shape; int8 for mu,
  uint8 for nu) and ``scales`` (fp32, the blocked view's shape with its last
  axis divided by :data:`BLOCK`). A pytree; the value is :func:`dequantize`."""
  codes: jax.Array
  scales: jax.Array


def is_quantized(x) -> bool:
  return isinstance(x, QuantizedMoment)


def split_kernel_refs(refs, apply: bool):
  """An 8-bit Adam kernel's refs in the order every backend passes them:
  ``(p_ref or None, (g, mu codes, mu scales, nu codes, nu scales), (out, the
  same four written back))``; ``p`` is read only when the kernel applies the
  update."""
  n_in = 6 if apply else 5
  ins, outs = list(refs[:n_in]), tuple(refs[n_in:])
  p_ref = ins.pop(0) if apply else None
  return p_ref, tuple(ins), outs


def fits(shape) -> bool:
  """Whether a leaf of ``shape`` can hold 8-bit moments: trailing axes that
  divide into whole blocks (:func:`.blocks.fits`)."""
  return blocks.fits(shape)


def scales_shape(shape) -> tuple[int, ...]:
  return blocks.per_block_shape(shape, BLOCK)


def zeros(shape, *, signed: bool) -> QuantizedMoment:
  """A zero moment of a leaf of ``shape`` (``signed``: mu's int8 codes)."""
  if not fits(shape):
    raise ValueError(f"8-bit moments need trailing axes whose product divides by {BLOCK}, "
                     f"got shape {tuple(shape)}")
  return QuantizedMoment(jnp.zeros(shape, MU_CODE_DTYPE if signed else NU_CODE_DTYPE),
                         jnp.zeros(scales_shape(shape), SCALE_DTYPE))


def zeros_like(p, *, signed: bool) -> QuantizedMoment:
  """:func:`zeros` placed like the leaf ``p``: the codes take ``p``'s sharding
  and the scales its ``PartitionSpec`` where that divides them (an axis whose
  shards would split the scales stays whole), for a committed sharded array
  and, traced, on Explicit axes under ``jax.set_mesh``. Otherwise under
  ``jit`` (Auto axes, or no mesh set), as optax's own moments, the placement
  is XLA's to propagate."""
  z = zeros(jnp.shape(p), signed=signed)
  return QuantizedMoment(*blocks.place_like(p, z.codes, z.scales))


def check(name: str, m, shape, *, signed: bool, owner: str = "adam_update"):
  """A :class:`QuantizedMoment` of a leaf of ``shape``; errors name ``name``."""
  want = MU_CODE_DTYPE if signed else NU_CODE_DTYPE
  if not is_quantized(m):
    raise TypeError(f"{owner}: {name} must be a QuantizedMoment like the other moment, "
                    f"got {type(m).__name__}")
  codes, scales = jnp.asarray(m.codes), jnp.asarray(m.scales)
  if codes.dtype != want:
    raise TypeError(f"{owner}: {name}.codes must be {want}, got {codes.dtype}")
  if scales.dtype != SCALE_DTYPE:
    raise TypeError(f"{owner}: {name}.scales must be float32, got {scales.dtype}")
  if tuple(codes.shape) != tuple(shape):
    raise ValueError(f"{owner}: {name}.codes has shape {codes.shape}, expected the "
                     f"gradient's {tuple(shape)}")
  if not fits(shape):
    raise ValueError(f"{owner}: 8-bit moments need trailing axes whose product divides by "
                     f"{BLOCK}, the gradient has shape {tuple(shape)}")
  if tuple(scales.shape) != scales_shape(shape):
    raise ValueError(f"{owner}: {name}.scales has shape {scales.shape}, expected "
                     f"{scales_shape(shape)} (one per block of {BLOCK})")
  return QuantizedMoment(codes, scales)


def nbytes(m: QuantizedMoment) -> int:
  return m.codes.size * m.codes.dtype.itemsize + m.scales.size * m.scales.dtype.itemsize


# ----------------------------------------------------------- block math --
def _codes_f32(codes):
  return codes.astype(jnp.int32).astype(jnp.float32)


def dequantize_mu(codes, scale):
  """fp32 ``mu`` of int8 ``codes`` (..., B) with ``scale`` (..., 1)."""
  return _codes_f32(codes) * scale


def dequantize_nu(codes, scale):
  """fp32 ``nu`` of uint8 ``codes`` (..., B) with ``scale`` (..., 1): a
  negative scale marks a block holding ``+Inf`` values, whose code 255
  reads ``+Inf`` (module docstring)."""
  c = _codes_f32(codes)
  a = c * jnp.abs(scale)
  return jnp.where((scale < 0) & (c == NU_CODE_MAX), jnp.float32(jnp.inf), a * a)


def _no_fence(x):
  return x


# The scales multiply by the fp32 reciprocals of the code ranges rather than
# divide by the ranges: a compiler may rewrite a division by a constant into
# a multiplication in one program and not in another (a kernel's reduced
# scalar, the reference's broadcast block), which would round the scales of
# two backends differently; a multiplication leaves nothing to rewrite.
_MU_STEP = 1.0 / MU_CODE_MAX
_NU_STEP = 1.0 / NU_CODE_MAX
_NU_STEP_INF = 1.0 / (NU_CODE_MAX - 1)   # a block holding +Inf: codes 0..254 finite


def mu_scale(x, axis=-1):
  """A block's ``mu`` scale, ``max |x| · fl(1/127)``, reduced over ``axis``
  (kept as size 1; ``axis=None``: the whole array is one block, a scalar)."""
  return jnp.max(jnp.abs(x), axis=axis, keepdims=axis is not None) * jnp.float32(_MU_STEP)


# The smallest scale of a block holding a positive nu: 2**-63, whose square
# (the first code's value) is the smallest normal fp32, 2**-126. Below it that
# value would be subnormal, which XLA and the GPUs flush to zero, and an
# element on code 1 would read nu = 0.
NU_SCALE_FLOOR = 2.0 ** -63


def nu_scale(x, axis=-1):
  """A block's ``nu`` scale, ``sqrt(max x) · fl(1/255)`` (``axis`` as
  :func:`mu_scale`), at least :data:`NU_SCALE_FLOOR` where the block holds a
  positive value (0 for an all-zero block); NaN where the block holds a NaN.
  A block holding ``+Inf`` (and no NaN) gets ``-sqrt(max of its finite
  values) · fl(1/254)`` (at least the floor), or -1 where those are all 0:
  negative, the mark :func:`dequantize_nu` reads."""
  keep = axis is not None
  floor = jnp.float32(NU_SCALE_FLOOR)
  top = jnp.max(x, axis=axis, keepdims=keep)
  finite_top = jnp.max(jnp.where(x < jnp.float32(jnp.inf), x, jnp.zeros_like(x)), axis=axis,
                       keepdims=keep)
  marked = jnp.sqrt(finite_top) * jnp.float32(_NU_STEP_INF)
  # (1 written as arithmetic on the block's value: Mosaic GPU cannot lower a
  # constant scalar array, which ones_like of a whole-block reduction is)
  marked = -jnp.where(finite_top > 0, jnp.maximum(marked, floor), marked * 0.0 + 1.0)
  plain = jnp.sqrt(top) * jnp.float32(_NU_STEP)
  plain = jnp.where(top > 0, jnp.maximum(plain, floor), plain)
  return jnp.where(top == jnp.float32(jnp.inf), marked, plain)


def quantize_mu(x, bits, scale=None, *, floor=jnp.floor):
  """fp32 ``x`` (..., B) → ``(int8 codes, scale (..., 1))``, stochastically
  rounded with the uint32 ``bits`` (..., B): ``floor(y + u)``
  for the scaled value ``y`` and ``u`` the uniform of ``bits``' top 16
  (:func:`.blocks.uniform16`: ``y + u`` never rounds past 127), which is
  ``floor(y) + 1`` with probability ``y - floor(y)`` (two operations where
  the comparison of ``u`` with the fraction takes five). ``scale``: the
  block's :func:`mu_scale`, where a kernel reduced it itself (returned as
  given). ``floor``: ``jnp.floor``, or :func:`.blocks.floor` (the same
  values) where a backend lowers no floor (Mosaic GPU)."""
  scale = mu_scale(x) if scale is None else scale
  y = jnp.clip(x * _inverse(scale), -MU_CODE_MAX, MU_CODE_MAX)
  # (y + u < 128: |y| <= 127 and u < 1; codes stay in [-127, 127])
  code = floor(y + uniform16(bits))
  code = jnp.where(_finite(y) & _finite(scale), code, 0.0)
  return blocks.integral_to_int32(code).astype(MU_CODE_DTYPE), scale


def quantize_nu(x, bits, scale=None, fence=_no_fence, *, floor=jnp.floor):
  """fp32 ``x >= 0`` (..., B) → ``(uint8 codes, scale (..., 1))``: codes
  linear in ``sqrt(x)``, rounded stochastically between the neighbouring
  values ``(k s)^2`` and ``((k+1) s)^2`` so that the stored ``nu`` is
  unbiased; at least 1 wherever ``x > 0``. In a block marked as holding
  ``+Inf`` (a negative scale, :func:`nu_scale`) the finite values take codes
  up to 254 and ``+Inf`` code 255. ``scale`` as in :func:`quantize_mu`;
  ``fence`` as in :func:`fuseopt.kernels.adam.math.adam_math`, ``floor``
  as in :func:`quantize_mu`. The rounding goes up where ``u · width < x -
  below`` (``u`` uniform in [0, 1)): the comparison of ``u`` with ``frac``
  multiplied out, with no division (on a TPU a division is a reciprocal and
  its Newton steps, a tenth of the kernel's vector work)."""
  scale = nu_scale(x) if scale is None else scale
  has_inf = scale < 0
  mag = jnp.abs(scale)
  s = jnp.where(mag > 0, mag, jnp.ones_like(mag))
  top = jnp.where(has_inf, jnp.float32(NU_CODE_MAX - 2), jnp.float32(NU_CODE_MAX - 1))
  t = jnp.minimum(jnp.maximum(jnp.sqrt(x) * _inverse(mag), 0.0), top)
  k = floor(t)
  below, above = k * s, (k + 1.0) * s
  # (squares rounded before the subtractions below: no FMA, fp_contract.py)
  below, above = fence(below * below), fence(above * above)
  width = above - below
  up = (width > 0) & (fence(uniform(bits) * width) < x - below)
  code = k + jnp.where(up, 1.0, 0.0)
  code = jnp.maximum(code, jnp.where(x > 0, 1.0, 0.0))
  code = jnp.where(_finite(t) & _finite(scale), code, 0.0)
  code = jnp.where(has_inf & (x == jnp.float32(jnp.inf)), jnp.float32(NU_CODE_MAX), code)
  return blocks.integral_to_int32(code).astype(NU_CODE_DTYPE), scale


def dequantize(m: QuantizedMoment, *, signed: bool) -> jax.Array:
  """The fp32 value of a whole leaf's moment (tests, inspection)."""
  shape = m.codes.shape
  codes = m.codes.reshape(scales_shape(shape) + (BLOCK,))
  f = dequantize_mu if signed else dequantize_nu
  return f(codes, m.scales[..., None]).reshape(shape)
