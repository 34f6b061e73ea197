"""Compile targets: the accelerators fuseopt is compiled for without hardware.

Every target is one entry of :data:`TARGETS`. A GPU target is a
``stream_executor.GpuTargetConfigProto`` in text format (a ``.txtpb`` file
in this folder, written from public specs; each file names its sources) that
XLA's CUDA compiler takes in place of a device; a TPU target is a libtpu
topology name. With the compilers installed (the ``compile`` extra: libtpu
for TPU, jax's CUDA plugin and ptxas for GPU) a jitted function is compiled
for a target on a CPU-only machine by the very compiler a device would run:

>>> t = targets.get("v6e")
>>> with targets.lowering_for(t):
...   compiled = jax.jit(f).trace(*targets.avals(t, args)).lower(
...       lowering_platforms=(t.lowering_platform,)).compile()

:func:`lowering_for` enters an abstract mesh whose device is the target's,
so that fuseopt's backend dispatch picks the target's kernels
(``mosaic_tpu`` on a TPU, ``triton`` on a GPU) while tracing on the CPU.

Adding a target is one entry in :data:`TARGETS` (and, for a GPU, its
``.txtpb`` file). See docs/compile_tier.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np

HERE = Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class Target:
  """One accelerator to compile for.

  Attributes:
    name: the short name (``"h200"``, ``"v6e"``, ...).
    platform: ``"gpu"`` or ``"tpu"`` (the abstract device's platform).
    device_kind: the device kind jax reports on the hardware; Pallas reads
      the GPU's compute capability from it.
    num_cores: SMs of a GPU, TensorCores per chip of a TPU.
    topologies: device count -> topology: libtpu's topology name on a TPU
      (``"v6e:2x4"``), the GPU topology string (``"1x1x8"``) on a GPU.
    spec: the GPU target description file in this folder (GPU only).
    implementation: the fuseopt backend that runs there.
    compute_capability: ``(major, minor)`` of a GPU.
    source: where the figures of the entry come from.
    ci_shared_cases: whether CI compiles the cases meant for every target
      (the kernels, the 1.2 B steps) here; ``False`` for a target that is
      there for the scale cases, whose other cases are the full sweep's.
  """
  name: str
  platform: str
  device_kind: str
  num_cores: int
  topologies: dict = dataclasses.field(hash=False, compare=False)
  implementation: str
  spec: str | None = None
  compute_capability: tuple[int, int] | None = None
  source: str = ""
  ci_shared_cases: bool = True

  @property
  def lowering_platform(self) -> str:
    return "cuda" if self.platform == "gpu" else "tpu"

  @property
  def device_counts(self) -> tuple[int, ...]:
    return tuple(sorted(self.topologies))


_TPU_SOURCE = ("libtpu's own topology description (jax.experimental.topologies), "
               "named as in Cloud TPU's accelerator types")
TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("v5e", "tpu", "TPU v5 lite", 1,
           {1: "v5e:2x2", 8: "v5e:2x4", 64: "v5e:8x8", 256: "v5e:16x16"}, "mosaic_tpu",
           source=_TPU_SOURCE),
    Target("v6e", "tpu", "TPU v6 lite", 1, {1: "v6e:2x2", 8: "v6e:2x4"}, "mosaic_tpu",
           source=_TPU_SOURCE),
    # One device a chip: its two TensorCores run as one (megacore).
    Target("v5p", "tpu", "TPU v5", 2, {1: "v5p:2x2x1", 1024: "v5p:8x8x16"}, "mosaic_tpu",
           source=_TPU_SOURCE, ci_shared_cases=False),
    # XLA's deviceless GPU topology is slices x hosts x devices a host.
    Target("h200", "gpu", "NVIDIA H200", 132,
           {1: "1x1x1", 8: "1x1x8", 64: "1x8x8", 256: "1x32x8"}, "triton",
           spec="h200.txtpb", compute_capability=(9, 0), source="h200.txtpb"),
    Target("l4", "gpu", "NVIDIA L4", 58, {1: "1x1x1"}, "triton",
           spec="l4.txtpb", compute_capability=(8, 9), source="l4.txtpb"),
    Target("rtx4090", "gpu", "NVIDIA GeForce RTX 4090", 128, {1: "1x1x1"}, "triton",
           spec="rtx4090.txtpb", compute_capability=(8, 9), source="rtx4090.txtpb"),
)}


class UnknownTarget(ValueError):
  pass


class CompilerMissing(RuntimeError):
  """The compiler of a target is not installed (names the missing package)."""


class BadTargetSpec(ValueError):
  """A GPU target description that the compiler does not parse."""


def get(name: str | Target) -> Target:
  """The target called ``name``; raises :class:`UnknownTarget` listing the
  known ones."""
  if isinstance(name, Target):
    return name
  try:
    return TARGETS[name]
  except KeyError:
    raise UnknownTarget(f"unknown compile target {name!r}; known targets: "
                        f"{', '.join(TARGETS)}") from None


#: jax's CUDA wheels as importable modules, the newer CUDA first: (the CUDA
#: plugin, its PJRT plugin, the NVIDIA package whose folder holds ``bin/ptxas``
#: and ``nvvm/libdevice``). jax 0.12.1 publishes the CUDA 13 set only
#: (``jax-cuda13-plugin``, ``-pjrt``; ``nvidia-cuda-nvcc`` and ``nvidia-nvvm``
#: 13 install under ``nvidia/cu13``); the floor's 0.10.2 (the
#: ``compile-floor`` extra) the CUDA 12 set (``nvidia-cuda-nvcc-cu12``:
#: ``nvidia/cuda_nvcc``).
CUDA_WHEELS: tuple[tuple[str, str, str], ...] = (
    ("jax_cuda13_plugin", "jax_plugins.xla_cuda13", "nvidia.cu13"),
    ("jax_cuda12_plugin", "jax_plugins.xla_cuda12", "nvidia.cuda_nvcc"),
)

# What each platform's compiler needs, as (importable module, or a tuple of
# modules any one of which will do, pip package).
_CUDA = tuple(zip(*CUDA_WHEELS))
_NEEDS = {
    "tpu": (("libtpu", "libtpu"),),
    "gpu": ((_CUDA[0], "jax's CUDA plugin (jax-cuda13-plugin; jax-cuda12-plugin on jax 0.10.2)"),
            (_CUDA[1], "its PJRT plugin (jax-cuda13-pjrt; jax-cuda12-pjrt on jax 0.10.2)"),
            (_CUDA[2], "ptxas (nvidia-cuda-nvcc; nvidia-cuda-nvcc-cu12 on jax 0.10.2)")),
}


def missing(target: str | Target) -> str | None:
  """``None`` when ``target``'s compiler is installed, else the reason,
  naming the missing package (pip install ``fuseopt[compile]`` has them
  all)."""
  t = get(target)
  for modules, package in _NEEDS[t.platform]:
    found = any(_find_spec(m) is not None
                for m in ((modules,) if isinstance(modules, str) else modules))
    if not found:
      return (f"the {t.name} compiler needs {package}, which is not installed "
              f"(pip install 'fuseopt[compile]')")
  return None


def _find_spec(module: str):
  try:
    return importlib.util.find_spec(module)
  except (ImportError, ValueError):
    return None


def cuda_toolkit_dir() -> Path | None:
  """The folder of the pip-installed CUDA toolkit that XLA compiles GPU
  programs with (``bin/ptxas``, ``nvvm/libdevice``): ``nvidia/cu13`` of CUDA
  13's wheels, else ``nvidia/cuda_nvcc`` of CUDA 12's, the order in which jax
  looks for them; ``None`` when neither is installed."""
  for *_, module in CUDA_WHEELS:
    spec = _find_spec(module)
    for root in (spec.submodule_search_locations or []) if spec else []:
      if (Path(root) / "bin" / "ptxas").exists():
        return Path(root)
  return None


def spec_text(target: str | Target) -> str:
  """The GPU target description of ``target`` (text-format proto)."""
  t = get(target)
  if t.spec is None:
    raise ValueError(f"target {t.name!r} is a {t.platform} target: it has no GPU description")
  return (HERE / t.spec).read_text()


def report_ptxas() -> None:
  """Makes XLA log ptxas's per-kernel report (registers, spill stores and
  loads), which the compile tier reads for spills.

  XLA runs ``ptxas --warn-on-spills`` on every Triton kernel but keeps its
  output to itself unless its subprocess-compilation module logs at verbosity
  2 with INFO logs shown. Logging reads these variables once, when XLA first
  logs: call this before jax initialises a backend (the test suite's conftest
  and ``fuseopt compile-check`` do). Variables already set are kept.
  """
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0")
  # Mosaic GPU kernels are compiled by jax's own ptxas call, which prints the
  # same report (to stdout) when asked.
  os.environ.setdefault("MOSAIC_GPU_DUMP_PTXAS", "1")
  vmodule = os.environ.get("TF_CPP_VMODULE", "")
  if "subprocess_compilation" not in vmodule:
    os.environ["TF_CPP_VMODULE"] = ",".join(filter(None, [vmodule, "subprocess_compilation=2"]))


def _prepare_env(platform: str) -> None:
  # The CUDA plugin refuses to initialise without a matching driver unless
  # told to skip the check; libtpu asks for the accelerator type it would run
  # on and logs an error per missing variable, and by default takes a
  # machine-wide lock file that makes a second process (a parallel test
  # worker) fail. None of these changes what compiles.
  if platform == "gpu":
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  else:
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-8")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def topology(target: str | Target, devices: int = 1):
  """libtpu's or XLA's description of ``devices`` devices of ``target``.

  Raises :class:`CompilerMissing` when the compiler is not installed and
  :class:`BadTargetSpec` (naming the file) when a GPU description does not
  parse.
  """
  return _topology(get(target), devices)


@functools.lru_cache(maxsize=None)
def _topology(t: Target, devices: int):
  from jax.experimental import topologies
  if devices not in t.topologies:
    raise ValueError(f"target {t.name!r} has no {devices}-device topology; "
                     f"device counts: {t.device_counts}")
  why = missing(t)
  if why:
    raise CompilerMissing(why)
  _prepare_env(t.platform)
  if t.platform == "tpu":
    return topologies.get_topology_desc(topology_name=t.topologies[devices], platform="tpu")
  text = spec_text(t)
  try:
    return topologies.get_topology_desc(platform="cuda", topology_name="", target_config=text,
                                        topology=t.topologies[devices])
  except Exception as e:  # noqa: BLE001 - jaxlib raises a bare RuntimeError/XlaRuntimeError
    msg = str(e)
    if "parse" in msg.lower() or "proto" in msg.lower() or "text" in msg.lower():
      raise BadTargetSpec(f"the GPU target description {HERE / t.spec} does not parse: {msg}") from e
    raise


def devices(target: str | Target, count: int = 1) -> list:
  """``count`` devices of ``target``'s topology (compile-only devices)."""
  return list(topology(target, count).devices)[:count]


