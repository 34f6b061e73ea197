"""What a Pallas call's ``interpret=`` gets: interpret mode per backend.

A backend's ``pallas_call`` runs on the CPU with ``interpret=``: ``True``
for Triton, a ``pltpu.InterpretParams`` for Mosaic TPU (which can detect
data races between grid steps) and a ``plgpu.InterpretGPUParams`` for
Mosaic GPU. :func:`fuseopt.kernels.dispatch.interpret_arg` hands each
backend its value, with the race detection the environment asks for
(``FUSEOPT_DETECT_RACES=1``, read by the dispatch).

Release-dependent (docs/compatibility.md): jax 0.12 added
``InterpretParams(on_race=...)``, and with ``detect_races=True`` a race
raises by default; 0.10.2 and 0.11.2 only record races where no public API
reads them. fuseopt asks for ``on_race="raise"`` where the release has it, so a
race is an error on 0.12, and runs without detection on 0.10.2 and 0.11.2 (it
would find and report nothing there). Decided by the signature, never by the version string.

Nothing here imports Pallas at module level.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any


@functools.cache
def raises_on_race() -> bool:
  """Whether ``pltpu.InterpretParams`` takes ``on_race`` (jax >= 0.12): only
  then can a race found in interpret mode be raised through the public API."""
  from jax.experimental.pallas import tpu as pltpu
  return "on_race" in inspect.signature(pltpu.InterpretParams).parameters


def tpu_params(*, detect_races: bool = False, **kwargs: Any) -> Any:
  """``pltpu.InterpretParams(**kwargs)``, detecting races (and raising on
  one) where the release can and ``detect_races`` asks. An explicit
  ``detect_races`` / ``on_race`` in ``kwargs`` wins; ``on_race`` is dropped
  on a release that does not know it (0.10.2, 0.11.2)."""
  from jax.experimental.pallas import tpu as pltpu
  if raises_on_race():
    if detect_races:
      kwargs.setdefault("detect_races", True)
    if kwargs.get("detect_races"):
      kwargs.setdefault("on_race", "raise")
  else:
    kwargs.pop("on_race", None)
  return pltpu.InterpretParams(**kwargs)


def params(implementation: str, interpret: bool, *, detect_races: bool = False) -> Any:
  """The ``interpret=`` value backend ``implementation``'s Pallas call wants."""
  if not interpret:
    return False
  if implementation == "mosaic_tpu":
    return tpu_params(detect_races=detect_races)
  if implementation == "mosaic_gpu":
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu.InterpretGPUParams()
  return True
