"""The NS GEMM ``a·X + B X``: the Mosaic TPU backend.

Grid (batch, m/bm, n/bn, m/bk), BlockSpec-pipelined tiles, an fp32 VMEM
accumulator; the epilogue tile of X is a third input whose block index does
not depend on k (fetched once per output tile).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from fuseopt.kernels import pallas_common
from fuseopt.kernels.newton_schulz.gemm.reference import gemm_cost
from fuseopt.kernels.newton_schulz.sym.shared import precision

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class MosaicTPUConfig:
  bm: int = 256
  bn: int = 512
  bk: int = 512

  def __post_init__(self):
    for name in ("bm", "bn", "bk"):
      v = getattr(self, name)
      if v <= 0 or v % 128:
        raise ValueError(f"{name} must be a positive multiple of 128, got {v}")


Config = MosaicTPUConfig
SEARCH_SPACE = tuple(MosaicTPUConfig(bm, bn, bk) for bm in (128, 256, 512)
                     for bn in (256, 512) for bk in (256, 512))


def heuristic(batch: int, m: int, n: int) -> MosaicTPUConfig:
  # The largest blocks that divide the 128-padded sizes (no extra padding).
  mp, np_ = -(-m // 128) * 128, -(-n // 128) * 128
  bm = 256 if mp % 256 == 0 else 128
  bk = next(b for b in (512, 256, 128) if mp % b == 0)
  bn = next(b for b in (512, 256, 128) if np_ % b == 0)
  return MosaicTPUConfig(bm, bn, bk)


def _kernel(coef_ref, b_ref, x_ref, *rest, nk, has_a):
  if has_a:
    xe_ref, o_ref, acc_ref = rest
  else:
    (o_ref, acc_ref), xe_ref = rest, None
  k = pl.program_id(3)

  @pl.when(k == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  acc_ref[...] += jnp.dot(b_ref[...], x_ref[...], preferred_element_type=F32,
                          precision=precision(x_ref.dtype))

  @pl.when(k == nk - 1)
  def _():
    acc = acc_ref[...]
    if has_a:
      acc = acc + coef_ref[0] * xe_ref[...].astype(F32)
    o_ref[...] = acc.astype(o_ref.dtype)


def gemm(b, x, coef, *, has_a, out_dtype, config: MosaicTPUConfig, interpret):
  from jax.experimental.pallas import tpu as pltpu
  batch, m, n = x.shape
  bm, bn, bk = config.bm, config.bn, config.bk
  nk = m // bk
  in_specs = [pl.BlockSpec(memory_space=pltpu.SMEM),
              pl.BlockSpec((None, bm, bk), lambda bb, i, j, k: (bb, i, k)),
              pl.BlockSpec((None, bk, bn), lambda bb, i, j, k: (bb, k, j))]
  args = [coef, b, x]
  if has_a:
    in_specs.append(pl.BlockSpec((None, bm, bn), lambda bb, i, j, k: (bb, i, j)))
    args.append(x)
  return pl.pallas_call(
      functools.partial(_kernel, nk=nk, has_a=has_a),
      out_shape=jax.ShapeDtypeStruct((batch, m, n), out_dtype),
      grid=(batch, m // bm, n // bn, nk),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((None, bm, bn), lambda bb, i, j, k: (bb, i, j)),
      scratch_shapes=[pltpu.VMEM((bm, bn), F32)],
      compiler_params=pallas_common.mosaic_compiler_params(
          interpret, ("parallel", "parallel", "parallel", "arbitrary")),
      interpret=interpret,
      name="fuseopt_ns_update",
      cost_estimate=gemm_cost(b, x, out_dtype, has_a),
  )(*args)
