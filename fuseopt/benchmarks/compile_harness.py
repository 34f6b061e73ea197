"""The compile tier's harness: one case compiled for a target by its real
compiler, and the figures read off the compiled program.

================  ==========================================================
figure            what it is
================  ==========================================================
temp_bytes        XLA's temporary buffers (``memory_analysis()``)
argument_bytes    inputs, per device
output_bytes      outputs, per device
alias_bytes       outputs that reuse a donated input's buffer
kernels           Pallas kernel launches in the compiled program
collectives       per kind (all-gather, all-to-all, ...): count and bytes
spills            ptxas's register-spill warnings (GPU targets)
lower_s,          seconds to trace + lower, and to compile (reported only)
compile_s
================  ==========================================================

The cases are :mod:`fuseopt.benchmarks.compile_cases`'s, the committed
figures :mod:`fuseopt.benchmarks.compile_results`'.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import sys
import tempfile
import time
from typing import Any, Callable, Iterator

import jax

from fuseopt import targets as targets_lib
from fuseopt.benchmarks import core

# --------------------------------------------------------------- figures --
_KERNEL_TARGET = re.compile(
    r'custom_call_target="(tpu_custom_call|__gpu\$xla\.gpu\.triton|mosaic_gpu[^"]*)"')
_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT )?\S+ = (.+?) (all-to-all|all-gather|all-reduce|reduce-scatter|"
    r"collective-permute|collective-broadcast|ragged-all-to-all)(-start)?\(", re.M)
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|c64|c128)\[([\d,]*)\]")
# ptxas -v: "Compiling entry function 'k' ...", "Function properties for k",
# then "S bytes stack frame, N bytes spill stores, M bytes spill loads"; and
# --warn-on-spills: "Registers are spilled to local memory in function 'k',
# N bytes spill stores, M bytes spill loads", which names its kernel itself.
# XLA runs ptxas on several threads, so such a warning can land inside
# another kernel's report: it must not be attributed to the kernel before it.
_PTXAS = re.compile(r"spilled to local memory in function '([^']+)', "
                    r"(\d+) bytes spill stores, (\d+) bytes spill loads|"
                    r"Compiling entry function '([^']+)'|Function properties for (\S+)|"
                    r"(\d+) bytes spill stores, (\d+) bytes spill loads")
KERNEL_PREFIX = "fuseopt_"   # every fuseopt Pallas kernel is named fuseopt_<op>


def spills(log_lines) -> list[str]:
  """ptxas's register spills, ``"<kernel>: S B spill stores, L B spill loads"``,
  from its verbose report (see :func:`fuseopt.targets.report_ptxas`), for
  every kernel of the program: fuseopt's (named ``fuseopt_*``) and XLA's own
  fusions."""
  out, entry = set(), "?"
  for m in _PTXAS.finditer("\n".join(log_lines)):
    if m.group(1):
      name, stores, loads = m.group(1), m.group(2), m.group(3)
    elif m.group(4) or m.group(5):
      entry = (m.group(4) or m.group(5)).strip("'\"")
      continue
    else:
      name, stores, loads = entry, m.group(6), m.group(7)
    if int(stores) or int(loads):
      out.add(f"{name}: {stores} B spill stores, {loads} B spill loads")
  return sorted(out)


def fuseopt_spills(spilled: list[str]) -> list[str]:
  """The spills of fuseopt's own kernels (XLA's fusions are XLA's)."""
  return [s for s in spilled if s.startswith(KERNEL_PREFIX)]


def kernel_launches(hlo: str) -> int:
  """Pallas kernel calls (Mosaic TPU, Triton, Mosaic GPU) in compiled HLO."""
  return len(_KERNEL_TARGET.findall(hlo))


