"""The whole Newton–Schulz iteration in one kernel: the Mosaic TPU backend.

The matrix lives in VMEM (v5e/v6e have 128 MiB; the kernel raises the scoped
limit to :data:`VMEM_LIMIT`); used when the estimated working set
(:func:`vmem_bytes`) is under :data:`VMEM_BUDGET` — up to about 1024 × 1024
in bf16.
"""

from __future__ import annotations

import dataclasses

from fuseopt.kernels import pallas_common
from fuseopt.kernels.newton_schulz.fused import shared

VMEM_BUDGET = 40 * 2**20
VMEM_LIMIT = 64 * 2**20


@dataclasses.dataclass(frozen=True)
class MosaicTPUConfig:
  vmem_limit_bytes: int = VMEM_LIMIT


Config = MosaicTPUConfig
SEARCH_SPACE = (MosaicTPUConfig(VMEM_LIMIT), MosaicTPUConfig(96 * 2**20))


def heuristic(m: int = 0, n: int = 0) -> MosaicTPUConfig:
  del m, n   # one config for every shape
  return MosaicTPUConfig()


def _round_up(v, g):
  return -(-v // g) * g


def padded_shape(m: int, n: int) -> tuple[int, int]:
  return _round_up(m, 128), _round_up(n, 128)


def vmem_bytes(m: int, n: int, itemsize: int = 2) -> int:
  """Working set of the kernel: double-buffered input and output blocks,
  fp32 products and their rounded copies (m <= n, padded)."""
  mn, mm = m * n, m * m
  return 4 * mn * itemsize + mn * (4 + 4 + itemsize) + mm * (4 + 4 + 2 * itemsize)


def fits(m: int, n: int, itemsize: int = 2) -> bool:
  mp, np_ = padded_shape(m, n)
  return vmem_bytes(mp, np_, itemsize) <= VMEM_BUDGET


def run(xp, table, *, config: MosaicTPUConfig, interpret):
  params = pallas_common.mosaic_compiler_params(interpret, ("parallel",),
                                                vmem_limit_bytes=config.vmem_limit_bytes)
  return shared.launch(xp, table, compiler_params=params, interpret=interpret)
