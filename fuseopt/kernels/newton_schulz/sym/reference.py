"""The symmetric product ``alpha·X Xᵀ + beta·X + gamma·I`` and the NS
polynomial ``B = b·A + c·A·A``: the references (plain ``jnp``, fp32
accumulation, one rounding)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def sym_reference(x, *, alpha=1.0, beta=0.0, gamma=0.0, out_dtype=None):
  """alpha·X Xᵀ + beta·X + gamma·I for batched X (B, m, k); fp32 accumulation."""
  out_dtype = out_dtype or x.dtype
  precision = jax.lax.Precision.HIGHEST if x.dtype == F32 else None
  acc = alpha * jnp.einsum("bik,bjk->bij", x, x, preferred_element_type=F32, precision=precision)
  if beta:
    acc = acc + beta * x.astype(F32)
  if gamma:
    acc = acc + gamma * jnp.eye(x.shape[-2], dtype=F32)
  return acc.astype(out_dtype)


def poly_reference(a, *, b, c, out_dtype=None):
  """b·A + c·A A (A (batch, m, m) symmetric), fp32 accumulation, one rounding."""
  out_dtype = out_dtype or a.dtype
  acc = c * jnp.einsum("bij,bjk->bik", a, a, preferred_element_type=jnp.float32)
  return (acc + b * a.astype(jnp.float32)).astype(out_dtype)
