"""Timing primitives of the benchmarks: a call's median time, a donated
step timed as a training loop runs it (:class:`Loop`), and a compile with a
time budget (:func:`compile_within`). :mod:`fuseopt.benchmarks.core`
re-exports them."""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from typing import Any, Callable

import jax


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


@dataclasses.dataclass
class Loop:
  """A variant timed as training runs it: ``fn(*args)`` donates its inputs,
  and ``feed(args, outputs)`` gives the next call's arguments (e.g.
  ``(params', state', grads)``), so one copy of params and state is alive and
  nothing is rebuilt between timed calls. The first call's outputs (from
  ``args`` as built) are the ones a case's check sees."""
  fn: Callable[..., Any]
  args: tuple
  feed: Callable[[tuple, Any], tuple]


def time_loop(fn: Callable, args: tuple, feed: Callable, *, warmup: int = 2, iters: int = 10,
              first: Callable[[Any], None] | None = None) -> dict[str, float]:
  """Median/min ms of ``iters`` (at least 10) steps of ``fn``, each step's
  outputs fed back as the next step's inputs (:class:`Loop`), after
  ``warmup`` steps; ``first(outputs)`` sees the first step's outputs."""
  iters = max(10, iters)
  times = []
  for k in range(warmup + iters):
    t0 = time.perf_counter()
    out = block(fn(*args))
    if k >= warmup:
      times.append((time.perf_counter() - t0) * 1e3)
    if k == 0 and first is not None:
      first(out)
    args = feed(args, out)
    del out
  del args
  return {"ms": statistics.median(times), "min_ms": min(times), "runs": len(times)}


class CompileTimeout(Exception):
  """A compile that did not finish within the run's compile budget."""


# Compiles given up on (still running in their threads): a process that has
# any should end with ``os._exit`` once its results are written.
ABANDONED_COMPILES: list[threading.Thread] = []


def compile_within(lowered, budget_s: float | None):
  """``(lowered.compile(), seconds)``; raises :class:`CompileTimeout` when
  the compile takes longer than ``budget_s`` (it goes on in a daemon thread,
  which :data:`ABANDONED_COMPILES` lists; the caller moves on)."""
  t0 = time.perf_counter()
  if budget_s is None:
    compiled = lowered.compile()
    return compiled, time.perf_counter() - t0
  box: dict[str, Any] = {}

  def work():
    try:
      box["compiled"] = lowered.compile()
    except BaseException as e:  # noqa: BLE001 - handed to the caller
      box["error"] = e
  th = threading.Thread(target=work, name="fuseopt-compile", daemon=True)
  th.start()
  th.join(max(0.0, budget_s))
  if th.is_alive():
    ABANDONED_COMPILES.append(th)
    raise CompileTimeout(f"compile_timeout: not compiled within the compile budget of {budget_s:.0f} s")
  if "error" in box:
    raise box["error"]
  return box["compiled"], time.perf_counter() - t0
