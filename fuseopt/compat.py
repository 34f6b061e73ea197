"""What differs between the jax releases fuseopt supports (0.11.2 to 0.12.x).

Every version-dependent code path of fuseopt is here, decided by what the
installed jax has (a signature, an attribute), never by comparing version
strings; docs/compatibility.md lists each difference and why. Kernels and
transforms call these functions instead of branching on the release.

- **TPU interpret mode's race detection** (:func:`tpu_interpret_params`):
  jax 0.12 added ``InterpretParams(on_race=...)``, and with
  ``detect_races=True`` a race raises by default; 0.11.2 only records races
  where no public API reads them. fuseopt asks for ``on_race="raise"`` where
  the release has it, so a race is an error on 0.12, and runs without
  detection on 0.11.2 (it would find and report nothing there).
- **Mosaic GPU loads**: jax 0.12 removed ``plgpu.load(ref, idx)``; the form
  both releases accept is ``plgpu.load(ref.at[idx], layout=...)`` (or a whole
  ref), which fuseopt's Mosaic GPU kernels use, so no shim is needed.

Nothing here imports Pallas at module level: ``fuseopt.optim`` may import
this module without loading a kernel backend.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import jax

#: The installed jax release as a tuple of ints, for reports (not branching).
JAX_VERSION: tuple[int, ...] = tuple(int(x) for x in jax.__version__.split(".")[:3]
                                     if x.isdigit())

# FUSEOPT_DETECT_RACES=1 runs TPU kernels in interpret mode with race
# detection (slower; on by default in the test suite of the newest release).


@functools.cache
def interpret_raises_on_race() -> bool:
  """Whether ``pltpu.InterpretParams`` takes ``on_race`` (jax >= 0.12): only
  then can a race found in interpret mode be raised through the public API."""
  from jax.experimental.pallas import tpu as pltpu
  return "on_race" in inspect.signature(pltpu.InterpretParams).parameters


def detect_races_requested() -> bool:
  """``FUSEOPT_DETECT_RACES=1`` is set (and the release can raise on a race)."""
  from fuseopt.kernels import dispatch   # the one reader of fuseopt's environment
  return dispatch.environment_overrides().detect_races and interpret_raises_on_race()


def tpu_interpret_params(**kwargs: Any) -> Any:
  """``pltpu.InterpretParams(**kwargs)``, with race detection that raises
  where the release supports it and ``FUSEOPT_DETECT_RACES=1`` asks for it.
  An explicit ``detect_races`` / ``on_race`` in ``kwargs`` wins; ``on_race``
  is dropped on a release that does not know it (0.11.2)."""
  from jax.experimental.pallas import tpu as pltpu
  if interpret_raises_on_race():
    if detect_races_requested():
      kwargs.setdefault("detect_races", True)
    if kwargs.get("detect_races"):
      kwargs.setdefault("on_race", "raise")
  else:
    kwargs.pop("on_race", None)
  return pltpu.InterpretParams(**kwargs)
