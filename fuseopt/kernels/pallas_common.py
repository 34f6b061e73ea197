"""Pallas plumbing shared by every backend: Mosaic TPU compiler params and
the cost estimates the kernels declare."""

from __future__ import annotations

from typing import Any

import jax


def mosaic_compiler_params(interpret: Any, dimension_semantics, **kwargs) -> Any:
  """``pltpu.CompilerParams`` for a Mosaic kernel, safe under ``jax.vmap``.

  ``vmap`` of a ``pallas_call`` prepends a grid axis. jax 0.11.2's Mosaic
  lowering gives that axis "parallel" semantics itself and expects
  ``dimension_semantics`` to cover only the kernel's own grid axes
  (``jax/_src/pallas/mosaic/lowering.py``), but its TPU interpreter zips the
  semantics with the whole grid and fails (``safe_zip() argument 1 has
  length 1 but argument 0 has length 2``). In interpret mode the semantics
  are therefore left unset (every axis "arbitrary": the interpreter then runs
  the grid in order, which gives the same results); compiled kernels get
  ``dimension_semantics`` as given.
  """
  from jax.experimental.pallas import tpu as pltpu
  if interpret is not False and interpret is not None:
    return pltpu.CompilerParams(**kwargs)
  return pltpu.CompilerParams(dimension_semantics=dimension_semantics, **kwargs)


def in_hbm(arrays, interpret) -> tuple:
  """``arrays`` (a tuple) kept in HBM, where a Mosaic kernel's pipeline reads
  them: left free, libtpu copies or slices whole operands into on-chip memory
  ahead of the kernel, an extra pass over them (docs/kernels.md). Interpret
  mode: unchanged. Safe under ``jax.vmap`` on every supported release (jax
  0.10.2's ``with_memory_space_constraint`` has no batching rule; the
  constraint does not depend on the shape, so a batched operand is pinned as
  a whole)."""
  if interpret is not False and interpret is not None:
    return tuple(arrays)
  return tuple(_pinned_to_hbm(a) for a in arrays)


@jax.custom_batching.custom_vmap
def _pinned_to_hbm(x):
  from jax.experimental.pallas import tpu as pltpu
  return pltpu.with_memory_space_constraint(x, pltpu.HBM)


@_pinned_to_hbm.def_vmap
def _pinned_to_hbm_batched(axis_size, in_batched, x):
  del axis_size
  return _pinned_to_hbm(x), in_batched[0]


def nbytes(*arrays) -> int:
  """Bytes of arrays or shape-dtype structs (None entries count 0)."""
  total = 0
  for a in arrays:
    if a is not None:
      n = 1
      for d in a.shape:
        n *= int(d)
      total += n * jax.numpy.dtype(a.dtype).itemsize
  return total


def cost_estimate(*, flops: float, bytes_accessed: float, transcendentals: float = 0) -> Any:
  """A ``pl.CostEstimate``: a kernel's floating-point work and its
  compulsory memory traffic (every operand read once, every result written
  once)."""
  from jax.experimental import pallas as pl
  return pl.CostEstimate(flops=int(flops), transcendentals=int(transcendentals),
                         bytes_accessed=int(bytes_accessed))
