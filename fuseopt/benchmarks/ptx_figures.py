"""PTX figures of fuseopt's compiled Triton kernels: the vector width of
every global load and store, registers and spills, deviceless.

A Pallas Triton kernel reaches XLA as a ``__gpu$xla.gpu.triton`` custom
call; XLA compiles it (TTIR -> TTGIR -> LLVM -> PTX, then ptxas) as a
kernel of its own (a ``kCustomKernel`` thunk), so plain ``xla_dump_to``
writes no PTX of it. XLA's dump of the PTX it hands ptxas is an "emitter"
dump named ``ptx``: ``xla_dump_to=DIR`` with ``xla_dump_emitter_re=ptx``
writes each LLVM module's PTX, Triton's kernels' included, as
``DIR/module_*.<n>.ptx``, at no cost to the compile (``xla_dump_emitter_re``
``.*`` adds the Triton pass pipeline, TTIR to LLVM, as
``*.triton-to-llvm.txt``: 5 MB and seconds a kernel). :func:`case_ptx`
compiles a compile-tier case that way: the flags go through
``lowered.compile(compiler_options=...)``, one compile at a time, so
nothing global changes.

:func:`figures` reads a PTX text: per ``.entry``, each global access
(``ld.global``/``st.global``, any cache qualifiers) with its width in bits
(``ld.global.v4.b32``: 128; ``.v2.b32``: 64; ``.b16``: 16) and the kernel
parameter its address derives from (def-use chains of the 64-bit address
registers back to ``ld.param``), and ptxas's ``-v`` report of the same PTX
(the bundled ptxas, the one XLA runs): registers, stack, spill stores and
loads. Parameters are numbered as Triton's: the ``pallas_call`` operands,
then its outputs.

The compile tier's guard (tests/compile/test_ptx_guards.py) holds the
default configs' figures to ``bench/results/compiled/jax-<release>/ptx-<target>.json``
(docs/compile_tier.md, "PTX: access widths").
"""

from __future__ import annotations

import collections
import contextlib
import glob
import hashlib
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

# ------------------------------------------------------------- PTX parsing --
_ENTRY = re.compile(r"^\s*\.(?:visible\s+)?\.entry\s+([\w$]+)\s*\(", re.M)
_TARGET = re.compile(r"^\s*\.target\s+(sm_\w+)", re.M)
_PARAM = re.compile(r"\.param\b[^,)]*?\s([\w$]+)\s*(?:\[\d+\]\s*)?[,)]")
# ld.global[.qualifiers][.vN].type  {regs}, [addr]   /  st.global... [addr], {regs}
_ACCESS = re.compile(r"(?:@!?%\w+\s+)?\b(ld|st)\.global((?:\.[\w:]+)+)\s+(.*?);")
_TYPE = re.compile(r"^[bsuf](\d+)$|^bf16$|^bf16x2$|^f16x2$")
_ADDR = re.compile(r"\[\s*(%\w+)\s*(?:\+\s*-?\w+\s*)?\]")
# A register's defining instruction: "op[.mods] %dst, src, ...;"
_DEF = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][\w.:]*)\s+(%\w+)\s*,\s*(.*?);", re.M)
_PARAM_LOAD = re.compile(r"ld\.param[\w.:]*\s+(%\w+)\s*,\s*\[\s*([\w$]+)\s*(?:\+\s*\d+\s*)?\]")


def _bits(qualifiers: str) -> tuple[int, int, str]:
  """``(vector length, bits, type)`` of an access's qualifiers
  (``.L1::evict_last.v4.b32`` -> ``(4, 128, "b32")``)."""
  vec, ty, elem = 1, "?", 0
  for q in qualifiers.strip(".").split("."):
    if re.fullmatch(r"v\d+", q):
      vec = int(q[1:])
    elif _TYPE.match(q):
      ty = q
      elem = {"bf16": 16, "bf16x2": 32, "f16x2": 32}.get(q) or int(q[1:])
  return vec, vec * elem, ty


