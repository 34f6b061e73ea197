"""Newton–Schulz's backends by name: this op's one dispatch table
(:func:`fuseopt.kernels.dispatch.select` chooses among them).

``"xla"`` is the reference iteration; each Pallas backend runs the fused
whole-NS kernel for a matrix that fits on chip, else the tiled
symmetric-product and GEMM kernels (:mod:`.paths`). Their kernels, configs,
heuristics and search spaces live in the pieces' backend modules
(:mod:`.sym`, :mod:`.gemm`, :mod:`.fused`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp

from fuseopt.kernels import dispatch
from fuseopt.kernels.newton_schulz import paths
from fuseopt.kernels.newton_schulz import reference


@dataclasses.dataclass(frozen=True)
class PallasBackend:
  """A Pallas backend of the iteration: its name and what it supports."""
  name: str
  supports: Callable[[dispatch.Call], str | None] = dispatch.supports_every_call

  def iterate(self, y, *, table, restarts, ns_dtype, interpret, config, ns_path=None):
    """The iteration on a normalised batch ``y`` (B, m, n), m <= n."""
    return paths.iterate(self.name, y, table=table, restarts=restarts, ns_dtype=ns_dtype,
                               interpret=interpret, config=config, ns_path=ns_path)


def mosaic_gpu_supports(call: dispatch.Call) -> str | None:
  """An sm_90 GPU (or interpret mode) and bf16 or f16 iterates: the
  warpgroup MMA reads fp32 only as TF32. Never chosen by
  ``implementation=None`` (Triton stays the GPU default); an sm_89 L4 or
  RTX 4090 is refused before anything is lowered."""
  reason = dispatch.mosaic_gpu_reason(call)
  if reason is not None:
    return reason
  ns_dtype = call.facts.get("ns_dtype")
  if ns_dtype is not None and jnp.dtype(ns_dtype).itemsize != 2:
    return (f"the Mosaic GPU kernels iterate in bf16 or f16 (the warpgroup MMA reads fp32 only "
            f"as TF32), got ns_dtype={jnp.dtype(ns_dtype)}")
  return None


BACKENDS = {
    "xla": reference,
    "triton": PallasBackend("triton"),
    "mosaic_tpu": PallasBackend("mosaic_tpu"),
    "mosaic_gpu": PallasBackend("mosaic_gpu", mosaic_gpu_supports),
}

# What implementation=None and gram=None mean where a measurement set them
# apart from dispatch.PLATFORM_ORDER (docs/measurements.md, "Newton–Schulz"
# and "TPU v5e"): on an H200 and on a TPU v5e the Gram iteration ran fastest
# for matrices of aspect ratio >= 2 (gram="auto"; on an H200 on the Triton
# path), and the standard iteration fastest as XLA's own matmuls. Without a
# measurement (CPU) the common order and optax's standard iteration stay.
DEFAULT_GRAM = {"gpu": "auto", "cuda": "auto", "tpu": "auto"}
STANDARD_ORDER = {"gpu": ("xla",), "cuda": ("xla",), "tpu": ("xla",)}
# On a TPU v5e XLA's matmuls also ran the Gram iteration fastest (its
# symmetric products on the Mosaic path lost to them at every shape).
GRAM_ORDER = {"tpu": ("xla",)}

