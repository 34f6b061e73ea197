"""The symmetric product ``alpha·X Xᵀ + beta·X + gamma·I``: the Mosaic GPU backend (sm_90).

A ``plgpu.kernel`` over (batch, upper-triangle tile pairs): the program of
pair (i, j), i <= j, streams the row blocks ``X[i·bm:, k]`` and
``X[j·bm:, k]`` through shared memory with TMA (``plgpu.emit_pipeline``,
``stages`` buffers deep) and accumulates ``X_i X_jᵀ`` with ``plgpu.wgmma``
(the second operand is the transposed view of its shared-memory tile) into
an fp32 register accumulator of one warpgroup; the epilogue (alpha scaling,
the ``beta·X`` tile fetched by TMA while the K loop runs, ``gamma`` on the
diagonal) runs in fp32 registers, the tile is rounded once and written twice
through shared memory: to (i, j) and, stored into a transposed view, to
(j, i); a diagonal tile takes its lower half from that transposed view, so
the output is exactly symmetric. The coefficients are runtime scalars (one compiled kernel per shape
serves every NS step). bf16 or f16 only; the tile layout and the sm_90 rule
are :mod:`..mosaic_gpu_common`'s.

Not measured on hardware: the heuristic and the search space follow the
Triton kernel's measured tiles and the H200's shared memory (227 KB a block).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from fuseopt.kernels import dispatch
from fuseopt.kernels.newton_schulz import mosaic_gpu_common as common
from fuseopt.kernels.newton_schulz.mosaic_gpu_common import F32


@dataclasses.dataclass(frozen=True)
class MosaicGPUConfig:
  """``bm`` × ``bm`` output tiles (one warpgroup's fp32 accumulator), ``bk``
  columns of X a pipeline step, ``stages`` pipeline buffers."""
  bm: int = 128
  bk: int = 64
  stages: int = 3

  def __post_init__(self):
    common.check_block("bm", self.bm), common.check_block("bk", self.bk)
    if self.bm > 128:
      raise ValueError(f"bm must be 64 or 128 (one warpgroup's accumulator), got {self.bm}")
    common.check_stages(self.stages)


Config = MosaicGPUConfig


def shared_memory_bytes(config: MosaicGPUConfig, itemsize: int = 2) -> int:
  """Pipeline buffers (two (bm, bk) tiles a stage) and the epilogue's two
  (bm, bm) tiles (the tile and its transpose)."""
  return itemsize * (config.stages * 2 * config.bm * config.bk + 2 * config.bm * config.bm)


# Not measured on hardware: the tiles of the measured Triton kernel (128-row
# tiles, K slices of 64) and their neighbours, 2-4 stages, as far as the
# H200's shared memory holds them.
SEARCH_SPACE = tuple(
    c for c in (MosaicGPUConfig(bm, bk, s) for bm in (64, 128) for bk in (64, 128)
                for s in (2, 3, 4))
    if shared_memory_bytes(c) <= common.SHARED_MEMORY_BYTES)


def heuristic(batch: int, m: int, k: int) -> MosaicGPUConfig:
  # As the Triton kernel: 128-tiles unless that leaves most SMs idle or pads
  # m beyond a multiple of 64.
  mp = common.round_up(m, common.GRANULE)
  tiles = mp // 128
  if mp % 128 or batch * tiles * (tiles + 1) // 2 < common.H200_SMS:
    return MosaicGPUConfig(64, 64, 4)
  return MosaicGPUConfig(128, 64, 3)


def supports(call) -> str | None:
  """An sm_90 GPU, or any machine in interpret mode."""
  return dispatch.mosaic_gpu_reason(call)


def upper_pairs(tiles: int) -> np.ndarray:
  """(i, j) of the upper-triangle tile pairs, row-major, flattened (int32)."""
  rows, cols = np.triu_indices(tiles)
  return np.stack([rows, cols], axis=1).reshape(-1).astype(np.int32)


def _kernel(coef_ref, pairs_ref, x_gmem, o_gmem, e_smem, t_smem, bar, *, m, bm, bk, nk,
            stages, terms):
  from jax.experimental.pallas import mosaic_gpu as plgpu

  def body(acc_ref):
    b = jax.lax.axis_index("batch")
    p = jax.lax.axis_index("pair")
    i, j = pairs_ref[2 * p], pairs_ref[2 * p + 1]
    tiles = m // bm
    scaled, has_beta, has_gamma = terms
    rows_i, rows_j = pl.ds(b * m + i * bm, bm), pl.ds(b * m + j * bm, bm)
    if has_beta:   # the beta·X tile, fetched while the K loop runs
      plgpu.copy_gmem_to_smem(x_gmem.at[rows_i, pl.ds(j * bm, bm)], e_smem, bar.at[0])

    def step(_, xi_smem, xj_smem):
      plgpu.wgmma(acc_ref, xi_smem, xj_smem.T)
      plgpu.wgmma_wait(1)

    tr = common.transforms()
    plgpu.emit_pipeline(
        step, grid=(nk,), max_concurrent_steps=stages,
        in_specs=[plgpu.BlockSpec((bm, bk), lambda k: (b * tiles + i, k), transforms=tr,
                                  delay_release=1),
                  plgpu.BlockSpec((bm, bk), lambda k: (b * tiles + j, k), transforms=tr,
                                  delay_release=1)])(x_gmem, x_gmem)
    plgpu.wgmma_wait(0)
    acc = acc_ref[...]
    if scaled:
      acc = acc * coef_ref[0]
    if has_beta:
      plgpu.barrier_wait(bar.at[0])
      acc = acc + coef_ref[1] * e_smem[...].astype(F32)
    if has_gamma:
      r = plgpu.broadcasted_iota(jnp.int32, (bm, bm), 0, layout=plgpu.Layout.WGMMA)
      c = plgpu.broadcasted_iota(jnp.int32, (bm, bm), 1, layout=plgpu.Layout.WGMMA)
      acc = jnp.where(r + (i - j) * bm == c, acc + coef_ref[2], acc)
    tile = acc.astype(e_smem.dtype)
    e_smem[...] = tile
    t_smem.T[...] = tile   # the mirror tile, through a transposed view
    plgpu.commit_smem()

    @pl.when(i == j)
    def _():
      # A diagonal tile is mirrored within itself: its strictly lower half is
      # its upper half transposed. The MMA gives (r, c) and (c, r) in
      # different accumulation orders, so without this the two may differ by
      # one rounding and the output would not be exactly symmetric.
      r = plgpu.broadcasted_iota(jnp.int32, (bm, bm), 0, layout=plgpu.Layout.WGMMA)
      c = plgpu.broadcasted_iota(jnp.int32, (bm, bm), 1, layout=plgpu.Layout.WGMMA)
      mirrored = plgpu.load(t_smem, layout=plgpu.Layout.WGMMA)
      e_smem[...] = jnp.where(r > c, mirrored, tile)
      plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(e_smem, o_gmem.at[rows_i, pl.ds(j * bm, bm)])

    @pl.when(i != j)
    def _():
      plgpu.copy_smem_to_gmem(t_smem, o_gmem.at[rows_j, pl.ds(i * bm, bm)])

    plgpu.wait_smem_to_gmem(0)

  pl.run_scoped(body, plgpu.ACC((bm, bm), F32))


def sym(x, coef, *, terms, out_dtype=None, config: MosaicGPUConfig, interpret):
  """The kernel on a padded X (batch, m, k) (m a multiple of bm, k of bk;
  square and symmetric when ``terms[1]``); ``coef`` = [alpha, beta, gamma, 0]
  (fp32), ``terms`` = which of them are present (static). Writes x's dtype."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  common.check_dtype("sym", x)
  common.check_out_dtype("sym", x, out_dtype)
  if not isinstance(config, MosaicGPUConfig):
    raise TypeError(f"sym: implementation='mosaic_gpu' takes a sym.mosaic_gpu.MosaicGPUConfig "
                    f"(SymMosaicGPUConfig), got {config!r}")
  batch, m, k = x.shape
  bm, bk = config.bm, config.bk
  if m % bm or k % bk:
    raise ValueError(f"sym (mosaic_gpu): {x.shape} is not a multiple of the blocks {config}")
  pairs = upper_pairs(m // bm)
  tr = common.transforms()
  out = plgpu.kernel(
      functools.partial(_kernel, m=m, bm=bm, bk=bk, nk=k // bk, stages=config.stages,
                        terms=tuple(bool(t) for t in terms)),
      out_type=jax.ShapeDtypeStruct((batch * m, m), x.dtype),
      grid=(batch, pairs.size // 2),
      grid_names=("batch", "pair"),
      scratch_types=dict(e_smem=plgpu.SMEM((bm, bm), x.dtype, transforms=tr),
                         t_smem=plgpu.SMEM((bm, bm), x.dtype, transforms=tr),
                         bar=plgpu.Barrier(num_barriers=1)),
      interpret=interpret or None,
      kernel_name="fuseopt_ns_sym_mgpu",
  )(coef, jnp.asarray(pairs), x.reshape(batch * m, k))
  return out.reshape(batch, m, m)