def entries(ptx: str) -> dict[str, str]:
  """``{entry name: its text}`` of a PTX module (header, then one chunk an
  ``.entry`` up to the next)."""
  starts = [(m.start(), m.group(1)) for m in _ENTRY.finditer(ptx)]
  out = {}
  for (pos, name), nxt in zip(starts, [s for s, _ in starts[1:]] + [len(ptx)]):
    out[name] = ptx[pos:nxt]
  return out


def _params(body: str) -> list[str]:
  head = body[:body.find(")") + 1]
  return _PARAM.findall(head)


def _params_of(reg: str, defs: dict[str, list[tuple[str, list[str]]]], params: dict[str, int],
               seen=None) -> set[int]:
  """The kernel parameters a 64-bit address register derives from: follows
  its definitions (``add``, ``mad``, ``cvta``, ``mov``, ``selp``...) back to
  ``ld.param``. One parameter for a plain access; several where LLVM merged
  the branches of a grouped launch into one access through a selected base
  pointer."""
  seen = seen if seen is not None else set()
  if reg in seen:
    return set()
  seen.add(reg)
  out = set()
  # PTX is not SSA: a register the branches of a grouped launch each set
  # has a definition in each.
  for op, srcs in defs.get(reg, ()):
    if op.startswith("ld.param"):
      out |= {params[srcs[0]]} if srcs[0] in params else set()
      continue
    for s in srcs:
      if s.startswith("%rd"):   # 64-bit: a pointer (32-bit indices are offsets)
        out |= _params_of(s, defs, params, seen)
  return out


def accesses(body: str) -> list[dict[str, Any]]:
  """Every global load and store of one ``.entry``, in program order:
  ``{"op": "ld"|"st", "bits", "vector", "type", "param"}`` (``param``: the
  index of the kernel parameter addressed, ``"i,j,..."`` for an access
  through a pointer selected among several, ``None`` when not traced)."""
  params = {name: i for i, name in enumerate(_params(body))}
  defs: dict[str, list[tuple[str, list[str]]]] = {}
  for m in _PARAM_LOAD.finditer(body):
    defs.setdefault(m.group(1), []).append(("ld.param", [m.group(2)]))
  for m in _DEF.finditer(body):
    op, dst, rest = m.group(1), m.group(2), m.group(3)
    if op.startswith(("ld.", "st.")):
      continue
    defs.setdefault(dst, []).append((op, re.findall(r"%\w+", rest)))
  out = []
  for m in _ACCESS.finditer(body):
    op, quals, operands = m.group(1), m.group(2), m.group(3)
    vec, bits, ty = _bits(quals)
    addr = _ADDR.search(operands)
    found = sorted(_params_of(addr.group(1), defs, params)) if addr else []
    param = ",".join(map(str, found)) if found else None
    out.append({"op": op, "bits": bits, "vector": vec, "type": ty, "param": param})
  return out


def histogram(acc: list[dict[str, Any]], op: str) -> dict[str, int]:
  """``{"<bits>": count}`` of one kind of access (``"ld"`` or ``"st"``)."""
  c = collections.Counter(str(a["bits"]) for a in acc if a["op"] == op)
  return dict(sorted(c.items(), key=lambda kv: -int(kv[0])))


_SHARED = re.compile(r"\b(ld|st)\.shared\b|\b(bar\.sync|barrier\.sync|bar\.warp\.sync)\b")


def shared(body: str) -> dict[str, int]:
  """Shared-memory traffic of one ``.entry``: ``{"ld", "st", "barriers"}``
  instruction counts. An elementwise kernel has none unless Triton converts
  a value between layouts through shared memory (operands of different
  widths given different per-thread layouts)."""
  c = collections.Counter()
  for m in _SHARED.finditer(body):
    c[m.group(1) or "barriers"] += 1
  return {"ld": c["ld"], "st": c["st"], "barriers": c["barriers"]}


