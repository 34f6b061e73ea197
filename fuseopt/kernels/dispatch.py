"""The one dispatch of :mod:`fuseopt.kernels`: which backend runs an op.

Every op has a plain-``jnp`` reference (``"xla"``) and Pallas backends:
``"triton"`` (GPU, Pallas's Triton lowering), ``"mosaic_tpu"`` (TPU) and, for
the elementwise ops and Newton–Schulz, ``"mosaic_gpu"`` (Pallas's Mosaic GPU
lowering, sm_90 only). Each op lists its backends in one table in its own
folder, ``<op>/backends.py`` (``BACKENDS``: name -> the module or record that
holds the backend's kernel, config, heuristic and search space), each with a
``supports(call)`` function that returns ``None`` when the backend can run
the :class:`Call` or a sentence saying why it cannot; the op hands its table
to :func:`select`.

The rule (:func:`select`):

1. ``implementation=<name>`` forces that backend. A name the op does not
   have, or a backend whose ``supports`` refuses the call, raises a
   ``ValueError`` naming the op, the backend and the reason. Nothing else
   overrides an explicit name.
2. ``implementation=None``: an environment override
   (:func:`environment_overrides`) names the backend, with the same checks;
   else the backends of the target's platform (:data:`PLATFORM_ORDER`) are
   tried in order and the first that supports the call runs. Each one
   passed over is logged at debug level on the ``"fuseopt"`` logger, naming
   the op, the backend and the reason. Every order ends with ``"xla"``; a
   platform not listed runs ``"xla"`` (there is no implicit TPU or GPU).

``mosaic_gpu`` is in no platform's order: it runs when named (Triton stays the
GPU default until a device run has timed both). An op whose measured fastest
backend on a platform is not the first of :data:`PLATFORM_ORDER` gives
:func:`select` its own order for that platform (``ORDER`` in the op's
``backends.py``, next to the measurement it rests on).

Adding a backend is one new file (the op's ``<backend>.py``, defining
``supports``) and one entry in the op's ``BACKENDS``.

Environment overrides (for debugging), read by :func:`environment_overrides`
and nowhere else, once per op call (the op hands what it read down):

- ``FUSEOPT_IMPLEMENTATION`` (``xla``, ``triton``, ``mosaic_tpu`` or
  ``mosaic_gpu``): the backend of every op called with ``implementation=None``;
- ``FUSEOPT_IMPLEMENTATION_<OP>`` (e.g. ``FUSEOPT_IMPLEMENTATION_ADAM_UPDATE``):
  the same for one op, which helps to bisect a numerical problem;
- ``FUSEOPT_NS_PATH`` (``fused`` or ``tiled``): Newton–Schulz's kernel path
  when neither ``config=`` nor ``gram=`` decides it (a Gram iteration has no
  fused kernel: the variable is then ignored, with a warning);
- ``FUSEOPT_DETECT_RACES=1``: interpret-mode TPU kernels raise on a data race
  (where the release can, :mod:`fuseopt.kernels.interpret`).

They are read when an op is *traced*. ``jax.jit`` caches what it traced and
does not see the environment, so a function jitted before a variable changed
keeps the choice it was traced with: set them before the process traces
anything (they are process settings), or call ``jax.clear_caches()`` after
changing one.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from typing import Any, Iterable, Mapping

import jax

from fuseopt import compat
from fuseopt.kernels import interpret as interpret_lib

logger = logging.getLogger("fuseopt")

IMPLEMENTATIONS = ("xla", "triton", "mosaic_tpu", "mosaic_gpu")
# The implementations resolve_implementation assumes when not told an op's.
WITHOUT_MOSAIC_GPU = ("xla", "triton", "mosaic_tpu")
ENV_VAR = "FUSEOPT_IMPLEMENTATION"
NS_PATH_ENV_VAR = "FUSEOPT_NS_PATH"
DETECT_RACES_ENV_VAR = "FUSEOPT_DETECT_RACES"

# The backends implementation=None tries, in order, per platform. Each ends
# with the reference; a platform not listed runs the reference.
PLATFORM_ORDER: Mapping[str, tuple[str, ...]] = {
    "cpu": ("xla",),
    "gpu": ("triton", "xla"),
    "cuda": ("triton", "xla"),
    "rocm": ("xla",),
    "tpu": ("mosaic_tpu", "xla"),
}

# ------------------------------------------------------------------ target --
@dataclasses.dataclass(frozen=True)
class Target:
  """The device a computation will run on."""
  platform: str
  device_kind: str = ""
  compute_capability: tuple[int, int] | None = None


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


def _abstract_device():
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  return device if device is not None and getattr(device, "platform", None) else None


def _concrete_device(arrays: Iterable[Any]):
  for a in arrays:
    if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer):
      try:
        return next(iter(a.devices()))
      except Exception:  # deleted or otherwise unusable array
        continue
  return None


def current_platform(arrays: Iterable[Any] = ()) -> str:
  """The platform a computation on ``arrays`` will run on.

  An abstract mesh with an abstract device (used to lower for a GPU or TPU
  from a CPU host) wins; then the devices of concrete input arrays; under
  ``jit`` the default backend.
  """
  device = _abstract_device()
  if device is not None:
    return device.platform
  concrete = _concrete_device(arrays)
  return concrete.platform if concrete is not None else jax.default_backend()


def target_device(arrays: Iterable[Any] = ()) -> Target:
  """The :class:`Target` of a computation on ``arrays``, found as
  :func:`current_platform` finds the platform."""
  device = _abstract_device()
  if device is not None:
    kind = getattr(device, "device_kind", "") or ""
    return Target(device.platform, kind, compute_capability(kind))
  concrete = _concrete_device(arrays)
  if concrete is None:
    concrete = jax.devices()[0]
  kind = getattr(concrete, "device_kind", "") or ""
  cc = getattr(concrete, "compute_capability", None)
  if isinstance(cc, str) and re.fullmatch(r"\d+\.\d+", cc):
    major, minor = cc.split(".")
    cc = (int(major), int(minor))
  else:
    cc = compute_capability(kind)
  return Target(concrete.platform, kind, cc)


# ------------------------------------------------------------- environment --
@dataclasses.dataclass(frozen=True)
class Overrides:
  """The environment overrides in effect (see the module docstring)."""
  implementation: str | None = None              # FUSEOPT_IMPLEMENTATION
  per_op: Mapping[str, str] = dataclasses.field(default_factory=dict)  # FUSEOPT_IMPLEMENTATION_<OP>
  ns_path: str | None = None                     # FUSEOPT_NS_PATH
  detect_races: bool = False                     # FUSEOPT_DETECT_RACES=1

  def implementation_for(self, op: str) -> tuple[str, str] | None:
    """``(variable, value)`` naming the backend of ``op``, or None."""
    key = op.upper()
    if self.per_op.get(key):
      return f"{ENV_VAR}_{key}", self.per_op[key]
    if self.implementation:
      return ENV_VAR, self.implementation
    return None


def environment_overrides() -> Overrides:
  """The one reader of fuseopt's environment variables (module docstring):
  called when an op is traced, never to override an explicit argument."""
  prefix = ENV_VAR + "_"
  per_op = {k[len(prefix):]: v for k, v in os.environ.items() if k.startswith(prefix) and v}
  ns_path = os.environ.get(NS_PATH_ENV_VAR) or None
  return Overrides(os.environ.get(ENV_VAR) or None, per_op, ns_path,
                   os.environ.get(DETECT_RACES_ENV_VAR, "") == "1")


# ---------------------------------------------------------------- dispatch --
@dataclasses.dataclass(frozen=True)
class Call:
  """What a backend's ``supports`` sees: the op, its target, whether it runs
  in interpret mode, and op-specific facts (dtypes, shapes, options)."""
  op: str
  target: Target
  interpret: bool = False
  facts: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __getattr__(self, name):
    try:
      return self.__dict__["facts"][name]
    except KeyError:
      raise AttributeError(name) from None


def supports_every_call(call: Call) -> str | None:
  """``supports`` of a backend that runs every call its public function
  accepts (the reference, and kernels that cover what they cannot tile
  themselves)."""
  del call
  return None


def piece_backend(backends: Mapping[str, Any], implementation: str, what: str):
  """The module of a Newton–Schulz piece's backend (``backends``: the
  piece's name -> module table), raising a ValueError naming ``what``."""
  if implementation not in backends:
    raise ValueError(f"{what}: implementation must be one of {tuple(backends)}, got "
                     f"{implementation!r}")
  return backends[implementation]


