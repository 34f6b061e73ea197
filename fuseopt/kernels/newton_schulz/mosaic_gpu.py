"""Newton–Schulz on the Mosaic GPU kernels (sm_90, opt-in): the fused
whole-NS kernel for a small matrix, else the tiled symmetric-product and GEMM
kernels (:mod:`.paths`; the tiled path runs the GEMM kernel by default). The
kernels, configs, heuristics and search spaces live in the pieces'
``mosaic_gpu`` modules (:mod:`.sym.mosaic_gpu`, :mod:`.gemm.mosaic_gpu`,
:mod:`.fused.mosaic_gpu`; shared layout in :mod:`.mosaic_gpu_common`).

Never chosen by ``implementation=None`` (Triton stays the GPU default);
compiles for sm_90 GPUs only (:func:`supports` refuses an sm_89 L4 or RTX
4090 before anything is lowered), runs anywhere in interpret mode. The
iterates are bf16 or f16: the warpgroup MMA reads fp32 only as TF32.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from fuseopt.kernels import dispatch
from fuseopt.kernels.newton_schulz import paths


def supports(call) -> str | None:
  """An sm_90 GPU (or interpret mode) and bf16 or f16 iterates."""
  reason = dispatch.mosaic_gpu_reason(call)
  if reason is not None:
    return reason
  ns_dtype = call.facts.get("ns_dtype")
  if ns_dtype is not None and jnp.dtype(ns_dtype).itemsize != 2:
    return (f"the Mosaic GPU kernels iterate in bf16 or f16 (the warpgroup MMA reads fp32 only "
            f"as TF32), got ns_dtype={jnp.dtype(ns_dtype)}")
  return None


# orthogonalize(y, *, table, restarts, ns_dtype, interpret, config): the
# iteration on a normalised batch ``y`` (B, m, n), m <= n.
orthogonalize = functools.partial(paths.orthogonalize, "mosaic_gpu")