def per_param(acc: list[dict[str, Any]]) -> dict[str, dict[str, list[int]]]:
  """``{"<param>": {"ld": widths, "st": widths}}``: the distinct widths of
  each parameter's loads and stores, widest first."""
  out: dict[str, dict[str, set]] = {}
  for a in acc:
    rec = out.setdefault(str(a["param"]), {"ld": set(), "st": set()})
    rec[a["op"]].add(a["bits"])
  return {k: {op: sorted(v, reverse=True) for op, v in rec.items() if v}
          for k, rec in sorted(out.items(), key=lambda kv: (
              kv[0] == "None", [int(x) for x in kv[0].split(",") if x.isdigit()]))}


# fp32 arithmetic: "op.mods.f32" (mul.rn.f32, fma.rn.f32, div.full.f32, sqrt.approx.f32, ...)
_F32_OP = re.compile(r"^\s*(?:@!?%\w+\s+)?((?:fma|mul|add|sub|div|sqrt|rsqrt|rcp|neg|abs|max|min|"
                     r"setp|selp|ex2|lg2|cvt)(?:\.[\w]+)*\.f32)\b", re.M)


def float_ops(body: str) -> dict[str, int]:
  """``{"mnemonic": count}`` of one ``.entry``'s fp32 instructions
  (``mul.rn.f32``, ``div.full.f32``, ...). Divided by the elements a thread
  holds, the arithmetic of one element: the same at every block size and grid
  when each element is computed by one instruction sequence. A ``.rn``
  multiply or add is rounded as written: no assembler contracts it into an FMA."""
  return dict(sorted(collections.Counter(m.group(1) for m in _F32_OP.finditer(body)).items()))


# ------------------------------------------------------------------- ptxas --
def ptxas_path() -> str | None:
  """The ptxas of the ``compile`` extra (``nvidia-cuda-nvcc``; CUDA 12's
  ``nvidia-cuda-nvcc-cu12`` on the floor), the one XLA runs on Triton
  kernels (:func:`fuseopt.targets.cuda_toolkit_dir`)."""
  from fuseopt import targets as targets_lib
  root = targets_lib.cuda_toolkit_dir()
  return str(root / "bin" / "ptxas") if root else None


_PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def ptxas_report(ptx: str, arch: str | None = None) -> dict[str, dict[str, int]]:
  """ptxas ``-v`` on ``ptx`` for its own ``.target`` (or ``arch``):
  ``{entry: {"registers", "stack_bytes", "spill_stores", "spill_loads"}}``.
  Runs ptxas with -O3 as XLA does (no register cap: XLA sets none for Triton
  kernels, whose ``.reqntid`` bounds them)."""
  exe = ptxas_path()
  if exe is None:
    raise FileNotFoundError("ptxas (nvidia-cuda-nvcc, the 'compile' extra) is not installed")
  arch = arch or (_TARGET.search(ptx).group(1) if _TARGET.search(ptx) else "sm_90a")
  with tempfile.TemporaryDirectory() as d:
    src = Path(d) / "k.ptx"
    src.write_text(ptx)
    res = subprocess.run([exe, f"-arch={arch}", "-O3", "-v", "--warn-on-spills", str(src),
                          "-o", str(Path(d) / "k.cubin")],
                         capture_output=True, text=True, check=True)
  out, name = {}, None
  for line in (res.stdout + res.stderr).splitlines():
    if m := _PTXAS_ENTRY.search(line):
      name = m.group(1)
      out[name] = {"registers": 0, "stack_bytes": 0, "spill_stores": 0, "spill_loads": 0}
    elif name and (m := _PTXAS_FRAME.search(line)):
      out[name].update(stack_bytes=int(m.group(1)), spill_stores=int(m.group(2)),
                       spill_loads=int(m.group(3)))
    elif name and (m := _PTXAS_REGS.search(line)):
      out[name]["registers"] = int(m.group(1))
  return out


