"""Choosing a kernel implementation and shared Pallas plumbing.

Every op in :mod:`fuseopt.kernels` has a plain-``jnp`` reference (``"xla"``)
and Pallas backends: ``"triton"`` (GPU, Pallas's Triton lowering),
``"mosaic_tpu"`` (TPU) and, for the elementwise ops, ``"mosaic_gpu"`` (Pallas's
Mosaic GPU lowering, sm_90 only: :func:`check_mosaic_gpu_target`).
``implementation=None`` picks by the platform the computation will run on
(never ``mosaic_gpu``: Triton stays the GPU default until a device run has
timed both); the environment variable ``FUSEOPT_IMPLEMENTATION`` (``xla``,
``triton``, ``mosaic_tpu`` or ``mosaic_gpu``) overrides that choice globally,
and ``FUSEOPT_IMPLEMENTATION_<OP>`` (e.g. ``FUSEOPT_IMPLEMENTATION_ADAM_UPDATE``)
for one op, which helps to bisect a numerical problem.
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterable

import jax

IMPLEMENTATIONS = ("xla", "triton", "mosaic_tpu", "mosaic_gpu")
# The implementations of an op that does not list its own: Mosaic GPU
# backends exist for the elementwise ops (stochastic rounding, Adam) only.
WITHOUT_MOSAIC_GPU = ("xla", "triton", "mosaic_tpu")
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
                           available: Iterable[str] = WITHOUT_MOSAIC_GPU) -> str:
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
  if implementation == "mosaic_gpu":
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu.InterpretGPUParams()
  return True


# Compute capabilities of the GPUs jax names by device kind (the kinds of jax
# 0.11.2's Pallas GPU info, matched the same way: the longest name found as
# words in the device kind, e.g. "NVIDIA H100 80GB HBM3" is an H100).
_COMPUTE_CAPABILITY = {
    "NVIDIA H100": (9, 0), "NVIDIA H200": (9, 0), "NVIDIA GH200": (9, 0),
    "NVIDIA L4": (8, 9), "NVIDIA L40": (8, 9), "NVIDIA GeForce RTX 4090": (8, 9),
    "NVIDIA A100": (8, 0), "NVIDIA A30": (8, 0), "NVIDIA A10": (8, 6), "Tesla T4": (7, 5),
    "NVIDIA B200": (10, 0), "NVIDIA GB200": (10, 0), "NVIDIA B300": (10, 3),
    "NVIDIA GB300": (10, 3),
}
_KIND_RE = re.compile(r"\b(" + "|".join(
    re.escape(k) for k in sorted(_COMPUTE_CAPABILITY, key=len, reverse=True)) + r")\b")


def compute_capability(device_kind: str) -> tuple[int, int] | None:
  """``(major, minor)`` of a GPU device kind, ``None`` when unknown."""
  m = _KIND_RE.search(device_kind or "")
  return _COMPUTE_CAPABILITY[m.group(1)] if m else None


def _target_device(arrays: Iterable[Any]) -> tuple[str, str, tuple[int, int] | None]:
  """(platform, device kind, compute capability) of the device a computation
  on ``arrays`` targets, found as :func:`current_platform` finds the platform."""
  mesh = jax.sharding.get_abstract_mesh()
  device = getattr(mesh, "abstract_device", None)
  if device is not None and getattr(device, "platform", None):
    kind = getattr(device, "device_kind", "") or ""
    return device.platform, kind, compute_capability(kind)
  concrete = None
  for a in arrays:
    if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer):
      try:
        concrete = next(iter(a.devices()))
        break
      except Exception:  # deleted or otherwise unusable array
        continue
  if concrete is None:
    concrete = jax.devices()[0]
  kind = getattr(concrete, "device_kind", "") or ""
  cc = getattr(concrete, "compute_capability", None)
  if isinstance(cc, str) and re.fullmatch(r"\d+\.\d+", cc):
    major, minor = cc.split(".")
    cc = (int(major), int(minor))
  else:
    cc = compute_capability(kind)
  return concrete.platform, kind, cc


def check_mosaic_gpu_target(op: str, interpret: bool, arrays: Iterable[Any] = ()) -> None:
  """Raises a ValueError unless a Mosaic GPU kernel of ``op`` can be compiled
  for the target device: an sm_90 GPU (H100, H200), or any machine in
  interpret mode.

  Called before anything is traced into a kernel: compiling a Mosaic GPU
  kernel for an sm_89 GPU (L4, RTX 4090) aborts the whole process inside LLVM
  ("Cannot select: intrinsic %llvm.nvvm.elect.sync", docs/pallas_notes.md), so
  it must never be attempted.
  """
  if interpret:
    return
  platform, kind, cc = _target_device(arrays)
  if platform not in ("gpu", "cuda"):
    raise ValueError(
        f"{op}: implementation='mosaic_gpu' compiles for NVIDIA sm_90 GPUs (H100, H200) only, "
        f"and the target is a {platform} device ({kind or 'unknown kind'}); pass "
        f"interpret=True to run the kernel in interpret mode, or use another implementation")
  if cc != (9, 0):
    what = f"compute capability {cc[0]}.{cc[1]} (sm_{cc[0]}{cc[1]})" if cc else (
        "an unknown compute capability")
    raise ValueError(
        f"{op}: implementation='mosaic_gpu' compiles for sm_90 GPUs (H100, H200) only; the "
        f"target device {kind!r} has {what}. Compiling a Mosaic GPU kernel for sm_89 "
        f"(L4, RTX 4090) aborts the process inside LLVM, so fuseopt refuses before lowering: "
        f"use implementation='triton' (the GPU default) there")


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
