"""NS polynomial ``B = b·A + c·A·A`` for the symmetric Gram matrix A.

Because A = Aᵀ, ``A·A = A·Aᵀ`` is itself a Gram product, so B is the
symmetric kernel of :mod:`.gram` on the square A with ``alpha=c`` and
``beta=b``: only the upper-triangle tiles of B are computed (the tile of A
needed by the ``b·A`` term is read in the epilogue) and each program writes
the mirror tile. Triton and Mosaic-TPU backends, configs, heuristics and
search spaces are those of :mod:`.gram` (the K loop runs over m).
"""

from __future__ import annotations

import jax.numpy as jnp

from fuseopt.kernels.ns import gram

TritonConfig = gram.TritonConfig
MosaicConfig = gram.MosaicConfig
TRITON_SEARCH_SPACE = gram.TRITON_SEARCH_SPACE
MOSAIC_SEARCH_SPACE = gram.MOSAIC_SEARCH_SPACE
heuristic = gram.heuristic


def poly_reference(a, *, b, c, out_dtype=None):
  """b·A + c·A A (A (batch, m, m) symmetric), fp32 accumulation, one rounding."""
  out_dtype = out_dtype or a.dtype
  acc = c * jnp.einsum("bij,bjk->bik", a, a, preferred_element_type=jnp.float32)
  return (acc + b * a.astype(jnp.float32)).astype(out_dtype)


def poly(a, *, b, c, out_dtype=None, implementation="triton", interpret=False, config=None):
  """b·A + c·A A for a symmetric A of shape (batch, m, m)."""
  if a.ndim != 3 or a.shape[1] != a.shape[2]:
    raise ValueError(f"poly: a must have shape (batch, m, m), got {a.shape}")
  return gram.sym(a, alpha=c, beta=b, out_dtype=out_dtype, implementation=implementation,
                  interpret=interpret, config=config)
