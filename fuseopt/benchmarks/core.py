"""Cases, timing, memory figures and hardware ceilings for benchmarks.

A :class:`Case` is one row of the report: an op on one shape, with several
*variants* (fuseopt's implementations and the baselines) measured in the same
run. Each variant is a builder returning ``(fn, args)``: ``fn`` is already
jitted, ``args`` are device arrays. Timing is the median of repeated calls
after warm-up; memory comes from ``memory_analysis()`` of the compiled
function, which is deterministic (also on the CPU) and so usable in CI.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

Builder = Callable[[], tuple[Callable[..., Any], tuple]]


@dataclasses.dataclass
class Case:
  op: str                       # "stochastic_round", "adam", "newton_schulz", "muon", ...
  name: str                     # the shape or workload, e.g. "4096x4096"
  variants: dict[str, Builder]  # label -> builder; fuseopt variants and baselines
  baseline: str                 # label of the baseline variant in ``variants``
  flops: float | None = None    # useful FLOPs of one call (roofline: matmul ceiling)
  bytes: float | None = None    # minimal bytes one call must move (roofline: bandwidth)
  params: int | None = None     # parameters, for scaling plots and bytes/param
  state_bytes: dict[str, int] = dataclasses.field(default_factory=dict)  # label -> optimizer state bytes
  check: Callable[[dict[str, Any]], dict[str, Any]] | None = None  # outputs by label -> correctness figures

  @property
  def id(self) -> str:
    return f"{self.op}/{self.name}"


def block(x):
  return jax.tree.map(lambda a: a.block_until_ready() if hasattr(a, "block_until_ready") else a, x)


def time_fn(fn: Callable, args: tuple, *, warmup: int = 2, iters: int = 10,
            min_time: float = 0.0, refresh: Callable[[], tuple] | None = None) -> dict[str, float]:
  """Median/min wall time of ``fn(*args)`` in ms.

  ``refresh`` builds fresh args before each call (needed when ``fn`` donates
  its inputs).
  """
  for _ in range(warmup):
    a = refresh() if refresh else args
    block(fn(*a))
  times = []
  start = time.perf_counter()
  while len(times) < iters or (time.perf_counter() - start) < min_time:
    a = refresh() if refresh else args
    block(a)
    t0 = time.perf_counter()
    block(fn(*a))
    times.append((time.perf_counter() - t0) * 1e3)
    if len(times) >= 10 * iters:
      break
  return {"ms": statistics.median(times), "min_ms": min(times), "runs": len(times)}


def memory_stats(fn: Callable, args: tuple) -> dict[str, int]:
  """Bytes from ``memory_analysis()`` of the compiled ``fn`` (deterministic)."""
  compiled = fn.lower(*args).compile() if hasattr(fn, "lower") else jax.jit(fn).lower(*args).compile()
  m = compiled.memory_analysis()
  out = {}
  for k in ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes",
            "alias_size_in_bytes", "generated_code_size_in_bytes"):
    v = getattr(m, k, None)
    if v is not None:
      out[k.replace("_size_in_bytes", "_bytes")] = int(v)
  return out


def compiled_stats(fn: Callable, args: tuple) -> dict[str, Any]:
  """Deterministic figures of the compiled ``fn``: memory, HLO op and fusion
  counts, custom calls (kernel launches), FLOPs and bytes from cost analysis."""
  lowered = fn.lower(*args) if hasattr(fn, "lower") else jax.jit(fn).lower(*args)
  compiled = lowered.compile()
  stats: dict[str, Any] = {}
  m = compiled.memory_analysis()
  for k in ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes"):
    v = getattr(m, k, None)
    if v is not None:
      stats[k.replace("_size_in_bytes", "_bytes")] = int(v)
  hlo = compiled.as_text()
  import re
  stats["hlo_fusions"] = len(re.findall(r"^\s*\S+ = \S+ fusion\(", hlo, re.M))
  stats["hlo_ops"] = len(re.findall(r"^\s*(ROOT )?\S+ = ", hlo, re.M))
  stats["custom_calls"] = len(re.findall(r"custom-call\(", hlo))
  try:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
      cost = cost[0] if cost else {}
    stats["cost_flops"] = float(cost.get("flops", 0.0))
    stats["cost_bytes"] = float(cost.get("bytes accessed", 0.0))
  except Exception:  # cost analysis is not available on every backend
    pass
  return stats


def measure_ceilings(platform: str | None = None, *, quick: bool = False) -> dict[str, float]:
  """Copy bandwidth (GB/s, fp32 ``x*a+b`` counted as 8 B/element) and bf16
  matmul rate (TFLOP/s), measured now on the default device."""
  platform = platform or jax.default_backend()
  accel = platform in ("gpu", "tpu")
  n = (1 << 28) if accel and not quick else (1 << 22)
  x = jnp.ones((n,), jnp.float32)
  f = jax.jit(lambda x: x * 1.0001 + 0.5)
  t = time_fn(f, (x,), iters=10 if accel else 3)
  bw = 8 * n / (t["min_ms"] * 1e-3) / 1e9
  d = 8192 if accel and not quick else 512
  a = jnp.ones((d, d), jnp.bfloat16)
  g = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
  t = time_fn(g, (a, a), iters=10 if accel else 3)
  tflops = 2 * d ** 3 / (t["min_ms"] * 1e-3) / 1e12
  del x, a
  return {"copy_gbps": bw, "matmul_tflops": tflops, "copy_elements": n, "matmul_dim": d}


def floor_ms(case: Case, ceilings: dict[str, float]) -> float | None:
  """The roofline floor of a case: the larger of its FLOP time and byte time."""
  parts = []
  if case.flops:
    parts.append(case.flops / (ceilings["matmul_tflops"] * 1e12) * 1e3)
  if case.bytes:
    parts.append(case.bytes / (ceilings["copy_gbps"] * 1e9) * 1e3)
  return max(parts) if parts else None


def run_case(case: Case, ceilings: dict[str, float], *, iters: int = 10,
             with_memory: bool = True) -> list[dict[str, Any]]:
  """Measures every variant of ``case``; returns one record per variant."""
  records = []
  outputs = {}
  floor = floor_ms(case, ceilings)
  for label, build in case.variants.items():
    fn, args = build()
    rec: dict[str, Any] = {"op": case.op, "case": case.name, "variant": label,
                           "is_baseline": label == case.baseline, "params": case.params}
    if with_memory:
      try:
        rec.update(memory_stats(fn, args))
      except Exception as e:  # noqa: BLE001 - memory is a report figure, not a gate
        rec["memory_error"] = repr(e)[:200]
    rec.update(time_fn(fn, args, iters=iters))
    if case.check is not None:
      outputs[label] = fn(*args)
    if label in case.state_bytes and case.params:
      rec["state_bytes_per_param"] = case.state_bytes[label] / case.params
    if case.flops:
      rec["tflops"] = case.flops / (rec["ms"] * 1e-3) / 1e12
    if case.bytes:
      rec["gbps"] = case.bytes / (rec["ms"] * 1e-3) / 1e9
    if floor:
      rec["floor_ms"] = floor
      rec["fraction_of_floor"] = floor / rec["ms"]
    records.append(rec)
    del fn, args
  base = next((r for r in records if r["is_baseline"]), None)
  if base:
    for r in records:
      r["ratio_to_baseline"] = r["ms"] / base["ms"]
  if case.check is not None:
    figures = case.check(outputs)
    for r in records:
      r["check"] = figures
  return records
