"""The copy-bandwidth ceiling's streaming kernel, and the GPU's clocks and power.

The benchmark suite's "% of floor" divides a case's minimal bytes by the copy
ceiling (:func:`fuseopt.benchmarks.core.measure_ceilings`), so the ceiling
must be what the memory system really sustains, not what one particular XLA
fusion reaches. On a GPU this module's Pallas-Triton kernel is one of its
measurements: ``o = x * scale + shift`` over a flat fp32 array (read 4 B,
write 4 B an element), written for bandwidth:

- **128-bit accesses**: a block is ``4 * 32 * num_warps * vectors`` elements,
  so each of a program's threads loads and stores whole 4-element fp32
  vectors (``ld.global.v4`` / ``st.global.v4``): a quarter of the memory
  instructions of 32-bit accesses, and full 128-byte lines per warp access.
  Triton vectorises when it can prove the addresses 16-byte aligned: jax's
  lowering marks the pointers ``tt.divisibility = 32`` and each block's start
  is hinted a multiple of the block (:func:`pl.multiple_of`);
- **persistent grid**: ``programs_per_sm`` programs on each SM (not one a
  block), each looping over blocks ``pid, pid + programs, ...`` with
  ``jax.lax.fori_loop`` inside the kernel: every SM keeps the same number of
  requests in flight until the end, with no tail of half-filled waves and
  no block-scheduling gaps.

The array holds a whole number of blocks (the caller chooses its size), so no
access is masked. It runs in interpret mode on the CPU (the tests check its
values there); the suite measures it on GPUs only, beside XLA's own copy and
axpy (TPUs and the CPU use those alone).

:func:`clocks_and_power` reads ``nvidia-smi -q -d CLOCK,POWER`` for a run's
meta (a GPU whose clocks or power cap held it back explains a low ceiling).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import shutil
import subprocess
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

#: fp32 elements of one 128-bit access.
VECTOR = 4
WARP = 32


@dataclasses.dataclass(frozen=True)
class StreamConfig:
  """``block`` = ``VECTOR * 32 * num_warps * vectors`` elements a loop step:
  each thread moves ``vectors`` 128-bit vectors a step."""
  num_warps: int = 8
  vectors: int = 2
  programs_per_sm: int = 4

  def __post_init__(self):
    if self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f"num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps}")
    if self.vectors <= 0 or self.vectors & (self.vectors - 1):
      raise ValueError(f"vectors must be a positive power of two, got {self.vectors}")
    if self.programs_per_sm <= 0:
      raise ValueError(f"programs_per_sm must be positive, got {self.programs_per_sm}")

  @property
  def block(self) -> int:
    return VECTOR * WARP * self.num_warps * self.vectors


#: The configs :func:`copy_ceilings` times (the best counts): 8 warps moving
#: two vectors a thread a step (8 KiB a block) with 4 and 8 programs an SM
#: (1024 and 2048 threads: half and all of an sm_80/sm_90 SM's), and 4 warps
#: moving four (also 8 KiB) with 8 programs an SM.
CONFIGS = (StreamConfig(8, 2, 4), StreamConfig(8, 2, 8), StreamConfig(4, 4, 8))


def _kernel(x_ref, o_ref, *, block, num_blocks, programs, scale, shift):
  pid = pl.program_id(0)
  # Blocks pid, pid + programs, ... below num_blocks (programs <= num_blocks,
  # so every program has at least one).
  steps = (num_blocks - 1 - pid) // programs + 1

  def step(i, carry):
    start = pl.multiple_of((pid + i * programs) * block, block)
    x = x_ref[pl.ds(start, block)]
    o_ref[pl.ds(start, block)] = x * jnp.asarray(scale, x.dtype) + jnp.asarray(shift, x.dtype)
    return carry

  jax.lax.fori_loop(0, steps, step, 0)


def stream(x: jax.Array, *, config: StreamConfig = StreamConfig(), num_sms: int,
           scale: float = 1.0001, shift: float = 0.5, interpret: bool = False) -> jax.Array:
  """``x * scale + shift`` of a flat fp32 ``x`` whose size is a multiple of
  ``config.block``, by ``num_sms * config.programs_per_sm`` persistent
  programs (fewer when there are fewer blocks)."""
  from jax.experimental.pallas import triton as plgpu
  (n,) = x.shape
  block = config.block
  if x.dtype != jnp.float32:
    raise ValueError(f"stream moves fp32, got {x.dtype}")
  if n == 0 or n % block:
    raise ValueError(f"stream needs a positive multiple of the block ({block}) elements, got {n}")
  num_blocks = n // block
  programs = max(1, min(num_blocks, num_sms * config.programs_per_sm))
  return pl.pallas_call(
      functools.partial(_kernel, block=block, num_blocks=num_blocks, programs=programs,
                        scale=float(scale), shift=float(shift)),
      out_shape=jax.ShapeDtypeStruct((n,), x.dtype),
      grid=(programs,),
      in_specs=[pl.BlockSpec((n,), lambda i: (0,))],
      out_specs=pl.BlockSpec((n,), lambda i: (0,)),
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1),
      interpret=interpret,
      name="fuseopt_ceiling_stream",
  )(x)


def num_sms(device=None) -> int | None:
  """SMs of a GPU device as jax reports them (``core_count``), else None."""
  d = device or jax.devices()[0]
  n = getattr(d, "core_count", None)
  return int(n) if n else None


# ----------------------------------------------------------- measuring --
#: fp32 elements of the streaming measurements on an accelerator: 2 GiB an
#: array, so a copy moves 4 GiB (read + write), far past any cache and
#: launch overhead.
STREAM_ELEMENTS = 1 << 29


def time_streamed(fn, args: tuple, *, calls: int, reps: int) -> float:
  """Seconds a call of ``fn(*args)`` takes back to back: ``calls`` calls
  dispatched without waiting (each result dropped but the last), the best
  of ``reps`` such batches divided by ``calls``. Dispatch is asynchronous,
  so the host's per-call overhead hides under the previous call's run and
  only the batch's first launch and last wait are exposed."""
  import time
  from fuseopt.benchmarks import core
  core.block(fn(*args))   # compiled and warm
  best = float("inf")
  for _ in range(reps):
    t0 = time.perf_counter()
    out = None
    for _ in range(calls):
      out = fn(*args)
    core.block(out)
    best = min(best, time.perf_counter() - t0)
    del out
  return best / calls


