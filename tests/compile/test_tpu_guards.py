"""Deviceless guards of the TPU kernels' speed: what makes a Mosaic kernel slow
on a chip, seen without one.

- **Bytes accessed against the byte model.** A fused AdamW step compiled for a
  v5e by libtpu moves the bytes its format needs and no more (XLA's
  ``cost_analysis``: each Pallas kernel by its declared cost, every other op
  by its own traffic): left free, libtpu copies or slices a kernel's whole
  operands into on-chip memory ahead of it, an extra pass that cost the
  default step 30 % of its bytes (docs/kernels.md, "TPU: operands in HBM").
- **No copy of an operand around a kernel**: no top-level ``copy``,
  ``copy-start``, ``slice-start`` or ``transpose`` of 4 MiB or more in the
  step's optimised HLO (a relayout or a prefetch is a full pass). Smaller
  ones remain: the 4-bit scales of the vocabulary-wide head, (2048, 250)
  fp32, which libtpu lays out row-major (its minor axis is past 128 lanes),
  are transposed into and out of the kernel, 2 MiB each way, under 1 % of
  that leaf's traffic.
- **Block shape, VMEM and grid steps** of every Mosaic elementwise kernel on
  the Llama tree's leaves: blocks of at least 32 Ki elements (a grid step has
  a fixed cost), their double-buffered footprint inside the limit the kernel
  asks for, and at most one grid step per 32 Ki elements of a leaf.

- **Vector bundles an element** of each gated kernel's innermost loop, read
  from libtpu's own scheduled LLO (:mod:`fuseopt.benchmarks.llo_figures`):
  the cycles its arithmetic takes an element, held to
  ``bench/results/compiled/jax-<release>/llo-v5e.json`` (more bundles, or a
  spill in the loop, fails; ``FUSEOPT_COMPILED_UPDATE=1`` records). The
  fp32 AdamW step with bf16 moments and stochastic rounding must stay
  bound by HBM, not by their vector work. Exact for one libtpu: a file
  written by another is reported against, not enforced.

The compile tests need libtpu (the ``compile`` extra) and skip without it;
the tiling checks run everywhere.
"""

import math
import os
import re

import jax
import jax.numpy as jnp
import pytest

import fuseopt.optim as fo
from fuseopt import targets
from fuseopt.benchmarks import compile_harness, llo_figures, workloads
from fuseopt.kernels import elementwise_tiling
from fuseopt.kernels.adam import mosaic_tpu as adam_tpu

TREE = dict(d=2048, ff=8192, layers=1, vocab=32000)
MIN_BLOCK = 32 * 1024

# Bytes a parameter of the fused step moves (read + written), by format:
# p, g in; p out; each moment in and out; 8-bit: fp32 scales a 256-block,
# 4-bit: a 128-block (docs/adam.md, "Memory").
BYTE_MODEL = {
    ("bfloat16", "float32"): 4 + 4 + 4 + 2 * (2 + 2),
    ("bfloat16", "bfloat16"): 2 + 2 + 2 + 2 * (2 + 2),
    ("int8", "float32"): 4 + 4 + 4 + 2 * (1 + 1) + 4 * 4 / 256,
    ("int4", "float32"): 4 + 4 + 4 + 2 * (0.5 + 0.5) + 4 * 4 / 128,
}
_COPIES = re.compile(r"^\s*(?:ROOT )?\S+ = (\S+) (copy|copy-start|slice-start|transpose)\(", re.M)


def _compiled_step(moment_dtype, p_dtype):
  t = targets.get("v5e")
  with targets.lowering_for(t, None):
    params = workloads.llama_tree(p_dtype, abstract=True, **TREE)
    tx = fo.adamw(1e-3, weight_decay=0.1, moment_dtype=moment_dtype)
    args = compile_harness._placed(t, (params, jax.eval_shape(tx.init, params), params))
    lowered = jax.jit(lambda p, s, g: fo.step(tx, g, s, p), donate_argnums=(0, 1)).trace(
        *args).lower(lowering_platforms=(t.lowering_platform,))
  return params, lowered.compile()


