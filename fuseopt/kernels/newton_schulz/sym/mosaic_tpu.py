"""The symmetric product ``alpha·X Xᵀ + beta·X + gamma·I``: the Mosaic TPU backend.

Grid (batch, pairs, K) driven by scalar-prefetched lists of tile rows and
columns (``PrefetchScalarGridSpec``), fp32 VMEM accumulator; on the last K
step the tile and its transpose are DMA'd to the output (left in HBM,
``memory_space=ANY``) because a BlockSpec can write only one block per step;
a diagonal tile is mirrored within itself (exactly symmetric).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from fuseopt.kernels import pallas_common
from fuseopt.kernels.newton_schulz.sym.shared import (F32, NT, epilogue, mirror_diagonal, precision,
                                                      round_up, sym_cost)


@dataclasses.dataclass(frozen=True)
class MosaicTPUConfig:
  bm: int = 256
  bk: int = 512

  def __post_init__(self):
    if self.bm <= 0 or self.bm % 128 or self.bk <= 0 or self.bk % 128:
      raise ValueError(f"bm and bk must be positive multiples of 128, got {self.bm}, {self.bk}")


Config = MosaicTPUConfig
SEARCH_SPACE = tuple(MosaicTPUConfig(bm, bk) for bm in (128, 256, 512)
                            for bk in (128, 256, 512, 1024))


def heuristic(batch: int, m: int, k: int) -> MosaicTPUConfig:
  # The largest blocks that divide the 128-padded sizes, so no padding beyond
  # 128 (the same config serves X Xᵀ, K = k, and A A, K = m: bk divides both).
  mp, kp = round_up(m, 128), round_up(k, 128)
  bm = 256 if (m >= 512 and mp % 256 == 0) else 128
  bk = next(b for b in (512, 256, 128) if mp % b == 0 and kp % b == 0)
  return MosaicTPUConfig(bm=bm, bk=bk)


def upper_pairs(tiles: int) -> tuple[np.ndarray, np.ndarray]:
  """Rows and columns of the upper-triangle tile pairs, row-major (int32)."""
  rows, cols = np.triu_indices(tiles)
  return rows.astype(np.int32), cols.astype(np.int32)


def _kernel(rows_ref, cols_ref, coef_ref, xi_ref, xj_ref, *rest, nk, bm, terms):
  from jax.experimental.pallas import tpu as pltpu
  if terms[1]:
    xs_ref, o_hbm, acc_ref, buf_ref, sem = rest
  else:
    (o_hbm, acc_ref, buf_ref, sem), xs_ref = rest, None
  b, t, k = pl.program_id(0), pl.program_id(1), pl.program_id(2)

  @pl.when(k == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  acc_ref[...] += jax.lax.dot_general(xi_ref[...], xj_ref[...], NT, preferred_element_type=F32,
                                      precision=precision(xi_ref.dtype))

  @pl.when(k == nk - 1)
  def _():
    i, j = rows_ref[t], cols_ref[t]
    coef = (coef_ref[0], coef_ref[1], coef_ref[2])
    acc = epilogue(acc_ref[...], xs_ref[...] if terms[1] else None, i, j, coef,
                    terms=terms, bm=bm)
    # Transpose in fp32 (the layout Mosaic transposes everywhere), round after.
    acc_t = acc.T
    buf_ref[0] = mirror_diagonal(acc, acc_t, i, j, bm=bm).astype(buf_ref.dtype)
    upper = pltpu.make_async_copy(
        buf_ref.at[0], o_hbm.at[b, pl.ds(i * bm, bm), pl.ds(j * bm, bm)], sem.at[0])
    upper.start()

    @pl.when(i != j)
    def _():
      buf_ref[1] = acc_t.astype(buf_ref.dtype)
      lower = pltpu.make_async_copy(
          buf_ref.at[1], o_hbm.at[b, pl.ds(j * bm, bm), pl.ds(i * bm, bm)], sem.at[1])
      lower.start()
      lower.wait()

    upper.wait()


def sym(x, coef, *, terms, out_dtype, config: MosaicTPUConfig, interpret):
  from jax.experimental.pallas import tpu as pltpu
  batch, m, k = x.shape
  bm, bk = config.bm, config.bk
  rows, cols = upper_pairs(m // bm)
  nk = k // bk
  in_specs = [pl.BlockSpec(memory_space=pltpu.SMEM),
              pl.BlockSpec((None, bm, bk), lambda b, t, kk, rows, cols: (b, rows[t], kk)),
              pl.BlockSpec((None, bm, bk), lambda b, t, kk, rows, cols: (b, cols[t], kk))]
  args = [coef, x, x]
  if terms[1]:
    in_specs.append(pl.BlockSpec((None, bm, bm), lambda b, t, kk, rows, cols: (b, rows[t], cols[t])))
    args.append(x)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(batch, rows.shape[0], nk),
      in_specs=in_specs,
      out_specs=pl.BlockSpec(memory_space=pl.ANY),
      scratch_shapes=[pltpu.VMEM((bm, bm), F32), pltpu.VMEM((2, bm, bm), out_dtype),
                      pltpu.SemaphoreType.DMA((2,))],
  )
  return pl.pallas_call(
      functools.partial(_kernel, nk=nk, bm=bm, terms=terms),
      out_shape=jax.ShapeDtypeStruct((batch, m, m), out_dtype),
      grid_spec=grid_spec,
      compiler_params=pallas_common.mosaic_compiler_params(
          interpret, ("parallel", "arbitrary", "arbitrary")),
      interpret=interpret,
      name="fuseopt_ns_sym",
      cost_estimate=sym_cost(x, out_dtype, bm, terms),
  )(jnp.asarray(rows), jnp.asarray(cols), *args)