def figures(ptx: str, *, prefix: str = "", ptxas: bool = True) -> dict[str, dict[str, Any]]:
  """Per ``.entry`` of ``ptx`` whose name starts with ``prefix``: ``loads``
  and ``stores`` (histograms ``{"<bits>": count}``), ``params``
  (:func:`per_param`), ``threads`` (``.reqntid``), and with ``ptxas``
  ptxas's ``registers``, ``stack_bytes``, ``spill_stores``, ``spill_loads``."""
  report = ptxas_report(ptx) if ptxas else {}
  out = {}
  for name, body in entries(ptx).items():
    if not name.startswith(prefix):
      continue
    acc = accesses(body)
    threads = re.search(r"\.(?:reqntid|maxntid)\s+(\d+)", body)
    fig = {"threads": int(threads.group(1)) if threads else None,
           "loads": histogram(acc, "ld"), "stores": histogram(acc, "st"),
           "params": per_param(acc), "shared": shared(body)}
    fig.update(report.get(name, {}))
    out[name] = fig
  return out


# ----------------------------------------------- compiling a case for PTX --
# XLA's PTX dump is the emitter dump named "ptx" (docstring above).
DUMP_OPTIONS = {"xla_dump_emitter_re": "ptx"}


def compile_for_ptx(lowered, dump_dir: str | os.PathLike) -> Any:
  """``lowered.compile()`` with XLA's PTX dump into ``dump_dir``."""
  return lowered.compile(compiler_options={"xla_dump_to": str(dump_dir), **DUMP_OPTIONS})


def dumped_ptx(dump_dir: str | os.PathLike, prefix: str = "fuseopt_") -> list[str]:
  """The distinct PTX texts in ``dump_dir`` that hold an entry named
  ``prefix*``."""
  texts = []
  for path in sorted(glob.glob(os.path.join(str(dump_dir), "**", "*.ptx"), recursive=True)):
    text = Path(path).read_text()
    if any(n.startswith(prefix) for n in entries(text)) and text not in texts:
      texts.append(text)
  return texts


def keyed(texts: list[str], prefix: str = "fuseopt_") -> dict[str, str]:
  """``{key: ptx}``, one key an entry: its name, with ``[<params> params]``
  appended when several kernels share a name (a grouped launch split into
  chunks of other sizes), and ``#<n>`` (ordered by their PTX's hash, which
  does not depend on XLA's compile threads) if that still collides."""
  by_name: dict[str, list[str]] = {}
  for text in texts:
    for name, body in entries(text).items():
      if name.startswith(prefix):
        by_name.setdefault(name, []).append(text)
  out = {}
  for name, ts in by_name.items():
    if len(ts) == 1:
      out[name] = ts[0]
      continue
    groups: dict[str, list[str]] = {}
    for t in ts:
      groups.setdefault(f"{name}[{len(_params(entries(t)[name]))} params]", []).append(t)
    for key, g in groups.items():
      g = sorted(g, key=lambda t: hashlib.sha256(t.encode()).hexdigest())
      for i, t in enumerate(g):
        out[key if len(g) == 1 else f"{key}#{i}"] = t
  return dict(sorted(out.items()))


def lower(target, fn, args, donate=()) -> Any:
  """``fn`` traced and lowered for ``target`` (abstract ``args``, placed on
  its devices)."""
  import jax

  from fuseopt import targets as targets_lib
  from fuseopt.benchmarks import compile_harness
  t = targets_lib.get(target)
  with targets_lib.lowering_for(t):
    args = compile_harness._placed(t, args)
    return jax.jit(fn, donate_argnums=donate).trace(*args).lower(
        lowering_platforms=(t.lowering_platform,))


def ptx_of(target, fn, args, donate=(), prefix: str = "fuseopt_") -> dict[str, str]:
  """``{kernel key: PTX}`` of fuseopt's Triton kernels in ``fn`` compiled
  for a GPU ``target`` (see :func:`keyed`)."""
  with tempfile.TemporaryDirectory(prefix="fuseopt-ptx-") as d, _quiet():
    compile_for_ptx(lower(target, fn, args, donate), d)
    return keyed(dumped_ptx(d, prefix), prefix)