def log_fallback(op: str, backend: str, reason: str, *, runs: str = "the next backend") -> None:
  """Logs at debug level that ``backend`` does not run (part of) ``op``."""
  logger.debug("fuseopt.kernels: %s: %s passed over (%s); %s runs", op, backend, reason, runs)


def resolve_implementation(op: str, implementation: str | None,
                           arrays: Iterable[Any] = (),
                           available: Iterable[str] = WITHOUT_MOSAIC_GPU,
                           overrides: Overrides | None = None) -> str:
  """The backend name for ``op`` from the argument, the environment and the
  platform alone (no ``supports`` checks: :func:`select` adds them).

  Args:
    op: the op's name, also used for the per-op environment override.
    implementation: ``None`` (choose) or one of ``available``.
    arrays: inputs, to find their platform.
    available: the op's backend names (its ``BACKENDS``' keys).
    overrides: the environment overrides this call read
      (:func:`environment_overrides` when not given).
  """
  available = tuple(available)
  if implementation is None:
    override = (overrides or environment_overrides()).implementation_for(op)
    if override is not None:
      variable, implementation = override
      if implementation not in available:
        raise ValueError(f"{variable}={implementation!r} is not an implementation of {op}; "
                         f"expected one of {available}")
  if implementation is None:
    platform = current_platform(arrays)
    implementation = next((n for n in PLATFORM_ORDER.get(platform, ("xla",)) if n in available),
                          "xla")
  if implementation not in available:
    raise ValueError(f"implementation={implementation!r} is not available for "
                     f"{op}; expected None or one of {available}")
  return implementation


