"""What each storage mode keeps: parameters + optimizer state a parameter, the
compiled fused step's temporaries and traffic, and the largest model whose
training state fits one chip.

A mode is one optimizer call (:data:`MODES`); its state bytes come from
``jax.eval_shape(tx.init, tree)`` on the 1.2 B tree
(:func:`fuseopt.benchmarks.workloads.llama_tree`) and the 8.8 B tree
(:func:`fuseopt.benchmarks.scale.tree`), exact and free (nothing is
allocated). Its fused step on the 1.2 B tree is a compile case
(``step/memory/<mode>/llama1.2b``, :func:`step_cases`): the compile tier
records its temporaries and its argument and output bytes for each target.
:func:`markdown` joins them into docs/adam.md's memory table (rendered by
``fuseopt report``).

The largest model per chip divides the chip's memory by the bytes a parameter
of **training state**: parameters, gradients (in the parameters' dtype) and
optimizer state, on the 8.8 B tree's proportions. Activations, the compiled
step's temporaries and the runtime's reserve are left out: the figure is an
upper bound, for comparing modes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp

F32, BF16 = jnp.float32, jnp.bfloat16
LR = 1e-3
WD = 0.1
MEMORY_START = "<!-- memory-table:start -->"
MEMORY_END = "<!-- memory-table:end -->"

# Chip memory in bytes (docs/adam.md, "Memory by mode", gives the sources).
CHIPS = {"H200": 141e9, "v5e": 16e9}
# The compile targets whose fused-step figures the table shows.
STEP_TARGETS = ("h200", "v6e")


@dataclasses.dataclass(frozen=True)
class Mode:
  """One storage mode: ``make()`` builds its transformation, whose parameters
  are ``params`` (a dtype); ``call`` is the call a user writes."""
  key: str
  family: str
  stores: str
  call: str
  make: Callable[[Any], Any]   # muon dimension numbers (or None) -> tx
  params: Any = F32


def _adamw(**kw):
  import fuseopt.optim as fo
  return lambda dims: fo.adamw(LR, weight_decay=WD, **kw)


def _optax_adamw(dims):
  import optax
  return optax.adamw(LR, weight_decay=WD)


def _muon(master_bits=None, **kw):
  def make(dims):
    import fuseopt.optim as fo
    tx = fo.muon(0.02, weight_decay=WD, muon_weight_dimension_numbers=dims, **kw)
    return tx if master_bits is None else fo.track_mantissa(tx, master_bits=master_bits)
  return make


def _tracked(master_bits, **kw):
  def make(dims):
    import fuseopt.optim as fo
    return fo.track_mantissa(fo.adamw(LR, weight_decay=WD, **kw), master_bits=master_bits)
  return make


MODES = (
    Mode("optax_adamw", "AdamW", "p fp32, m and v fp32", "optax.adamw(lr)", _optax_adamw),
    Mode("adamw", "AdamW", "p fp32, m and v bf16 (the default)", "fo.adamw(lr)", _adamw()),
    Mode("adamw_int8", "AdamW", "p fp32, m and v 8-bit", 'fo.adamw(lr, moment_dtype="int8")',
         _adamw(moment_dtype="int8")),
    Mode("adamw_int4", "AdamW", "p fp32, m and v 4-bit", 'fo.adamw(lr, moment_dtype="int4")',
         _adamw(moment_dtype="int4")),
    Mode("adamw_master24_int8", "AdamW", "p bf16 + 24-bit master, m and v 8-bit (goal A)",
         'fo.track_mantissa(fo.adamw(lr, moment_dtype="int8"), master_bits=24)',
         _tracked(24, moment_dtype="int8"), BF16),
    Mode("adamw_master24_int4", "AdamW", "p bf16 + 24-bit master, m and v 4-bit (goal B)",
         'fo.track_mantissa(fo.adamw(lr, moment_dtype="int4"), master_bits=24)',
         _tracked(24, moment_dtype="int4"), BF16),
    Mode("muon", "Muon", "p fp32, momentum fp32; AdamW side bf16 (the default)", "fo.muon(lr)",
         _muon()),
    Mode("muon_int8", "Muon", "p fp32, momentum 8-bit; AdamW side 8-bit",
         'fo.muon(lr, mu_dtype="int8", moment_dtype="int8")',
         _muon(mu_dtype="int8", moment_dtype="int8")),
    Mode("muon_master24_int8", "Muon",
         "p bf16 + 24-bit master, momentum 8-bit; AdamW side 4-bit (goal C)",
         'fo.track_mantissa(fo.muon(lr, mu_dtype="int8", moment_dtype="int4"), master_bits=24)',
         _muon(24, mu_dtype="int8", moment_dtype="int4"), BF16),
    Mode("muon_bf16_int8", "Muon",
         "p bf16 (stochastically rounded), momentum 8-bit; AdamW side 4-bit (goal C')",
         'fo.muon(lr, mu_dtype="int8", moment_dtype="int4")',
         _muon(mu_dtype="int8", moment_dtype="int4"), BF16),
)
BY_KEY = {m.key: m for m in MODES}


def _nbytes(tree) -> int:
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def trees() -> dict[str, tuple[Any, Callable]]:
  """name -> (abstract fp32 tree, its Muon dimension numbers)."""
  from fuseopt.benchmarks import scale, workloads
  from fuseopt.benchmarks.cases import muon as muon_cases
  return {"1.2B": (workloads.llama_tree(F32), muon_cases.muon_dims),
          "8.8B": (scale.tree("llama8.8b"), muon_cases.muon_dims)}


def _quiet(fn, *args):
  import warnings
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")   # leaves without quantisation blocks keep bf16
    return fn(*args)


@functools.lru_cache(maxsize=None)
def figures(mode_key: str, tree_name: str) -> dict:
  """Bytes a parameter of ``mode``'s parameters and state on a tree."""
  mode = BY_KEY[mode_key]
  tree, dims = trees()[tree_name]
  params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, mode.params), tree)
  state = _quiet(jax.eval_shape, mode.make(dims).init, params)
  n = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
  p, s = _nbytes(params) / n, _nbytes(state) / n
  return {"params": n, "param_bytes": p, "state_bytes": s, "stored": p + s,
          # training state: parameters, gradients in their dtype, optimizer state
          "training": 2 * p + s}


