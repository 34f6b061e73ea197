"""The Triton Adam kernels' grouped launches: their config and search
spaces, and the grid arithmetic the dense (:mod:`.triton`) and blockwise
(:mod:`.triton_blockwise`) grouped launches share: which leaf a program works
on, each leaf's clamped block index, the leaves' scalar and seed rows."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from fuseopt.kernels import elementwise_tiling
from fuseopt.kernels.adam.math import N_SCALARS, N_SEEDS
from fuseopt.kernels.elementwise_tiling import TritonConfig


# ---------------------------------------------------------- triton, grouped --
# One launch over a list of leaves (per-leaf launches repeat each kernel's
# ramp-up and drain; docs/measurements.md has what they cost on the 1.2 B tree). The leaves stay where they are: each is its own operand and
# in-place output, the 1-D grid runs over the sum of their block counts, and
# program ``i`` works on leaf ``k`` where ``starts[k] <= i < starts[k + 1]``.
@dataclasses.dataclass(frozen=True)
class TritonGroupConfig:
  """Tiling of a grouped launch: ``block`` elements a program, ``num_warps``,
  and at most ``max_leaves_per_launch`` leaves a launch (the kernel body holds
  one unrolled branch per leaf, so this bounds the kernel's code size)."""
  block: int = 1024
  num_warps: int = 8
  max_leaves_per_launch: int = 16

  def __post_init__(self):
    TritonConfig(self.block, self.num_warps)  # same checks
    if not 1 <= self.max_leaves_per_launch <= 64:
      raise ValueError(f"max_leaves_per_launch must be in [1, 64], got "
                       f"{self.max_leaves_per_launch}")


# Measured on the H200 inside CUDA graphs (bench/results/nvidia-h200/device_run.json).
GROUP_SEARCH_SPACE = tuple(TritonGroupConfig(b, w, k) for b in (512, 1024, 2048, 4096)
                           for w in (4, 8) for k in (8, 16))


# The grouped launch over 8-bit leaves holds a block's codes, scales and
# fp32 moments and the loaded leaf's values across the branch that picks the
# leaf: at 32 elements a thread (block 4096, 4 warps) ptxas spills 120-200
# bytes a thread on the H200 and L4 (the compile tier), so its space stops at 16.
# The grouped launch over 4-bit leaves holds more (a row's two halves' bytes,
# nibbles and scales) and uses the same space: the compile tier's
# llama-1-layer-int4 cases compile without spills at every config of it.
QUANTIZED_GROUP_SEARCH_SPACE = tuple(c for c in GROUP_SEARCH_SPACE
                                     if c.block // (c.num_warps * 32) <= 16)


def leaf_config(group: TritonGroupConfig) -> TritonConfig:
  """A grouped launch's tiling for a leaf that runs one launch of its own."""
  return TritonConfig(group.block, group.num_warps)


def group_heuristic(sizes) -> TritonGroupConfig:
  # Block 1024 / 8 warps: the per-leaf kernel's measured best on the H200;
  # a group of tiny leaves gets one small block, as triton_heuristic does.
  c = elementwise_tiling.triton_heuristic(max(sizes, default=1))
  return TritonGroupConfig(block=c.block, num_warps=c.num_warps, max_leaves_per_launch=16)


def group_leaf(i, starts):
  """``(k, first)``: the leaf of program ``i`` and its first program, from
  ``starts`` (static): integer arithmetic, no table in memory. (Pallas's
  Triton lowering cannot add a converted comparison to an integer: ``past``
  is 1 where ``i >= starts[j]`` by a clamp instead.)"""
  k = jnp.int32(0)
  first = jnp.int32(0)
  for j in range(1, len(starts) - 1):
    past = jnp.clip(i - (starts[j] - 1), 0, 1)
    k = k + past
    first = first + past * (starts[j] - starts[j - 1])
  return k, first


def bisect(k, lo: int, hi: int, branch):
  """``branch(j)`` for the static ``j == k`` in ``[lo, hi)``, as a balanced
  tree of two-way conds (Pallas's Triton lowering nests an n-way switch n
  deep)."""
  if hi - lo == 1:
    return branch(lo)
  mid = (lo + hi) // 2
  return jax.lax.cond(k < mid, lambda: bisect(k, lo, mid, branch),
                      lambda: bisect(k, mid, hi, branch))


class Held:
  """A stand-in for an output ref: keeps what is stored into it."""

  def __init__(self, dtype):
    self.dtype = dtype
    self.value = None

  def __setitem__(self, key, value):
    self.value = value


def program_starts(counts, per_program: int) -> list[int]:
  """A grouped launch's first program of each leaf (``counts`` of elements
  or rows, ``per_program`` of them a program), and the grid's size last."""
  starts = [0]
  for n in counts:
    starts.append(starts[-1] + pl.cdiv(n, per_program))
  return starts


def clamped(starts, k: int):
  """Leaf ``k``'s block index in program ``i``: clamped into range outside
  its own programs, so every address the lowering forms stays inside the leaf."""
  lo, nblocks = starts[k], starts[k + 1] - starts[k]
  return lambda i: jnp.clip(i - lo, 0, nblocks - 1)


def leaf_rows(scalars, seeds):
  """A grouped launch's ``(K, N_SCALARS)`` scalar and ``(K, N_SEEDS)`` seed
  rows, flat, padded to a power of two rows (Triton block shapes are powers
  of two), and their two whole-array specs."""
  n_leaves = scalars.shape[0]
  rows = pl.next_power_of_2(n_leaves)
  pad = lambda a: jnp.pad(a, ((0, rows - n_leaves), (0, 0))).reshape(-1)
  specs = [pl.BlockSpec((rows * N_SCALARS,), lambda i: (0,)),
           pl.BlockSpec((rows * N_SEEDS,), lambda i: (0,))]
  return pad(scalars), pad(seeds), specs
