"""Shared strategies and settings of the property suite.

Bulk data comes from a NumPy generator seeded by hypothesis (fast to draw,
shrinks through its seed); what the properties are about (shapes, special
values and where they sit, seeds, offsets, hyperparameters) is drawn by
hypothesis itself. Every test runs a fixed, derandomized example budget, so
the suite's CI time is fixed too.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# derandomize: the same examples on every run (CI stays reproducible and its
# time fixed); deadline=None: interpret-mode kernels compile on first use.
SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FAST = settings(max_examples=40, **SETTINGS)       # cheap properties (one compile, or none)
MEDIUM = settings(max_examples=15, **SETTINGS)     # a compile or a trace per example
KERNEL = settings(max_examples=5, **SETTINGS)      # interpret-mode kernels

# A few shapes, so jitted properties compile once per shape and not once per
# example: 0-d, empty, ragged (not a multiple of 128 or of any block), 2-D
# and 3-D, one over a full Mosaic row block.
SHAPE_BUCKETS = ((), (0,), (1,), (7,), (130,), (3, 129), (2, 0, 5), (2, 3, 257), (40, 128))

UINT32 = st.one_of(st.integers(0, 2**32 - 1),
                   st.sampled_from([0, 1, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1]))

# fp32 bit patterns of the values the rounding contract speaks of.
SPECIAL_BITS = (
    0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0xFF800123, 0xFFC00001,  # NaN payloads
    0x7F800000, 0xFF800000,                                                  # +-Inf
    0x00000000, 0x80000000,                                                  # +-0
    0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000,                                      # near the largest finite
    0x00000001, 0x807FFFFF, 0x00008000, 0x0000FFFF,                          # subnormals
)


@st.composite
def shapes(draw, max_dims=3, max_side=24, max_size=1500, min_dims=0):
  """0-d, empty and ragged shapes (sides not multiples of any block)."""
  ndim = draw(st.integers(min_dims, max_dims))
  shape = tuple(draw(st.lists(st.integers(0, max_side), min_size=ndim, max_size=ndim)))
  while int(np.prod(shape, dtype=np.int64)) > max_size:
    shape = tuple(max(1, s // 2) for s in shape)
  return shape


@st.composite
def fp32_arrays(draw, shape=None, specials=True):
  """fp32 arrays over many magnitudes, with special values sprinkled in."""
  if shape is None:
    shape = draw(shapes())
  elif isinstance(shape, st.SearchStrategy):
    shape = draw(shape)
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  size = int(np.prod(shape, dtype=np.int64))
  kind = draw(st.sampled_from(["normal", "wide", "bits"]))
  if kind == "normal":
    flat = rng.standard_normal(size).astype(np.float32)
  elif kind == "wide":  # magnitudes from 1e-40 (subnormal) to 1e38
    flat = (rng.standard_normal(size) * 10.0 ** rng.uniform(-40, 38, size)).astype(np.float32)
  else:  # any bit pattern at all
    flat = rng.integers(0, 2**32, size, dtype=np.uint64).astype(np.uint32).view(np.float32)
  if specials and size:
    k = draw(st.integers(0, min(size, 8)))
    for _ in range(k):
      flat.view(np.uint32)[draw(st.integers(0, size - 1))] = draw(st.sampled_from(SPECIAL_BITS))
  return flat.reshape(shape)


def bits16(x) -> np.ndarray:
  return np.asarray(x).view(np.uint16)


def bf16_neighbours(x: np.ndarray):
  """The two bf16 patterns around each fp32 ``x`` (truncation and one ulp up,
  clamped at the largest finite bf16), as uint16."""
  b = x.view(np.uint32)
  sign = (b >> 16) & 0x8000
  mag = b & 0x7FFFFFFF
  lo = mag >> 16
  hi = np.minimum(lo + 1, 0x7F7F)
  hi = np.where((mag & 0xFFFF) == 0, lo, hi)
  return (sign | lo).astype(np.uint16), (sign | hi).astype(np.uint16)
