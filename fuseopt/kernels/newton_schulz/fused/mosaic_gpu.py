"""The whole Newton–Schulz iteration in one kernel: the Mosaic GPU backend (sm_90).

One CTA per matrix, so only for *small* matrices (:func:`fits`: m padded to
64 at most 128, X, A and B within the H200's shared memory, e.g. 128 × 512
or 64 × 1536). X (as column chunks of ``bn``, one TMA copy each), A and B
live in shared memory for every step; each product is a warpgroup MMA
(``plgpu.wgmma``) computed ``bn`` output columns at a time into an fp32
register accumulator (an m × bn accumulator: 64 registers a thread for
m = 128, bn = 64). The coefficients are baked in (static), the steps
unrolled. bf16 or f16 only; the tile layout and the sm_90 rule are
:mod:`..mosaic_gpu_common`'s. Larger matrices take the tiled kernels.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from fuseopt.kernels import dispatch
from fuseopt.kernels.newton_schulz import mosaic_gpu_common as common
from fuseopt.kernels.newton_schulz.mosaic_gpu_common import F32

MAX_M = 128          # m padded to 64 or 128 (one warpgroup's MMA rows)


@dataclasses.dataclass(frozen=True)
class MosaicGPUConfig:
  """Every product is computed ``bn`` output columns at a time, and X is
  held as column chunks of ``bn``."""
  bn: int = 64

  def __post_init__(self):
    if self.bn not in (64, 128):
      raise ValueError(f"bn must be 64 or 128, got {self.bn}")


Config = MosaicGPUConfig
SEARCH_SPACE = (MosaicGPUConfig(64), MosaicGPUConfig(128))


def heuristic(m: int = MAX_M, n: int = 0) -> MosaicGPUConfig:
  # 128 × 128 accumulators with their epilogue operand spill registers
  # inside the unrolled steps; 64-column ones do not.
  del n
  return MosaicGPUConfig(64 if common.round_up(m, common.GRANULE) > 64 else 128)


def padded_shape(m: int, n: int, config: MosaicGPUConfig | None = None) -> tuple[int, int]:
  """m to a multiple of 64, n to the column chunk."""
  bn = (config or heuristic(m, n)).bn
  return common.round_up(m, common.GRANULE), common.round_up(n, bn)


def shared_memory_bytes(mp: int, np_: int, itemsize: int = 2) -> int:
  """X, A and B in shared memory."""
  return itemsize * (mp * np_ + 2 * mp * mp)


def fits(m: int, n: int, itemsize: int = 2) -> bool:
  """Whether the kernel takes an (m, n) matrix (m <= n)."""
  mp, np_ = padded_shape(m, n)
  return mp <= MAX_M and shared_memory_bytes(mp, np_, itemsize) <= common.SHARED_MEMORY_BYTES


def supports(call) -> str | None:
  """An sm_90 GPU, or any machine in interpret mode."""
  return dispatch.mosaic_gpu_reason(call)


def _kernel(x_gmem, o_gmem, x_smem, a_smem, b_smem, bar, *, table, mp, bn, chunks):
  from jax.experimental.pallas import mosaic_gpu as plgpu
  dtype = x_smem.dtype
  b = jax.lax.axis_index("batch")
  rows = pl.ds(b * mp, mp)
  cols = lambda h: pl.ds(h * bn, bn)
  for c in range(chunks):
    plgpu.copy_gmem_to_smem(x_gmem.at[rows, cols(c)], x_smem.at[c], bar.at[c])
  for c in range(chunks):
    plgpu.barrier_wait(bar.at[c])

  hb = min(bn, mp)   # the column block of the m × m products
  hcols = lambda h: pl.ds(h * hb, hb)

  def product(fn, width):
    return pl.run_scoped(fn, plgpu.ACC((mp, width), F32))

  for a, bc, cc in table:
    for h in range(mp // hb):
      def gram(acc_ref, h=h):   # A[:, h] = X X[h rows]ᵀ, summed over X's column chunks
        @pl.loop(0, chunks)
        def _(c):
          plgpu.wgmma(acc_ref, x_smem.at[c], x_smem.at[c].at[hcols(h)].T)
          plgpu.wgmma_wait(1)   # one MMA in flight (X is not overwritten here)
        plgpu.wgmma_wait(0)
        return acc_ref[...].astype(dtype)
      tile = product(gram, hb)
      # A twice: an MMA cannot take one shared-memory ref as both operands
      # (B then overwrites the second copy).
      a_smem.at[:, hcols(h)][...] = tile
      b_smem.at[:, hcols(h)][...] = tile
    plgpu.commit_smem()
    for h in range(mp // hb):
      def poly(acc_ref, h=h, bc=bc, cc=cc):   # B = b·A + c·A A (A symmetric), by columns
        plgpu.wgmma(acc_ref, a_smem, b_smem.at[:, hcols(h)])
        plgpu.wgmma_wait(0)
        return (cc * acc_ref[...] + bc * a_smem.at[:, hcols(h)][...].astype(F32)).astype(dtype)
      # Column block h of B needs only column block h of the copy: overwritten.
      b_smem.at[:, hcols(h)][...] = product(poly, hb)
    plgpu.commit_smem()
    @pl.loop(0, chunks)
    def _(c, a=a):
      def update(acc_ref):   # X' = a·X + B X; chunk c needs only the old chunk c
        plgpu.wgmma(acc_ref, b_smem, x_smem.at[c])
        plgpu.wgmma_wait(0)
        return (acc_ref[...] + a * x_smem.at[c][...].astype(F32)).astype(dtype)
      x_smem.at[c][...] = product(update, bn)
    plgpu.commit_smem()
  for c in range(chunks):
    plgpu.copy_smem_to_gmem(x_smem.at[c], o_gmem.at[rows, cols(c)])
  plgpu.wait_smem_to_gmem(0)


def run(xp, table, *, config: MosaicGPUConfig, interpret):
  """Every NS step on a normalised batch (batch, m, n), m <= n, bf16 or f16,
  padded by :func:`padded_shape`; the columns are padded further to
  ``config.bn`` when the config's chunk is not the heuristic's (exact for
  NS) and sliced back."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  common.check_dtype("newton_schulz_fused", xp)
  if not isinstance(config, MosaicGPUConfig):
    raise TypeError(f"newton_schulz_fused: implementation='mosaic_gpu' takes a "
                    f"fused.mosaic_gpu.MosaicGPUConfig (FusedMosaicGPUConfig), got {config!r}")
  batch, m, n = xp.shape
  mp, np_ = padded_shape(m, n, config)
  if mp > MAX_M or shared_memory_bytes(mp, np_, xp.dtype.itemsize) > common.SHARED_MEMORY_BYTES:
    raise ValueError(f"newton_schulz_fused (mosaic_gpu): a {m} × {n} matrix does not fit one "
                     f"CTA's shared memory (padded {mp} × {np_})")
  bn = config.bn
  x = jnp.pad(xp, ((0, 0), (0, mp - m), (0, np_ - n))) if (mp, np_) != (m, n) else xp
  tr = common.transforms()
  chunks = np_ // bn
  out = plgpu.kernel(
      functools.partial(_kernel, table=table, mp=mp, bn=bn, chunks=chunks),
      out_type=jax.ShapeDtypeStruct((batch * mp, np_), x.dtype),
      grid=(batch,),
      grid_names=("batch",),
      scratch_types=dict(x_smem=plgpu.SMEM((chunks, mp, bn), x.dtype, transforms=tr),
                         a_smem=plgpu.SMEM((mp, mp), x.dtype, transforms=tr),
                         b_smem=plgpu.SMEM((mp, mp), x.dtype, transforms=tr),
                         bar=plgpu.Barrier(num_barriers=chunks)),
      interpret=interpret or None,
      kernel_name="fuseopt_ns_fused_mgpu",
  )(x.reshape(batch * mp, np_))
  out = out.reshape(batch, mp, np_)
  return out[:, :m, :n] if (mp, np_) != (m, n) else out