def mesh(target: str | Target, shape: tuple[int, ...] = (1,), axis_names: tuple[str, ...] = ("x",),
         axis_types=None) -> jax.sharding.Mesh:
  """A mesh of ``prod(shape)`` devices of ``target``."""
  import jax
  n = int(np.prod(shape))
  devs = devices(target, n)
  kwargs = {} if axis_types is None else {"axis_types": axis_types}
  return jax.sharding.Mesh(np.array(devs).reshape(shape), axis_names, **kwargs)


def abstract_device(target: str | Target) -> jax.sharding.AbstractDevice:
  import jax
  t = get(target)
  return jax.sharding.AbstractDevice(device_kind=t.device_kind, num_cores=t.num_cores,
                                     platform=t.platform)


@contextlib.contextmanager
def lowering_for(target: str | Target, mesh: jax.sharding.Mesh | None = None) -> Iterator[None]:
  """Trace as if on ``target``: an abstract mesh whose device is the target's
  (the axes of ``mesh`` if given), so that backend dispatch and Pallas's
  Triton lowering (compute capability from the device kind) see the target."""
  import jax
  t = get(target)
  if mesh is None:
    am = jax.sharding.AbstractMesh((), (), abstract_device=abstract_device(t))
  else:
    am = jax.sharding.AbstractMesh(mesh.axis_sizes, mesh.axis_names, axis_types=mesh.axis_types,
                                   abstract_device=abstract_device(t))
  with jax.sharding.use_abstract_mesh(am):
    yield


def avals(target: str | Target, tree: Any, sharding: Any = None) -> Any:
  """``tree``'s arrays / structs as ``ShapeDtypeStruct`` placed on one device
  of ``target`` (or with ``sharding``: one sharding, or a tree of them)."""
  import jax
  if sharding is None:
    sharding = jax.sharding.NamedSharding(mesh(target), jax.sharding.PartitionSpec())
  leaves, treedef = jax.tree.flatten(tree)
  if isinstance(sharding, jax.sharding.Sharding):
    shardings = [sharding] * len(leaves)
  else:
    shardings = treedef.flatten_up_to(sharding)

  def one(x, s):
    if not hasattr(x, "shape"):
      return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
  return jax.tree.unflatten(treedef, [one(x, s) for x, s in zip(leaves, shardings)])


__all__ = ["report_ptxas", "Target", "TARGETS", "UnknownTarget", "CompilerMissing", "BadTargetSpec", "get",
           "missing", "spec_text", "topology", "devices", "mesh", "abstract_device",
           "lowering_for", "avals"]