def _element_bytes(shape_text: str) -> int:
  """Bytes of an HLO array type such as ``f32[2048,2048]{1,0:T(8,128)}``."""
  m = re.match(r"\(?(\w+)\[([\d,]*)\]", shape_text)
  if not m:
    return 0
  dims = [int(d) for d in m.group(2).split(",") if d]
  return math.prod(dims) * max(1, int(re.sub(r"\D", "", m.group(1)) or 8) // 8)


@pytest.mark.parametrize("moment_dtype,p_dtype", list(BYTE_MODEL),
                         ids=[f"{m}-p{jnp.dtype(p).name}" for m, p in BYTE_MODEL])
def test_fused_step_moves_the_byte_model(moment_dtype, p_dtype):
  why = targets.missing("v5e")
  if why:
    pytest.skip(why)
  params, compiled = _compiled_step(moment_dtype, jnp.dtype(p_dtype))
  n = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  per_param = cost["bytes accessed"] / n
  # (the 1-D norms, which keep bf16 moments under the blockwise formats, and
  # the step's scalars are the slack)
  assert per_param == pytest.approx(BYTE_MODEL[moment_dtype, p_dtype], rel=0.01), per_param
  entry = compiled.as_text()
  entry = entry[entry.index("ENTRY"):]
  big = [m.group(0).strip()[:160] for m in _COPIES.finditer(entry)
         if _element_bytes(m.group(1)) >= 4 << 20]
  assert not big, f"copies of leaf-sized arrays around the kernels: {big}"


def _leaves():
  return jax.tree.leaves(workloads.llama_tree(jnp.float32, abstract=True, **TREE))


@pytest.mark.parametrize("p_dtype,m_dtype", [(jnp.float32, jnp.bfloat16),
                                             (jnp.bfloat16, jnp.bfloat16)])
def test_adam_kernel_blocks_fill_vmem_budget(p_dtype, m_dtype):
  config = adam_tpu.heuristic(0)
  for leaf in _leaves():
    p = jax.ShapeDtypeStruct(leaf.shape, p_dtype)
    mu = jax.ShapeDtypeStruct(leaf.shape, m_dtype)
    tiling = adam_tpu.tiling_of(p, p, mu, mu, p_dtype, config)
    assert tiling is not None, leaf.shape
    block = math.prod(b or 1 for b in tiling.block)
    size = math.prod(leaf.shape)
    assert block >= min(MIN_BLOCK, size), (leaf.shape, tiling)
    assert math.prod(tiling.grid) <= max(1, size // MIN_BLOCK), (leaf.shape, tiling)
    vmem = tiling.vmem_bytes(adam_tpu.stream_bytes_of(p, p, mu, mu, p_dtype))
    assert vmem <= elementwise_tiling.MOSAIC_VMEM_BYTES
    assert elementwise_tiling.mosaic_vmem_limit(vmem) >= vmem


@pytest.mark.parametrize("layout", ["int8", "int4"])
def test_blockwise_kernel_grid_is_bounded(layout):
  """The blockwise kernels' steps hold whole row groups, at most
  ``_GROUPS`` a step (the kernel body's loop), and at least 32 Ki elements
  where the leaf has them."""
  config = adam_tpu.heuristic(0)
  for leaf in _leaves():
    view = adam_tpu.quantized_view(leaf.shape)
    tiling = adam_tpu.quantized_tiling(view, config, layout)
    assert tiling is not None, leaf.shape
    size = math.prod(leaf.shape)
    assert tiling.groups <= 2 * adam_tpu._GROUPS
    assert tiling.rows * tiling.groups * 256 >= min(MIN_BLOCK, size), (leaf.shape, tiling)
    assert math.prod(tiling.grid) <= max(1, size // MIN_BLOCK), (leaf.shape, tiling)


# Kernels whose vector work must stay within their bytes' HBM time.
HBM_BOUND = ("kernel/stochastic_round/mosaic_tpu/2048x8192/heuristic",
             "kernel/adam_update/mosaic_tpu/pf32-gf32-mbf16/heuristic")


@pytest.mark.xdist_group("llo-v5e")
def test_kernel_bundles_an_element():
  why = targets.missing("v5e")
  if why:
    pytest.skip(why)
  fresh = llo_figures.case_figures("v5e")
  if os.environ.get("FUSEOPT_COMPILED_UPDATE") == "1":
    llo_figures.write("v5e", fresh)
    return
  for case_id in HBM_BOUND:
    for name, fig in fresh[case_id].items():
      assert fig["bound"] == "hbm", (
          f"{case_id}: {name}: {fig['bundles_per_1024']} bundles per 1024 elements, more than "
          f"the {fig['hbm_cycles_per_1024']} cycles their bytes take at the spec bandwidth")
  doc = llo_figures.load("v5e")
  path = llo_figures.results_path("v5e")
  assert doc is not None, (f"{path} is missing: record it with FUSEOPT_COMPILED_UPDATE=1 "
                           "pytest tests/compile/test_tpu_guards.py -k bundles")
  exact = doc["environment"] == llo_figures.environment()
  fails, notes = [], []
  for case_id, kernels in fresh.items():
    base = doc["cases"].get(case_id, {})
    for name, fig in kernels.items():
      f, n = llo_figures.compare(fig, base.get(name))
      fails += [f"{case_id}: {name}: {x}" for x in f]
      notes += [f"{case_id}: {name}: {x}" for x in n]
  if notes:
    print("\n".join(notes))
  if exact:
    assert not fails, "\n".join(fails)
  elif fails:
    pytest.skip(f"{path} was written by other compilers; against it: " + "; ".join(fails))


_BUNDLES = """\
     0   :  { %s1 = inlined_call_operand.hbm [shape: f32[8,128]] }
   0x1 LB: > { %s2 = sphi %s1, %s9 } /* Start region 7 :: Start region 8 */
   0x2   : > { %v3 = vld [vmem:[%s2] sm:$0xff] }
   0x3 LB: >> { %v4 = vmul.f32 %v3, %v3  ;;  %v5 = vadd.f32 %v4, %v3 } /* Start region 12 */
   0x4   : >> { %30 = vst [vmem:[#allocation5_spill] sm:$0xff] /*vst_source=*/%v5  ;;  %v6 = vsel %vm1, %v5, %v4 }
   0x5   : >> { %31 = sbr.rel (%p1) target = $region44 }
   0x6   : >> { %v7 = vld [vmem:[#allocation5_spill] sm:$0xff]  ;;  %32 = sbr.rel (!%p2) target = $region12 }
   0x7   : > { %33 = sbr.rel (!%p3) target = $region8 }
   0x8   :  { %34 = vsyncpa [#allocation6], 1 }
"""


def test_llo_innermost_loop_and_its_figures():
  """The innermost loop runs from its ``LB:`` bundle to the branch back to
  a region it starts (a forward branch inside it is not its end); its
  bundles per 1024 elements set the bound."""
  lines = llo_figures.bundles(_BUNDLES)
  assert len(lines) == 9
  loops = llo_figures.innermost_loops(lines)
  assert [len(loop) for loop in loops] == [4]
  fig = llo_figures.figures(_BUNDLES, elements=256, bytes_per_element=6,
                            bytes_per_cycle=546.0)
  assert fig["loop"]["bundles"] == 4 and fig["loop"]["spills"] == 2
  assert fig["loop"]["top_ops"] == {"vmul.f32": 1, "vadd.f32": 1, "vst": 1, "vsel": 1, "vld": 1}
  assert fig["bundles_per_1024"] == 16.0 and fig["bound"] == "vector"
  assert fig["floor_share_at_most"] == pytest.approx(6 * 1024 / 546 / 16, abs=1e-3)
  base = dict(fig, bundles_per_1024=15.0)
  fails, _ = llo_figures.compare(fig, base)
  assert fails and "grew" in fails[0]
  assert llo_figures.compare(fig, dict(fig, bundles_per_1024=15.9))[0] == []
