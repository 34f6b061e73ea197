"""Vector bundles of fuseopt's Mosaic TPU kernels, from libtpu's scheduled
LLO, deviceless: how many cycles a kernel's arithmetic takes an element.

libtpu lowers a Mosaic kernel to LLO, the TensorCore's VLIW program, and
schedules it into bundles: one bundle issues in one cycle (scalar, vector
ALU, load, store, cross-lane and transcendental slots side by side). Its
flags ``--xla_jf_dump_to=DIR --xla_jf_dump_llo_text=true`` write every
stage of every program it compiles; ``<fingerprint>-<kernel>.<n>-<stage>-
final_bundles.txt`` is a kernel's scheduled program, one line a bundle,
each loop's first bundle marked ``LB:`` and its last a branch back
(``sbr.rel``). libtpu reads its flags once, when it loads
(``LIBTPU_INIT_ARGS``): a compile here runs in a subprocess
(:func:`case_figures`), which compiles for the target as the compile tier
does (no TPU needed).

A streaming kernel's DMAs run beside its bundles, so a step takes the
longer of its bytes at the HBM bandwidth and its bundles at the core's
clock. Each elementwise kernel's innermost loop is one chunk of its block
(``elementwise_tiling.CHUNK``; the blockwise kernels' ``CHUNK_ROWS`` rows
of a row group, ``adam.mosaic_tpu``), so its bundles per chunk give the
kernel's cycles an element: :func:`figures` reports them per 1024 elements
(one fp32 vreg), beside the cycles the same elements' bytes take at the
spec bandwidth (:data:`BYTES_PER_CYCLE`). A kernel whose bundles exceed
its bytes' cycles is bound by its vector work, not by HBM, and runs at
``bytes' cycles / bundles`` of the floor at best (docs/kernels.md, "TPU:
bundles an element").

The compile tier's guard (tests/compile/test_tpu_guards.py) holds
:data:`GUARDED_CASES`' figures to ``bench/results/compiled/jax-<release>/
llo-<target>.json``: more bundles an element (past a 2 % margin for the
scheduler's noise), or a spill in the innermost loop, fails.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

SCHEMA = "fuseopt-llo/1"

# Bytes a TensorCore's HBM moves a cycle at the spec bandwidth: v5e, 819
# GB/s at 1.5 GHz (197 bf16 TFLOP/s from 4 MXUs of 128 x 128 MACs, 2
# FLOPs a MAC: 197e12 / (4 * 16384 * 2) = 1.50e9 cycles a second; Google
# Cloud's TPU v5e documentation).
BYTES_PER_CYCLE = {"v5e": 819e9 / 1.5e9}

# Compile-tier cases whose kernels are gated, with each case's elements an
# iteration of its kernel's innermost loop (one chunk) and the bytes an
# element the kernel moves (read and written: its format's byte model,
# docs/adam.md "Memory"). Every case is a (2048, 8192) leaf, which the
# chunks divide.
GUARDED_CASES = {
    "kernel/stochastic_round/mosaic_tpu/2048x8192/heuristic": ("chunk", 4 + 2),
    "kernel/adam_update/mosaic_tpu/pf32-gf32-mbf16/heuristic": ("chunk", 4 + 4 + 4 + 2 * 4),
    "kernel/adam_update/mosaic_tpu/pbf16-gf32-mbf16/heuristic": ("chunk", 2 + 4 + 2 + 2 * 4),
    "kernel/adam_update/mosaic_tpu/pbf16-gbf16-mbf16/heuristic": ("chunk", 2 + 2 + 2 + 2 * 4),
    "kernel/adam_update/mosaic_tpu/mantissa24-pbf16-gf32-mbf16/heuristic":
        ("chunk", 2 + 4 + 2 + 2 * 1 + 2 * 4),
    "kernel/adam_update/mosaic_tpu/int8-pf32-gf32/heuristic": ("rows", 4 + 4 + 4 + 2 * 2 + 4 * 4 / 256),
    "kernel/adam_update/mosaic_tpu/int4-pf32-gf32/heuristic": ("rows", 4 + 4 + 4 + 2 * 1 + 4 * 4 / 128),
}
# The margin a kernel's bundles an element may grow by before the guard fails.
MARGIN = 0.02


def elements_per_iteration(kind: str) -> int:
  """Elements an iteration of a kernel's innermost loop covers: an
  elementwise kernel's chunk, or a blockwise kernel's rows of one row group."""
  import math

  from fuseopt.kernels import elementwise_tiling
  from fuseopt.kernels.adam import blocks
  from fuseopt.kernels.adam import mosaic_tpu
  if kind == "chunk":
    return math.prod(elementwise_tiling.CHUNK)
  return mosaic_tpu.CHUNK_ROWS * blocks.ROW


# ------------------------------------------------------------- LLO parsing --
_BUNDLE = re.compile(r"^\s+(?:0x[0-9a-f]+|0)\s+")
_HEAD = re.compile(r"^\s+0x[0-9a-f]+\s+LB:")
_OP = re.compile(r"= (v[a-z][\w.]*)")


def bundles(text: str) -> list[str]:
  """The bundle lines of a ``final_bundles`` dump, in address order."""
  return [line for line in text.splitlines() if _BUNDLE.match(line)]


def innermost_loops(lines: list[str]) -> list[list[str]]:
  """Each loop holding no other: from a ``LB:`` bundle, which starts the
  loop's regions (``Start region N``), to the branch back to one of them
  (``sbr.rel ... target = $regionN``), where no other loop starts between."""
  out = []
  for i, line in enumerate(lines):
    if not _HEAD.match(line):
      continue
    regions = set(re.findall(r"Start region (\d+)", line))
    for j in range(i + 1, len(lines)):
      if _HEAD.match(lines[j]):
        break
      m = re.search(r"sbr\.rel\b.*?target = \$region(\d+)", lines[j])
      if m and m.group(1) in regions:
        out.append(lines[i:j + 1])
        break
  return out


def loop_figures(loop: list[str]) -> dict[str, Any]:
  """A loop's bundles, its vector operations by opcode, and its spills
  (vector loads and stores of spill slots)."""
  ops = collections.Counter(m.group(1) for line in loop for m in _OP.finditer(line))
  spills = sum(len(re.findall(r"= v(?:ld|st) \[vmem:\[#allocation\d+_spill\]", line))
               for line in loop)
  return {"bundles": len(loop), "vector_ops": sum(ops.values()), "spills": spills,
          "top_ops": dict(ops.most_common(int(os.environ.get("FUSEOPT_LLO_TOP_OPS", "12"))))}


def figures(text: str, *, elements: int, bytes_per_element: float,
            bytes_per_cycle: float) -> dict[str, Any]:
  """One kernel's figures from its ``final_bundles`` text: its innermost
  loop (the one with the most bundles) per ``elements``, bundles per 1024
  elements, and the cycles 1024 elements' bytes take at ``bytes_per_cycle``."""
  lines = bundles(text)
  loops = innermost_loops(lines)
  if not loops:
    raise ValueError("no loop in the kernel's bundles (is its block chunked?)")
  inner = loop_figures(max(loops, key=len))
  per_1024 = inner["bundles"] * 1024 / elements
  hbm = bytes_per_element * 1024 / bytes_per_cycle
  return {"kernel_bundles": len(lines), "loop": inner, "elements_per_iteration": elements,
          "bundles_per_1024": round(per_1024, 2), "hbm_cycles_per_1024": round(hbm, 2),
          "bound": "vector" if per_1024 > hbm else "hbm",
          "floor_share_at_most": round(min(1.0, hbm / per_1024), 3)}


