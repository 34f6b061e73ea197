"""The NS primitives on the tiled kernels, for the iteration of :mod:`.reference`.

:class:`KernelOps` offers the same ``sym`` / ``matmul`` methods as
:class:`~.reference.ReferenceOps`, backed by the :mod:`.sym` kernel and the
:mod:`.gemm` kernel (or XLA's dot for ``matmul``, the default: see
:mod:`.gemm`). :meth:`KernelOps.run` pads the
matrices once to a multiple of every block used, so no kernel pads or slices
inside the loop (NS maps zero rows/columns to zero rows/columns exactly).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from fuseopt.kernels.newton_schulz import gemm as gemm_k
from fuseopt.kernels.newton_schulz import sym as sym_k

F32 = jnp.float32
# The TPU's XLA-dot iterate is written behind a barrier from this many
# elements a call up (see KernelOps.matmul): past every call of the 1.2 B
# tree's steps (at most one 2048 x 8192 matrix, 2^24), below one
# 4096 x 14336 matrix.
TPU_BARRIER_ELEMENTS = 1 << 24


@dataclasses.dataclass(frozen=True)
class TiledConfig:
  """Block configs for the multi-kernel path (``None`` → the shape heuristic).

  ``sym``: :mod:`fuseopt.kernels.newton_schulz.sym` config for the symmetric products;
  ``matmul``: :mod:`fuseopt.kernels.newton_schulz.gemm` config, the string ``"xla"``
  (the default, except on ``mosaic_gpu``, whose default is ``"pallas"``) to run
  ``a·X + B X`` as an XLA dot with a fused add, or
  ``"pallas"`` for the GEMM kernel with its shape heuristic. The Pallas
  kernel adds ``a·X`` in its epilogue and writes only the rounded result:
  XLA's dot keeps fp32 products and an fp32 copy of X (excess precision) per
  call, 3-4 fp32 buffers the size of the call on an H200 and a TPU.

  Any TiledConfig forces the tiled path, except ``TiledConfig(matmul="pallas")``,
  which leaves the choice (single fused kernel or tiled) to the shape.
  """
  sym: Any = None
  matmul: Any = None


class KernelOps:

  def __init__(self, dtype, implementation, interpret, config):
    self.dtype = jnp.dtype(dtype)
    self.impl = implementation
    self.interpret = interpret
    self.config = config
    self.sym_config = None
    self.matmul_config = None

  def run(self, x, iterate):
    batch, m, n = x.shape
    self.sym_config = self.config.sym or sym_k.heuristic(self.impl, batch, m, n)
    # Mosaic GPU runs its own GEMM kernel by default (gemm.mosaic_gpu).
    default = "pallas" if self.impl == "mosaic_gpu" else "xla"
    self.matmul_config = self.config.matmul if self.config.matmul is not None else default
    if self.matmul_config == "pallas":
      self.matmul_config = gemm_k.heuristic(self.impl, batch, m, n)
    gm = max(self.sym_config.bm, self.sym_config.bk)
    gn = self.sym_config.bk
    if self.matmul_config != "xla":
      um, un = gemm_k.granules(self.matmul_config)
      gm, gn = max(gm, um, un), max(gn, un)
    pm, pn = -m % gm, -n % gn
    if pm or pn:
      x = jnp.pad(x, ((0, 0), (0, pm), (0, pn)))
    y = iterate(x)
    return y[:, :m, :n] if (pm or pn) else y

  def sym(self, x, *, alpha=1.0, beta=0.0, gamma=0.0):
    return sym_k.sym(x, alpha=alpha, beta=beta, gamma=gamma, out_dtype=self.dtype,
                     implementation=self.impl, interpret=self.interpret, config=self.sym_config)

  def matmul(self, b, x, *, a=0.0):
    if self.matmul_config == "xla":
      y = gemm_k.gemm_reference(b, x, a=a, out_dtype=self.dtype)
      # The barrier makes XLA write the iterate in ``dtype`` here. Without it
      # XLA moves the epilogue and the rounding into the next iteration's
      # fusions: they read the fp32 product and recompute the iterate from it
      # (the same bits), so an fp32 product of the call stays live from one
      # step to the next. XLA's GPU backend kept up to three
      # (docs/fused_step.md); libtpu two once a call holds more than
      # TPU_BARRIER_ELEMENTS (the 8.8 B step on 256 x v5e: 898 MiB a device,
      # 374 MiB with the barrier; docs/scaling.md). On smaller TPU calls
      # libtpu's own schedule is the smaller one (v6e builder step: 193 MiB,
      # 217 MiB with the barrier), so they keep it.
      if self.impl == "mosaic_tpu" and x.size <= TPU_BARRIER_ELEMENTS:
        return y
      return jax.lax.optimization_barrier(y)
    return gemm_k.gemm(b, x, a=a, out_dtype=self.dtype, implementation=self.impl,
                       interpret=self.interpret, config=self.matmul_config)
