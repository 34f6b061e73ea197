"""The largest live buffers at a compiled program's memory peak.

XLA's temporary memory (``memory_analysis().temp_size_in_bytes``) is one
allocation whose slices are reused by values with disjoint live ranges; its
size is the peak. With ``XLA_FLAGS=--xla_dump_to=DIR`` XLA writes, for every
compiled module, the buffer assignment (each value's slice: offset and size)
and the live ranges (each value's first and last instruction in the
schedule). This module reads both, finds the instruction where the most
bytes of the temp allocation are live, and lists the values live there, each
with the jax operation that made it (the ``op_name`` of its HLO metadata).

Command line (compiles one case of :mod:`fuseopt.benchmarks.compiled` with a
dump, prints its figures and the table)::

  JAX_PLATFORMS=cpu python -m fuseopt.benchmarks.peak_buffers h200 \\
      step/hybrid_recipe/fuseopt_step/llama1.2b [--top 12]

or, on an existing dump directory: ``python -m fuseopt.benchmarks.peak_buffers
--dump DIR``.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import sys
import tempfile
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Buffer:
  name: str          # HLO value, with its tuple index when it has one
  size: int
  offset: int
  shape: str
  live: tuple[int, int]
  op: str            # the jax operation in the HLO metadata ("" when none)


@dataclasses.dataclass(frozen=True)
class Peak:
  bytes: int
  instruction: int
  instructions: int
  live: tuple[Buffer, ...]   # largest first

  def table(self, top: int = 12) -> str:
    rows = ["| MiB | shape | HLO value | jax operation |", "| ---: | --- | --- | --- |"]
    for b in self.live[:top]:
      rows.append(f"| {b.size / 2**20:.1f} | `{b.shape.split('{')[0]}` | `{b.name}` | "
                  f"`{b.op.removeprefix('jit(step)/')}` |")
    return "\n".join(rows)


_VALUE = re.compile(r" value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (\S+)")
_RANGE = re.compile(r"\s+(\S+?)(\{[\d,]*\})?:(\d+)-(\d+)$")
_INSTR = re.compile(r"\s*(?:ROOT )?%(\S+) = .*?metadata=\{([^}]*)\}")
_OP = re.compile(r'op_name="([^"]*)"')


def _module_files(dump: str | Path, module: str) -> tuple[Path, Path, Path]:
  found = sorted(glob.glob(str(Path(dump) / f"*{module}*after_optimizations-buffer-assignment.txt")))
  if not found:
    raise FileNotFoundError(f"no buffer assignment of a module matching {module!r} in {dump}")
  ba = Path(found[-1])
  base = str(ba).removesuffix("-buffer-assignment.txt")
  return ba, Path(base + "-live-range.txt"), Path(base + ".txt")


def peak(dump: str | Path, module: str = "jit_step") -> Peak:
  """The peak of the temp allocation of the dumped module ``module``."""
  ba, lr, hlo = _module_files(dump, module)
  values, in_temp = [], False
  for line in ba.read_text().splitlines():
    if line.startswith("allocation"):
      # (device memory only: a TPU's allocations of other colours are its
      # on-chip memories, e.g. libtpu's prefetches into VMEM, "S(1)")
      in_temp = " color " not in line and ("preallocated-temp" in line or not any(
          k in line for k in ("parameter", "constant", "output shape", "thread-local")))
      continue
    m = _VALUE.match(line) if in_temp else None
    if m:
      values.append((m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)))
  ranges = {}
  for line in lr.read_text().splitlines():
    m = _RANGE.match(line)
    if m:
      name, index, start, end = m.groups()
      ranges[name + (index if index and index != "{}" else "")] = (int(start), int(end))
  ops = {}
  for line in hlo.read_text().splitlines():
    m = _INSTR.match(line)
    if m:
      op = _OP.search(m.group(2))
      ops[m.group(1)] = op.group(1) if op else ""
  buffers = [Buffer(n, s, o, shape, ranges[n], ops.get(n.split("{")[0], ""))
             for n, s, o, shape in values if n in ranges]
  best, at = 0, 0
  for t in sorted({b.live[0] for b in buffers}):
    # Bytes of the allocation covered by values live at t (slices may share bytes).
    covered, end = 0, -1
    for lo, hi in sorted((b.offset, b.offset + b.size) for b in buffers
                         if b.live[0] <= t <= b.live[1]):
      if hi > end:
        covered += hi - max(lo, end)
        end = hi
    if covered > best:
      best, at = covered, t
  live = sorted((b for b in buffers if b.live[0] <= at <= b.live[1]), key=lambda b: -b.size)
  last = max((b.live[1] for b in buffers), default=0)
  return Peak(best, at, last + 1, tuple(live))


def compile_and_dump(target: str, case_id: str, dump: str | Path) -> dict:
  """Compiles ``case_id`` for ``target`` with XLA dumping into ``dump``; its figures."""
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}").strip()
  import jax
  from fuseopt.benchmarks import compile_cases, compile_harness
  for case in compile_cases.cases(target, kinds=("step", "sharded", "scale"), full=True,
                                  baselines=True):
    if case.id == case_id:
      if case.devices > 1:
        jax.config.update("jax_num_cpu_devices", case.devices)
      return compile_harness.compile_case(target, case)
  raise KeyError(f"no case {case_id!r} for {target}")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m fuseopt.benchmarks.peak_buffers",
                               description=__doc__.split("\n\n")[0])
  ap.add_argument("target", nargs="?")
  ap.add_argument("case", nargs="?")
  ap.add_argument("--dump", default=None, help="read this dump directory instead of compiling")
  ap.add_argument("--module", default="jit_step")
  ap.add_argument("--top", type=int, default=12)
  args = ap.parse_args(argv)
  if args.dump is None:
    if not (args.target and args.case):
      ap.error("give TARGET CASE, or --dump DIR")
    dump = tempfile.mkdtemp(prefix="fuseopt-dump-")
    fig = compile_and_dump(args.target, args.case, dump)
    print(json.dumps({"target": args.target, "case": args.case,
                      **{k: fig[k] for k in ("temp_bytes", "kernels", "collectives", "lower_s",
                                             "compile_s")}}))
  else:
    dump = args.dump
  p = peak(dump, args.module)
  print(f"peak {p.bytes:,} B ({p.bytes / 2**30:.2f} GiB) at instruction {p.instruction} "
        f"of {p.instructions}")
  print(p.table(args.top))
  return 0


if __name__ == "__main__":
  sys.exit(main())