def kernel_texts(dump_dir: str | os.PathLike, prefix: str = "fuseopt_") -> dict[str, str]:
  """``{kernel name: final bundles}`` of the fuseopt kernels in a dump."""
  out = {}
  for p in sorted(Path(dump_dir).iterdir()):
    m = re.match(r"^\d+-(" + re.escape(prefix) + r"[\w]+?)(?:\.\d+)?-\d+-final_bundles\.txt$",
                 p.name)
    if m:
      out[m.group(1)] = p.read_text()
  return out


# --------------------------------------------------------------- compiling --
def _compile_cases(target: str, case_ids: list[str], out_dir: str) -> None:
  """In the subprocess: compile each case with libtpu's dump on, its files
  moved into ``out_dir/<case index>/``."""
  from fuseopt import targets as targets_lib
  from fuseopt.benchmarks import compile_cases
  from fuseopt.benchmarks import ptx_figures
  t = targets_lib.get(target)
  dump = Path(out_dir) / "dump"
  by_id = {c.id: c for c in compile_cases.cases(t, kinds=("kernel",))}
  for i, case_id in enumerate(case_ids):
    with targets_lib.lowering_for(t):
      fn, args, donate = by_id[case_id].build(t)
    ptx_figures.lower(t, fn, args, donate).compile()
    dest = Path(out_dir) / str(i)
    dest.mkdir()
    for p in list(dump.iterdir()) if dump.exists() else []:
      if p.name.endswith("final_bundles.txt"):
        p.rename(dest / p.name)
      else:
        p.unlink()


