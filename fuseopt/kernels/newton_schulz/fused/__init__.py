"""The whole Newton–Schulz iteration in one kernel, for matrices that fit on chip.

A small NS spends most of its time in launches (15 GEMMs and their
epilogues; docs/measurements.md has optax's time for 1024² against the FLOP
floor). Here one program holds a whole (normalised) matrix and runs every
step — ``A = X Xᵀ``, ``B = b·A + c·A A``, ``X = a·X + B X`` — in on-chip
memory; the grid runs over the batch, one matrix per program.

- ``mosaic_tpu`` (:mod:`.mosaic_tpu`): the matrix in VMEM, up to about
  1024 × 1024 in bf16;
- ``triton`` (:mod:`.triton`): one CTA per matrix, so only for *small*
  matrices (m <= 128 and m·n <= 16384 once padded to powers of two);
- ``mosaic_gpu`` (:mod:`.mosaic_gpu`, sm_90): one CTA per matrix, X, A and B
  in shared memory, warpgroup MMA; m <= 128, up to 128 × 512 or 64 × 1536.

The coefficients are baked in (static), the steps unrolled. Padding with
zero rows/columns is exact for NS (they stay zero).
"""

from __future__ import annotations

import jax.numpy as jnp

from fuseopt.kernels import dispatch
from fuseopt.kernels.newton_schulz.fused import mosaic_gpu
from fuseopt.kernels.newton_schulz.fused import mosaic_tpu
from fuseopt.kernels.newton_schulz.fused import triton
from fuseopt.kernels.newton_schulz.fused.mosaic_gpu import MosaicGPUConfig
from fuseopt.kernels.newton_schulz.fused.mosaic_tpu import MosaicTPUConfig
from fuseopt.kernels.newton_schulz.fused.reference import ns_fused_reference
from fuseopt.kernels.newton_schulz.fused.triton import TritonConfig

F32 = jnp.float32

# The backends of this piece, by name: each module holds its kernel launch,
# Config, heuristic, SEARCH_SPACE and ``fits``.
BACKENDS = {"triton": triton, "mosaic_tpu": mosaic_tpu, "mosaic_gpu": mosaic_gpu}


def padded_shape(implementation: str, m: int, n: int) -> tuple[int, int]:
  return _backend(implementation).padded_shape(m, n)


def fits(implementation: str, m: int, n: int, itemsize: int = 2) -> bool:
  """Whether backend ``implementation``'s fused kernel takes an (m, n) matrix."""
  if implementation not in BACKENDS:
    return False
  return BACKENDS[implementation].fits(m, n, itemsize)


def heuristic(implementation: str, m: int = 128, n: int = 0):
  """The config backend ``implementation`` picks (Mosaic GPU's by the matrix's m)."""
  return _backend(implementation).heuristic(m, n)


def _backend(implementation: str):
  return dispatch.piece_backend(BACKENDS, implementation, "newton_schulz_fused")


def newton_schulz_fused(x, table, *, implementation, interpret=False, config=None):
  """Runs every NS step on a normalised batch (B, m, n), m <= n, in one kernel."""
  backend = _backend(implementation)
  batch, m, n = x.shape
  mp, np_ = backend.padded_shape(m, n)
  xp = jnp.pad(x, ((0, 0), (0, mp - m), (0, np_ - n))) if (mp, np_) != (m, n) else x
  config = config or backend.heuristic(m, n)
  table = tuple(tuple(float(v) for v in row) for row in table)
  out = backend.run(xp, table, config=config, interpret=interpret)
  return out[:, :m, :n] if (mp, np_) != (m, n) else out
