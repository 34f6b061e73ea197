"""The PTX guard: the default configs' Triton kernels keep their global
access widths and do not spill (docs/compile_tier.md, "PTX: access widths").

Each case of :data:`fuseopt.benchmarks.ptx_figures.GUARDED_CASES` is compiled
for every GPU target, deviceless, with XLA's PTX dump on; the width of every
``ld.global``/``st.global`` of each fuseopt kernel, per kernel parameter,
ptxas's registers and spills and the kernel's shared-memory traffic are held
to ``bench/results/compiled/jax-<release>/ptx-<target>.json``: a parameter
whose narrowest access narrows (or goes), a spill, or a shared-memory layout
conversion that appears fails. ``FUSEOPT_COMPILED_UPDATE=1`` records instead.
The figures are exact for one compiler set (jax's Triton, LLVM, ptxas): a
file written with others is reported against, not enforced.
"""
from __future__ import annotations

import os
import textwrap

import pytest

from fuseopt import targets
from fuseopt.benchmarks import compile_cases, compile_results, ptx_figures

UPDATE = os.environ.get("FUSEOPT_COMPILED_UPDATE") == "1"
GPU_TARGETS = [name for name, t in targets.TARGETS.items() if t.platform == "gpu"]


def _params():
  return [pytest.param(name, case_id, id=f"{name}/{case_id}",
                       marks=pytest.mark.xdist_group(f"ptx-{name}"))
          for name in GPU_TARGETS for case_id in ptx_figures.GUARDED_CASES]


@pytest.mark.parametrize("target,case_id", _params())
def test_default_config_ptx(target, case_id):
  why = targets.missing(target)
  if why:
    pytest.skip(why)
  case = {c.id: c for c in compile_cases.cases(target, kinds=("kernel",))}[case_id]
  fresh = ptx_figures.case_figures(target, case)
  assert fresh, f"{target}: {case_id}: no fuseopt Triton kernel in the dumped PTX"
  for key, fig in fresh.items():
    assert not fig.get("spill_stores") and not fig.get("spill_loads"), (
        f"{target}: {case_id}: {key} spills: {fig['spill_stores']} B stores, "
        f"{fig['spill_loads']} B loads ({fig['registers']} registers)")
  if UPDATE:
    ptx_figures.write(target, {case_id: fresh})
    return
  doc = ptx_figures.load(target)
  path = ptx_figures.results_path(target)
  assert doc is not None, (f"{path} is missing: record it with "
                           "FUSEOPT_COMPILED_UPDATE=1 pytest tests/compile/test_ptx_guards.py")
  base = doc["cases"].get(case_id)
  assert base is not None, (f"{target}: {case_id} is not in {path}: record it with "
                            "FUSEOPT_COMPILED_UPDATE=1 pytest tests/compile/test_ptx_guards.py")
  fails = []
  for key in sorted(set(base) | set(fresh)):
    if key not in fresh:
      fails.append(f"{key}: no longer compiled (kernels {sorted(fresh)})")
      continue
    f, notes = ptx_figures.compare(fresh[key], base.get(key))
    fails += [f"{key}: {x}" for x in f]
    for n in notes:
      print(f"{target}: {case_id}: {key}: {n}")
  if not compile_results.versions_match(doc):
    print(f"{target}: {case_id}: {path} records {doc.get('environment')}, not the installed "
          "compilers: figures not enforced" + (f" ({'; '.join(fails)})" if fails else ""))
    return
  assert not fails, (f"{target}: {case_id}: " + "; ".join(fails)
                     + " (if intended: FUSEOPT_COMPILED_UPDATE=1 pytest tests/compile/test_ptx_guards.py)")


