"""How a Pallas backend runs the Newton–Schulz iteration: the whole
iteration in one fused kernel (:mod:`.fused`, matrices that fit on chip), or
each product on the tiled kernels (:mod:`.sym` and :mod:`.gemm`, through
:class:`~.tiled.KernelOps`). See docs/kernels.md, "What implementation=None
runs"."""

from __future__ import annotations

from fuseopt.kernels import dispatch
from fuseopt.kernels.newton_schulz import fused
from fuseopt.kernels.newton_schulz import reference
from fuseopt.kernels.newton_schulz import tiled
from fuseopt.kernels.newton_schulz.tiled import TiledConfig

PATHS = ("fused", "tiled")


def pick_path(impl, m, n, batch, config, use_gram, ns_path=None) -> str:
  """``"fused"`` or ``"tiled"`` for backend ``impl`` on a batch of (m, n) matrices.

  An explicit ``config`` decides (any :class:`TiledConfig` but
  ``TiledConfig(matmul="pallas")`` is tiled, a fused config fused); then a
  Gram iteration is tiled (it has no fused kernel: ``FUSEOPT_NS_PATH=fused``
  is ignored for it, with a warning); then ``ns_path``, the
  ``FUSEOPT_NS_PATH`` override the caller read
  (:func:`fuseopt.kernels.dispatch.environment_overrides`); then whether the
  matrix fits the fused kernel.
  """
  del batch
  if isinstance(config, TiledConfig) and (config.sym is not None or config.matmul != "pallas"):
    return "tiled"
  if isinstance(config, tuple(b.Config for b in fused.BACKENDS.values())):
    return "fused"
  forced = ns_path
  if forced is not None and forced not in PATHS:
    raise ValueError(f"{dispatch.NS_PATH_ENV_VAR}={forced!r}: expected one of {PATHS}")
  if use_gram:
    if forced == "fused":
      dispatch.logger.warning("fuseopt.kernels: newton_schulz: %s=fused ignored: the Gram "
                              "iteration (gram=) has no fused kernel; it runs tiled",
                              dispatch.NS_PATH_ENV_VAR)
    return "tiled"
  if forced is not None:
    return forced
  return "fused" if fused.fits(impl, m, n) else "tiled"


def iterate(impl, y, *, table, restarts, ns_dtype, interpret, config, ns_path=None):
  """The iteration on a normalised batch ``y`` (B, m, n), m <= n, on backend
  ``impl``'s kernels; ``interpret`` is the Pallas call's value."""
  batch, m, n = y.shape
  if pick_path(impl, m, n, batch, config, restarts is not None, ns_path) == "fused":
    return fused.newton_schulz_fused(y, table, implementation=impl, interpret=interpret,
                                     config=config if not isinstance(config, TiledConfig) else None)
  cfg = config if isinstance(config, TiledConfig) else TiledConfig()
  kops = tiled.KernelOps(ns_dtype, impl, interpret, cfg)
  return kops.run(y, reference.iterate(table, restarts, kops))
