"""The NS GEMM ``a·X + B X``: the reference (batched, fp32 accumulation and
epilogue, one rounding), and the cost the kernels declare."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fuseopt.kernels import pallas_common

F32 = jnp.float32


def gemm_reference(b, x, *, a=0.0, out_dtype=None):
  """a·X + B X, batched, fp32 accumulation and epilogue, one rounding."""
  out_dtype = out_dtype or x.dtype
  precision = jax.lax.Precision.HIGHEST if x.dtype == F32 else None
  acc = jnp.einsum("bij,bjk->bik", b, x, preferred_element_type=F32, precision=precision)
  if a:
    acc = acc + a * x.astype(F32)
  return acc.astype(out_dtype)


def gemm_cost(b, x, out_dtype, has_a):
  """2m FLOPs per output of B X, 2 more for the a·X epilogue; B and X read
  once, the output written once."""
  batch, m, n = x.shape
  out = jax.ShapeDtypeStruct((batch, m, n), out_dtype)
  return pallas_common.cost_estimate(flops=batch * m * n * (2 * m + (2 if has_a else 0)),
                                bytes_accessed=pallas_common.nbytes(b, x, out))
