"""Tiling shared by fuseopt's elementwise kernels (stochastic rounding, Adam).

Both tile a leaf's *flat* index space, so the counter hash sees global flat
indices whatever the block:

- Triton: a 1-D grid of ``block`` elements a program (a power of two), the
  ragged last block masked by Pallas;
- Mosaic TPU: the flat array viewed as ``(rows, 128)`` lanes, ``block_rows``
  rows a grid step (a multiple of 16: bf16 packs 16 rows a vreg tile).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

LANES = 128


@dataclasses.dataclass(frozen=True)
class TritonConfig:
  block: int = 1024
  num_warps: int = 8

  def __post_init__(self):
    if self.block <= 0 or self.block & (self.block - 1):
      raise ValueError(f"block must be a positive power of two, got {self.block}")
    if self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f"num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps}")


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
  block_rows: int = 512

  def __post_init__(self):
    if self.block_rows <= 0 or self.block_rows % 16:
      raise ValueError(f"block_rows must be a positive multiple of 16, got {self.block_rows}")


def triton_heuristic(size: int) -> TritonConfig:
  # Block 1024 / 8 warps measured best for per-leaf elementwise passes on the
  # H200, and block 4096 failed inside XLA's CUDA graph there
  # (docs/measurements.md, "Adam"); tiny arrays get one small block.
  block = min(1024, max(128, pl.next_power_of_2(max(size, 1))))
  return TritonConfig(block=block, num_warps=8 if size >= 1024 else 4)


def triton_flat_index(block: int) -> jax.Array:
  """uint32 flat indices of the current Triton program's block."""
  start = (pl.program_id(0) * block).astype(jnp.uint32)
  return start + jax.lax.iota(jnp.uint32, block)


def mosaic_flat_index(block_rows: int) -> jax.Array:
  """uint32 flat indices of the current Mosaic grid step's (block_rows, 128) tile."""
  shape = (block_rows, LANES)
  row0 = (pl.program_id(0) * block_rows).astype(jnp.uint32)
  rows = jax.lax.broadcasted_iota(jnp.uint32, shape, 0) + row0
  return rows * jnp.uint32(LANES) + jax.lax.broadcasted_iota(jnp.uint32, shape, 1)
