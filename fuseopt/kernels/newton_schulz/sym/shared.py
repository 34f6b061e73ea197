"""What the symmetric-product backends share: the epilogue, the tile-pair
count, the product precision and the cost estimate."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fuseopt.kernels import pallas_common

F32 = jnp.float32
NT = (((1,), (1,)), ((), ()))  # contract the last axes: a @ bᵀ


def pow2(v, name):
  if v <= 0 or v & (v - 1):
    raise ValueError(f"{name} must be a positive power of two, got {v}")


def num_pairs(tiles: int) -> int:
  return tiles * (tiles + 1) // 2


def round_up(v, g):
  return -(-v // g) * g


def precision(dtype):
  """fp32 iterates get true fp32 products (Triton's default would be TF32)."""
  return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == F32 else None


def epilogue(acc, xs, i, j, coef, *, terms, bm):
  """``terms`` (static) says which of alpha-scaling, beta, gamma are present;
  ``coef`` (runtime scalars) holds their values, so one compiled kernel
  serves every NS step's coefficients."""
  scaled, has_beta, has_gamma = terms
  if scaled:
    acc = acc * coef[0]
  if has_beta:
    acc = acc + coef[1] * xs.astype(F32)
  if has_gamma:
    r = jax.lax.broadcasted_iota(jnp.int32, (bm, bm), 0)
    c = jax.lax.broadcasted_iota(jnp.int32, (bm, bm), 1)
    acc = acc + jnp.where((r == c) & (i == j), coef[2], jnp.float32(0))
  return acc


def mirror_diagonal(acc, acc_t, i, j, *, bm):
  """A diagonal tile (i == j) mirrored within itself: the strictly lower half
  taken from ``acc_t`` (the tile transposed). The MMA computes (r, c) and
  (c, r) in different accumulation orders, so without this a diagonal tile
  may differ from its transpose by one rounding; with it the whole output is
  exactly symmetric (the off-diagonal tiles are written with their mirror)."""
  r = jax.lax.broadcasted_iota(jnp.int32, (bm, bm), 0)
  c = jax.lax.broadcasted_iota(jnp.int32, (bm, bm), 1)
  return jnp.where((r > c) & (i == j), acc_t, acc)


def sym_cost(x, out_dtype, bm, terms):
  """What the symmetric kernels execute: the upper-triangle tile pairs only
  (``num_pairs(m/bm)`` tiles of bm² outputs, 2k FLOPs each) and 1-3
  epilogue FLOPs per stored output; the input read once, both triangles
  written."""
  batch, m, k = x.shape
  pairs = num_pairs(m // bm)
  epilogue = sum(bool(t) for t in terms)
  flops = batch * pairs * bm * bm * (2 * k + epilogue)
  out = jax.ShapeDtypeStruct((batch, m, m), out_dtype)
  return pallas_common.cost_estimate(flops=flops, bytes_accessed=pallas_common.nbytes(x, out))
