"""What differs between the jax releases fuseopt supports (0.10.2 to 0.12.x).

Every version-dependent code path of fuseopt is here, decided by what the
installed jax has (a signature, an attribute), never by comparing version
strings; docs/compatibility.md lists each difference and why. Kernels and
transforms call these functions instead of branching on the release.

- **TPU interpret mode's race detection** lives with the kernels' interpret
  parameters (:mod:`fuseopt.kernels.interpret`): jax 0.12 added
  ``InterpretParams(on_race=...)``; fuseopt raises on a race where the
  release can, and runs without detection on 0.10.2 and 0.11.2.
- **Mosaic GPU loads**: jax 0.12 removed ``plgpu.load(ref, idx)``; the form
  both releases accept is ``plgpu.load(ref.at[idx], layout=...)`` (or a whole
  ref), which fuseopt's Mosaic GPU kernels use, so no shim is needed.
- **Mosaic GPU on jax 0.10.2**: its Pallas Mosaic GPU module has no
  interpret mode (``plgpu.InterpretGPUParams``) and no ``plgpu.load``
  without an index, both of which fuseopt's Mosaic GPU kernels use; :func:`mosaic_gpu_missing` names what the installed release lacks,
  and the ``mosaic_gpu`` backend of every op refuses a call there with that
  reason (:func:`fuseopt.kernels.dispatch.mosaic_gpu_reason`).
- **A pinned layout as a donated output**: jax 0.10.2 gives a jitted
  function's output that is a ``with_layout_constraint``'s own result the
  layout ``AUTO``, which cannot take a donated input's buffer (``jit``
  raises "Input layout being donated was None while output layout was
  AUTO"); later releases give it the pinned layout. :func:`pin_layout`
  follows the constraint with a copy, lowered to nothing, on every release.
- **jax's CUDA wheels** (the compile tier's GPU compilers): jax 0.12.1
  publishes its CUDA plugin for CUDA 13 only, the floor's 0.10.2 for CUDA 12;
  :data:`fuseopt.targets.CUDA_WHEELS` finds whichever is installed (there,
  since :mod:`fuseopt.targets` loads without jax).

Nothing here imports Pallas at module level: ``fuseopt.optim`` may import
this module without loading a kernel backend.
"""

from __future__ import annotations

import functools
import inspect

import jax

#: The installed jax release as a tuple of ints, for reports (not branching).
JAX_VERSION: tuple[int, ...] = tuple(int(x) for x in jax.__version__.split(".")[:3]
                                     if x.isdigit())


def pin_layout(x: jax.Array, major_to_minor: tuple[int, ...]) -> jax.Array:
  """``x`` pinned to the dense layout ``major_to_minor``
  (``jax.experimental.layout.with_layout_constraint``), fit to be the output
  of a jitted function that donates its inputs, on every release.

  jax 0.10.2 turns a jit output that is the constraint's own result into an
  ``AUTO``-layout output, and refuses to donate an input (default layout)
  into it; from 0.11.2 that output takes the pinned layout. The constraint
  is followed by ``jnp.copy`` (jax's copy primitive, which lowers to
  nothing), so the jit's output is never the constraint's result: the
  layout still reaches XLA through the constraint, and the compiled program
  is the one the bare constraint gives where the release accepts it.
  """
  import jax.numpy as jnp
  from jax.experimental import layout as jax_layout
  return jnp.copy(jax_layout.with_layout_constraint(x, jax_layout.Layout(tuple(major_to_minor))))


@functools.cache
def mosaic_gpu_missing() -> tuple[str, ...]:
  """What fuseopt's Mosaic GPU kernels use that the installed jax's Pallas
  Mosaic GPU module lacks (empty from jax 0.11.2): interpret mode
  (``plgpu.InterpretGPUParams``) and ``plgpu.load`` of a whole ref or an
  ``.at[...]`` view without an index (jax 0.10.2 has neither)."""
  try:
    from jax.experimental.pallas import mosaic_gpu as plgpu
  except ImportError as e:   # pragma: no cover - a build without Mosaic GPU
    return (f"jax.experimental.pallas.mosaic_gpu ({e})",)
  missing = []
  if not hasattr(plgpu, "InterpretGPUParams"):
    missing.append("its interpret mode (plgpu.InterpretGPUParams)")
  idx = inspect.signature(plgpu.load).parameters.get("idx")
  if idx is not None and idx.default is inspect.Parameter.empty:
    missing.append("plgpu.load of a ref without an index")
  return tuple(missing)


def mosaic_gpu_release_reason() -> str | None:
  """Why the installed jax cannot run fuseopt's Mosaic GPU kernels (``None``
  where it can): the sentence the ``mosaic_gpu`` backends refuse with."""
  missing = mosaic_gpu_missing()
  if not missing:
    return None
  return (f"fuseopt's Mosaic GPU kernels need jax >= 0.11.2's Mosaic GPU, and jax "
          f"{jax.__version__} lacks {' and '.join(missing)}; use implementation='triton' "
          f"(the GPU default) or upgrade jax")
