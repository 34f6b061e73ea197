"""The whole Newton–Schulz iteration in one kernel: the Triton backend (GPU).

One CTA per matrix, so only for *small* matrices (a GPU SM has 228 KB of
shared memory and one CTA cannot use the others): padded to powers of two,
m <= 128 and m·n <= 16384 (e.g. 128 × 128, 64 × 256, 32 × 512). Larger GPU
matrices take the tiled kernels.
"""

from __future__ import annotations

import dataclasses

from jax.experimental import pallas as pl

from fuseopt.kernels.newton_schulz.fused import shared

MAX_M = 128
MAX_ELEMENTS = 16384


@dataclasses.dataclass(frozen=True)
class TritonConfig:
  num_warps: int = 4
  num_stages: int = 1


Config = TritonConfig
SEARCH_SPACE = (TritonConfig(4), TritonConfig(8))


def heuristic(m: int = 0, n: int = 0) -> TritonConfig:
  del m, n   # one config for every shape
  return TritonConfig()


def padded_shape(m: int, n: int) -> tuple[int, int]:
  return max(16, pl.next_power_of_2(m)), max(16, pl.next_power_of_2(n))


def fits(m: int, n: int, itemsize: int = 2) -> bool:
  del itemsize
  mp, np_ = padded_shape(m, n)
  return mp <= MAX_M and mp * np_ <= MAX_ELEMENTS


def run(xp, table, *, config: TritonConfig, interpret):
  from jax.experimental.pallas import triton as plgpu
  params = plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages)
  return shared.launch(xp, table, compiler_params=params, interpret=interpret)
