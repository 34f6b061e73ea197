"""Argument checks shared by fuseopt's transforms: errors name the parameter
and what was expected.

A value is checked when it is concrete: a Python number, a NumPy scalar or a
jax array of shape ``()`` outside any trace (so an array-valued
hyperparameter cannot bypass a check written for Python floats). Traced
values (inside ``jit``, or ``optax.inject_hyperparams``' update) and
schedules are not checked here (a schedule's own record validates its fields,
see :mod:`fuseopt.optim.schedules`)."""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from fuseopt.kernels._validate import concrete_float
from fuseopt.kernels.adam import int4
from fuseopt.kernels.adam import quantized


class StaticDefault:
  """A default that :func:`optax.inject_hyperparams` leaves static.

  inject_hyperparams binds the defaults along with the given arguments and
  turns every int, float or array among them into a traced array of its
  state, so under ``jit`` an ``int`` default that sizes a kernel (Muon's
  ``ns_steps``) arrives as a tracer whose value nothing can read. This holder
  is none of those types (nor a callable, which would be taken for a
  schedule), so the value reaches the factory as it is; it prints, compares
  and hashes as the value it holds, so signatures and docs still read
  ``ns_steps=5``."""

  __slots__ = ("value",)

  def __init__(self, value):
    self.value = value

  def __repr__(self):
    return repr(self.value)

  def __eq__(self, other):
    return self.value == static_value(other)

  def __hash__(self):
    return hash(self.value)

  def __index__(self):
    return operator.index(self.value)

  def __int__(self):
    return int(self.value)


def static_value(value):
  """``value``, or the value a :class:`StaticDefault` holds."""
  return value.value if isinstance(value, StaticDefault) else value


def passes_through(x) -> bool:
  """Whether a parameter (or state) leaf is one the optimizers leave alone:
  an integer or bool leaf (a step counter, a token table kept among the
  params). It gets a zero update in its own dtype and its state keeps
  ``init``'s dtypes, step after step, in ``update`` and in the fused step
  alike (optax's Adam would turn its ``mu`` into float32 and decay the
  integers)."""
  return not jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def number(owner: str, name: str, value, *, schedule: bool = False,
           optional: bool = False) -> float | None:
  """The concrete float to check in ``value``, or None when there is nothing
  to check (a traced value; a schedule where ``schedule``; None where
  ``optional``).

  Raises a ``TypeError`` naming the argument for anything that is not a
  real scalar: a bool (``b2=True`` would be taken as 1), a string
  (``b2='0.5'`` used to fail at the first update, without the name), an
  array that is not a scalar, a callable where no schedule is taken.
  """
  if isinstance(value, jax.core.Tracer):
    return None
  if value is None and optional:
    return None
  what = "a number" + (" or a schedule" if schedule else "") + (" or None" if optional else "")
  if callable(value):
    if schedule:
      return None
    raise TypeError(f"{owner}: {name} must be {what}, got the callable {value!r}")
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{owner}: {name} must be {what}, got the bool {value!r}")
  v = concrete_float(value)
  if v is None:
    raise TypeError(f"{owner}: {name} must be {what}, got {value!r}")
  return v


def check_rate(owner: str, name: str, value, *, optional: bool = False) -> None:
  """A learning rate or weight decay: a finite number >= 0, or a schedule."""
  v = number(owner, name, value, schedule=True, optional=optional)
  if v is not None and (not math.isfinite(v) or v < 0):
    raise ValueError(f"{owner}: {name} must be a finite number >= 0 or a schedule, got {value!r}")


def check_decay(owner: str, name: str, value) -> None:
  """A moment decay (b1, b2, beta): in [0, 1)."""
  v = number(owner, name, value)
  if v is not None and not 0.0 <= v < 1.0:
    raise ValueError(f"{owner}: {name} must be in [0, 1), got {value!r}")


def check_nonnegative(owner: str, name: str, value) -> None:
  """An epsilon: a finite number >= 0."""
  v = number(owner, name, value)
  if v is not None and not (math.isfinite(v) and v >= 0.0):
    raise ValueError(f"{owner}: {name} must be >= 0 and finite, got {value!r}")


def check_positive(owner: str, name: str, value, *, optional: bool = False) -> None:
  """A scale such as Muon's ``consistent_rms``: a finite number > 0 (a
  negative one flips the update's sign, zero makes it vanish)."""
  v = number(owner, name, value, optional=optional)
  if v is not None and not (math.isfinite(v) and v > 0.0):
    raise ValueError(f"{owner}: {name} must be a finite number > 0, got {value!r}")


