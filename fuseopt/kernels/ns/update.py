"""NS update ``X' = a·X + B X``: reference, Triton and Mosaic-TPU GEMMs with a fused epilogue.

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

Backends:

- ``triton``: grid (batch, m/bm, n/bn); the K loop (over m) runs in the
  program; X and B are whole-matrix refs sliced with ``pl.ds``.
- ``mosaic_tpu``: grid (batch, m/bm, n/bn, m/bk), BlockSpec-pipelined tiles,
  an fp32 VMEM accumulator; the epilogue tile of X is a third input whose
  block index does not depend on k (fetched once per output tile).

Sizes that are not multiples of the blocks are zero-padded and sliced back
(exact: zero rows/columns contribute nothing).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from fuseopt.kernels import _backend
from fuseopt.kernels.ns.gram import precision

F32 = jnp.float32


# ----------------------------------------------------------------- configs --
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


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
  bm: int = 256
  bn: int = 512
  bk: int = 512

  def __post_init__(self):
    for name in ("bm", "bn", "bk"):
      v = getattr(self, name)
      if v <= 0 or v % 128:
        raise ValueError(f"{name} must be a positive multiple of 128, got {v}")


TRITON_SEARCH_SPACE = tuple(TritonConfig(bm, bn, bk, w, 3) for bm in (64, 128) for bn in (64, 128)
                            for bk in (32, 64) for w in (4, 8))
MOSAIC_SEARCH_SPACE = tuple(MosaicConfig(bm, bn, bk) for bm in (128, 256, 512)
                            for bn in (256, 512) for bk in (256, 512))


def triton_heuristic(batch: int, m: int, n: int) -> TritonConfig:
  # 128×128 tiles, bk 64, 8 warps, 3 stages (the H200 matmul prototype that
  # matched XLA, docs/measurements.md); 64-row tiles when 128 would leave most SMs idle.
  if batch * pl.cdiv(m, 128) * pl.cdiv(n, 128) < 132:
    return TritonConfig(64, 64, 64, 4, 3)
  return TritonConfig(128, 128, 64, 8, 3)


def mosaic_heuristic(batch: int, m: int, n: int) -> MosaicConfig:
  # The largest blocks that divide the 128-padded sizes (no extra padding).
  mp, np_ = -(-m // 128) * 128, -(-n // 128) * 128
  bm = 256 if mp % 256 == 0 else 128
  bk = next(b for b in (512, 256, 128) if mp % b == 0)
  bn = next(b for b in (512, 256, 128) if np_ % b == 0)
  return MosaicConfig(bm, bn, bk)


def heuristic(implementation: str, batch: int, m: int, n: int):
  if implementation == "triton":
    return triton_heuristic(batch, m, n)
  return mosaic_heuristic(batch, m, n)


# --------------------------------------------------------------- reference --
def matmul_reference(b, x, *, a=0.0, out_dtype=None):
  """a·X + B X, batched, fp32 accumulation and epilogue, one rounding."""
  out_dtype = out_dtype or x.dtype
  precision = jax.lax.Precision.HIGHEST if x.dtype == F32 else None
  acc = jnp.einsum("bij,bjk->bik", b, x, preferred_element_type=F32, precision=precision)
  if a:
    acc = acc + a * x.astype(F32)
  return acc.astype(out_dtype)


def _matmul_cost(b, x, out_dtype, has_a):
  """2m FLOPs per output of B X, 2 more for the a·X epilogue; B and X read
  once, the output written once."""
  batch, m, n = x.shape
  out = jax.ShapeDtypeStruct((batch, m, n), out_dtype)
  return _backend.cost_estimate(flops=batch * m * n * (2 * m + (2 if has_a else 0)),
                                bytes_accessed=_backend.nbytes(b, x, out))


# ------------------------------------------------------------------ triton --
def _triton_kernel(coef_ref, b_ref, x_ref, o_ref, *, nk, bm, bn, bk, has_a):
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


def _matmul_triton(b, x, coef, *, has_a, out_dtype, config: TritonConfig, interpret):
  from jax.experimental.pallas import triton as plgpu
  batch, m, n = x.shape
  bm, bn, bk = config.bm, config.bn, config.bk
  return pl.pallas_call(
      functools.partial(_triton_kernel, nk=m // bk, bm=bm, bn=bn, bk=bk, has_a=has_a),
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
      cost_estimate=_matmul_cost(b, x, out_dtype, has_a),
  )(coef, b, x)


# -------------------------------------------------------------- mosaic_tpu --
def _mosaic_kernel(coef_ref, b_ref, x_ref, *rest, nk, has_a):
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


def _matmul_mosaic(b, x, coef, *, has_a, out_dtype, config: MosaicConfig, interpret):
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
      functools.partial(_mosaic_kernel, nk=nk, has_a=has_a),
      out_shape=jax.ShapeDtypeStruct((batch, m, n), out_dtype),
      grid=(batch, m // bm, n // bn, nk),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((None, bm, bn), lambda bb, i, j, k: (bb, i, j)),
      scratch_shapes=[pltpu.VMEM((bm, bn), F32)],
      compiler_params=_backend.mosaic_compiler_params(
          interpret, ("parallel", "parallel", "parallel", "arbitrary")),
      interpret=interpret,
      name="fuseopt_ns_update",
      cost_estimate=_matmul_cost(b, x, out_dtype, has_a),
  )(*args)


# ------------------------------------------------------------------ public --
def granules(config) -> tuple[int, int]:
  """(multiple for m, multiple for n)."""
  return max(config.bm, config.bk), config.bn


def matmul(b, x, *, a=0.0, out_dtype=None, implementation="triton", interpret=False, config=None):
  """a·X + B X for B (batch, m, m) and X (batch, m, n)."""
  if x.ndim != 3 or b.ndim != 3 or b.shape != (x.shape[0], x.shape[1], x.shape[1]):
    raise ValueError(f"matmul: expected b (batch, m, m) and x (batch, m, n), got {b.shape}, {x.shape}")
  batch, m, n = x.shape
  out_dtype = jnp.dtype(out_dtype or x.dtype)
  config = config or heuristic(implementation, batch, m, n)
  gm, gn = granules(config)
  pm, pn = -m % gm, -n % gn
  if pm or pn:
    x = jnp.pad(x, ((0, 0), (0, pm), (0, pn)))
    b = jnp.pad(b, ((0, 0), (0, pm), (0, pm)))
  has_a = isinstance(a, jax.core.Tracer) or float(a) != 0.0
  coef = jnp.stack([jnp.asarray(a, F32)] + [jnp.zeros((), F32)] * 3)
  kwargs = dict(has_a=has_a, out_dtype=out_dtype, config=config, interpret=interpret)
  if implementation == "triton":
    out = _matmul_triton(b, x, coef, **kwargs)
  elif implementation == "mosaic_tpu":
    out = _matmul_mosaic(b, x, coef, **kwargs)
  else:
    raise ValueError(f"matmul: implementation must be 'triton' or 'mosaic_tpu', got {implementation!r}")
  return out[:, :m, :n] if (pm or pn) else out