def collectives(hlo: str) -> dict[str, dict[str, int]]:
  """``{kind: {"count", "bytes"}}`` of compiled per-device HLO. Bytes are
  those of the collective's result on one device (for an async pair, the
  ``-start``'s array results: the received buffers)."""
  out: dict[str, dict[str, int]] = {}
  for shape, kind, _ in _COLLECTIVE.findall(hlo):
    nbytes = 0
    # Scalars are an async start's context words, not data.
    arrays = [a for a in _ARRAY.findall(shape) if a[1]]
    # An async start returns (operands, results): count the results.
    if shape.startswith("(") and len(arrays) >= 2:
      arrays = arrays[len(arrays) // 2:]
    for dtype, dims in arrays:
      n = math.prod(int(d) for d in dims.split(",") if d)
      nbytes += n * core.HLO_ITEMSIZE.get(dtype, 4)
    rec = out.setdefault(kind, {"count": 0, "bytes": 0})
    rec["count"] += 1
    rec["bytes"] += nbytes
  return dict(sorted(out.items()))


@contextlib.contextmanager
def _captured_stderr(fd: int = 2) -> Iterator[list[str]]:
  """Collects what native code writes to file descriptor 2 (ptxas's warnings
  reach the process's stderr from XLA, below Python's ``sys.stderr``), or to
  ``fd`` (1: Mosaic GPU's ptxas report, ``MOSAIC_GPU_DUMP_PTXAS``)."""
  lines: list[str] = []
  stream = sys.stderr if fd == 2 else sys.stdout
  stream.flush()
  saved = os.dup(fd)
  with tempfile.TemporaryFile(mode="w+b") as tmp:
    os.dup2(tmp.fileno(), fd)
    try:
      yield lines
    finally:
      stream.flush()
      os.dup2(saved, fd)
      os.close(saved)
      tmp.seek(0)
      text = tmp.read().decode("utf-8", "replace")
      lines.extend(text.splitlines())


@dataclasses.dataclass(frozen=True)
class Case:
  """One thing to compile.

  ``build(target)`` returns ``(fn, args, donate_argnums)``: ``fn`` a plain
  function, ``args`` abstract arrays (``jax.ShapeDtypeStruct``; placed on the
  target's devices by :func:`compile_case` unless they carry a sharding).
  """
  id: str
  build: Callable[[targets_lib.Target], tuple[Callable, tuple, tuple]]
  kind: str = "kernel"               # "kernel", "step", "sharded" or "scale"
  devices: int = 1
  implementations: tuple[str, ...] = ("triton", "mosaic_tpu")
  full_only: bool = False            # only in the full sweep (``full=True``)
  expect_kernels: bool = True        # False for optax's baselines and XLA paths
  # optax's own step, compiled beside fuseopt's for the figures: recorded by
  # ``compile-check --update``, left out of the tests (its figures move with
  # optax's and jax's versions, not with fuseopt's code).
  baseline: bool = False
  # The targets whose CI run compiles this case (``None``: every target); on
  # the others it belongs to the full sweep (``full=True``). See CI_TARGETS.
  ci_targets: tuple[str, ...] | None = None
  mesh: Callable[[targets_lib.Target], Any] | None = None   # sharded cases
  # Mosaic GPU kernels: only GPUs of compute capability 9.0, even in the full
  # sweep (fuseopt refuses the others before lowering).
  sm90_only: bool = False
  # The targets the case belongs to (``None``: every target with its device
  # count); the scale cases name theirs.
  on_targets: tuple[str, ...] | None = None
  # A compile failure is a figure of the case (a step that does not fit the
  # device, a layout that does not compile yet), recorded as ``{"error"}``;
  # the tests then hold the case to it (see tests/compile/tier.py).
  records_failure: bool = False


class CompileFailure(AssertionError):
  pass


def compile_case(target, case: Case) -> dict[str, Any]:
  """Compiles ``case`` for ``target``; returns its figures.

  Raises :class:`CompileFailure` naming the target, the case and the
  compiler's message when lowering or compiling fails.
  """
  t = targets_lib.get(target)
  mesh = case.mesh(t) if case.mesh is not None else None
  try:
    t0 = time.perf_counter()
    with targets_lib.lowering_for(t, mesh):
      fn, args, donate = case.build(t)
      args = _placed(t, args)
      lowered = jax.jit(fn, donate_argnums=donate).trace(*args).lower(
          lowering_platforms=(t.lowering_platform,))
    t1 = time.perf_counter()
    with _captured_stderr() as log, _captured_stderr(1) as out_log:
      compiled = lowered.compile()
    t2 = time.perf_counter()
  except Exception as e:  # noqa: BLE001 - every compiler error becomes one clear failure
    msg = f"{type(e).__name__}: {e}"
    raise CompileFailure(f"{case.id} does not compile for {t.name} ({t.device_kind}): "
                         f"{_short(msg)}") from e
  hlo = compiled.as_text()
  mem = compiled.memory_analysis()
  spilled = sorted(set(spills(log)) | set(spills(out_log)))
  for line in log:   # the compilers' warnings and errors stay visible
    if re.match(r"\s*[WE]\d{4}|.*\b(warning|error)\b", line, re.I) and "ptxas info" not in line:
      print(line, file=sys.stderr)
  figures = {
      "temp_bytes": int(mem.temp_size_in_bytes),
      "argument_bytes": int(mem.argument_size_in_bytes),
      "output_bytes": int(mem.output_size_in_bytes),
      "alias_bytes": int(mem.alias_size_in_bytes),
      "kernels": kernel_launches(hlo),
      "collectives": collectives(hlo),
      "spills": spilled,
      "lower_s": round(t1 - t0, 2),
      "compile_s": round(t2 - t1, 2),
  }
  if case.expect_kernels and figures["kernels"] == 0:
    raise CompileFailure(f"{case.id} compiled for {t.name} without any {t.implementation} "
                         "kernel: the dispatch fell back to XLA")
  return figures


def _short(msg: str, limit: int = 4000) -> str:
  # libtpu's messages carry the whole MLIR location stack: keep the head.
  return msg if len(msg) <= limit else msg[:limit] + " [...]"


def _placed(t, args):
  leaves, treedef = jax.tree.flatten(args)
  default = None
  out = []
  for x in leaves:
    if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None:
      if default is None:
        default = jax.sharding.NamedSharding(targets_lib.mesh(t), jax.sharding.PartitionSpec())
      x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=default)
    out.append(x)
  return jax.tree.unflatten(treedef, out)