# ---------------------------------------------------- the parser, no compiler --
_PTX = textwrap.dedent("""\
    .version 8.8
    .target sm_90a
    .address_size 64
    .visible .entry fuseopt_k(
    \t.param .u64 .ptr .align 32 fuseopt_k_param_0,
    \t.param .u64 .ptr .align 32 fuseopt_k_param_1,
    \t.param .u64 .ptr .align 32 fuseopt_k_param_2,
    \t.param .u64 .ptr .align 32 fuseopt_k_param_3
    )
    .reqntid 256, 1, 1
    {
    \t.reg .pred \t%p<3>;
    \t.reg .b16 \t%rs<2>;
    \t.reg .b32 \t%r<10>;
    \t.reg .b64 \t%rd<21>;
    \tld.param::entry.b64 \t%rd10, [fuseopt_k_param_0];
    \tcvta.to.global.u64 \t%rd11, %rd10;
    \tld.param::entry.b64 \t%rd12, [fuseopt_k_param_1];
    \tcvta.to.global.u64 \t%rd13, %rd12;
    \tld.param::entry.b64 \t%rd14, [fuseopt_k_param_2];
    \tcvta.to.global.u64 \t%rd15, %rd14;
    \tld.param::entry.b64 \t%rd16, [fuseopt_k_param_3];
    \tcvta.to.global.u64 \t%rd17, %rd16;
    \tmul.wide.s32 \t%rd20, %r1, 4;
    \tadd.s64 \t%rd1, %rd11, %rd20;
    \tld.global.L1::evict_last.v4.b32 { %r2, %r3, %r4, %r5 }, [ %rd1 + 0 ];
    \t@%p1 bra \t$L_else;
    \tmov.u64 \t%rd2, %rd13;
    \tbra.uni \t$L_join;
    $L_else:
    \tmov.u64 \t%rd2, %rd15;
    $L_join:
    \tadd.s64 \t%rd3, %rd2, %rd20;
    \t@%p2 ld.global.v2.b32 { %r6, %r7 }, [ %rd3 + 0 ];
    \tadd.s64 \t%rd4, %rd17, %rd20;
    \tst.global.b16 [ %rd4 + 0 ], %rs1;
    \tst.shared.v4.b32 [ %r9 + 0 ], { %r2, %r3, %r4, %r5 };
    \tbar.sync \t0;
    \tret;
    }
    """)


def test_parser_reads_widths_params_and_shared():
  (name, body), = ptx_figures.entries(_PTX).items()
  assert name == "fuseopt_k"
  acc = ptx_figures.accesses(body)
  assert [(a["op"], a["bits"], a["param"]) for a in acc] == [
      ("ld", 128, "0"), ("ld", 64, "1,2"), ("st", 16, "3")]
  fig = ptx_figures.figures(_PTX, ptxas=False)["fuseopt_k"]
  assert fig["loads"] == {"128": 1, "64": 1} and fig["stores"] == {"16": 1}
  assert fig["params"] == {"0": {"ld": [128]}, "1,2": {"ld": [64]}, "3": {"st": [16]}}
  assert fig["shared"] == {"ld": 0, "st": 1, "barriers": 1}
  assert fig["threads"] == 256


def test_compare_fails_on_narrowing_spills_and_conversions():
  base = {"params": {"2": {"ld": [128]}, "4": {"ld": [64]}}, "loads": {"128": 1, "64": 1},
          "stores": {}, "shared": {"ld": 0, "st": 0, "barriers": 0}, "registers": 32,
          "spill_stores": 0, "spill_loads": 0}
  same = dict(base)
  assert ptx_figures.compare(same, base) == ([], [])
  narrowed = dict(base, params={"2": {"ld": [64]}, "4": {"ld": [64]}})
  fails, _ = ptx_figures.compare(narrowed, base)
  assert fails == ["param 2: ld narrowed: [128] -> [64] bits"]
  wider = dict(base, params={"2": {"ld": [128]}, "4": {"ld": [128]}}, registers=48)
  fails, notes = ptx_figures.compare(wider, base)
  assert not fails and any("widened" in n for n in notes) and any("registers" in n for n in notes)
  spilled = dict(base, spill_stores=16, shared={"ld": 2, "st": 2, "barriers": 1})
  fails, _ = ptx_figures.compare(spilled, base)
  assert any("spill_stores" in f for f in fails) and any("barriers" in f for f in fails)