def case_ptx(target, case) -> dict[str, str]:
  """:func:`ptx_of` a compile-tier case (:class:`~fuseopt.benchmarks.compile_harness.Case`)."""
  from fuseopt import targets as targets_lib
  t = targets_lib.get(target)
  with targets_lib.lowering_for(t):
    fn, args, donate = case.build(t)
  return ptx_of(t, fn, args, donate)


def case_figures(target, case) -> dict[str, dict[str, Any]]:
  """``{kernel key: figures}`` of a compile-tier case (:func:`figures` of
  each of its fuseopt kernels)."""
  out = {}
  for key, text in case_ptx(target, case).items():
    name = key.split("[")[0].split("#")[0]
    out[key] = figures(text, prefix=name)[name]
  return out


@contextlib.contextmanager
def _quiet():
  """XLA logs a line a dumped file at INFO when the compile tier shows INFO
  logs (targets.report_ptxas): keep native stderr for the duration."""
  from fuseopt.benchmarks import compile_harness
  with compile_harness._captured_stderr():
    yield


# ------------------------------------------------------- recorded figures --
SCHEMA = "fuseopt-ptx/1"

# The default configs whose PTX is gated (tests/compile/test_ptx_guards.py):
# compile-tier case ids (fuseopt.benchmarks.compile_cases), on every GPU target.
GUARDED_CASES = (
    "kernel/adam_update/triton/pf32-gf32-mbf16/heuristic",
    "kernel/adam_update/triton/pbf16-gf32-mbf16/heuristic",
    "kernel/adam_update/triton/pbf16-gbf16-mbf16/heuristic",
    "kernel/adam_update/triton/pf32-gf32-mf32/heuristic",
    "kernel/adam_update/triton/ragged-pf32-gf32-mbf16/heuristic",
    "kernel/adam_update/triton/int8-pf32-gf32/heuristic",
    "kernel/adam_update_tree/triton/llama-1-layer/heuristic",
    "kernel/adam_update_tree/triton/llama-1-layer-int8/heuristic",
    "kernel/stochastic_round/triton/2048x8192/heuristic",
    "kernel/stochastic_round/triton/1000x3001/heuristic",
)


def results_path(target, root: Path | str | None = None, *, jax_version: str | None = None) -> Path:
  """``<root>/jax-<release>/ptx-<target>.json`` (root: the compile tier's
  ``bench/results/compiled``): PTX is exact for one set of compilers (jax's
  Triton, LLVM, ptxas), so each release keeps its own file, beside the
  compile tier's figures of the same release."""
  import jax

  from fuseopt import targets as targets_lib
  from fuseopt.benchmarks import compile_results
  root = compile_results.RESULTS_DIR if root is None else Path(root)
  return Path(root) / f"jax-{jax_version or jax.__version__}" / f"ptx-{targets_lib.get(target).name}.json"


def load(target, root: Path | str | None = None) -> dict[str, Any] | None:
  path = results_path(target, root)
  return json.loads(path.read_text()) if path.exists() else None


def write(target, figures_by_case: dict[str, dict], root: Path | str | None = None) -> Path:
  """Merges ``{case id: {kernel key: figures}}`` into ``target``'s file
  (cases no longer guarded leave it)."""
  import datetime

  from fuseopt import targets as targets_lib
  from fuseopt.benchmarks import compile_results
  t = targets_lib.get(target)
  path = results_path(t, root)
  old = json.loads(path.read_text()) if path.exists() else {}
  cases_ = {k: v for k, v in {**old.get("cases", {}), **figures_by_case}.items()
            if k in GUARDED_CASES}
  doc = {"schema": SCHEMA, "target": t.name, "device_kind": t.device_kind,
         "compute_capability": list(t.compute_capability or ()),
         "environment": compile_results.environment(),
         "written": datetime.date.today().isoformat(),
         "cases": dict(sorted(cases_.items()))}
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(doc, indent=1) + "\n")
  return path


