"""What the fused Newton–Schulz backends share: the kernel body (the
coefficients baked in, the steps unrolled) and the launch over the batch."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from fuseopt.kernels import pallas_common
from fuseopt.kernels.newton_schulz.sym.shared import NT, precision

F32 = jnp.float32


def _kernel(x_ref, o_ref, *, table):
  dtype = x_ref.dtype
  prec = precision(dtype)
  x = x_ref[...]
  for a, b, c in table:
    g = jax.lax.dot_general(x, x, NT, preferred_element_type=F32, precision=prec).astype(dtype)
    p = (c * jnp.dot(g, g, preferred_element_type=F32, precision=prec)
         + b * g.astype(F32)).astype(dtype)
    x = (jnp.dot(p, x, preferred_element_type=F32, precision=prec) + a * x.astype(F32)).astype(dtype)
  o_ref[...] = x


def launch(xp, table, *, compiler_params, interpret):
  """One program per matrix of the padded batch ``xp`` (B, mp, np)."""
  batch, mp, np_ = xp.shape
  return pl.pallas_call(
      functools.partial(_kernel, table=table),
      out_shape=jax.ShapeDtypeStruct((batch, mp, np_), xp.dtype),
      grid=(batch,),
      in_specs=[pl.BlockSpec((None, mp, np_), lambda b: (b, 0, 0))],
      out_specs=pl.BlockSpec((None, mp, np_), lambda b: (b, 0, 0)),
      compiler_params=compiler_params,
      interpret=interpret,
      name="fuseopt_ns_fused",
      # Per step: X Xᵀ (2m²n), A·A with b·A (2m³ + 2m²), B X with a·X (2m²n + 2mn).
      cost_estimate=pallas_common.cost_estimate(
          flops=batch * len(table) * (4 * mp * mp * np_ + 2 * mp**3 + 2 * mp * mp + 2 * mp * np_),
          bytes_accessed=2 * pallas_common.nbytes(xp)),
  )(xp)
