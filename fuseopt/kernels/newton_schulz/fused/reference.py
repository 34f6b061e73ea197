"""The whole Newton–Schulz iteration in one kernel: the reference."""

from __future__ import annotations

import jax.numpy as jnp

F32 = jnp.float32


def ns_fused_reference(x, table):
  """The iteration on an already normalised batch (B, m, n), m <= n, in x.dtype."""
  for a, b, c in table:
    g = jnp.einsum("bik,bjk->bij", x, x, preferred_element_type=F32).astype(x.dtype)
    p = (c * jnp.einsum("bij,bjk->bik", g, g, preferred_element_type=F32)
         + b * g.astype(F32)).astype(x.dtype)
    x = (jnp.einsum("bij,bjk->bik", p, x, preferred_element_type=F32)
         + a * x.astype(F32)).astype(x.dtype)
  return x
