"""The NS GEMM ``a·X + B X``: the Triton backend (GPU).

Grid (batch, m/bm, n/bn); the K loop (over m) runs in the program; X and B
are whole-matrix refs sliced with ``pl.ds``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from fuseopt.kernels.newton_schulz.gemm.reference import gemm_cost
from fuseopt.kernels.newton_schulz.sym.shared import precision

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class TritonConfig:
  bm: int = 128
  bn: int = 128
  bk: int = 64
  num_warps: int = 8
  num_stages: int = 3

  def __post_init__(self):
    for name in ("bm", "bn", "bk"):
      v = getattr(self, name)
      if v < 16 or v & (v - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {v}")


Config = TritonConfig
SEARCH_SPACE = tuple(TritonConfig(bm, bn, bk, w, 3) for bm in (64, 128) for bn in (64, 128)
                     for bk in (32, 64) for w in (4, 8))


def heuristic(batch: int, m: int, n: int) -> TritonConfig:
  # 128×128 tiles, bk 64, 8 warps, 3 stages (the H200 matmul prototype that
  # matched XLA, docs/measurements.md); 64-row tiles when 128 would leave most SMs idle.
  if batch * pl.cdiv(m, 128) * pl.cdiv(n, 128) < 132:
    return TritonConfig(64, 64, 64, 4, 3)
  return TritonConfig(128, 128, 64, 8, 3)


def _kernel(coef_ref, b_ref, x_ref, o_ref, *, nk, bm, bn, bk, has_a):
  i, j = pl.program_id(1), pl.program_id(2)
  ri = pl.ds(pl.multiple_of(i * bm, bm), bm)
  cj = pl.ds(pl.multiple_of(j * bn, bn), bn)

  def body(k, acc):
    kk = pl.ds(pl.multiple_of(k * bk, bk), bk)
    return acc + jnp.dot(b_ref[ri, kk], x_ref[kk, cj], preferred_element_type=F32,
                         precision=precision(x_ref.dtype))
  acc = jax.lax.fori_loop(0, nk, body, jnp.zeros((bm, bn), F32))
  if has_a:  # a is a runtime scalar: one compiled kernel for every step
    acc = acc + coef_ref[0] * x_ref[ri, cj].astype(F32)
  o_ref[...] = acc.astype(o_ref.dtype)


def gemm(b, x, coef, *, has_a, out_dtype, config: TritonConfig, interpret):
  from jax.experimental.pallas import triton as plgpu
  batch, m, n = x.shape
  bm, bn, bk = config.bm, config.bn, config.bk
  return pl.pallas_call(
      functools.partial(_kernel, nk=m // bk, bm=bm, bn=bn, bk=bk, has_a=has_a),
      out_shape=jax.ShapeDtypeStruct((batch, m, n), out_dtype),
      grid=(batch, m // bm, n // bn),
      in_specs=[pl.BlockSpec((4,), lambda bb, i, j: (0,)),
                pl.BlockSpec((None, m, m), lambda bb, i, j: (bb, 0, 0)),
                pl.BlockSpec((None, m, n), lambda bb, i, j: (bb, 0, 0))],
      out_specs=pl.BlockSpec((None, bm, bn), lambda bb, i, j: (bb, i, j)),
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
      interpret=interpret,
      name="fuseopt_ns_update",
      cost_estimate=gemm_cost(b, x, out_dtype, has_a),
  )(coef, b, x)
