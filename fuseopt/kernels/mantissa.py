"""bf16 parameters with an fp32-class master: a bf16 half and a signed companion.

A master is kept as two arrays: ``hi``, the bfloat16 parameter the model
reads, and ``lo``, a signed integer companion in the optimizer state. Both
live in the bit patterns of fp32: with ``b`` the master's 32 bits,

- ``hi`` is ``b`` rounded to its top 16 bits, to nearest (ties away from
  zero in magnitude): the bf16 value nearest the master, within half a bf16
  ulp (a bf16 cast of the master, but for ties);
- ``lo`` is the difference ``b - bits(hi)``, an integer in
  ``[-2**15, 2**15)``, stored as

  ======== ========================= ===================================
  ``lo``   master                    bytes a parameter (``hi`` + ``lo``)
  ======== ========================= ===================================
  int16    fp32, bit for bit         4 (an fp32 master copy beside bf16
                                     parameters: 6)
  int8     24 bits: fp32 rounded to  3
           15 mantissa bits (nearest
           even), ``lo = diff >> 8``
  ======== ========================= ===================================

:func:`join` adds the two back as integers, so ``join(*split(x, dtype))`` is
the master exactly: with an int16 companion the fp32 value bit for bit (an
update computed in fp32 and split again loses nothing: the masters follow an
fp32 run of the same optimizer, "mantissa tracking", modded-nanogpt speedrun
record #57, 2025); with an int8 companion the fp32 value rounded to nearest
(even) at 8 mantissa bits below bf16's, i.e. within ``ulp_bf16 / 512`` of it
(FlashOptim, Databricks 2026, arXiv 2602.23349, keeps such an 8-bit error
term beside bf16 weights; its term is the error scaled to the element's ulp
and rounded, ours the bit-pattern difference, so the master is an exact
fp32 value and ``join`` is an integer add). Bit patterns of one sign are
ordered like their values and adjacent patterns are adjacent values, so the
difference is exact across a power of two, and ``hi``'s rounding carries
into the exponent as a bf16 cast does.

Round to nearest, not stochastically: the 24-bit master is a function of the
fp32 value alone, so every program that computes the same fp32 value (a
fused kernel, ``update`` + ``apply_updates``) stores the same bits without
a seed. The cost: an update smaller than half the 24-bit ulp (below
``2**-16`` of the parameter, at most ``2**-15``) leaves the master unchanged.

Special values: ``±0`` and ``±Inf`` split into themselves and ``lo = 0``; a
NaN splits into the quiet NaN ``0x7FC00000`` (its payload is not kept). A
master beyond bf16's largest finite value by half an ulp or more shows as
``±Inf`` in ``hi`` (as a bf16 cast) while ``join`` still returns it.

Plain ``jnp`` on fp32/uint32/int32 values (bit casts, shifts, integer adds),
so the same functions run in XLA and inside the Pallas kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

EXACT = jnp.dtype(jnp.int16)     # companion of an fp32 master, bit for bit
MASTER24 = jnp.dtype(jnp.int8)   # companion of a 24-bit master
COMPANION_DTYPES = (EXACT, MASTER24)
# The name a transform's ``companion=`` takes for each companion dtype.
COMPANION_NAMES = {"int16": EXACT, "int8": MASTER24}

_HI_MASK = 0xFFFF0000
_HALF_HI = 0x8000           # half of hi's last place, in the low 16 bits
_QUIET_NAN = 0x7FC00000


def _shift(dtype) -> int:
  """Low bits of the fp32 pattern a companion of ``dtype`` leaves out."""
  return 16 - 8 * jnp.dtype(dtype).itemsize


def _bits(x32) -> jax.Array:
  return jax.lax.bitcast_convert_type(x32.astype(jnp.float32), jnp.uint32)


def _master_bits(bits, shift: int) -> jax.Array:
  """fp32 ``bits`` as the master a companion keeping ``16 - shift`` of the
  low 16 bits holds: NaN made the quiet NaN (rounding a payload could make
  it an Inf), then rounded to nearest even at bit ``shift``."""
  nan = (bits & 0x7FFFFFFF) > 0x7F800000
  bits = jnp.where(nan, jnp.uint32(_QUIET_NAN), bits)
  if shift == 0:
    return bits
  half = jnp.uint32((1 << (shift - 1)) - 1)
  odd = (bits >> shift) & jnp.uint32(1)
  return (bits + half + odd) & jnp.uint32(~((1 << shift) - 1) & 0xFFFFFFFF)


def master(x32, dtype) -> jax.Array:
  """``x32`` as the fp32 master a companion of ``dtype`` keeps:
  ``join(*split(x32, dtype))`` without the split."""
  return jax.lax.bitcast_convert_type(_master_bits(_bits(x32), _shift(dtype)), jnp.float32)


def join(hi, lo) -> jax.Array:
  """The fp32 master of a bf16 half ``hi`` and its companion ``lo`` (int16
  or int8): ``bits(hi) + (lo << shift)`` as 32-bit integers."""
  shift = _shift(lo.dtype)
  diff = jax.lax.shift_left(lo.astype(jnp.int32), jnp.int32(shift)) if shift else lo.astype(jnp.int32)
  return jax.lax.bitcast_convert_type(
      _bits(hi) + jax.lax.bitcast_convert_type(diff, jnp.uint32), jnp.float32)


def _halves(bits, dtype) -> tuple[jax.Array, jax.Array]:
  shift = _shift(dtype)
  bits = _master_bits(bits, shift)
  hi_bits = (bits + jnp.uint32(_HALF_HI)) & jnp.uint32(_HI_MASK)
  # The high word as an fp32 whose low bits are zero is a bf16 value, so the
  # conversion to bf16 is exact (no rounding happens).
  hi = jax.lax.bitcast_convert_type(hi_bits, jnp.float32).astype(jnp.bfloat16)
  diff = jax.lax.bitcast_convert_type(bits - hi_bits, jnp.int32)
  if shift:
    diff = jax.lax.shift_right_arithmetic(diff, jnp.int32(shift))
  return hi, diff.astype(dtype)


def split(x32, dtype=EXACT) -> tuple[jax.Array, jax.Array]:
  """``x32`` (fp32) as ``(hi, lo)``: the bf16 value nearest its master and
  the ``dtype`` companion. ``join(*split(x, dtype))`` is ``master(x, dtype)``,
  ``x`` itself bit for bit with an int16 companion (NaN: the quiet NaN)."""
  return _halves(_bits(x32), jnp.dtype(dtype))


def split_once(x32, dtype=EXACT) -> tuple[jax.Array, jax.Array]:
  """:func:`split` for code that XLA fuses (not inside a kernel): the fp32
  value's bits pass an ``optimization_barrier`` first.

  Without it XLA may recompute ``x32`` in two fusions, one for each half,
  and a compiler that contracts a multiply and an add into a fused
  multiply-add in one and not the other (XLA's CPU and GPU backends do, per
  fusion) gives the halves of two different values: where the two differ
  across the 16-bit boundary, the joined master is off by a whole bf16 ulp.
  The barrier makes the value once (one uint32 buffer of the leaf's size).
  """
  return _halves(jax.lax.optimization_barrier(_bits(x32)), jnp.dtype(dtype))


def widen_once(g) -> jax.Array:
  """``g`` in fp32 for an fp32 master's step, made once in memory.

  A pass that reads a bf16 gradient and widens it in registers is another
  program than the fp32 run's, which reads fp32; XLA contracts ``a*b + c*d``
  (Adam's ``b1*mu + (1-b1)*g``) into a fused multiply-add choosing the
  product per program, so the two round a rare element differently (seen on
  XLA's CPU backend). Behind an ``optimization_barrier`` the widened
  gradient is an fp32 array, and the pass that reads it the fp32 run's
  program. fp32 (and wider, and non-float) leaves are returned as they are.
  """
  dtype = jnp.result_type(g)
  if not jnp.issubdtype(dtype, jnp.floating) or jnp.finfo(dtype).bits >= 32:
    return g
  return jax.lax.optimization_barrier(jnp.asarray(g).astype(jnp.float32))
