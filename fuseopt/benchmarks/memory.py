"""What each storage mode keeps: parameters + optimizer state a parameter, the
compiled fused step's temporaries and traffic, and the largest model whose
training state fits one chip.

A mode is one optimizer call (:data:`MODES`); its state bytes come from
``jax.eval_shape(tx.init, tree)`` on the 1.2 B tree
(:func:`fuseopt.benchmarks.workloads.llama_tree`) and the 8.8 B tree
(:func:`fuseopt.benchmarks.scale.tree`), exact and free (nothing is
allocated). Its fused step on the 1.2 B tree is a compile case
(``step/memory/<mode>/llama1.2b``, ``compile_cases.memory_step_cases``): the
compile tier records its temporaries and its argument and output bytes for
each target. :mod:`fuseopt.benchmarks.memory_report` joins them into
docs/adam.md's memory table (rendered by ``fuseopt report``).

The largest model per chip divides the chip's memory by the bytes a parameter
of **training state**: parameters, gradients (in the parameters' dtype) and
optimizer state, on the 8.8 B tree's proportions. Activations, the compiled
step's temporaries and the runtime's reserve are left out: the figure is an
upper bound, for comparing modes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

F32, BF16 = jnp.float32, jnp.bfloat16
LR = 1e-3
WD = 0.1
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


def quiet(fn, *args):
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
  state = quiet(jax.eval_shape, mode.make(dims).init, params)
  n = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
  p, s = _nbytes(params) / n, _nbytes(state) / n
  return {"params": n, "param_bytes": p, "state_bytes": s, "stored": p + s,
          # training state: parameters, gradients in their dtype, optimizer state
          "training": 2 * p + s}


def largest_model(mode_key: str, chip: str) -> float:
  """Parameters whose training state fits ``chip`` (8.8 B tree's proportions)."""
  return CHIPS[chip] / figures(mode_key, "8.8B")["training"]