def case_figures(target: str, case_ids: list[str] | None = None) -> dict[str, dict[str, Any]]:
  """``{case id: {kernel: figures}}`` of ``case_ids`` (default:
  :data:`GUARDED_CASES`) compiled for a TPU ``target`` in one subprocess."""
  case_ids = list(GUARDED_CASES if case_ids is None else case_ids)
  with tempfile.TemporaryDirectory(prefix="fuseopt-llo-") as d:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               LIBTPU_INIT_ARGS=" ".join(filter(None, (
                   os.environ.get("LIBTPU_INIT_ARGS", ""),
                   f"--xla_jf_dump_to={d}/dump", "--xla_jf_dump_llo_text=true"))))
    proc = subprocess.run(
        [sys.executable, "-m", "fuseopt.benchmarks.llo_figures", target, d, *case_ids],
        env=env, capture_output=True, text=True)
    if proc.returncode:
      raise RuntimeError(f"compiling {case_ids} for {target} failed:\n{proc.stderr[-4000:]}")
    out = {}
    for i, case_id in enumerate(case_ids):
      kind, nbytes = GUARDED_CASES[case_id]
      out[case_id] = {
          name: figures(text, elements=elements_per_iteration(kind), bytes_per_element=nbytes,
                        bytes_per_cycle=BYTES_PER_CYCLE[target])
          for name, text in kernel_texts(Path(d) / str(i)).items()}
    return out


# ------------------------------------------------------- recorded figures --
def results_path(target, root: Path | str | None = None, *, jax_version: str | None = None) -> Path:
  """``<root>/jax-<release>/llo-<target>.json``: exact for one libtpu, so
  each release keeps its own file (as the PTX figures)."""
  import jax

  from fuseopt.benchmarks import compile_results
  root = compile_results.RESULTS_DIR if root is None else Path(root)
  return Path(root) / f"jax-{jax_version or jax.__version__}" / f"llo-{target}.json"


def load(target, root: Path | str | None = None) -> dict[str, Any] | None:
  path = results_path(target, root)
  return json.loads(path.read_text()) if path.exists() else None


def environment() -> dict[str, str]:
  """The compilers the figures are exact for: jax, jaxlib and libtpu."""
  from fuseopt.benchmarks import compile_results
  return {k: v for k, v in compile_results.environment().items()
          if k in ("jax", "jaxlib", "libtpu")}


