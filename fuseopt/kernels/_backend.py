"""Choosing a kernel implementation and shared Pallas plumbing.

Every op in :mod:`fuseopt.kernels` has a plain-``jnp`` reference (``"xla"``)
and up to two Pallas backends: ``"triton"`` (GPU, Pallas's Triton lowering)
and ``"mosaic_tpu"`` (TPU).  ``implementation=None`` picks by the platform the
computation will run on; the environment variable ``FUSEOPT_IMPLEMENTATION``
(``xla``, ``triton`` or ``mosaic_tpu``) overrides that choice globally, and
``FUSEOPT_IMPLEMENTATION_<OP>`` (e.g. ``FUSEOPT_IMPLEMENTATION_ADAM_UPDATE``)
for one op, which helps to bisect a numerical problem.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

import jax

IMPLEMENTATIONS = ("xla", "triton", "mosaic_tpu")
ENV_VAR = "FUSEOPT_IMPLEMENTATION"

_PLATFORM_DEFAULT = {"gpu": "triton", "cuda": "triton", "rocm": "xla", "tpu": "mosaic_tpu"}


def current_platform(arrays: Iterable[Any] = ()) -> str:
  """The platform a computation on ``arrays`` will run on.

  An abstract mesh with an abstract device (used to lower for a GPU or TPU
  from a CPU host) wins; then the devices of concrete input arrays; under
  ``jit`` the default backend.
  """
  mesh = jax.sharding.get_abstract_mesh()
  device = getattr(mesh, "abstract_device", None)
  if device is not None and getattr(device, "platform", None):
    return device.platform
  for a in arrays:
    if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer):
      try:
        return next(iter(a.devices())).platform
      except Exception:  # deleted or otherwise unusable array
        continue
  return jax.default_backend()


def resolve_implementation(op: str, implementation: str | None,
                           arrays: Iterable[Any] = (),
                           available: Iterable[str] = IMPLEMENTATIONS) -> str:
  """Returns the implementation name to run for ``op``.

  Args:
    op: the op's name, used for the per-op environment override.
    implementation: ``None`` (choose) or one of ``available``.
    arrays: inputs, to find their platform.
    available: the implementations this op has.
  """
  available = tuple(available)
  if implementation is None:
    implementation = (os.environ.get(f"{ENV_VAR}_{op.upper()}")
                      or os.environ.get(ENV_VAR) or None)
    if implementation is not None and implementation not in available:
      raise ValueError(
          f"{ENV_VAR}={implementation!r} is not an implementation of {op}; "
          f"expected one of {available}")
  if implementation is None:
    implementation = _PLATFORM_DEFAULT.get(current_platform(arrays), "xla")
    if implementation not in available:
      implementation = "xla"
  if implementation not in available:
    raise ValueError(f"implementation={implementation!r} is not available for "
                     f"{op}; expected None or one of {available}")
  return implementation


def interpret_arg(implementation: str, interpret: bool) -> Any:
  """The ``interpret=`` value pallas_call wants for a backend."""
  if not interpret:
    return False
  if implementation == "mosaic_tpu":
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.InterpretParams()
  return True


def mosaic_compiler_params(interpret: Any, dimension_semantics, **kwargs) -> Any:
  """``pltpu.CompilerParams`` for a Mosaic kernel, safe under ``jax.vmap``.

  ``vmap`` of a ``pallas_call`` prepends a grid axis. jax 0.11.2's Mosaic
  lowering gives that axis "parallel" semantics itself and expects
  ``dimension_semantics`` to cover only the kernel's own grid axes
  (``jax/_src/pallas/mosaic/lowering.py``), but its TPU interpreter zips the
  semantics with the whole grid and fails (``safe_zip() argument 1 has
  length 1 but argument 0 has length 2``). In interpret mode the semantics
  are therefore left unset (every axis "arbitrary": the interpreter then runs
  the grid in order, which gives the same results); compiled kernels get
  ``dimension_semantics`` as given.
  """
  from jax.experimental.pallas import tpu as pltpu
  if interpret is not False and interpret is not None:
    return pltpu.CompilerParams(**kwargs)
  return pltpu.CompilerParams(dimension_semantics=dimension_semantics, **kwargs)


# Per-element work of the elementwise kernels, for their cost estimates (XLA's
# cost analysis, and a TPU's optimal_seconds, count a Pallas kernel only by
# what it declares). Adam: the two moment updates (3 + 4), the bias-corrected
# step (sqrt, eps, divide, lr: 4), the weight decay and the parameter write
# (3); one square root. Integer hashing of the stochastic rounding is not
# floating-point work.
ADAM_FLOPS_PER_ELEMENT = 14
ADAM_TRANSCENDENTALS_PER_ELEMENT = 1


def nbytes(*arrays) -> int:
  """Bytes of arrays or shape-dtype structs (None entries count 0)."""
  total = 0
  for a in arrays:
    if a is not None:
      n = 1
      for d in a.shape:
        n *= int(d)
      total += n * jax.numpy.dtype(a.dtype).itemsize
  return total


def cost_estimate(*, flops: float, bytes_accessed: float, transcendentals: float = 0) -> Any:
  """A ``pl.CostEstimate``: a kernel's floating-point work and its
  compulsory memory traffic (every operand read once, every result written
  once)."""
  from jax.experimental import pallas as pl
  return pl.CostEstimate(flops=int(flops), transcendentals=int(transcendentals),
                         bytes_accessed=int(bytes_accessed))
