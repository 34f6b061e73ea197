"""Symmetric product ``alpha·X Xᵀ + beta·X + gamma·I``: reference, Triton and Mosaic-TPU.

``X Xᵀ`` is symmetric, so only the tiles (i, j) with i <= j are computed; the
program that computes tile (i, j) also writes its transpose to (j, i). The
same kernel serves three NS products:

- the Gram matrix ``A = X Xᵀ`` (alpha=1);
- the polynomial ``B = b·A + c·A A`` (A symmetric, so ``A A = A Aᵀ``:
  alpha=c, beta=b on the square A; see :mod:`.poly`);
- Gram NS's ``Z = a·I + b·R + c·R R`` (gamma=a).

With ``beta != 0`` the input must be square and *symmetric* (it is A or R in
every use): the mirror tile carries the transposed ``beta·X`` tile.
Products accumulate in fp32; the epilogue runs in fp32 and the tile is
rounded once to the output dtype.

Backends:

- ``triton``: grid (batch, pairs): a 1-D axis over the T(T+1)/2 upper-triangle
  tile pairs (no idle programs), the pair decoded from the program id in
  closed form; the K loop runs inside the program over ``bk`` slices; both
  tiles are stored from registers.
- ``mosaic_tpu``: grid (batch, pairs, K) driven by scalar-prefetched lists of
  tile rows and columns (``PrefetchScalarGridSpec``), fp32 VMEM accumulator;
  on the last K step the tile and its transpose are DMA'd to the output (left
  in HBM, ``memory_space=ANY``) because a BlockSpec can write only one block
  per step.

Sizes that are not multiples of the blocks are zero-padded by the wrapper
(zero rows and columns do not change X Xᵀ's valid part) and sliced back.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from fuseopt.kernels import _backend

F32 = jnp.float32
_NT = (((1,), (1,)), ((), ()))  # contract the last axes: a @ bᵀ


# ----------------------------------------------------------------- configs --
def _pow2(v, name):
  if v <= 0 or v & (v - 1):
    raise ValueError(f"{name} must be a positive power of two, got {v}")


@dataclasses.dataclass(frozen=True)
class TritonConfig:
  bm: int = 128          # output tile side (rows = cols)
  bk: int = 64           # K slice per loop step
  num_warps: int = 8
  num_stages: int = 3

  def __post_init__(self):
    _pow2(self.bm, "bm"), _pow2(self.bk, "bk")
    if self.bm < 16 or self.bk < 16:
      raise ValueError(f"bm and bk must be >= 16 (tl.dot), got {self.bm}, {self.bk}")


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
  bm: int = 256
  bk: int = 512

  def __post_init__(self):
    if self.bm <= 0 or self.bm % 128 or self.bk <= 0 or self.bk % 128:
      raise ValueError(f"bm and bk must be positive multiples of 128, got {self.bm}, {self.bk}")


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


TRITON_SEARCH_SPACE = tuple(
    c for c in (TritonConfig(bm, bk, w, s) for bm in (64, 128) for bk in (32, 64, 128)
                for w in (4, 8) for s in (3, 4))
    if triton_shared_memory_bytes(c) <= H200_SHARED_MEMORY_OPTIN)
MOSAIC_SEARCH_SPACE = tuple(MosaicConfig(bm, bk) for bm in (128, 256, 512)
                            for bk in (128, 256, 512, 1024))

H200_SMS = 132


def num_pairs(tiles: int) -> int:
  return tiles * (tiles + 1) // 2


def _round_up(v, g):
  return -(-v // g) * g


def triton_heuristic(batch: int, m: int, k: int) -> TritonConfig:
  # 128-tiles unless that leaves most of the 132 SMs idle (e.g. 1024²: 36
  # programs; 64-tiles give 136) or would pad m beyond a multiple of 64.
  mp = _round_up(m, 64)
  if mp % 128 or batch * num_pairs(mp // 128) < H200_SMS:
    return TritonConfig(bm=64, bk=64, num_warps=4, num_stages=3)
  return TritonConfig(bm=128, bk=64, num_warps=8, num_stages=3)


def mosaic_heuristic(batch: int, m: int, k: int) -> MosaicConfig:
  # The largest blocks that divide the 128-padded sizes, so no padding beyond
  # 128 (the same config serves X Xᵀ, K = k, and A A, K = m: bk divides both).
  mp, kp = _round_up(m, 128), _round_up(k, 128)
  bm = 256 if (m >= 512 and mp % 256 == 0) else 128
  bk = next(b for b in (512, 256, 128) if mp % b == 0 and kp % b == 0)
  return MosaicConfig(bm=bm, bk=bk)


def heuristic(implementation: str, batch: int, m: int, k: int):
  if implementation == "triton":
    return triton_heuristic(batch, m, k)
  return mosaic_heuristic(batch, m, k)


def granules(config) -> tuple[int, int]:
  """(row, K) multiples the kernel needs; a square input needs max of both."""
  return config.bm, config.bk


def precision(dtype):
  """fp32 iterates get true fp32 products (Triton's default would be TF32)."""
  return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == F32 else None


# --------------------------------------------------------------- reference --
def sym_reference(x, *, alpha=1.0, beta=0.0, gamma=0.0, out_dtype=None):
  """alpha·X Xᵀ + beta·X + gamma·I for batched X (B, m, k); fp32 accumulation."""
  out_dtype = out_dtype or x.dtype
  precision = jax.lax.Precision.HIGHEST if x.dtype == F32 else None
  acc = alpha * jnp.einsum("bik,bjk->bij", x, x, preferred_element_type=F32, precision=precision)
  if beta:
    acc = acc + beta * x.astype(F32)
  if gamma:
    acc = acc + gamma * jnp.eye(x.shape[-2], dtype=F32)
  return acc.astype(out_dtype)


def _epilogue(acc, xs, i, j, coef, *, terms, bm):
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


def _sym_cost(x, out_dtype, bm, terms):
  """What the symmetric kernels execute: the upper-triangle tile pairs only
  (``num_pairs(m/bm)`` tiles of bm² outputs, 2k FLOPs each) and 1-3
  epilogue FLOPs per stored output; the input read once, both triangles
  written."""
  batch, m, k = x.shape
  pairs = num_pairs(m // bm)
  epilogue = sum(bool(t) for t in terms)
  flops = batch * pairs * bm * bm * (2 * k + epilogue)
  out = jax.ShapeDtypeStruct((batch, m, m), out_dtype)
  return _backend.cost_estimate(flops=flops, bytes_accessed=_backend.nbytes(x, out))


# ------------------------------------------------------------------ triton --
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


def _triton_kernel(coef_ref, x_ref, o_ref, *, tiles, nk, bm, bk, terms):
  t = pl.program_id(1)
  i, j = pair_from_index(t, tiles)
  ri = pl.ds(pl.multiple_of(i * bm, bm), bm)
  rj = pl.ds(pl.multiple_of(j * bm, bm), bm)

  def body(k, acc):
    kk = pl.ds(pl.multiple_of(k * bk, bk), bk)
    return acc + jax.lax.dot_general(x_ref[ri, kk], x_ref[rj, kk], _NT,
                                     preferred_element_type=F32, precision=precision(x_ref.dtype))
  acc = jax.lax.fori_loop(0, nk, body, jnp.zeros((bm, bm), F32))
  xs = x_ref[ri, rj] if terms[1] else None
  coef = (coef_ref[0], coef_ref[1], coef_ref[2])
  acc = _epilogue(acc, xs, i, j, coef, terms=terms, bm=bm)
  o_ref[ri, rj] = acc.astype(o_ref.dtype)

  @pl.when(i != j)
  def _():
    o_ref[rj, ri] = acc.T.astype(o_ref.dtype)


def _sym_triton(x, coef, *, terms, out_dtype, config: TritonConfig, interpret):
  from jax.experimental.pallas import triton as plgpu
  batch, m, k = x.shape
  bm, bk = config.bm, config.bk
  tiles = m // bm
  return pl.pallas_call(
      functools.partial(_triton_kernel, tiles=tiles, nk=k // bk, bm=bm, bk=bk, terms=terms),
      out_shape=jax.ShapeDtypeStruct((batch, m, m), out_dtype),
      grid=(batch, num_pairs(tiles)),
      in_specs=[pl.BlockSpec((4,), lambda b, t: (0,)),
                pl.BlockSpec((None, m, k), lambda b, t: (b, 0, 0))],
      out_specs=pl.BlockSpec((None, m, m), lambda b, t: (b, 0, 0)),
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
      interpret=interpret,
      name="fuseopt_ns_sym",
      cost_estimate=_sym_cost(x, out_dtype, bm, terms),
  )(coef, x)


# -------------------------------------------------------------- mosaic_tpu --
def upper_pairs(tiles: int) -> tuple[np.ndarray, np.ndarray]:
  """Rows and columns of the upper-triangle tile pairs, row-major (int32)."""
  rows, cols = np.triu_indices(tiles)
  return rows.astype(np.int32), cols.astype(np.int32)


def _mosaic_kernel(rows_ref, cols_ref, coef_ref, xi_ref, xj_ref, *rest, nk, bm, terms):
  from jax.experimental.pallas import tpu as pltpu
  if terms[1]:
    xs_ref, o_hbm, acc_ref, buf_ref, sem = rest
  else:
    (o_hbm, acc_ref, buf_ref, sem), xs_ref = rest, None
  b, t, k = pl.program_id(0), pl.program_id(1), pl.program_id(2)

  @pl.when(k == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  acc_ref[...] += jax.lax.dot_general(xi_ref[...], xj_ref[...], _NT, preferred_element_type=F32,
                                      precision=precision(xi_ref.dtype))

  @pl.when(k == nk - 1)
  def _():
    i, j = rows_ref[t], cols_ref[t]
    coef = (coef_ref[0], coef_ref[1], coef_ref[2])
    acc = _epilogue(acc_ref[...], xs_ref[...] if terms[1] else None, i, j, coef,
                    terms=terms, bm=bm)
    buf_ref[0] = acc.astype(buf_ref.dtype)
    upper = pltpu.make_async_copy(
        buf_ref.at[0], o_hbm.at[b, pl.ds(i * bm, bm), pl.ds(j * bm, bm)], sem.at[0])
    upper.start()

    @pl.when(i != j)
    def _():
      # Transpose in fp32 (the layout Mosaic transposes everywhere), round after.
      buf_ref[1] = acc.T.astype(buf_ref.dtype)
      lower = pltpu.make_async_copy(
          buf_ref.at[1], o_hbm.at[b, pl.ds(j * bm, bm), pl.ds(i * bm, bm)], sem.at[1])
      lower.start()
      lower.wait()

    upper.wait()


def _sym_mosaic(x, coef, *, terms, out_dtype, config: MosaicConfig, interpret):
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
      functools.partial(_mosaic_kernel, nk=nk, bm=bm, terms=terms),
      out_shape=jax.ShapeDtypeStruct((batch, m, m), out_dtype),
      grid_spec=grid_spec,
      compiler_params=_backend.mosaic_compiler_params(
          interpret, ("parallel", "arbitrary", "arbitrary")),
      interpret=interpret,
      name="fuseopt_ns_sym",
      cost_estimate=_sym_cost(x, out_dtype, bm, terms),
  )(jnp.asarray(rows), jnp.asarray(cols), *args)


# ------------------------------------------------------------------ public --
def _is_not(v, const) -> bool:
  """Whether a coefficient term is present: a traced value always is."""
  if isinstance(v, jax.core.Tracer):
    return True
  return float(v) != const


def _pad_to(x, m_mult, k_mult):
  _, m, k = x.shape
  pm, pk = -m % m_mult, -k % k_mult
  if pm or pk:
    x = jnp.pad(x, ((0, 0), (0, pm), (0, pk)))
  return x


def sym(x, *, alpha=1.0, beta=0.0, gamma=0.0, out_dtype=None, implementation="triton",
        interpret=False, config=None):
  """alpha·X Xᵀ + beta·X + gamma·I for X of shape (B, m, k) (square if beta/gamma;
  symmetric if beta, since the lower triangle is the mirror of the upper).

  ``interpret`` is the pallas_call value (``True`` or ``pltpu.InterpretParams``).
  """
  if x.ndim != 3:
    raise ValueError(f"sym: x must have shape (batch, m, k), got {x.shape}")
  batch, m, k = x.shape
  square = _is_not(beta, 0.0) or _is_not(gamma, 0.0)
  if square and m != k:
    raise ValueError(f"sym: beta/gamma need a square x, got {x.shape}")
  out_dtype = jnp.dtype(out_dtype or x.dtype)
  config = config or heuristic(implementation, batch, m, k)
  if square:
    g = max(config.bm, config.bk)
    xp = _pad_to(x, g, g)
  else:
    xp = _pad_to(x, config.bm, config.bk)
  terms = (_is_not(alpha, 1.0), _is_not(beta, 0.0), _is_not(gamma, 0.0))
  coef = jnp.stack([jnp.asarray(v, F32) for v in (alpha, beta, gamma, 0.0)])
  kwargs = dict(terms=terms, out_dtype=out_dtype, config=config, interpret=interpret)
  if implementation == "triton":
    out = _sym_triton(xp, coef, **kwargs)
  elif implementation == "mosaic_tpu":
    out = _sym_mosaic(xp, coef, **kwargs)
  else:
    raise ValueError(f"sym: implementation must be 'triton' or 'mosaic_tpu', got {implementation!r}")
  return out[:, :m, :m] if out.shape[1] != m else out