def write(target, figures_by_case: dict[str, dict], root: Path | str | None = None) -> Path:
  """Merges ``{case id: {kernel: figures}}`` into ``target``'s file (cases
  no longer guarded leave it)."""
  import datetime
  path = results_path(target, root)
  old = json.loads(path.read_text()) if path.exists() else {}
  cases_ = {k: v for k, v in {**old.get("cases", {}), **figures_by_case}.items()
            if k in GUARDED_CASES}
  doc = {"schema": SCHEMA, "target": target, "bytes_per_cycle": BYTES_PER_CYCLE[target],
         "environment": environment(),
         "written": datetime.date.today().isoformat(), "cases": dict(sorted(cases_.items()))}
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(doc, indent=1) + "\n")
  return path


def compare(fresh: dict[str, Any], base: dict[str, Any] | None) -> tuple[list[str], list[str]]:
  """(failures, notes) of one kernel's fresh figures against its recorded
  ones: bundles an element grown past :data:`MARGIN`, or spills in the
  innermost loop, fail; fewer bundles is a note (record them)."""
  if base is None:
    return [], ["not recorded (new kernel)"]
  fails, notes = [], []
  a, b = fresh["bundles_per_1024"], base["bundles_per_1024"]
  if a > b * (1 + MARGIN):
    fails.append(f"bundles per 1024 elements grew: {b} -> {a} "
                 f"(HBM takes {fresh['hbm_cycles_per_1024']})")
  elif a < b:
    notes.append(f"bundles per 1024 elements fell: {b} -> {a}")
  if fresh["loop"]["spills"] > base["loop"]["spills"]:
    fails.append(f"spills in the innermost loop: {base['loop']['spills']} -> "
                 f"{fresh['loop']['spills']}")
  return fails, notes


# ------------------------------------------------------------------ table --
LLO_START = "<!-- llo-table:start -->"
LLO_END = "<!-- llo-table:end -->"


def markdown(doc: dict[str, Any]) -> str:
  """The recorded figures as a table: a row a gated kernel."""
  env = doc["environment"]
  rows = [f"libtpu {env.get('libtpu', '?')} (jax {env.get('jax', '?')}), {doc['target']}, "
          f"{doc['bytes_per_cycle']:.0f} B a cycle at the spec bandwidth; "
          f"`{results_path(doc['target'], jax_version=env.get('jax'))}`:",
          "",
          "| kernel case | B an element | HBM cycles / 1024 | bundles / 1024 | bound by | "
          "at most, of the floor | spill accesses a loop |",
          "| --- | ---: | ---: | ---: | --- | ---: | ---: |"]
  for case_id, kernels in doc["cases"].items():
    for name, f in kernels.items():
      nbytes = f["hbm_cycles_per_1024"] * doc["bytes_per_cycle"] / 1024
      rows.append(f"| `{case_id.split('/')[1]}` {case_id.split('/')[3]} | {nbytes:.2f} | "
                  f"{f['hbm_cycles_per_1024']:.1f} | {f['bundles_per_1024']:.1f} | "
                  f"{'HBM' if f['bound'] == 'hbm' else 'vector work'} | "
                  f"{100 * f['floor_share_at_most']:.0f} % | {f['loop']['spills']} |")
  return "\n".join(rows) + "\n"


def render(page: Path | str, compiled_root: Path | str, target: str = "v5e") -> bool | None:
  """Replaces the table between ``page``'s llo-table markers with the
  newest jax release's recorded figures (None: none recorded)."""
  from fuseopt.benchmarks import report
  found = sorted(Path(compiled_root).glob(f"jax-*/llo-{target}.json"),
                 key=lambda p: tuple(int(x) for x in re.findall(r"\d+", p.parent.name)))
  if not found:
    return None
  return report.replace_between(page, LLO_START, LLO_END,
                                markdown(json.loads(found[-1].read_text())))


if __name__ == "__main__":
  _compile_cases(sys.argv[1], sys.argv[3:], sys.argv[2])