def check_dtype(owner: str, name: str, value, allowed, *, optional: bool = True):
  """``value`` as a dtype among ``allowed`` (a dtype, its name or its
  scalar type), or None where ``optional``."""
  if value is None and optional:
    return None
  names = ", ".join(jnp.dtype(d).name for d in allowed) + (" or None" if optional else "")
  try:
    dtype = jnp.dtype(value)
  except TypeError:
    raise TypeError(f"{owner}: {name} must be a dtype ({names}), got {value!r}") from None
  if dtype not in tuple(jnp.dtype(d) for d in allowed):
    raise ValueError(f"{owner}: {name} must be {names}, got {dtype}")
  return dtype


# The names that ask for blockwise moments: 8-bit (fuseopt.kernels.adam.quantized)
# and 4-bit (fuseopt.kernels.adam.int4).
INT8 = quantized.MOMENT_DTYPE_NAME
INT4 = int4.MOMENT_DTYPE_NAME
BLOCKWISE = (INT8, INT4)
# Every moment format the Adam kernel stores, as the messages list them.
_MOMENT_FORMATS = (f"float32, bfloat16, {INT8!r} (8-bit codes, a scale per block of "
                   f"{quantized.BLOCK}), {INT4!r} (4-bit codes, a scale per block of "
                   f"{int4.BLOCK}) or None")


def moment_format(owner: str, name: str, value):
  """``value`` as an Adam moment format: ``jnp.dtype(float32)``,
  ``jnp.dtype(bfloat16)`` (given as a dtype, its name or its scalar type),
  :data:`INT8` (the name, or ``jnp.int8``), :data:`INT4` (the name, or
  ``jnp.int4``) or None (optax's dtypes).

  The one reading of ``moment_dtype``, where it enters
  (:func:`~fuseopt.optim.adam`, :func:`~fuseopt.optim.adamw`,
  :func:`~fuseopt.optim.scale_by_adam`, the Muon family,
  :func:`~fuseopt.optim.convert_moments`), so that every caller accepts the
  same values and every refusal lists all five.
  A ``TypeError`` for what is no dtype (``8``, ``"INT8"``), a ``ValueError``
  for a dtype the kernel has no format for (``uint8``, ``float16``)."""
  if value is None:
    return None
  hint = ""
  if isinstance(value, str) and value != value.lower() and value.lower() in (
      "float32", "bfloat16", INT8, INT4):
    hint = f" (did you mean {value.lower()!r}?)"
  try:
    dtype = jnp.dtype(value)
  except TypeError:
    raise TypeError(f"{owner}: {name} must be a dtype ({_MOMENT_FORMATS}), got "
                    f"{value!r}{hint}") from None
  if dtype == jnp.int8:
    return INT8
  if dtype == jnp.int4:
    return INT4
  if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
    raise ValueError(f"{owner}: {name} must be {_MOMENT_FORMATS}, got {dtype}")
  return dtype


def check_mu_dtype(owner: str, value):
  """optax's ``mu_dtype`` (the first moment's dtype alone): a floating dtype
  (or a complex one, for complex parameters: optax's own tests pass
  ``mu_dtype="complex64"``) or None, returned as given. An integer or bool
  ``mu_dtype`` stored the momentum as a plain cast, which rounds gradients of
  1e-3 to 0: the optimizer ran on without momentum, not a word said (optax
  does the same cast). A user after 8-bit moments is pointed at the format
  that keeps them with block scales."""
  if value is None:
    return None
  what = ("a floating dtype (e.g. float32 or bfloat16; complex for complex parameters: a dtype, "
          "its name or its scalar type) or None")
  int8 = (f"; for 8-bit or 4-bit moments pass moment_dtype={INT8!r} or {INT4!r} (adam, adamw, "
          f"scale_by_adam, and "
          f"the AdamW side of muon, normuon, muonclip; Muon's momentum: mu_dtype={INT8!r} of "
          f"muon, normuon, muonclip, scale_by_muon)")
  try:
    dtype = jnp.dtype(value)
  except TypeError:
    raise TypeError(f"{owner}: mu_dtype must be {what}, got {value!r}{int8}") from None
  if not jnp.issubdtype(dtype, jnp.inexact):
    raise ValueError(f"{owner}: mu_dtype must be {what}, got {dtype} (a plain {dtype} cast of "
                     f"the momentum rounds small gradients to 0){int8}")
  return value


