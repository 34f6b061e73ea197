"""The copy-bandwidth ceiling's streaming kernel, and the GPU's clocks and power.

The benchmark suite's "% of floor" divides a case's minimal bytes by the copy
ceiling (:func:`measure_ceilings`), so the ceiling
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

:func:`measure_ceilings` takes the best of these (and the matmul rate) for
a run. :func:`fuseopt.benchmarks.environment.clocks_and_power` reads
``nvidia-smi -q -d CLOCK,POWER`` for the run's meta (a GPU whose clocks or
power cap held it back explains a low ceiling); the kernel's PTX, deviceless,
is :func:`fuseopt.benchmarks.ptx_figures.stream_ptx`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from fuseopt.benchmarks import core

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
  jax.block_until_ready(fn(*args))   # compiled and warm
  best = float("inf")
  for _ in range(reps):
    t0 = time.perf_counter()
    out = None
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
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


# ------------------------------------------------------- the suite's ceilings --
# The memory bandwidth each device kind is sold with (GB/s), keyed by
# ``jax.devices()[0].device_kind``: the denominator of a row's "% of the
# spec floor" (its bytes moved at this rate), beside the copy ceiling
# measured in the same run.
SPEC_GBPS = {
    "TPU v5 lite": 819.0, "TPU v5e": 819.0,
    "TPU v6 lite": 1640.0, "TPU v6e": 1640.0,
    "TPU v5": 2765.0, "TPU v5p": 2765.0,
    "TPU v4": 1228.0,
    "NVIDIA H200": 4800.0,
    "NVIDIA H100 80GB HBM3": 3350.0,
    "NVIDIA L4": 300.0,
    "NVIDIA GeForce RTX 4090": 1008.0,
}


def spec_gbps(device_kind: str | None) -> float | None:
  """:data:`SPEC_GBPS` of ``device_kind``, or None for a kind not listed."""
  return SPEC_GBPS.get(device_kind or "")


def measure_ceilings(platform: str | None = None, *, quick: bool = False) -> dict[str, Any]:
  """Copy bandwidth (GB/s) and bf16 matmul rate (TFLOP/s), measured now on
  the default device.

  The copy ceiling ``copy_gbps`` is the best of several streaming
  measurements, each recorded (``copy_ceiling_source`` names the winner):

  - ``copy_gbps_xla_scale_shift``: one jitted XLA fp32 ``x*a+b`` (8 B an
    element), the best of single timed calls: 2 GiB of traffic on an
    accelerator (``quick``: 512 MiB), once the suite's only measurement,
    kept so that runs stay comparable with earlier ones;
  - ``copy_gbps_xla_copy``, ``copy_gbps_xla_axpy`` and, on a GPU,
    ``copy_gbps_pallas_stream`` (a persistent Pallas-Triton kernel with
    128-bit accesses): 2^29 fp32 elements (4 GiB read + written; axpy 6 GiB)
    timed as back-to-back calls so that dispatch overhead hides
    (:mod:`fuseopt.benchmarks.ceiling`). On the CPU these run on 2^22
    elements.

  Matmul: 8192³ (``quick``: 4096³). On the CPU, where bf16 matmuls are
  emulated and slower than fp32 ones, the matmul ceiling is the faster of
  the two, so that no fp32-accumulating case appears above its floor.
  """
  platform = platform or jax.default_backend()
  accel = platform in ("gpu", "tpu")
  n = ((1 << 26) if quick else (1 << 28)) if accel else (1 << 22)
  d = ((4096 if quick else 8192) if accel else 512)
  iters = 10 if accel else 5
  x = jnp.ones((n,), jnp.float32)
  f = jax.jit(lambda x: x * 1.0001 + 0.5)
  # More calls on the CPU: it is shared, and the ceiling is the best call.
  t = core.time_fn(f, (x,), iters=iters if accel else 20)
  copies = {"copy_gbps_xla_scale_shift": 8 * n / (t["min_ms"] * 1e-3) / 1e9}
  del x
  copies.update(copy_ceilings(platform, calls=8 if accel else 4, reps=5,
                                      n=None if accel else (1 << 22)))
  measured = {k: v for k, v in copies.items() if k.startswith("copy_gbps_") and not k.endswith("_error")}
  source = max(measured, key=measured.get)
  rates = {}
  for dtype in (jnp.bfloat16,) if accel else (jnp.bfloat16, jnp.float32):
    a = jnp.ones((d, d), dtype)
    g = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype))
    t = core.time_fn(g, (a, a), iters=iters)
    rates[jnp.dtype(dtype).name] = 2 * d ** 3 / (t["min_ms"] * 1e-3) / 1e12
    del a
  return {"copy_gbps": copies[source], "copy_ceiling_source": source.removeprefix("copy_gbps_"),
          **copies, "matmul_tflops": max(rates.values()), "copy_elements": n, "matmul_dim": d,
          **{f"matmul_tflops_{k}": v for k, v in rates.items()}}
