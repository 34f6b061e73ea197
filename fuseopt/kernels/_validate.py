"""Checks of the scalar arguments of fuseopt's public ops.

A scalar may be a Python number, a NumPy scalar or a jax array of shape
``()``. Concrete values (anything but a tracer) are checked, whatever their
type, so an array-valued hyperparameter cannot slip past a check written for
Python floats; a traced value (inside ``jit``, ``vmap`` or
``optax.inject_hyperparams``' update) cannot be inspected and is used as it
is. Every error names the op and the argument.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def concrete_float(value: Any) -> float | None:
  """``value`` as a Python float if it is a concrete real scalar; None if it
  is traced (or not a real scalar at all: the caller's type check decides)."""
  if isinstance(value, jax.core.Tracer):
    return None
  if isinstance(value, (bool, np.bool_)):
    return None
  if isinstance(value, numbers.Real):
    return float(value)
  try:
    arr = np.asarray(value)
  except Exception:  # an object numpy cannot read: not ours to judge here
    return None
  # jnp.issubdtype knows ml_dtypes' floats (a bf16 scalar from
  # optax.inject_hyperparams(..., hyperparam_dtype=bf16)); np.issubdtype does not.
  if arr.shape != () or not (jnp.issubdtype(arr.dtype, jnp.floating)
                             or jnp.issubdtype(arr.dtype, jnp.integer)):
    return None
  return float(arr)


def check_real(owner: str, name: str, value: Any, *, lo: float | None = None,
               hi: float | None = None, lo_open: bool = False, hi_open: bool = False) -> None:
  """Raises ``ValueError`` unless a concrete ``value`` is finite and in the range.

  ``lo``/``hi`` bound the range (None: unbounded); ``lo_open``/``hi_open``
  exclude the bound itself. Non-finite values (NaN, +-Inf) always fail: a NaN
  compares False with everything, so ``v < 0`` alone would let it through.
  """
  v = concrete_float(value)
  if v is None:
    return
  lo_s = "" if lo is None else (f"> {lo}" if lo_open else f">= {lo}")
  hi_s = "" if hi is None else (f"< {hi}" if hi_open else f"<= {hi}")
  expected = " and ".join(s for s in (lo_s, hi_s) if s) or "any value"
  ok = math.isfinite(v)
  if ok and lo is not None:
    ok = v > lo if lo_open else v >= lo
  if ok and hi is not None:
    ok = v < hi if hi_open else v <= hi
  if not ok:
    raise ValueError(f"{owner}: {name} must be a finite number ({expected}), got {value!r}")
