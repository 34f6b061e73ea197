"""What the Newton–Schulz Mosaic GPU kernels share (sm_90: warpgroup MMA and TMA).

The ``mosaic_gpu`` backends of the pieces — :mod:`.sym.mosaic_gpu`,
:mod:`.gemm.mosaic_gpu` and :mod:`.fused.mosaic_gpu` — use one tile layout:
a batch is the row-stacked 2-D view of its matrices (a free reshape), so each
tile is a plain 2-D TMA box; shared-memory tiles are 128-byte swizzled (8, 64)
tiles of 16-bit elements, so every block is a multiple of 64. Inputs are bf16
or f16 (the warpgroup MMA reads fp32 operands only as TF32: fp32 iterates are
refused), accumulation and epilogue fp32, the output in the input's dtype.

Compiles for sm_90 only (each backend's ``supports`` refuses other GPUs before
lowering: :func:`fuseopt.kernels.dispatch.mosaic_gpu_reason`); runs anywhere in
interpret mode (``plgpu.InterpretGPUParams()``).
"""

from __future__ import annotations

import jax.numpy as jnp

F32 = jnp.float32
# The H200's opt-in shared memory a block, less room for the pipeline's barriers.
SHARED_MEMORY_BYTES = 232448 - 2048
# Warpgroup MMA tiles: M a multiple of 64 (one warpgroup), and 128-byte
# swizzled shared-memory tiles of (8, 64) 16-bit elements, so every block a
# multiple of 64.
GRANULE = 64
SWIZZLE = 128
H200_SMS = 132


def check_block(name, v):
  if v <= 0 or v % GRANULE:
    raise ValueError(f"{name} must be a positive multiple of {GRANULE}, got {v}")


def check_stages(stages):
  if not 1 <= stages <= 8:
    raise ValueError(f"stages must be in [1, 8], got {stages}")


def round_up(v, g):
  return -(-v // g) * g


def transforms():
  """The shared-memory tile transforms of every operand (tiling, swizzle)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  return (plgpu.TilingTransform((8, SWIZZLE // 2)), plgpu.SwizzleTransform(SWIZZLE))


def check_dtype(op, x):
  if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise ValueError(f"{op}: implementation='mosaic_gpu' takes bf16 or f16 matrices (the "
                     f"warpgroup MMA reads fp32 only as TF32), got {x.dtype}")


def check_out_dtype(op, x, out_dtype):
  """The kernels write the input's dtype."""
  if out_dtype is not None and jnp.dtype(out_dtype) != jnp.dtype(x.dtype):
    raise ValueError(f"{op}: implementation='mosaic_gpu' writes x's dtype {x.dtype}, "
                     f"got out_dtype={out_dtype}")
