"""The software and hardware a benchmark ran on, for its results JSON.

Two parts, so that a process that must not touch the accelerator (it would
take JAX's preallocated share of its memory) can still say what is
installed:

- :func:`versions`: installed package versions read from their metadata,
  without importing them (torch and triton are never imported here), the
  CUDA plugin and NVIDIA library wheels, Python;
- :func:`device_info`: what the default JAX backend reports (this starts
  it), and the driver as ``nvidia-smi`` reports it where that tool exists.

:func:`collect` is both. Every field is best effort: a missing package or
tool gives ``None`` (or no entry), never an exception.
"""

from __future__ import annotations

import importlib.metadata as metadata
import platform as _platform
import re
import shutil
import subprocess
from typing import Any

_PACKAGES = ("jax", "jaxlib", "optax", "numpy", "ml_dtypes", "triton", "torch")
# Distributions that carry an accelerator runtime: JAX's PJRT plugins and
# libtpu, and NVIDIA's CUDA wheels (their versions are the CUDA runtime,
# cuBLAS, cuDNN, ... that the plugin loads).
_RUNTIME_PREFIXES = ("jax-cuda", "jax_cuda", "jax-rocm", "jax_rocm", "libtpu", "nvidia-")


def _version(name: str) -> str | None:
  try:
    return metadata.version(name)
  except metadata.PackageNotFoundError:
    return None


def versions() -> dict[str, Any]:
  """Python and package versions; ``None`` for a package not installed."""
  out: dict[str, Any] = {"python": _platform.python_version(), "machine": _platform.machine(),
                         "os": f"{_platform.system()} {_platform.release()}"}
  out.update({name: _version(name) for name in _PACKAGES})
  runtime = {}
  for dist in metadata.distributions():
    name = (dist.metadata["Name"] or "").lower()
    if name.startswith(_RUNTIME_PREFIXES):
      runtime[name] = dist.version
  out["runtime_packages"] = dict(sorted(runtime.items()))
  return out


def _run(cmd: list[str], timeout: float = 10.0) -> str | None:
  try:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True).stdout
  except (OSError, subprocess.SubprocessError):
    return None


def nvidia_smi() -> dict[str, Any] | None:
  """Driver version, CUDA version the driver supports, and per-GPU name,
  memory and clocks from ``nvidia-smi``; None where it is not installed."""
  if shutil.which("nvidia-smi") is None:
    return None
  out: dict[str, Any] = {}
  fields = ("name", "driver_version", "memory.total", "clocks.max.sm", "clocks.max.memory",
            "power.limit", "pci.bus_id")
  text = _run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"])
  if text:
    gpus = [dict(zip(fields, (v.strip() for v in line.split(","))))
            for line in text.strip().splitlines() if line.strip()]
    out["gpus"] = gpus
    if gpus:
      out["driver_version"] = gpus[0].get("driver_version")
  header = _run(["nvidia-smi"])
  if header:
    m = re.search(r"CUDA Version:\s*([\d.]+)", header)
    if m:
      out["driver_cuda_version"] = m.group(1)
  return out or None


def device_info() -> dict[str, Any]:
  """What the default JAX backend reports: platform, device kind and count,
  the runtime's version string (e.g. CUDA's), device memory; plus
  ``nvidia-smi``. Starts the backend."""
  import jax

  d = jax.devices()[0]
  out: dict[str, Any] = {"platform": d.platform, "device_kind": d.device_kind,
                         "num_devices": jax.device_count(), "process_count": jax.process_count()}
  try:
    out["platform_version"] = d.client.platform_version
  except Exception:  # noqa: BLE001 - best effort
    pass
  try:
    stats = d.memory_stats() or {}
    out["memory_bytes_limit"] = stats.get("bytes_limit")
  except Exception:  # noqa: BLE001 - not every backend has memory stats
    pass
  try:
    out["jax_environment"] = jax.print_environment_info(return_string=True)[:4000]
  except Exception:  # noqa: BLE001
    pass
  smi = nvidia_smi()
  if smi:
    out["nvidia_smi"] = smi
  return out


def collect() -> dict[str, Any]:
  """:func:`versions` and :func:`device_info` in one dict."""
  return {**versions(), **device_info()}


# --------------------------------------------------------- clocks, power --
_SMI_TIMEOUT_S = 10.0
# Sections of ``nvidia-smi -q -d CLOCK,POWER`` and the fields read from them
# (names as the driver prints them; drivers before 535 call the power
# section "Power Readings" and the current draw "Power Draw").
_SECTIONS = {"Clocks": "clocks", "Max Clocks": "max_clocks",
             "Applications Clocks": "application_clocks",
             "GPU Power Readings": "power", "Power Readings": "power"}
_FIELDS = {"clocks": ("SM", "Memory", "Graphics"), "max_clocks": ("SM", "Memory", "Graphics"),
           "application_clocks": ("Graphics", "Memory"),
           "power": ("Average Power Draw", "Instantaneous Power Draw", "Power Draw",
                     "Current Power Limit", "Power Limit", "Enforced Power Limit",
                     "Max Power Limit")}
_NUMBER = re.compile(r"^([\d.]+)\s*(MHz|W)$")


def parse_clocks_and_power(text: str) -> list[dict[str, Any]]:
  """Per GPU (in ``nvidia-smi -q``'s order): ``{"clocks": {"sm_mhz", ...},
  "max_clocks": {...}, "application_clocks": {...}, "power": {"power_draw_w",
  "power_limit_w", ...}}``, the fields found (numbers in MHz and W; a field
  the driver reports "N/A" is left out)."""
  gpus: list[dict[str, Any]] = []
  section = None
  for line in text.splitlines():
    if line.startswith("GPU "):
      gpus.append({"bus_id": line[4:].strip()})
      section = None
      continue
    if not gpus or not line.strip():
      continue
    indent = len(line) - len(line.lstrip())
    key, _, value = (s.strip() for s in line.partition(":"))
    if not value:
      # A section header at the first level under the GPU (a sub-header
      # such as "Power Samples" ends the section's fields).
      section = _SECTIONS.get(key) if indent <= 4 else None
      continue
    if section is None or key not in _FIELDS[section]:
      continue
    m = _NUMBER.match(value)
    if not m:
      continue
    unit = m.group(2).lower()
    name = re.sub(r"[^a-z0-9]+", "_", key.lower()).strip("_")
    name = {"instantaneous_power_draw": "power_draw"}.get(name, name)
    gpus[-1].setdefault(section, {}).setdefault(f"{name}_{unit}", float(m.group(1)))
  return gpus


def clocks_and_power() -> dict[str, Any] | None:
  """``nvidia-smi -q -d CLOCK,POWER`` now: ``{"raw": text, "gpus": [...]}``
  (:func:`parse_clocks_and_power`); None where nvidia-smi is not installed
  or fails. Never raises."""
  if shutil.which("nvidia-smi") is None:
    return None
  try:
    text = subprocess.run(["nvidia-smi", "-q", "-d", "CLOCK,POWER"], capture_output=True,
                          text=True, timeout=_SMI_TIMEOUT_S, check=True).stdout
  except (OSError, subprocess.SubprocessError):
    return None
  out: dict[str, Any] = {"raw": text}
  try:
    out["gpus"] = parse_clocks_and_power(text)
  except Exception:  # noqa: BLE001 - the raw text is the record; parsing is a convenience
    pass
  return out
