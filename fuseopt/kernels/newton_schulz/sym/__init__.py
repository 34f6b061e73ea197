"""Symmetric product ``alpha·X Xᵀ + beta·X + gamma·I`` (the NS Gram and polynomial products).

``X Xᵀ`` is symmetric, so only the tiles (i, j) with i <= j are computed; the
program that computes tile (i, j) also writes its transpose to (j, i). The
same kernel serves three NS products:

- the Gram matrix ``A = X Xᵀ`` (alpha=1);
- the polynomial ``B = b·A + c·A A`` (A symmetric, so ``A A = A Aᵀ``:
  alpha=c, beta=b on the square A; see :mod:`.poly`);
- Gram NS's ``Z = a·I + b·R + c·R R`` (gamma=a).

(:func:`poly` names the second use.)

With ``beta != 0`` the input must be square and *symmetric* (it is A or R in
every use): the mirror tile carries the transposed ``beta·X`` tile.
Products accumulate in fp32; the epilogue runs in fp32 and the tile is
rounded once to the output dtype.

Backends, one module each: :mod:`.triton`, :mod:`.mosaic_tpu`, :mod:`.mosaic_gpu`
(sm_90, bf16/f16, writes the input's dtype); the reference in :mod:`.reference`.

Sizes that are not multiples of the blocks are zero-padded by the wrapper
(zero rows and columns do not change X Xᵀ's valid part) and sliced back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fuseopt.kernels import dispatch
from fuseopt.kernels.newton_schulz.sym import mosaic_gpu
from fuseopt.kernels.newton_schulz.sym import mosaic_tpu
from fuseopt.kernels.newton_schulz.sym import triton
from fuseopt.kernels.newton_schulz.sym.mosaic_gpu import MosaicGPUConfig
from fuseopt.kernels.newton_schulz.sym.mosaic_tpu import MosaicTPUConfig
from fuseopt.kernels.newton_schulz.sym.mosaic_tpu import upper_pairs
from fuseopt.kernels.newton_schulz.sym.reference import poly_reference
from fuseopt.kernels.newton_schulz.sym.reference import sym_reference
from fuseopt.kernels.newton_schulz.sym.shared import num_pairs
from fuseopt.kernels.newton_schulz.sym.shared import precision
from fuseopt.kernels.newton_schulz.sym.triton import H200_SHARED_MEMORY_OPTIN
from fuseopt.kernels.newton_schulz.sym.triton import TritonConfig
from fuseopt.kernels.newton_schulz.sym.triton import pair_from_index
from fuseopt.kernels.newton_schulz.sym.triton import triton_shared_memory_bytes

F32 = jnp.float32

# The backends of this piece, by name: each module holds its kernel, Config,
# heuristic and SEARCH_SPACE.
BACKENDS = {"triton": triton, "mosaic_tpu": mosaic_tpu, "mosaic_gpu": mosaic_gpu}


def _backend(implementation: str, what: str):
  return dispatch.piece_backend(BACKENDS, implementation, what)


def heuristic(implementation: str, batch: int, m: int, k: int):
  """The config backend ``implementation`` picks for ``(batch, m, k)``."""
  return _backend(implementation, "sym").heuristic(batch, m, k)


def granules(config) -> tuple[int, int]:
  """(row, K) multiples the kernel needs; a square input needs max of both."""
  return config.bm, config.bk


def _is_not(v, const) -> bool:
  """Whether a coefficient term is present: a traced value always is."""
  if isinstance(v, jax.core.Tracer):
    return True
  return float(v) != const


def _pad_to(x, m_mult, k_mult):
  _, m, k = x.shape
  pm, pk = -m % m_mult, -k % k_mult
  if pm or pk:
    x = jnp.pad(x, ((0, 0), (0, pm), (0, pk)))
  return x


def sym(x, *, alpha=1.0, beta=0.0, gamma=0.0, out_dtype=None, implementation="triton",
        interpret=False, config=None):
  """alpha·X Xᵀ + beta·X + gamma·I for X of shape (B, m, k) (square if beta/gamma;
  symmetric if beta, since the lower triangle is the mirror of the upper).

  ``interpret`` is the pallas_call value (``True`` or ``pltpu.InterpretParams``).
  """
  if x.ndim != 3:
    raise ValueError(f"sym: x must have shape (batch, m, k), got {x.shape}")
  batch, m, k = x.shape
  square = _is_not(beta, 0.0) or _is_not(gamma, 0.0)
  if square and m != k:
    raise ValueError(f"sym: beta/gamma need a square x, got {x.shape}")
  out_dtype = jnp.dtype(out_dtype or x.dtype)
  backend = _backend(implementation, "sym")
  config = config or backend.heuristic(batch, m, k)
  if square:
    g = max(config.bm, config.bk)
    xp = _pad_to(x, g, g)
  else:
    xp = _pad_to(x, config.bm, config.bk)
  terms = (_is_not(alpha, 1.0), _is_not(beta, 0.0), _is_not(gamma, 0.0))
  coef = jnp.stack([jnp.asarray(v, F32) for v in (alpha, beta, gamma, 0.0)])
  kwargs = dict(terms=terms, out_dtype=out_dtype, config=config, interpret=interpret)
  out = backend.sym(xp, coef, **kwargs)
  return out[:, :m, :m] if out.shape[1] != m else out


def poly(a, *, b, c, out_dtype=None, implementation="triton", interpret=False, config=None):
  """The NS polynomial ``b·A + c·A A`` for a symmetric A of shape (batch, m, m).

  Because A = Aᵀ, ``A·A = A·Aᵀ`` is itself a Gram product, so B is :func:`sym`
  on the square A with ``alpha=c`` and ``beta=b``: only the upper-triangle
  tiles of B are computed (the tile of A needed by the ``b·A`` term is read
  in the epilogue) and each program writes the mirror tile.
  """
  if a.ndim != 3 or a.shape[1] != a.shape[2]:
    raise ValueError(f"poly: a must have shape (batch, m, m), got {a.shape}")
  return sym(a, alpha=c, beta=b, out_dtype=out_dtype, implementation=implementation,
             interpret=interpret, config=config)