def canonical_mu_dtype(owner: str, value):
  """``mu_dtype`` as optax reads it: :func:`check_mu_dtype`'s floating dtype,
  canonical for the x64 setting (``float64`` is ``float32`` without x64), or
  None. The one reading of optax's ``mu_dtype``, for Adam's moments and
  Muon's momentum alike."""
  dtype = check_mu_dtype(owner, value)
  return None if dtype is None else jax.dtypes.canonicalize_dtype(dtype)


# Every format of Muon's momentum, as the messages list them.
_MUON_MU_FORMATS = (f"a floating dtype (e.g. float32 or bfloat16: a dtype, its name or its scalar "
                    f"type), {INT8!r} (8-bit codes, a scale per block of {quantized.BLOCK}) or None")


def muon_mu_dtype(owner: str, value, name: str = "mu_dtype"):
  """Muon's ``mu_dtype`` (the momentum's format): :data:`INT8` (the name, or
  ``jnp.int8``: blockwise 8-bit, :mod:`fuseopt.kernels.adam.quantized`'s
  ``mu``), else :func:`canonical_mu_dtype`'s floating dtype or None. Any other
  integer or bool dtype is refused with every accepted value listed, naming
  the argument ``name`` (:func:`~fuseopt.optim.convert_moments` reads its
  ``momentum_dtype`` here)."""
  if value is None:
    return None
  try:
    dtype = jnp.dtype(value)
  except TypeError:
    raise TypeError(f"{owner}: {name} must be {_MUON_MU_FORMATS}, got {value!r}") from None
  if dtype == jnp.int8:
    return INT8
  if not jnp.issubdtype(dtype, jnp.inexact):
    raise ValueError(f"{owner}: {name} must be {_MUON_MU_FORMATS}, got {dtype} (a plain "
                     f"{dtype} cast of the momentum rounds small gradients to 0)")
  return jax.dtypes.canonicalize_dtype(dtype)


def check_state(owner: str, tx, state, params) -> None:
  """Raises a ``ValueError`` naming the first difference between ``state``
  and what ``tx.init(params)`` builds (its tree structure, then each leaf's
  shape and dtype). Costs one abstract trace of ``tx.init``, no computation."""
  try:
    expected = jax.eval_shape(tx.init, params)
  except Exception:  # noqa: BLE001 - init cannot be traced here (e.g. a traced mask):
    return           # the update itself reports its own, more precise error

  got_paths, got_def = jax.tree_util.tree_flatten_with_path(state)
  want_paths, want_def = jax.tree_util.tree_flatten_with_path(expected)
  if got_def != want_def:
    got = {jax.tree_util.keystr(k) for k, _ in got_paths}
    want = {jax.tree_util.keystr(k) for k, _ in want_paths}
    missing, extra = sorted(want - got)[:3], sorted(got - want)[:3]
    detail = "; ".join(s for s in (f"missing {missing}" if missing else "",
                                   f"unexpected {extra}" if extra else "") if s)
    raise ValueError(f"{owner}: state does not have the structure of tx.init(params) "
                     f"({detail or 'same leaves, different containers'}): was it built by "
                     f"this transformation, for these params?\n  expected: {want_def}\n"
                     f"  got:      {got_def}")
  for (path, g), (_, w) in zip(got_paths, want_paths):
    shape, dtype = getattr(g, "shape", None), getattr(g, "dtype", None)
    if shape is None or tuple(shape) != tuple(w.shape) or dtype != w.dtype:
      raise ValueError(f"{owner}: state leaf {jax.tree_util.keystr(path)} is "
                       f"{dtype}{list(shape) if shape is not None else ''}, but tx.init(params) "
                       f"gives {w.dtype}{list(w.shape)}")


def as_record(owner: str, name: str, value, cls):
  """``value`` as a ``cls`` record: the record itself, a mapping of its
  fields (a YAML config's), or ``None`` for the defaults."""
  if value is None:
    return cls()
  if isinstance(value, cls):
    return value
  if isinstance(value, Mapping):
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - fields)
    if unknown:
      raise ValueError(f"{owner}: {name} has unknown fields {unknown}; expected some of "
                       f"{sorted(fields)}")
    return cls(**value)
  raise TypeError(f"{owner}: {name} must be a fuseopt.optim.{cls.__name__} (or a mapping of its "
                  f"fields), got {value!r}")

