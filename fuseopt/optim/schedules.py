"""Learning-rate schedules as records: a kind name, its own fields, its optax schedule.

A config names a schedule by its ``kind`` and holds only that kind's fields
(``{"kind": "cosine", "peak": 3e-4, "warmup_steps": 2000}``), so a run's
record never carries a field another schedule reads. Every record has
``.schedule(steps) -> optax.Schedule`` where ``steps`` is the length of the
whole run in optimizer updates.

Every decay endpoint is an absolute step: a run resumed from a checkpoint
evaluates the same curve, however long each stretch of training lasts. Steps
at and past a schedule's end keep its end value.

One rule for every kind about the run's length: ``steps`` (the whole run, in
updates) is an integer >= 1, and the warmup ends within the run
(``warmup_steps <= steps``); otherwise ``.schedule(steps)`` raises naming the
field. A zero-length run has no updates to schedule, and a warmup longer than
the run never reaches ``peak``: both are mistakes in a config, never a curve
anyone wants. Decay endpoints given as absolute steps may lie past the run's
end (the run stops part-way down the curve, as when a longer run is cut).

Impossible combinations raise a ``ValueError`` that names the field
(``Linear.decay_start``, ``Power.tail.start``, ...).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Mapping

import jax.numpy as jnp
import optax

__all__ = [
    "SCHEDULES",
    "ScheduleBase",
    "Constant",
    "Cosine",
    "Linear",
    "Power",
    "PowerTail",
    "WSD",
    "linear_schedule",
    "power_schedule",
    "register_schedule",
    "schedule_from_dict",
]

# kind name -> record class; filled by @register_schedule.
SCHEDULES: dict[str, type["ScheduleBase"]] = {}


def register_schedule(kind: str):
  """Class decorator: registers a schedule record under ``kind``."""

  def deco(cls):
    if kind in SCHEDULES and SCHEDULES[kind] is not cls:
      raise ValueError(f"schedule kind {kind!r} is already registered to {SCHEDULES[kind].__name__}")
    cls.kind = kind
    SCHEDULES[kind] = cls
    return cls

  return deco


# --------------------------------------------------------------------------- #
# Validation helpers: every error names the record's field.
# --------------------------------------------------------------------------- #


def _number(owner: str, name: str, value, *, minimum=None, strict=False, allow_none=False):
  if value is None and allow_none:
    return None
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise ValueError(f"{owner}.{name} must be a number, got {value!r}")
  if not math.isfinite(value):
    raise ValueError(f"{owner}.{name} must be finite, got {value!r}")
  if minimum is not None:
    if strict and not value > minimum:
      raise ValueError(f"{owner}.{name} must be > {minimum}, got {value!r}")
    if not strict and not value >= minimum:
      raise ValueError(f"{owner}.{name} must be >= {minimum}, got {value!r}")
  return float(value)


def _step(owner: str, name: str, value, *, allow_none=False):
  if value is None and allow_none:
    return None
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise ValueError(f"{owner}.{name} must be a non-negative integer step, got {value!r}")
  return value


def _run_steps(owner: str, steps) -> int:
  if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
    raise ValueError(f"{owner}.schedule: steps (the run's length in updates) must be an integer >= 1, "
                     f"got {steps!r}")
  return steps


def _warmup_within(owner: str, warmup_steps: int, steps: int) -> None:
  """The rule shared by every kind: the warmup ends within the run."""
  if warmup_steps > steps:
    raise ValueError(f"{owner}.warmup_steps ({warmup_steps}) is longer than the run ({steps} steps): "
                     "the rate would never reach its peak; shorten the warmup or lengthen the run")


def _ramp(count, start, stop):
  """(count - start) / (stop - start) clipped to [0, 1]; a zero-length ramp is done."""
  count = jnp.asarray(count, jnp.float32)
  if stop <= start:
    return jnp.where(count >= start, 1.0, 0.0).astype(jnp.float32)
  return jnp.clip((count - start) / float(stop - start), 0.0, 1.0)


def _warmup(count, init, peak, warmup_steps):
  """init -> peak linearly over [0, warmup_steps]."""
  return init + (peak - init) * _ramp(count, 0, warmup_steps)


# --------------------------------------------------------------------------- #
# Records.
# --------------------------------------------------------------------------- #


class ScheduleBase:
  """One learning-rate schedule's record: its own fields and its optax schedule.

  Subclasses are frozen dataclasses registered under a kind name
  (:data:`SCHEDULES`); :meth:`to_dict` / :func:`schedule_from_dict` round-trip
  them through plain dicts (and so YAML).
  """

  kind: ClassVar[str] = ""

  def schedule(self, steps: int) -> optax.Schedule:
    """The rate at each update of a ``steps``-update run."""
    raise NotImplementedError

  def to_dict(self) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": self.kind}
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      out[f.name] = value.to_dict() if isinstance(value, PowerTail) else value
    return out

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "ScheduleBase":
    return schedule_from_dict(d) if cls is ScheduleBase else _build_record(cls, dict(d))


def _build_record(cls, d: dict):
  d.pop("kind", None)
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(d) - names)
  if unknown:
    raise ValueError(f"{cls.__name__} (kind {cls.kind!r}) got unknown field(s) {unknown}; "
                     f"its fields are {sorted(names)}")
  try:
    return cls(**d)
  except TypeError as e:  # a missing required field
    raise ValueError(f"{cls.__name__} (kind {cls.kind!r}): {e}") from None


def schedule_from_dict(d: Mapping[str, Any] | ScheduleBase) -> ScheduleBase:
  """The record ``d`` describes: ``d["kind"]`` picks the class, the rest are its fields."""
  if isinstance(d, ScheduleBase):
    return d
  if not isinstance(d, Mapping):
    raise ValueError(f"schedule must be a mapping with a 'kind' key or a schedule record, got {d!r}")
  kind = d.get("kind")
  if kind not in SCHEDULES:
    raise ValueError(f"schedule.kind must be one of {sorted(SCHEDULES)}, got {kind!r}")
  return _build_record(SCHEDULES[kind], dict(d))


@register_schedule("constant")
@dataclasses.dataclass(frozen=True)
class Constant(ScheduleBase):
  """Linear warmup from 0 to ``peak`` over ``warmup_steps``, then ``peak``."""

  peak: float
  warmup_steps: int = 0

  def __post_init__(self):
    _number("Constant", "peak", self.peak, minimum=0.0)
    _step("Constant", "warmup_steps", self.warmup_steps)

  def schedule(self, steps: int) -> optax.Schedule:
    _warmup_within("Constant", self.warmup_steps, _run_steps("Constant", steps))
    peak, warmup = float(self.peak), self.warmup_steps
    return lambda count: _warmup(count, 0.0, peak, warmup)


@register_schedule("cosine")
@dataclasses.dataclass(frozen=True)
class Cosine(ScheduleBase):
  """Linear warmup ``init -> peak``, cosine ``peak -> end`` ending at step ``decay_steps``.

  ``decay_steps`` is the absolute step where the cosine reaches ``end``
  (None: the run's end), as in :func:`optax.warmup_cosine_decay_schedule`
  whose ``decay_steps`` includes the warmup. Past it the rate stays ``end``.
  Loshchilov & Hutter 2017, "SGDR", arXiv 1608.03983.
  """

  peak: float
  warmup_steps: int = 0
  end: float = 0.0
  init: float = 0.0
  decay_steps: int | None = None

  def __post_init__(self):
    _number("Cosine", "peak", self.peak, minimum=0.0)
    _number("Cosine", "end", self.end, minimum=0.0)
    _number("Cosine", "init", self.init, minimum=0.0)
    _step("Cosine", "warmup_steps", self.warmup_steps)
    _step("Cosine", "decay_steps", self.decay_steps, allow_none=True)
    if self.decay_steps is not None and self.decay_steps < self.warmup_steps:
      raise ValueError(f"Cosine.decay_steps ({self.decay_steps}) must be >= warmup_steps ({self.warmup_steps}): "
                       "it is the absolute step where the cosine ends")

  def schedule(self, steps: int) -> optax.Schedule:
    steps = _run_steps("Cosine", steps)
    end_step = steps if self.decay_steps is None else self.decay_steps
    if end_step < self.warmup_steps:
      raise ValueError(f"Cosine.decay_steps: the run's end ({steps}) comes before the warmup's end "
                       f"({self.warmup_steps}); set decay_steps or a longer run")
    _warmup_within("Cosine", self.warmup_steps, steps)
    peak, end, init, w = float(self.peak), float(self.end), float(self.init), self.warmup_steps

    def fn(count):
      count = jnp.asarray(count, jnp.float32)
      p = _ramp(count, w, end_step)
      cos = end + (peak - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * p))
      return jnp.where(count < w, _warmup(count, init, peak, w), cos)

    return fn


def linear_schedule(peak: float, warmup_steps: int, decay_start: int | None, decay_end: int,
                    end_value: float = 0.0) -> optax.Schedule:
  """lm-engine's linear scheduler as a function.

  From zero to ``peak`` over the warmup, constant to ``decay_start`` (None:
  the warmup's end), then linear to ``end_value`` at step ``decay_end``, and
  ``end_value`` afterwards. All three are absolute steps.
  """
  _number("linear_schedule", "peak", peak, minimum=0.0)
  _number("linear_schedule", "end_value", end_value, minimum=0.0)
  _step("linear_schedule", "warmup_steps", warmup_steps)
  _step("linear_schedule", "decay_start", decay_start, allow_none=True)
  _step("linear_schedule", "decay_end", decay_end)
  start = warmup_steps if decay_start is None else decay_start
  if start < warmup_steps:
    raise ValueError(f"linear_schedule: decay_start ({decay_start}) comes before the warmup's end ({warmup_steps})")
  if decay_end < start:
    raise ValueError(f"linear_schedule: decay_end ({decay_end}) comes before decay_start ({start})")
  peak, end_value = float(peak), float(end_value)

  def fn(count):
    count = jnp.asarray(count, jnp.float32)
    decay = peak + (end_value - peak) * _ramp(count, start, decay_end)
    return jnp.where(count < warmup_steps, _warmup(count, 0.0, peak, warmup_steps), decay)

  return fn


@register_schedule("linear")
@dataclasses.dataclass(frozen=True)
class Linear(ScheduleBase):
  """lm-engine's linear scheduler (:func:`linear_schedule`).

  0 -> ``peak`` over the warmup, constant to ``decay_start`` (None: the
  warmup's end), linear to ``end`` at step ``decay_steps`` (None: the run's end).
  """

  peak: float
  warmup_steps: int = 0
  decay_start: int | None = None
  decay_steps: int | None = None
  end: float = 0.0

  def __post_init__(self):
    _number("Linear", "peak", self.peak, minimum=0.0)
    _number("Linear", "end", self.end, minimum=0.0)
    _step("Linear", "warmup_steps", self.warmup_steps)
    _step("Linear", "decay_start", self.decay_start, allow_none=True)
    _step("Linear", "decay_steps", self.decay_steps, allow_none=True)
    if self.decay_start is not None and self.decay_start < self.warmup_steps:
      raise ValueError(f"Linear.decay_start ({self.decay_start}) comes before the warmup's end "
                       f"(warmup_steps={self.warmup_steps})")
    start = self.warmup_steps if self.decay_start is None else self.decay_start
    if self.decay_steps is not None and self.decay_steps < start:
      raise ValueError(f"Linear.decay_steps ({self.decay_steps}) comes before the decay's start ({start})")

  def schedule(self, steps: int) -> optax.Schedule:
    steps = _run_steps("Linear", steps)
    start = self.warmup_steps if self.decay_start is None else self.decay_start
    end_step = steps if self.decay_steps is None else self.decay_steps
    if end_step < start:
      raise ValueError(f"Linear.decay_steps: the run's end ({steps}) comes before the decay's start ({start}); "
                       "set decay_steps or a longer run")
    _warmup_within("Linear", self.warmup_steps, steps)
    return linear_schedule(self.peak, self.warmup_steps, start, end_step, self.end)


def power_schedule(peak: float, warmup_steps: int, a: float, b: float = -0.51, c: float = 1.0,
                   decay_start: int | None = None, decay_end: int | None = None,
                   end_value: float = 0.0) -> optax.Schedule:
  """lm-engine's power scheduler with an optional linear tail.

  Past the warmup the rate is ``min(peak, a * (step * c) ** b)``: the power
  law in batch size and step of Shen et al. 2024, "Power Scheduler: A Batch
  Size and Token Number Agnostic Learning Rate Scheduler", arXiv 2408.13359
  (lm-engine's examples take ``a`` = 4 x batch size, ``c`` = tokens per step).
  The warmup rises linearly from 0 to that value at ``warmup_steps``. With
  ``decay_start`` set the rate follows the law to that step, then falls
  linearly to ``end_value`` at ``decay_end`` (required then) and stays there.
  """
  _number("power_schedule", "peak", peak, minimum=0.0)
  _number("power_schedule", "a", a, minimum=0.0, strict=True)
  _number("power_schedule", "b", b)
  _number("power_schedule", "c", c, minimum=0.0, strict=True)
  _number("power_schedule", "end_value", end_value, minimum=0.0)
  _step("power_schedule", "warmup_steps", warmup_steps)
  _step("power_schedule", "decay_start", decay_start, allow_none=True)
  _step("power_schedule", "decay_end", decay_end, allow_none=True)
  if decay_start is not None:
    if decay_start < warmup_steps:
      raise ValueError(f"power_schedule: decay_start ({decay_start}) comes before the warmup's end ({warmup_steps})")
    if decay_end is None:
      raise ValueError("power_schedule: decay_end is required when decay_start is set")
    if decay_end < decay_start:
      raise ValueError(f"power_schedule: decay_start ({decay_start}) comes after decay_end ({decay_end})")
  peak, a, b, c, end_value = float(peak), float(a), float(b), float(c), float(end_value)

  def law(s):
    # 0 ** negative b is inf, which the min with peak turns into peak.
    return jnp.minimum(peak, a * jnp.power(s * c, b))

  def law_py(s):
    x = s * c
    return peak if (x == 0 and b < 0) else min(peak, a * x ** b)

  at_warmup = law_py(float(warmup_steps))
  at_tail = law_py(float(decay_start)) if decay_start is not None else 0.0

  def fn(count):
    count = jnp.asarray(count, jnp.float32)
    rate = jnp.where(count < warmup_steps, at_warmup * _ramp(count, 0, warmup_steps), law(count))
    if decay_start is not None:
      tail = at_tail + (end_value - at_tail) * _ramp(count, decay_start, decay_end)
      rate = jnp.where(count >= decay_start, tail, rate)
    return rate

  return fn


@dataclasses.dataclass(frozen=True)
class PowerTail:
  """A power schedule's linear tail: from the law's rate at ``start`` to ``end`` at step ``steps`` (None: the run's end)."""

  start: int
  steps: int | None = None
  end: float = 0.0

  def __post_init__(self):
    _step("Power.tail", "start", self.start)
    _step("Power.tail", "steps", self.steps, allow_none=True)
    _number("Power.tail", "end", self.end, minimum=0.0)
    if self.steps is not None and self.start > self.steps:
      raise ValueError(f"Power.tail.start ({self.start}) comes after the tail's end (tail.steps={self.steps})")

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


@register_schedule("power")
@dataclasses.dataclass(frozen=True)
class Power(ScheduleBase):
  """lm-engine's power scheduler (:func:`power_schedule`), with an optional :class:`PowerTail`.

  Warmup 0 -> ``min(peak, a * (W * c) ** b)``, then ``min(peak, a * (step * c) ** b)``,
  then, with ``tail``, a linear decay from the law's rate at ``tail.start``
  to ``tail.end`` at ``tail.steps``. arXiv 2408.13359.
  """

  peak: float
  warmup_steps: int
  a: float
  b: float = -0.51
  c: float = 1.0
  tail: PowerTail | None = None

  def __post_init__(self):
    _number("Power", "peak", self.peak, minimum=0.0)
    _number("Power", "a", self.a, minimum=0.0, strict=True)
    _number("Power", "b", self.b)
    _number("Power", "c", self.c, minimum=0.0, strict=True)
    _step("Power", "warmup_steps", self.warmup_steps)
    if isinstance(self.tail, Mapping):
      object.__setattr__(self, "tail", _build_record(PowerTail, dict(self.tail)))
    if self.tail is not None and not isinstance(self.tail, PowerTail):
      raise ValueError(f"Power.tail must be a PowerTail, a mapping of its fields or None, got {self.tail!r}")
    if self.tail is not None and self.tail.start < self.warmup_steps:
      raise ValueError(f"Power.tail.start ({self.tail.start}) comes before the warmup's end "
                       f"(warmup_steps={self.warmup_steps})")

  def schedule(self, steps: int) -> optax.Schedule:
    steps = _run_steps("Power", steps)
    _warmup_within("Power", self.warmup_steps, steps)
    if self.tail is None:
      return power_schedule(self.peak, self.warmup_steps, self.a, self.b, self.c)
    end_step = steps if self.tail.steps is None else self.tail.steps
    if self.tail.start > end_step:
      raise ValueError(f"Power.tail.start ({self.tail.start}) comes after the tail's end "
                       f"(the run's end, {steps}); set tail.steps or a longer run")
    return power_schedule(self.peak, self.warmup_steps, self.a, self.b, self.c,
                          decay_start=self.tail.start, decay_end=end_step, end_value=self.tail.end)


_WSD_DECAYS = ("cosine", "linear", "exponential")


@register_schedule("wsd")
@dataclasses.dataclass(frozen=True)
class WSD(ScheduleBase):
  """Warmup-Stable-Decay (Hu et al. 2024, "MiniCPM", arXiv 2404.06395).

  0 -> ``peak`` over ``warmup_steps``, ``peak`` on a stable plateau, then the
  decay to ``end`` over the run's last ``decay_steps`` updates (or its last
  ``decay_fraction``; give exactly one), ``end`` afterwards.

  ``decay``: ``"cosine"`` (half cosine), ``"linear"``, or ``"exponential"``,
  MiniCPM's form ``peak * 0.5 ** ((step - S) / T)``, with the half-life
  ``T = D * ln 2 / ln(peak / end)`` chosen so the rate lands on ``end``
  (> 0) at the run's end: ``peak * (end / peak) ** ((step - S) / D)``.
  """

  peak: float
  warmup_steps: int = 0
  decay_steps: int | None = None
  decay_fraction: float | None = None
  decay: str = "cosine"
  end: float = 0.0

  def __post_init__(self):
    _number("WSD", "peak", self.peak, minimum=0.0)
    _number("WSD", "end", self.end, minimum=0.0)
    _step("WSD", "warmup_steps", self.warmup_steps)
    _step("WSD", "decay_steps", self.decay_steps, allow_none=True)
    _number("WSD", "decay_fraction", self.decay_fraction, minimum=0.0, strict=True, allow_none=True)
    if (self.decay_steps is None) == (self.decay_fraction is None):
      raise ValueError("WSD.decay_steps / WSD.decay_fraction: give exactly one "
                       f"(got decay_steps={self.decay_steps!r}, decay_fraction={self.decay_fraction!r})")
    if self.decay_fraction is not None and self.decay_fraction > 1.0:
      raise ValueError(f"WSD.decay_fraction must be in (0, 1], got {self.decay_fraction!r}")
    if self.decay not in _WSD_DECAYS:
      raise ValueError(f"WSD.decay must be one of {_WSD_DECAYS}, got {self.decay!r}")
    if self.decay == "exponential" and not (0.0 < self.end <= self.peak):
      raise ValueError(f"WSD.end must be in (0, peak] for an exponential decay, got {self.end!r}")

  def schedule(self, steps: int) -> optax.Schedule:
    steps = _run_steps("WSD", steps)
    length = self.decay_steps if self.decay_steps is not None else int(round(self.decay_fraction * steps))
    start = steps - length
    if start < self.warmup_steps:
      field = "decay_steps" if self.decay_steps is not None else "decay_fraction"
      raise ValueError(f"WSD.{field}: the decay would start at step {start}, before the warmup's end "
                       f"({self.warmup_steps}) of a {steps}-step run")
    _warmup_within("WSD", self.warmup_steps, steps)
    peak, end, w, decay = float(self.peak), float(self.end), self.warmup_steps, self.decay

    def fn(count):
      count = jnp.asarray(count, jnp.float32)
      p = _ramp(count, start, steps)
      if decay == "cosine":
        dec = end + (peak - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * p))
      elif decay == "linear":
        dec = peak + (end - peak) * p
      else:
        dec = peak * jnp.power(end / peak, p)
      return jnp.where(count < w, _warmup(count, 0.0, peak, w), dec)

    return fn
