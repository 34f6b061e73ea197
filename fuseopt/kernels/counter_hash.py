"""The counter hash behind fuseopt's stochastic rounding.

Random bits are a pure function of ``(seed, index)`` where ``index`` is the
element's position in the *whole logical array* (row-major flat index plus an
``offset``), never its position in a block or a shard. A rounding is therefore
identical whatever the block size, grid, vmap or sharding that computes it.

The hash is murmur3's 32-bit finaliser (``fmix32``) applied to
``index * 0x9E3779B1 + seed`` in uint32 arithmetic with wrap-around (indices
beyond 2**32 wrap). All functions here are plain ``jnp`` on uint32 values, so
they run unchanged inside Pallas kernels (Triton and Mosaic) and in XLA.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

GOLDEN = 0x9E3779B1
_M1 = 0x85EBCA6B
_M2 = 0xC2B2AE35

# Stream ids: each stream of an optimizer step gets its own seed, hence an
# independent 16-bit lane of random bits for every element.
STREAM_PARAM = 0
STREAM_MU = 1
STREAM_NU = 2


def uint32_scalar(value, *, name: str, owner: str) -> jax.Array:
  """``value`` as a uint32 scalar, for a seed or an index offset.

  Every value of uint32 is valid: Python and NumPy integers in [0, 2**32)
  (those in [2**31, 2**32) do not fit jax's default int32, so they are
  converted through NumPy's uint32, never through ``jnp.asarray``), and
  integer jax arrays of shape ``()``. Concrete values outside that range,
  floats, bools and non-scalars raise an error naming ``owner``'s argument
  ``name``; a traced integer is taken modulo 2**32 (it cannot be checked).
  """
  where = f"{owner}: {name}"
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{where} must be an integer in [0, 2**32), got the bool {value!r}")
  if isinstance(value, numbers.Integral):
    v = int(value)
    if not 0 <= v < 2**32:
      raise ValueError(f"{where} must be an integer in [0, 2**32), got {v}")
    return jnp.asarray(np.uint32(v))
  if isinstance(value, numbers.Real):
    raise TypeError(f"{where} must be an integer in [0, 2**32), got the float {value!r} "
                    "(it would be truncated)")
  arr = value if isinstance(value, jax.Array) else np.asarray(value)
  if arr.ndim or not jnp.issubdtype(arr.dtype, jnp.integer):
    raise TypeError(f"{where} must be an integer scalar in [0, 2**32), got "
                    f"{arr.dtype}{list(arr.shape)}")
  if not isinstance(arr, jax.core.Tracer):
    v = int(np.asarray(arr))
    if not 0 <= v < 2**32:
      raise ValueError(f"{where} must be an integer in [0, 2**32), got {v}")
  return jnp.asarray(arr).astype(jnp.uint32)


def _u32(v) -> jax.Array:
  return jnp.asarray(v).astype(jnp.uint32) if not isinstance(v, int) else jnp.uint32(v & 0xFFFFFFFF)


def fmix32(h: jax.Array) -> jax.Array:
  """murmur3's 32-bit finaliser (a bijection on uint32)."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(_M1)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(_M2)
  h = h ^ (h >> 16)
  return h


def hash_bits(index: jax.Array, seed: jax.Array) -> jax.Array:
  """32 random bits for each uint32 ``index`` under a uint32 ``seed``."""
  return fmix32(index * jnp.uint32(GOLDEN) + seed)


def derive_seed(seed, step, leaf_index, stream) -> jax.Array:
  """The uint32 seed of one (step, leaf, stream) of an optimizer.

  ``fmix32(fmix32(fmix32(seed ^ step * GOLDEN) + leaf * M1) + stream * M2)``:
  each argument passes through the finaliser before the next is mixed in, so
  neighbouring steps, leaves and streams get unrelated seeds.
  """
  s = _u32(seed) ^ (_u32(step) * jnp.uint32(GOLDEN))
  s = fmix32(s) + _u32(leaf_index) * jnp.uint32(_M1)
  s = fmix32(s) + _u32(stream) * jnp.uint32(_M2)
  return fmix32(s)


def round_fp32_bits_to_bf16(bits: jax.Array, rand: jax.Array) -> jax.Array:
  """Stochastically rounds fp32 bit patterns; returns the bf16 pattern (uint32).

  ``bits`` are fp32 patterns as uint32, ``rand`` uint32 whose low 16 bits are
  used. The result is the upper half-word of the rounded pattern, still held
  in a uint32 (callers narrow it to uint16 and bitcast to bf16).

  - finite: add 16 random bits below the kept mantissa and truncate, so
    P(round away from zero) = discarded fraction / 2**16 exactly; the sign bit
    is never touched (the magnitude cannot carry into it), so the sign is kept
    and -0 stays -0; subnormals round like any other value; a carry into the
    all-ones exponent (Inf) is clamped to the largest finite bf16.
  - non-finite: Inf stays Inf; NaN stays NaN whatever its payload (the quiet
    bit is set, since truncating a payload held in the low bits alone would
    otherwise turn the NaN into an Inf).
  """
  mag = bits & jnp.uint32(0x7FFFFFFF)
  nonfinite = mag >= jnp.uint32(0x7F800000)
  rounded = (mag + (rand & jnp.uint32(0xFFFF))) >> 16
  # A finite magnitude rounds to at most 0x7F80 (Inf's pattern): a minimum
  # clamps that one value to the largest finite bf16, 0x7F7F. Signed (the
  # values are below 2**31): Mosaic TPU cannot legalize an unsigned min
  # ('arith.minui').
  i32 = lambda v: jax.lax.bitcast_convert_type(v, jnp.int32)
  rounded = jax.lax.bitcast_convert_type(jnp.minimum(i32(rounded), jnp.int32(0x7F7F)), jnp.uint32)
  passthrough = (mag >> 16) | jnp.where(mag > jnp.uint32(0x7F800000),
                                        jnp.uint32(0x0040), jnp.uint32(0))
  return ((bits >> 16) & jnp.uint32(0x8000)) | jnp.where(nonfinite, passthrough, rounded)


def bf16_from_bits(half: jax.Array) -> jax.Array:
  """bf16 values from bf16 patterns held in uint32."""
  return jax.lax.bitcast_convert_type(half.astype(jnp.uint16), jnp.bfloat16)


def round_with_bits(x: jax.Array, rand: jax.Array) -> jax.Array:
  """fp32 ``x`` → bf16, rounded with the low 16 bits of the uint32 ``rand``
  (:func:`stochastic_round_values` given its hash; two values can share one
  hash, each with a half of it)."""
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  return bf16_from_bits(round_fp32_bits_to_bf16(bits, rand))


def stochastic_round_values(x: jax.Array, index: jax.Array, seed: jax.Array) -> jax.Array:
  """fp32 ``x`` → bf16, rounded with the hash of (``index``, ``seed``).

  Every backend's kernel calls this. All the arithmetic is on 32-bit lanes;
  the rounded half-word is narrowed by an integer truncation (uint32 ->
  uint16) and a same-width bitcast, never by a float conversion: widening the
  pattern to fp32 and converting it to bf16 is exact for numbers, but a float
  conversion may canonicalise a NaN (jax 0.11.2's TPU interpreter turns the
  pattern 0xFFFFFFFF into 0xFFC0 where the other backends keep 0xFFFF), and
  NaN bits must agree on every backend too.
  """
  return round_with_bits(x, hash_bits(index, seed))