def largest_model(mode_key: str, chip: str) -> float:
  """Parameters whose training state fits ``chip`` (8.8 B tree's proportions)."""
  return CHIPS[chip] / figures(mode_key, "8.8B")["training"]


def step_cases():
  """The fused step of each mode on the 1.2 B tree, for the compile tier
  (the full sweep; :data:`STEP_TARGETS` recorded)."""
  from fuseopt.benchmarks import compile_steps, workloads
  from fuseopt.benchmarks.cases import muon as muon_cases
  from fuseopt.benchmarks.compile_harness import Case
  out = []
  for mode in MODES:
    if mode.key == "optax_adamw":
      continue   # optax's step is compiled by the other step cases

    def build(t, mode=mode):
      tx = mode.make(muon_cases.muon_dims)
      tree = workloads.llama_tree(mode.params)
      state = _quiet(jax.eval_shape, tx.init, tree)
      return compile_steps.step_fn(tx, True), (tree, state, tree), (0, 1)
    out.append(Case(f"step/memory/{mode.key}/llama1.2b", build, kind="step", ci_targets=(),
                    full_only=True, on_targets=STEP_TARGETS))
  return out


def _compiled(root: Path) -> dict[str, dict]:
  """target -> the step cases' figures the compile tier recorded under
  ``root`` for this jax release."""
  from fuseopt.benchmarks import compile_results
  out = {}
  for target in STEP_TARGETS:
    path = compile_results.results_path(target, root)
    if path.exists():
      out[target] = json.loads(path.read_text())["cases"]
  return out


def _gb(x: float) -> str:
  return f"{x / 1e9:.1f} B"


def markdown(results: Path | str = Path("bench/results/compiled")) -> str:
  """The memory table: a row a mode."""
  compiled = _compiled(Path(results))
  n12 = figures("adamw", "1.2B")["params"]
  head = ["family", "stores", "call", "B/param p + state, 1.2 B", "8.8 B"]
  head += [f"step temp / moved B/param ({t})" for t in STEP_TARGETS]
  head += [f"largest model, {c}" for c in CHIPS]
  rows = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] * 3 + ["---:"] * (
      len(head) - 3)) + " |"]
  for mode in MODES:
    cells = [mode.family, mode.stores, f"`{mode.call}`"]
    cells += [f"{figures(mode.key, t)['stored']:.2f}" for t in ("1.2B", "8.8B")]
    for target in STEP_TARGETS:
      r = compiled.get(target, {}).get(f"step/memory/{mode.key}/llama1.2b")
      if r is None:
        cells.append("-")
        continue
      moved = (r["argument_bytes"] + r["output_bytes"]) / n12
      cells.append(f"{r['temp_bytes']:,} B / {moved:.2f}")
    cells += [_gb(largest_model(mode.key, chip)) for chip in CHIPS]
    rows.append("| " + " | ".join(cells) + " |")
  return "\n".join(rows) + "\n"


def render(page: Path | str = "docs/adam.md",
           results: Path | str = Path("bench/results/compiled")) -> bool | None:
  """Rewrites the table between the memory-table markers of ``page``."""
  from fuseopt.benchmarks import compiled
  return compiled.render_between(page, MEMORY_START, MEMORY_END, markdown(results))