def _xla_copy(x):
  return jnp.copy(x)     # a device-to-device copy (XLA's copy thunk on a GPU)


def _xla_axpy(x, y):
  return x * jnp.float32(1.0001) + y


def copy_ceilings(platform: str, *, calls: int, reps: int, n: int | None = None,
                  interpret: bool = False) -> dict[str, Any]:
  """The streaming measurements of the copy ceiling over ``n`` fp32 elements
  (default :data:`STREAM_ELEMENTS`), in GB/s, each the best of ``reps``
  batches of ``calls`` calls (:func:`time_streamed`):

  - ``copy_gbps_xla_copy``: XLA's copy of ``x`` (8 B an element);
  - ``copy_gbps_xla_axpy``: XLA's ``a * x + y`` (12 B an element);
  - ``copy_gbps_pallas_stream`` (GPU only): :func:`stream`, the best of
    :data:`CONFIGS` (``pallas_stream_config`` names it; ``..._error``
    where the kernel failed, which leaves the XLA figures).

  ``interpret`` runs the kernel in interpret mode (the tests, on the CPU).
  """
  n = n or STREAM_ELEMENTS
  out: dict[str, Any] = {"copy_stream_elements": n}
  x = jnp.ones((n,), jnp.float32)

  def rate(name, fn, args, bytes_per_element):
    try:
      out[name] = bytes_per_element * n / time_streamed(jax.jit(fn), args, calls=calls, reps=reps) / 1e9
    except Exception as e:  # noqa: BLE001 - one measurement must not cost the others
      out[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]

  rate("copy_gbps_xla_copy", _xla_copy, (x,), 8)
  y = jnp.full((n,), 0.5, jnp.float32)
  rate("copy_gbps_xla_axpy", _xla_axpy, (x, y), 12)
  del y
  sms = None
  if platform == "gpu":
    # A device that does not report its SMs gets 132 (an H100/H200's): the
    # grid stays persistent, in more or fewer waves.
    sms = num_sms() or 132
  if sms:
    best, best_config = None, None
    for config in CONFIGS:
      key = "copy_gbps_pallas_stream"
      rate(key, functools.partial(stream, config=config, num_sms=sms, interpret=interpret), (x,), 8)
      got = out.pop(key, None)
      if got is not None and (best is None or got > best):
        best, best_config = got, config
    if best is not None:
      out["copy_gbps_pallas_stream"] = best
      out["pallas_stream_config"] = (f"num_warps={best_config.num_warps} "
                                     f"vectors={best_config.vectors} "
                                     f"programs_per_sm={best_config.programs_per_sm} "
                                     f"block={best_config.block} sms={sms}")
      out.pop("copy_gbps_pallas_stream_error", None)
  del x
  return out


# ------------------------------------------------- deviceless PTX check --
def stream_ptx(target: str = "h200", *, n: int = STREAM_ELEMENTS,
               config: StreamConfig = StreamConfig()) -> str:
  """The PTX of :func:`stream` over ``n`` fp32 elements as XLA compiles it
  for a GPU compile target (:mod:`fuseopt.targets`, no GPU needed; read with
  :mod:`fuseopt.benchmarks.ptx_figures`). Raises
  :class:`fuseopt.targets.CompilerMissing` without the ``compile`` extra."""
  from fuseopt import targets
  from fuseopt.benchmarks import ptx_figures
  t = targets.get(target)
  if t.platform != "gpu":
    raise ValueError(f"{t.name} is not a GPU target")
  why = targets.missing(t)
  if why:
    raise targets.CompilerMissing(why)
  fn = functools.partial(stream, config=config, num_sms=t.num_cores)
  kernels = ptx_figures.ptx_of(t, fn, (jax.ShapeDtypeStruct((n,), jnp.float32),),
                               prefix="fuseopt_ceiling_stream")
  if not kernels:
    raise RuntimeError(f"XLA dumped no PTX of fuseopt_ceiling_stream for {t.name}")
  return next(iter(kernels.values()))


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
