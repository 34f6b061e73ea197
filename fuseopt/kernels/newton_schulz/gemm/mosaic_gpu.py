"""The NS GEMM ``a·X + B X``: the Mosaic GPU backend (sm_90).

One program per (bm, bn) output tile of a ``plgpu.kernel`` over (batch, rows,
cols): B's row block and X's column block are pipelined over K through shared
memory with TMA (``plgpu.emit_pipeline``, ``stages`` buffers deep) into a
warpgroup MMA (``plgpu.wgmma``) with an fp32 register accumulator; the
``a·X`` tile is fetched by TMA during the K loop and added in fp32 registers
before the single rounding. ``a`` is a runtime scalar (one compiled kernel
per shape serves every NS step). bf16 or f16 only; the tile layout and the
sm_90 rule are :mod:`..mosaic_gpu_common`'s.

Unlike the Triton and Mosaic TPU backends, the tiled NS path runs this kernel
by default on ``implementation="mosaic_gpu"`` (``TiledConfig.matmul=None``
means ``"pallas"`` there: :class:`~fuseopt.kernels.newton_schulz.tiled.KernelOps`).

Not measured on hardware: the heuristic and the search space follow the
Triton kernel's measured tiles and the H200's shared memory (227 KB a block).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax.experimental import pallas as pl

from fuseopt.kernels import dispatch
from fuseopt.kernels.newton_schulz import mosaic_gpu_common as common
from fuseopt.kernels.newton_schulz.mosaic_gpu_common import F32


@dataclasses.dataclass(frozen=True)
class MosaicGPUConfig:
  """``bm`` × ``bn`` output tiles, ``bk`` a pipeline step, ``stages`` buffers."""
  bm: int = 128
  bn: int = 128
  bk: int = 64
  stages: int = 3

  def __post_init__(self):
    for name in ("bm", "bn", "bk"):
      common.check_block(name, getattr(self, name))
    if self.bm * self.bn > 128 * 128 or self.bn > 256:
      raise ValueError(f"bm × bn must be at most 128 × 128 (an fp32 accumulator of 128 "
                       f"registers a thread) and bn <= 256, got {self.bm} × {self.bn}")
    common.check_stages(self.stages)


Config = MosaicGPUConfig


def shared_memory_bytes(config: MosaicGPUConfig, itemsize: int = 2) -> int:
  """Pipeline buffers ((bm, bk) and (bk, bn) a stage) and one (bm, bn)
  epilogue tile (the ``a·X`` tile, overwritten by the result)."""
  c = config
  return itemsize * (c.stages * (c.bm * c.bk + c.bk * c.bn) + c.bm * c.bn)


# Not measured on hardware: the measured Triton tiles and their neighbours,
# 2-4 stages, as far as the H200's shared memory holds them; bm × bn beyond
# 128 × 128 would spill the accumulator.
SEARCH_SPACE = tuple(
    c for c in (MosaicGPUConfig(bm, bn, 64, s) for bm, bn in ((64, 64), (64, 128), (64, 256),
                                                              (128, 64), (128, 128))
                for s in (2, 3, 4))
    if shared_memory_bytes(c) <= common.SHARED_MEMORY_BYTES)


def heuristic(batch: int, m: int, n: int) -> MosaicGPUConfig:
  if batch * pl.cdiv(m, 128) * pl.cdiv(n, 128) < common.H200_SMS:
    return MosaicGPUConfig(64, 128, 64, 4)
  return MosaicGPUConfig(128, 128, 64, 3)


def supports(call) -> str | None:
  """An sm_90 GPU, or any machine in interpret mode."""
  return dispatch.mosaic_gpu_reason(call)


def _kernel(coef_ref, b_gmem, x_gmem, o_gmem, e_smem, bar, *, m, bm, bn, bk, stages, has_a):
  from jax.experimental.pallas import mosaic_gpu as plgpu

  def body(acc_ref):
    b = jax.lax.axis_index("batch")
    i, j = jax.lax.axis_index("row"), jax.lax.axis_index("col")
    rows, cols = pl.ds(b * m + i * bm, bm), pl.ds(j * bn, bn)
    if has_a:   # the a·X tile, fetched while the K loop runs
      plgpu.copy_gmem_to_smem(x_gmem.at[rows, cols], e_smem, bar.at[0])

    def step(_, b_smem, x_smem):
      plgpu.wgmma(acc_ref, b_smem, x_smem)
      plgpu.wgmma_wait(1)

    tr = common.transforms()
    plgpu.emit_pipeline(
        step, grid=(m // bk,), max_concurrent_steps=stages,
        in_specs=[plgpu.BlockSpec((bm, bk), lambda k: (b * (m // bm) + i, k), transforms=tr,
                                  delay_release=1),
                  plgpu.BlockSpec((bk, bn), lambda k: (b * (m // bk) + k, j), transforms=tr,
                                  delay_release=1)])(b_gmem, x_gmem)
    plgpu.wgmma_wait(0)
    acc = acc_ref[...]
    if has_a:
      plgpu.barrier_wait(bar.at[0])
      acc = acc + coef_ref[0] * e_smem[...].astype(F32)
    e_smem[...] = acc.astype(e_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(e_smem, o_gmem.at[rows, cols])
    plgpu.wait_smem_to_gmem(0)

  pl.run_scoped(body, plgpu.ACC((bm, bn), F32))


def gemm(b, x, coef, *, has_a, out_dtype=None, config: MosaicGPUConfig, interpret):
  """``a·X + B X`` on padded B (batch, m, m), X (batch, m, n) (m a multiple
  of bm and bk, n of bn); ``coef[0]`` = a (fp32). Writes x's dtype."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  common.check_dtype("gemm", x)
  common.check_dtype("gemm", b)
  common.check_out_dtype("gemm", x, out_dtype)
  if not isinstance(config, MosaicGPUConfig):
    raise TypeError(f"gemm: implementation='mosaic_gpu' takes a gemm.mosaic_gpu.MosaicGPUConfig "
                    f"(GemmMosaicGPUConfig), got {config!r}")
  batch, m, n = x.shape
  bm, bn, bk = config.bm, config.bn, config.bk
  if m % bm or m % bk or n % bn:
    raise ValueError(f"gemm (mosaic_gpu): {x.shape} is not a multiple of the blocks {config}")
  out = plgpu.kernel(
      functools.partial(_kernel, m=m, bm=bm, bn=bn, bk=bk, stages=config.stages,
                        has_a=bool(has_a)),
      out_type=jax.ShapeDtypeStruct((batch * m, n), x.dtype),
      grid=(batch, m // bm, n // bn),
      grid_names=("batch", "row", "col"),
      scratch_types=dict(e_smem=plgpu.SMEM((bm, bn), x.dtype, transforms=common.transforms()),
                         bar=plgpu.Barrier(num_barriers=1)),
      interpret=interpret or None,
      kernel_name="fuseopt_ns_gemm_mgpu",
  )(coef, b.astype(x.dtype).reshape(batch * m, m), x.reshape(batch * m, n))
  return out.reshape(batch, m, n)


matmul = gemm