def select(op: str, backends: Mapping[str, Any], implementation: str | None,
           arrays: Iterable[Any] = (), *, interpret: bool = False,
           overrides: Overrides | None = None, order: Mapping[str, tuple[str, ...]] | None = None,
           **facts: Any) -> str:
  """The backend of ``backends`` (the op's table) that runs this call of
  ``op`` (the rule of the module docstring). ``facts`` are what the
  backends' ``supports`` read; ``overrides`` what the op read from the
  environment for this call (read here when not given); ``order`` the op's
  own order for the platforms where a measurement set it apart from
  :data:`PLATFORM_ORDER` (the op's ``backends.py`` says which and why)."""
  arrays = tuple(arrays)
  overrides = overrides or environment_overrides()
  call = Call(op, target_device(arrays), bool(interpret), facts)
  named, source = implementation, ""
  if named is None:
    override = overrides.implementation_for(op)
    if override is not None:
      # Say where the name came from: nothing in the call names it.
      named, source = override[1], f" (set by the environment variable {override[0]})"
  if named is not None:
    name = resolve_implementation(op, implementation, arrays, backends, overrides)
    reason = backends[name].supports(call)
    if reason is not None:
      raise ValueError(f"{op}: implementation={name!r}{source} cannot run this call: {reason}")
    return name
  platform = call.target.platform
  tried = (order or {}).get(platform) or PLATFORM_ORDER.get(platform, ("xla",))
  for name in [n for n in tried if n in backends]:
    reason = backends[name].supports(call)
    if reason is None:
      return name
    log_fallback(op, name, reason)
  return "xla"


def mosaic_gpu_reason(call: Call) -> str | None:
  """Why a Mosaic GPU kernel cannot be compiled for ``call``'s target: only
  an sm_90 GPU (H100, H200) takes one, or any machine in interpret mode; and
  only on a jax release whose Mosaic GPU has what the kernels use
  (:func:`fuseopt.compat.mosaic_gpu_release_reason`: jax 0.10.2 has not).

  Checked before anything is traced into a kernel: compiling a Mosaic GPU
  kernel for an sm_89 GPU (L4, RTX 4090) aborts the whole process inside LLVM
  ("Cannot select: intrinsic %llvm.nvvm.elect.sync", docs/pallas_notes.md), so
  it must never be attempted.
  """
  if call.interpret:
    return compat.mosaic_gpu_release_reason()
  t = call.target
  if t.platform not in ("gpu", "cuda"):
    return (f"Mosaic GPU compiles for NVIDIA sm_90 GPUs (H100, H200) only, and the target is a "
            f"{t.platform} device ({t.device_kind or 'unknown kind'}); pass interpret=True to "
            f"run the kernel in interpret mode, or use another implementation")
  cc = t.compute_capability
  if cc != (9, 0):
    what = f"compute capability {cc[0]}.{cc[1]} (sm_{cc[0]}{cc[1]})" if cc else (
        "an unknown compute capability")
    return (f"Mosaic GPU compiles for sm_90 GPUs (H100, H200) only; the target device "
            f"{t.device_kind!r} has {what}. Compiling a Mosaic GPU kernel for sm_89 (L4, "
            f"RTX 4090) aborts the process inside LLVM, so fuseopt refuses before lowering: use "
            f"implementation='triton' (the GPU default) there")
  return compat.mosaic_gpu_release_reason()


def check_mosaic_gpu_target(op: str, interpret: bool, arrays: Iterable[Any] = ()) -> None:
  """Raises a ValueError (naming ``op``) unless a Mosaic GPU kernel can be
  compiled for the target device (:func:`mosaic_gpu_reason`)."""
  reason = mosaic_gpu_reason(Call(op, target_device(arrays), bool(interpret)))
  if reason is not None:
    raise ValueError(f"{op}: implementation='mosaic_gpu' cannot run this call: {reason}")


def interpret_arg(implementation: str, interpret: bool) -> Any:
  """The ``interpret=`` value a backend's Pallas call wants
  (:mod:`fuseopt.kernels.interpret`), with the race detection
  ``FUSEOPT_DETECT_RACES`` asks for."""
  # (the environment read only where it decides something: a TPU kernel in interpret mode)
  races = bool(interpret) and implementation == "mosaic_tpu" and (
      environment_overrides().detect_races)
  return interpret_lib.params(implementation, interpret, detect_races=races)