# ------------------------------------------------------------------- gate --
def compare(fresh: dict[str, Any], base: dict[str, Any] | None) -> tuple[list[str], list[str]]:
  """(failures, notes) of one kernel's fresh figures against its recorded
  ones: a parameter's load or store narrower than recorded (its narrowest
  width) or gone fails, as do spills (or stack) that appear or grow and
  shared-memory traffic or barriers that appear or grow (a layout conversion
  between the loads and the stores); registers and histogram changes are
  notes."""
  if base is None:
    return [], ["not recorded (new kernel)"]
  fails, notes = [], []
  for p, rec in base.get("params", {}).items():
    now = fresh.get("params", {}).get(p)
    for op, widths in rec.items():
      if not widths:
        continue
      got = (now or {}).get(op)
      if not got:
        fails.append(f"param {p}: no {op} any more (recorded {widths} bits)")
      elif min(got) < min(widths):
        fails.append(f"param {p}: {op} narrowed: {widths} -> {got} bits")
      elif min(got) > min(widths):
        notes.append(f"param {p}: {op} widened: {widths} -> {got} bits")
  for op in ("loads", "stores"):
    b, f = base.get(op, {}), fresh.get(op, {})
    if b != f:
      notes.append(f"{op} histogram {b} -> {f}")
  for k in ("spill_stores", "spill_loads", "stack_bytes"):
    a, b = fresh.get(k), base.get(k)
    if a is not None and b is not None and a > b:
      fails.append(f"{k} grew: {b} -> {a}")
  for k, v in (base.get("shared") or {}).items():
    now = (fresh.get("shared") or {}).get(k, 0)
    if now > v:
      fails.append(f"shared-memory {k} grew: {v} -> {now} (a layout conversion)")
  a, b = fresh.get("registers"), base.get("registers")
  if a is not None and b is not None and a != b:
    notes.append(f"registers {b} -> {a}")
  return fails, notes


__all__ = ["SCHEMA", "GUARDED_CASES", "results_path", "load", "write", "entries", "shared",
           "accesses", "histogram", "per_param", "ptxas_path", "ptxas_report",
           "figures", "compile_for_ptx", "dumped_ptx", "keyed", "lower", "ptx_of", "case_ptx",
           "case_figures", "compare"]


# ------------------------------------------- the ceiling's kernel, deviceless --
def stream_ptx(target: str = "h200", *, n: int | None = None, config=None) -> str:
  """The PTX of the ceiling's streaming kernel
  (:func:`fuseopt.benchmarks.ceiling.stream`) over ``n`` fp32 elements
  (default ``ceiling.STREAM_ELEMENTS``) as XLA compiles it for a GPU compile
  target (:mod:`fuseopt.targets`, no GPU needed). Raises
  :class:`fuseopt.targets.CompilerMissing` without the ``compile`` extra."""
  import functools

  import jax
  import jax.numpy as jnp

  from fuseopt import targets
  from fuseopt.benchmarks import ceiling
  n = ceiling.STREAM_ELEMENTS if n is None else n
  config = ceiling.StreamConfig() if config is None else config
  t = targets.get(target)
  if t.platform != "gpu":
    raise ValueError(f"{t.name} is not a GPU target")
  why = targets.missing(t)
  if why:
    raise targets.CompilerMissing(why)
  fn = functools.partial(ceiling.stream, config=config, num_sms=t.num_cores)
  kernels = ptx_of(t, fn, (jax.ShapeDtypeStruct((n,), jnp.float32),),
                               prefix="fuseopt_ceiling_stream")
  if not kernels:
    raise RuntimeError(f"XLA dumped no PTX of fuseopt_ceiling_stream for {t.name}")
  return next(iter(kernels.values()))
