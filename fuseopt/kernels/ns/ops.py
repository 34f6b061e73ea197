"""The NS primitives on the tiled kernels, for the iteration in newton_schulz.py.

:class:`KernelOps` offers the same ``sym`` / ``matmul`` methods as the
reference ops, backed by :mod:`.gram` and :mod:`.update` (or XLA's dot for
``matmul``, the default: see :mod:`.update`). :meth:`KernelOps.run` pads the
matrices once to a multiple of every block used, so no kernel pads or slices
inside the loop (NS maps zero rows/columns to zero rows/columns exactly).
"""

from __future__ import annotations

import jax.numpy as jnp

from fuseopt.kernels.ns import gram as gram_k
from fuseopt.kernels.ns import update as update_k

F32 = jnp.float32


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
    self.sym_config = self.config.sym or gram_k.heuristic(self.impl, batch, m, n)
    self.matmul_config = self.config.matmul if self.config.matmul is not None else "xla"
    if self.matmul_config == "pallas":
      self.matmul_config = update_k.heuristic(self.impl, batch, m, n)
    gm = max(self.sym_config.bm, self.sym_config.bk)
    gn = self.sym_config.bk
    if self.matmul_config != "xla":
      um, un = update_k.granules(self.matmul_config)
      gm, gn = max(gm, um, un), max(gn, un)
    pm, pn = -m % gm, -n % gn
    if pm or pn:
      x = jnp.pad(x, ((0, 0), (0, pm), (0, pn)))
    y = iterate(x)
    return y[:, :m, :n] if (pm or pn) else y

  def sym(self, x, *, alpha=1.0, beta=0.0, gamma=0.0):
    return gram_k.sym(x, alpha=alpha, beta=beta, gamma=gamma, out_dtype=self.dtype,
                      implementation=self.impl, interpret=self.interpret, config=self.sym_config)

  def matmul(self, b, x, *, a=0.0):
    if self.matmul_config == "xla":
      return update_k.matmul_reference(b, x, a=a, out_dtype=self.dtype)
    return update_k.matmul(b, x, a=a, out_dtype=self.dtype, implementation=self.impl,
                           interpret=self.interpret, config=self.matmul_config)
