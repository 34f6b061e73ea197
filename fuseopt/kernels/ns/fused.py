"""The whole Newton–Schulz iteration in one kernel, for matrices that fit on chip.

A small NS spends most of its time in launches (15 GEMMs and their
epilogues; docs/measurements.md: optax takes 0.36 ms for 1024² where the FLOP
floor is 0.03 ms). Here one program holds a whole (normalised) matrix and runs every
step — ``A = X Xᵀ``, ``B = b·A + c·A A``, ``X = a·X + B X`` — in on-chip
memory; the grid runs over the batch, one matrix per program.

- ``mosaic_tpu``: the matrix lives in VMEM (v5e/v6e have 128 MiB; the
  kernel raises the scoped limit to :data:`MOSAIC_VMEM_LIMIT`); used when the
  estimated working set (:func:`mosaic_vmem_bytes`) is under
  :data:`MOSAIC_VMEM_BUDGET` — up to about 1024 × 1024 in bf16.
- ``triton``: one CTA per matrix, so only for *small* matrices (a GPU SM has
  228 KB of shared memory and one CTA cannot use the others): padded to
  powers of two, m <= 128 and m·n <= 16384 (e.g. 128 × 128, 64 × 256,
  32 × 512). Larger GPU matrices take the tiled kernels.

The coefficients are baked in (static), the steps unrolled. Padding with
zero rows/columns is exact for NS (they stay zero).
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
_NT = (((1,), (1,)), ((), ()))

MOSAIC_VMEM_BUDGET = 40 * 2**20
MOSAIC_VMEM_LIMIT = 64 * 2**20
TRITON_MAX_M = 128
TRITON_MAX_ELEMENTS = 16384


@dataclasses.dataclass(frozen=True)
class TritonConfig:
  num_warps: int = 4
  num_stages: int = 1


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
  vmem_limit_bytes: int = MOSAIC_VMEM_LIMIT


TRITON_SEARCH_SPACE = (TritonConfig(4), TritonConfig(8))
MOSAIC_SEARCH_SPACE = (MosaicConfig(MOSAIC_VMEM_LIMIT), MosaicConfig(96 * 2**20))


def _round_up(v, g):
  return -(-v // g) * g


def padded_shape(implementation: str, m: int, n: int) -> tuple[int, int]:
  if implementation == "triton":
    return max(16, pl.next_power_of_2(m)), max(16, pl.next_power_of_2(n))
  return _round_up(m, 128), _round_up(n, 128)


def mosaic_vmem_bytes(m: int, n: int, itemsize: int = 2) -> int:
  """Working set of the Mosaic kernel: double-buffered input and output
  blocks, fp32 products and their rounded copies (m <= n, padded)."""
  mn, mm = m * n, m * m
  return 4 * mn * itemsize + mn * (4 + 4 + itemsize) + mm * (4 + 4 + 2 * itemsize)


def fits(implementation: str, m: int, n: int, itemsize: int = 2) -> bool:
  mp, np_ = padded_shape(implementation, m, n)
  if implementation == "triton":
    return mp <= TRITON_MAX_M and mp * np_ <= TRITON_MAX_ELEMENTS
  if implementation == "mosaic_tpu":
    return mosaic_vmem_bytes(mp, np_, itemsize) <= MOSAIC_VMEM_BUDGET
  return False


def heuristic(implementation: str):
  return TritonConfig() if implementation == "triton" else MosaicConfig()


# --------------------------------------------------------------- reference --
def ns_fused_reference(x, table):
  """The iteration on an already normalised batch (B, m, n), m <= n, in x.dtype."""
  for a, b, c in table:
    g = jnp.einsum("bik,bjk->bij", x, x, preferred_element_type=F32).astype(x.dtype)
    p = (c * jnp.einsum("bij,bjk->bik", g, g, preferred_element_type=F32)
         + b * g.astype(F32)).astype(x.dtype)
    x = (jnp.einsum("bij,bjk->bik", p, x, preferred_element_type=F32)
         + a * x.astype(F32)).astype(x.dtype)
  return x


# ------------------------------------------------------------------ kernel --
def _kernel(x_ref, o_ref, *, table):
  dtype = x_ref.dtype
  prec = precision(dtype)
  x = x_ref[...]
  for a, b, c in table:
    g = jax.lax.dot_general(x, x, _NT, preferred_element_type=F32, precision=prec).astype(dtype)
    p = (c * jnp.dot(g, g, preferred_element_type=F32, precision=prec)
         + b * g.astype(F32)).astype(dtype)
    x = (jnp.dot(p, x, preferred_element_type=F32, precision=prec) + a * x.astype(F32)).astype(dtype)
  o_ref[...] = x


def newton_schulz_fused(x, table, *, implementation, interpret=False, config=None):
  """Runs every NS step on a normalised batch (B, m, n), m <= n, in one kernel."""
  batch, m, n = x.shape
  mp, np_ = padded_shape(implementation, m, n)
  xp = jnp.pad(x, ((0, 0), (0, mp - m), (0, np_ - n))) if (mp, np_) != (m, n) else x
  config = config or heuristic(implementation)
  table = tuple(tuple(float(v) for v in row) for row in table)
  if implementation == "triton":
    from jax.experimental.pallas import triton as plgpu
    params = plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)
  elif implementation == "mosaic_tpu":
    from jax.experimental.pallas import tpu as pltpu
    params = _backend.mosaic_compiler_params(interpret, ("parallel",),
                                             vmem_limit_bytes=config.vmem_limit_bytes)
  else:
    raise ValueError(f"newton_schulz_fused: implementation must be 'triton' or 'mosaic_tpu', "
                     f"got {implementation!r}")
  out = pl.pallas_call(
      functools.partial(_kernel, table=table),
      out_shape=jax.ShapeDtypeStruct((batch, mp, np_), x.dtype),
      grid=(batch,),
      in_specs=[pl.BlockSpec((None, mp, np_), lambda b: (b, 0, 0))],
      out_specs=pl.BlockSpec((None, mp, np_), lambda b: (b, 0, 0)),
      compiler_params=params,
      interpret=interpret,
      name="fuseopt_ns_fused",
      # Per step: X Xᵀ (2m²n), A·A with b·A (2m³ + 2m²), B X with a·X (2m²n + 2mn).
      cost_estimate=_backend.cost_estimate(
          flops=batch * len(table) * (4 * mp * mp * np_ + 2 * mp**3 + 2 * mp * mp + 2 * mp * np_),
          bytes_accessed=2 * _backend.nbytes(xp)),
  )(xp)
  return out[:, :m, :n] if (mp, np_) != (m, n) else out
