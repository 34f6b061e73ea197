"""What the blockwise-moment kernel tests (8-bit and 4-bit, every backend)
share: the hyperparameters, bitwise comparison of codes and scales, random
moments quantised by the format itself, two jitted steps, the parameter's
tolerance."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from fuseopt.kernels import adam_update, counter_hash
from fuseopt.kernels.adam import formats
from tests.kernels import harness

F32, BF16 = jnp.float32, jnp.bfloat16
HYPER = dict(learning_rate=3e-3, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0,
             weight_decay=0.1, seed=17, leaf_index=5)


def same(a, b, what=""):
  """Bitwise equal: codes (1-byte integers) exactly, fp32 scales and
  parameters NaN-safe."""
  a, b = np.asarray(a), np.asarray(b)
  assert a.dtype == b.dtype and a.shape == b.shape, what
  if a.dtype.itemsize == 1:
    np.testing.assert_array_equal(a, b, err_msg=what)
  else:
    harness.assert_bitwise_equal(a, b, what)


@functools.partial(jax.jit, static_argnums=(1, 2))
def moments(key, shape, fmt: str):
  """Moments in format ``fmt`` ("int8", "int4") of random fp32 ones (``mu``
  of both signs, ``nu`` spread over several decades, so codes sit on many
  levels), quantised once by the format's own functions (one program)."""
  k = jax.random.split(key, 2)
  bits = counter_hash.hash_bits(
      jnp.arange(math.prod(shape), dtype=jnp.uint32).reshape(shape), jnp.uint32(7))
  f = formats.BY_NAME[fmt]
  return (f.quantize(0.1 * jax.random.normal(k[0], shape), bits, signed=True),
          f.quantize(0.01 * jax.random.uniform(k[1], shape) ** 4, bits, signed=False))


def steps(impl, p, g, mu, nu, n=2, **kw):
  """``n`` jitted steps of ``adam_update`` in interpret mode, gradient ``g * c`` at step ``c``."""
  f = jax.jit(lambda p, g, mu, nu, c: adam_update(p, g, mu, nu, count=c, implementation=impl,
                                                  interpret=True, **HYPER, **kw))
  for c in range(1, n + 1):
    p, mu, nu = f(p, g * c, mu, nu, c)
  return p, mu, nu


def inputs(request, shape, fmt: str, p_dtype=F32, g_dtype=F32):
  """Fresh ``(p, g, mu, nu)``: ``p`` None where ``p_dtype`` is (the direction)."""
  k = jax.random.split(harness.fresh_key(request), 3)
  p = jax.random.normal(k[0], shape).astype(p_dtype) if p_dtype else None
  g = jax.random.normal(k[1], shape).astype(g_dtype)
  return (p, g) + moments(k[2], shape, fmt)


def params_close(got, want, what="params"):
  """The parameter (or direction) within the few fp32 ulps two programs of
  Adam's division chain may differ by; bf16, one bf16 ulp (an fp32 ulp can
  move the stochastic rounding's threshold)."""
  a, b = np.asarray(got, np.float32), np.asarray(want, np.float32)
  if got.dtype == BF16:
    assert np.all(np.abs(a - b) <= np.abs(b) * 2.0 ** -7), what
  else:
    harness.assert_close(a, b, rtol=1e-6, atol=1e-7 * float(np.abs(b).max()), what=what)


def wide_nu(block: int):
  """Blocks of ``block`` second moments whose largest spans 1e-24 .. 1e30,
  each with a 0 and elements down to 12 decades below it (all normal fp32:
  XLA and the GPUs flush subnormals to zero), and hash bits to round them."""
  maxima = 10.0 ** np.arange(-24, 31, 3)
  rel = np.concatenate([[1.0, 0.0], 10.0 ** -np.linspace(0, 12, block - 2)])
  v = jnp.asarray(maxima[:, None] * rel[None, :], F32)
  bits = counter_hash.hash_bits(jnp.arange(v.size, dtype=jnp.uint32).reshape(v.shape),
                                jnp.uint32(5))
  return v, bits


def tiny_nu(block: int):
  """Blocks of ``block`` second moments whose largest runs from the smallest
  normal fp32 (2**-126) up by factors of 8, each down to 27 binary orders
  below it, floored at 2**-126 (nothing subnormal), and hash bits to round
  them: the blocks whose levels would fall into the subnormals."""
  tiny = np.float32(2.0 ** -126)
  maxima = tiny * np.float32(2.0) ** np.arange(0, 28, 3, dtype=np.float32)
  rel = np.float32(2.0) ** -np.linspace(0, 27, block, dtype=np.float32)
  v = jnp.asarray(np.maximum(maxima[:, None] * rel[None, :], tiny), F32)
  bits = counter_hash.hash_bits(jnp.arange(v.size, dtype=jnp.uint32).reshape(v.shape),
                                jnp.uint32(9))
  return v, bits