def test_ptxas_report_reads_registers():
  if ptx_figures.ptxas_path() is None:
    pytest.skip("ptxas (nvidia-cuda-nvcc, the 'compile' extra) is not installed")
  report = ptx_figures.ptxas_report(_PTX)
  assert set(report) == {"fuseopt_k"}
  assert report["fuseopt_k"]["registers"] > 0 and report["fuseopt_k"]["spill_stores"] == 0


# ----------------------------------------- per-element arithmetic, any size --
def _adam_ptx(target, config, n, param_dtype):
  import jax
  import jax.numpy as jnp

  from fuseopt.kernels import adam

  def fn(p, g, mu, nu):
    return adam.adam_update(p, g, mu, nu, count=3, learning_rate=1e-3, weight_decay=0.1,
                            implementation="triton", config=config)
  S = jax.ShapeDtypeStruct
  args = (S((n,), param_dtype), S((n,), param_dtype), S((n,), jnp.bfloat16),
          S((n,), jnp.bfloat16))
  (text,) = ptx_figures.ptx_of(target, fn, args, donate=(0, 2, 3)).values()
  (body,) = ptx_figures.entries(text).values()
  return body


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_per_leaf_adam_arithmetic_is_the_same_at_every_size(param_dtype):
  """The per-leaf Adam kernel (the default launch on GPU) computes each
  element with one sequence of fp32 instructions, whatever its block, its
  warps and the leaf's size (a leaf, or one of its shards): the fp32
  instruction counts of the compiled PTX are the per-element counts times
  the elements a thread holds, plus the same few scalar instructions a
  thread (the bias corrections' reciprocals), and every multiply and add is rounded as
  written (``.rn``: ptxas contracts none into an FMA). This is what makes a
  sharded step bitwise the unsharded one on the GPU, which the CPU's
  interpret mode cannot show for fp32 parameters (tests/sharding/test_elementwise.py)."""
  from fuseopt.kernels.adam import TritonConfig
  if targets.missing("h200"):
    pytest.skip(targets.missing("h200"))
  import jax.numpy as jnp
  dtype = jnp.dtype(param_dtype)
  # (block, warps, leaf size): elements a thread = block / (32 warps)
  runs = [(256, 8, 1 << 16), (1024, 8, 1 << 16), (1024, 8, (1 << 13) + 3), (2048, 8, 1 << 16),
          (1024, 4, 1 << 16)]
  # A thread's count of each instruction is (elements it holds) x (the
  # per-element count) + (its scalar work: the bias corrections' reciprocals,
  # computed once a thread): read both off the runs of 1 and 4 elements a
  # thread, then every run must be that line.
  counts = {(block, warps, n): ptx_figures.float_ops(_adam_ptx("h200", TritonConfig(block, warps),
                                                                n, dtype))
            for block, warps, n in runs}
  one, four = counts[runs[0]], counts[runs[1]]
  assert set(one) == set(four), (one, four)
  assert all((four[k] - one[k]) % 3 == 0 for k in one), (one, four)
  per_element = {k: (four[k] - one[k]) // 3 for k in one}
  scalar = {k: one[k] - per_element[k] for k in one}
  assert per_element.get("div.full.f32") and per_element.get("sqrt.approx.f32"), per_element
  assert all(v <= 2 for v in scalar.values()), f"scalar work a thread: {scalar}"
  for (block, warps, n), ops in counts.items():
    per_thread = block // (32 * warps)
    want = {k: per_thread * per_element[k] + scalar[k] for k in per_element}
    assert ops == want, f"block/warps/size {(block, warps, n)}: {ops} != {want}"
  first = per_element
  contractible = [k for k in first if k.split(".")[0] in ("mul", "add", "sub")
                  and ".rn." not in k]
  assert not contractible, f"multiplies or adds without .rn (an assembler may fuse them): {contractible}"
