"""The symmetric product ``alpha·X Xᵀ + beta·X + gamma·I``: the Triton backend (GPU).

Grid (batch, pairs): a 1-D axis over the T(T+1)/2 upper-triangle tile pairs
(no idle programs), the pair decoded from the program id in closed form; the
K loop runs inside the program over ``bk`` slices; both tiles are stored from
registers, a diagonal tile mirrored within itself (exactly symmetric).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from fuseopt.kernels.newton_schulz.sym.shared import (F32, NT, epilogue, mirror_diagonal, num_pairs,
                                                      pow2, precision, round_up, sym_cost)


@dataclasses.dataclass(frozen=True)
class TritonConfig:
  bm: int = 128          # output tile side (rows = cols)
  bk: int = 64           # K slice per loop step
  num_warps: int = 8
  num_stages: int = 3

  def __post_init__(self):
    pow2(self.bm, "bm"), pow2(self.bk, "bk")
    if self.bm < 16 or self.bk < 16:
      raise ValueError(f"bm and bk must be >= 16 (tl.dot), got {self.bm}, {self.bk}")


Config = TritonConfig

# 128-row tiles, bk 64, 4–8 warps, 3–4 stages measured best on the H200 for a
# prototype of this kernel; 256-row tiles spilled registers, so they are not
# searched (docs/measurements.md, "Pallas-Triton prototypes").
# Triton's pipeline holds num_stages copies of both operand tiles in shared
# memory; configs beyond the H200's 227 KB a block are not searched (bm 128,
# bk 128, 4 stages asks for 256 KB: XLA refuses to compile it for an H200,
# docs/compile_tier.md).
H200_SHARED_MEMORY_OPTIN = 232448


def triton_shared_memory_bytes(config: TritonConfig, itemsize: int = 2) -> int:
  return config.num_stages * 2 * config.bm * config.bk * itemsize


SEARCH_SPACE = tuple(
    c for c in (TritonConfig(bm, bk, w, s) for bm in (64, 128) for bk in (32, 64, 128)
                for w in (4, 8) for s in (3, 4))
    if triton_shared_memory_bytes(c) <= H200_SHARED_MEMORY_OPTIN)


H200_SMS = 132


def heuristic(batch: int, m: int, k: int) -> TritonConfig:
  # 128-tiles unless that leaves most of the 132 SMs idle (e.g. 1024²: 36
  # programs; 64-tiles give 136) or would pad m beyond a multiple of 64.
  mp = round_up(m, 64)
  if mp % 128 or batch * num_pairs(mp // 128) < H200_SMS:
    return TritonConfig(bm=64, bk=64, num_warps=4, num_stages=3)
  return TritonConfig(bm=128, bk=64, num_warps=8, num_stages=3)


def pair_from_index(t, tiles: int):
  """(i, j), i <= j, of the t-th tile pair in row-major upper-triangle order.

  Row i holds tiles - i pairs starting at i·tiles - i(i-1)/2; the float root
  is corrected by one step either way, so rounding cannot pick a wrong row.
  """
  w = jnp.float32(2 * tiles + 1)
  i = jnp.floor((w - jnp.sqrt(w * w - 8.0 * t.astype(F32))) * 0.5).astype(jnp.int32)
  i = jnp.minimum(jnp.maximum(i, 0), tiles - 1)

  def start(r):
    return r * tiles - (r * (r - 1)) // 2
  i = jnp.where(start(i + 1) <= t, i + 1, i)
  i = jnp.where(start(i) > t, i - 1, i)
  return i, i + (t - start(i))


def _kernel(coef_ref, x_ref, o_ref, *, tiles, nk, bm, bk, terms):
  t = pl.program_id(1)
  i, j = pair_from_index(t, tiles)
  ri = pl.ds(pl.multiple_of(i * bm, bm), bm)
  rj = pl.ds(pl.multiple_of(j * bm, bm), bm)

  def body(k, acc):
    kk = pl.ds(pl.multiple_of(k * bk, bk), bk)
    return acc + jax.lax.dot_general(x_ref[ri, kk], x_ref[rj, kk], NT,
                                     preferred_element_type=F32, precision=precision(x_ref.dtype))
  acc = jax.lax.fori_loop(0, nk, body, jnp.zeros((bm, bm), F32))
  xs = x_ref[ri, rj] if terms[1] else None
  coef = (coef_ref[0], coef_ref[1], coef_ref[2])
  acc = epilogue(acc, xs, i, j, coef, terms=terms, bm=bm)
  acc_t = acc.T
  o_ref[ri, rj] = mirror_diagonal(acc, acc_t, i, j, bm=bm).astype(o_ref.dtype)

  @pl.when(i != j)
  def _():
    o_ref[rj, ri] = acc_t.astype(o_ref.dtype)


def sym(x, coef, *, terms, out_dtype, config: TritonConfig, interpret):
  from jax.experimental.pallas import triton as plgpu
  batch, m, k = x.shape
  bm, bk = config.bm, config.bk
  tiles = m // bm
  return pl.pallas_call(
      functools.partial(_kernel, tiles=tiles, nk=k // bk, bm=bm, bk=bk, terms=terms),
      out_shape=jax.ShapeDtypeStruct((batch, m, m), out_dtype),
      grid=(batch, num_pairs(tiles)),
      in_specs=[pl.BlockSpec((4,), lambda b, t: (0,)),
                pl.BlockSpec((None, m, k), lambda b, t: (b, 0, 0))],
      out_specs=pl.BlockSpec((None, m, m), lambda b, t: (b, 0, 0)),
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
      interpret=interpret,
      name="fuseopt_ns_sym",
      cost_estimate=sym_cost(x, out_dtype, bm, terms),
  )(coef, x)
