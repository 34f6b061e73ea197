"""Argument checks shared by fuseopt's transforms: errors name the parameter
and what was expected. Traced values and schedules are not checked here (a
schedule's own record validates its fields, see :mod:`fuseopt.optim.schedules`)."""

from __future__ import annotations

import math


def _number(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_rate(owner: str, name: str, value) -> None:
  """A learning rate or weight decay: a finite number >= 0, or a schedule."""
  if callable(value) or not _number(value):
    return
  if not math.isfinite(value) or value < 0:
    raise ValueError(f"{owner}: {name} must be a finite number >= 0 or a schedule, got {value!r}")


def check_decay(owner: str, name: str, value) -> None:
  """A moment decay (b1, b2, beta): in [0, 1)."""
  if _number(value) and not 0.0 <= value < 1.0:
    raise ValueError(f"{owner}: {name} must be in [0, 1), got {value!r}")


def check_nonnegative(owner: str, name: str, value) -> None:
  if _number(value) and not value >= 0.0:
    raise ValueError(f"{owner}: {name} must be >= 0, got {value!r}")
