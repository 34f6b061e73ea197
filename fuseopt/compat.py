"""What differs between the jax releases fuseopt supports (0.11.2 to 0.12.x).

Every version-dependent code path of fuseopt is here, decided by what the
installed jax has (a signature, an attribute), never by comparing version
strings; docs/compatibility.md lists each difference and why. Kernels and
transforms call these functions instead of branching on the release.

- **TPU interpret mode's race detection** lives with the kernels' interpret
  parameters (:mod:`fuseopt.kernels.interpret`): jax 0.12 added
  ``InterpretParams(on_race=...)``; fuseopt raises on a race where the
  release can, and runs without detection on 0.11.2.
- **Mosaic GPU loads**: jax 0.12 removed ``plgpu.load(ref, idx)``; the form
  both releases accept is ``plgpu.load(ref.at[idx], layout=...)`` (or a whole
  ref), which fuseopt's Mosaic GPU kernels use, so no shim is needed.

Nothing here imports Pallas at module level: ``fuseopt.optim`` may import
this module without loading a kernel backend.
"""

from __future__ import annotations

import jax

#: The installed jax release as a tuple of ints, for reports (not branching).
JAX_VERSION: tuple[int, ...] = tuple(int(x) for x in jax.__version__.split(".")[:3]
                                     if x.isdigit())
