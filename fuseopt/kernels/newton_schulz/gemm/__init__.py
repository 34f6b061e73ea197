"""The NS GEMM ``X' = a·X + B X``, with the ``a·X`` term fused into its epilogue.

B is (m, m) and X is (m, n), batched (B, ·, ·). The ``a·X`` term is added in
the GEMM's epilogue: the output tile (i, j) also reads X's tile (i, j) (which
is the tile the K loop reads at k = i for its B-column slice, but with the
output's columns) and adds ``a·X`` in fp32 before the single rounding. This
saves one read-modify-write pass of X against an unfused ``a*X + dot``.

Which one runs by default: the NS dispatch (``TiledConfig.matmul``) uses
XLA's dot for this product unless a config asks for this kernel, because
cuBLAS/XLA's TPU GEMM are the tuned baseline for a dense (non-symmetric)
product, XLA fuses the scaled add into its GEMM output fusion, and the
measured Pallas-Triton GEMM prototype was only at parity (docs/measurements.md)
(beats XLA at 2048³/4096³, loses at 8192³). The benchmark runs both
(``fuseopt[triton+pallas_update]``) so the choice can be flipped on data.

Backends, one module each: :mod:`.triton`, :mod:`.mosaic_tpu`, :mod:`.mosaic_gpu`
(sm_90, bf16/f16, writes the input's dtype; the tiled NS path's default GEMM
on that backend); the reference in :mod:`.reference`.

Sizes that are not multiples of the blocks are zero-padded and sliced back
(exact: zero rows/columns contribute nothing).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fuseopt.kernels import dispatch
from fuseopt.kernels.newton_schulz.gemm import mosaic_gpu
from fuseopt.kernels.newton_schulz.gemm import mosaic_tpu
from fuseopt.kernels.newton_schulz.gemm import triton
from fuseopt.kernels.newton_schulz.gemm.mosaic_gpu import MosaicGPUConfig
from fuseopt.kernels.newton_schulz.gemm.mosaic_tpu import MosaicTPUConfig
from fuseopt.kernels.newton_schulz.gemm.reference import gemm_reference
from fuseopt.kernels.newton_schulz.gemm.triton import TritonConfig

F32 = jnp.float32

# The backends of this piece, by name: each module holds its kernel, Config,
# heuristic and SEARCH_SPACE.
BACKENDS = {"triton": triton, "mosaic_tpu": mosaic_tpu, "mosaic_gpu": mosaic_gpu}


def _backend(implementation: str):
  return dispatch.piece_backend(BACKENDS, implementation, "gemm")


def heuristic(implementation: str, batch: int, m: int, n: int):
  """The config backend ``implementation`` picks for ``(batch, m, n)``."""
  return _backend(implementation).heuristic(batch, m, n)


def granules(config) -> tuple[int, int]:
  """(multiple for m, multiple for n)."""
  return max(config.bm, config.bk), config.bn


def gemm(b, x, *, a=0.0, out_dtype=None, implementation="triton", interpret=False, config=None):
  """a·X + B X for B (batch, m, m) and X (batch, m, n)."""
  if x.ndim != 3 or b.ndim != 3 or b.shape != (x.shape[0], x.shape[1], x.shape[1]):
    raise ValueError(f"gemm: expected b (batch, m, m) and x (batch, m, n), got {b.shape}, {x.shape}")
  batch, m, n = x.shape
  out_dtype = jnp.dtype(out_dtype or x.dtype)
  backend = _backend(implementation)
  config = config or backend.heuristic(batch, m, n)
  gm, gn = granules(config)
  pm, pn = -m % gm, -n % gn
  if pm or pn:
    x = jnp.pad(x, ((0, 0), (0, pm), (0, pn)))
    b = jnp.pad(b, ((0, 0), (0, pm), (0, pm)))
  has_a = isinstance(a, jax.core.Tracer) or float(a) != 0.0
  coef = jnp.stack([jnp.asarray(a, F32)] + [jnp.zeros((), F32)] * 3)
  kwargs = dict(has_a=has_a, out_dtype=out_dtype, config=config, interpret=interpret)
  out = backend.gemm(b, x, coef, **kwargs)
  return out[:, :m, :n] if (pm or pn) else out


matmul = gemm
