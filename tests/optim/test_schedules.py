"""Every schedule's value at its boundaries, against numbers computed by hand."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fuseopt.optim import schedules as S


def values(fn, steps):
  """fn at each step, evaluated as optax does: one traced int32 count per call."""
  jf = jax.jit(fn)
  return np.array([float(jf(jnp.int32(s))) for s in steps])


def check(fn, expected: dict):
  got = values(fn, list(expected))
  np.testing.assert_allclose(got, list(expected.values()), rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- Cosine


def test_cosine_boundaries():
  # warmup 0 -> 1 over 10 steps, cosine 1 -> 0.1 ending at step 110.
  fn = S.Cosine(peak=1.0, warmup_steps=10, end=0.1, decay_steps=110).schedule(200)
  check(fn, {0: 0.0, 5: 0.5, 10: 1.0,
             60: 0.1 + 0.9 * 0.5,                               # half way: cos(pi/2) = 0
             35: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)),  # a quarter in
             110: 0.1, 150: 0.1, 200: 0.1, 10_000: 0.1})


def test_cosine_init_and_run_end():
  # decay_steps=None: the cosine ends at the run's end (110 here).
  fn = S.Cosine(peak=1.0, warmup_steps=10, end=0.1, init=0.2).schedule(110)
  check(fn, {0: 0.2, 5: 0.6, 10: 1.0, 60: 0.55, 110: 0.1, 111: 0.1})


def test_cosine_no_warmup():
  check(S.Cosine(peak=2.0).schedule(100), {0: 2.0, 50: 1.0, 100: 0.0, 101: 0.0})


# ---------------------------------------------------------------- Linear


def test_linear_boundaries():
  fn = S.Linear(peak=2.0, warmup_steps=4, decay_start=10, decay_steps=20, end=0.5).schedule(1000)
  check(fn, {0: 0.0, 2: 1.0, 4: 2.0, 7: 2.0, 10: 2.0, 15: 1.25, 20: 0.5, 30: 0.5, 1000: 0.5})


def test_linear_defaults_decay_from_warmup_to_run_end():
  fn = S.Linear(peak=1.0, warmup_steps=10).schedule(110)
  check(fn, {0: 0.0, 10: 1.0, 60: 0.5, 110: 0.0, 500: 0.0})


def test_linear_schedule_function_matches_record():
  fn = S.linear_schedule(2.0, 4, 10, 20, end_value=0.5)
  check(fn, {0: 0.0, 4: 2.0, 10: 2.0, 15: 1.25, 20: 0.5, 25: 0.5})
  # decay_start None: the warmup's end.
  check(S.linear_schedule(1.0, 10, None, 20), {10: 1.0, 15: 0.5, 20: 0.0})


def test_absolute_endpoints_keep_the_curve_on_resume():
  # A run extended from 100 to 300 steps keeps the same curve when the
  # decay's end is an absolute step.
  a = S.Linear(peak=1.0, warmup_steps=5, decay_start=20, decay_steps=80).schedule(100)
  b = S.Linear(peak=1.0, warmup_steps=5, decay_start=20, decay_steps=80).schedule(300)
  steps = [0, 3, 5, 20, 50, 80, 99]
  np.testing.assert_array_equal(values(a, steps), values(b, steps))


# ---------------------------------------------------------------- Power


def test_power_boundaries():
  # law(s) = min(0.02, 0.1 * s ** -0.5): law(100) = 0.01, law(400) = 0.005.
  fn = S.Power(peak=0.02, warmup_steps=100, a=0.1, b=-0.5).schedule(10_000)
  check(fn, {0: 0.0, 50: 0.005, 100: 0.01, 400: 0.005, 10_000: 0.001})


def test_power_cap_and_c():
  # a = 1: law(100) = 0.1 > peak, so the warmup ends at peak and the rate
  # stays there until law(s) = 0.02 at s = 2500.
  fn = S.Power(peak=0.02, warmup_steps=100, a=1.0, b=-0.5).schedule(10_000)
  check(fn, {0: 0.0, 50: 0.01, 100: 0.02, 2500: 0.02, 10_000: 0.01})
  # c scales the step: law(100) = 0.1 * (100 * 2) ** -0.5.
  fn = S.Power(peak=1.0, warmup_steps=100, a=0.1, b=-0.5, c=2.0).schedule(1000)
  check(fn, {50: 0.5 * 0.1 / math.sqrt(200), 100: 0.1 / math.sqrt(200), 800: 0.1 / 40})


def test_power_tail():
  tail = S.PowerTail(start=400, steps=600, end=0.001)
  fn = S.Power(peak=0.02, warmup_steps=100, a=0.1, b=-0.5, tail=tail).schedule(10_000)
  check(fn, {0: 0.0, 100: 0.01, 399: 0.1 / math.sqrt(399), 400: 0.005, 500: 0.003, 600: 0.001, 700: 0.001})
  # tail.steps None: the run's end.
  fn = S.Power(peak=0.02, warmup_steps=100, a=0.1, b=-0.5, tail=S.PowerTail(start=400)).schedule(800)
  check(fn, {400: 0.005, 600: 0.0025, 800: 0.0, 900: 0.0})


def test_power_schedule_function():
  fn = S.power_schedule(0.02, 100, 0.1, -0.5, decay_start=400, decay_end=600, end_value=0.0)
  check(fn, {0: 0.0, 100: 0.01, 400: 0.005, 500: 0.0025, 600: 0.0, 601: 0.0})
  check(S.power_schedule(0.02, 100, 0.1, -0.5), {100: 0.01, 10_000: 0.001})


# ---------------------------------------------------------------- WSD


@pytest.mark.parametrize("decay,mid", [("linear", 0.5), ("cosine", 0.5), ("exponential", 0.1)])
def test_wsd_boundaries(decay, mid):
  end = 0.01 if decay == "exponential" else 0.0
  # 100-step run: warmup to step 10, plateau to step 80, decay over the last 20.
  fn = S.WSD(peak=1.0, warmup_steps=10, decay_steps=20, decay=decay, end=end).schedule(100)
  check(fn, {0: 0.0, 5: 0.5, 10: 1.0, 50: 1.0, 80: 1.0, 90: mid, 100: end, 120: end})


def test_wsd_exponential_is_minicpm_half_life():
  # MiniCPM's form peak * 0.5 ** ((s - S) / T), with T set by peak/end over D.
  fn = S.WSD(peak=1.0, decay_steps=20, decay="exponential", end=0.25).schedule(100)
  # peak/end = 4 = two half-lives over 20 steps: T = 10.
  check(fn, {80: 1.0, 85: 0.5 ** 0.5, 90: 0.5, 100: 0.25})


def test_wsd_fraction_equals_steps():
  a = S.WSD(peak=1.0, warmup_steps=10, decay_fraction=0.2, decay="linear").schedule(100)
  b = S.WSD(peak=1.0, warmup_steps=10, decay_steps=20, decay="linear").schedule(100)
  steps = [0, 10, 79, 80, 85, 100]
  np.testing.assert_array_equal(values(a, steps), values(b, steps))


# ---------------------------------------------------------------- Constant


def test_constant():
  check(S.Constant(peak=3.0, warmup_steps=3).schedule(10), {0: 0.0, 1: 1.0, 3: 3.0, 10: 3.0, 1000: 3.0})
  check(S.Constant(peak=3.0).schedule(10), {0: 3.0, 9: 3.0})


# ---------------------------------------------------------------- registry


def test_registry_and_dict_round_trip():
  assert set(S.SCHEDULES) == {"constant", "cosine", "linear", "power", "wsd"}
  records = [
      S.Constant(peak=1.0, warmup_steps=2),
      S.Cosine(peak=1.0, warmup_steps=2, end=0.1, decay_steps=50),
      S.Linear(peak=1.0, warmup_steps=2, decay_start=5, decay_steps=50),
      S.Power(peak=0.02, warmup_steps=10, a=0.1, tail=S.PowerTail(start=20, steps=40)),
      S.WSD(peak=1.0, warmup_steps=2, decay_fraction=0.1, decay="exponential", end=0.01),
  ]
  for r in records:
    d = r.to_dict()
    assert d["kind"] == r.kind
    assert S.schedule_from_dict(d) == r
    assert S.ScheduleBase.from_dict(d) == r
  assert S.schedule_from_dict({"kind": "power", "peak": 0.02, "warmup_steps": 10, "a": 0.1,
                               "tail": {"start": 20}}).tail == S.PowerTail(start=20)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("make,field", [
    (lambda: S.Linear(peak=1.0, warmup_steps=10, decay_start=5), "decay_start"),
    (lambda: S.Linear(peak=1.0, warmup_steps=10, decay_start=20, decay_steps=15), "decay_steps"),
    (lambda: S.Linear(peak=-1.0), "peak"),
    (lambda: S.Cosine(peak=1.0, warmup_steps=10, decay_steps=5), "decay_steps"),
    (lambda: S.Cosine(peak=1.0, end=-0.1), "end"),
    (lambda: S.Cosine(peak=1.0, warmup_steps=-1), "warmup_steps"),
    (lambda: S.Power(peak=1.0, warmup_steps=10, a=-1.0), "a"),
    (lambda: S.Power(peak=1.0, warmup_steps=10, a=1.0, c=0.0), "c"),
    (lambda: S.Power(peak=1.0, warmup_steps=10, a=1.0, tail=S.PowerTail(start=5)), "tail.start"),
    (lambda: S.PowerTail(start=700, steps=600), "tail.start"),
    (lambda: S.PowerTail(start=10, end=-1.0), "tail.end"),
    (lambda: S.WSD(peak=1.0), "decay_steps"),
    (lambda: S.WSD(peak=1.0, decay_steps=5, decay_fraction=0.1), "decay_fraction"),
    (lambda: S.WSD(peak=1.0, decay_fraction=1.5), "decay_fraction"),
    (lambda: S.WSD(peak=1.0, decay_steps=5, decay="step"), "decay"),
    (lambda: S.WSD(peak=1.0, decay_steps=5, decay="exponential", end=0.0), "end"),
    (lambda: S.Constant(peak=float("nan")), "peak"),
    (lambda: S.power_schedule(1.0, 10, 1.0, decay_start=20, decay_end=15), "decay_end"),
    (lambda: S.linear_schedule(1.0, 10, 5, 20), "decay_start"),
])
def test_bad_fields_raise_naming_the_field(make, field):
  with pytest.raises(ValueError, match=field.replace(".", r"\.")):
    make()


@pytest.mark.parametrize("record,steps,field", [
    (S.Power(peak=1.0, warmup_steps=10, a=1.0, tail=S.PowerTail(start=700)), 600, "tail.start"),
    (S.WSD(peak=1.0, warmup_steps=50, decay_steps=60), 100, "decay_steps"),
    (S.WSD(peak=1.0, warmup_steps=50, decay_fraction=0.6), 100, "decay_fraction"),
    (S.Linear(peak=1.0, warmup_steps=10, decay_start=50), 40, "decay_steps"),
    (S.Cosine(peak=1.0, warmup_steps=50), 40, "decay_steps"),
    (S.Constant(peak=1.0), -1, "steps"),
])
def test_impossible_runs_raise_naming_the_field(record, steps, field):
  with pytest.raises(ValueError, match=field.replace(".", r"\.")):
    record.schedule(steps)


def test_from_dict_errors():
  with pytest.raises(ValueError, match="schedule.kind"):
    S.schedule_from_dict({"kind": "triangle", "peak": 1.0})
  with pytest.raises(ValueError, match="unknown field.*decay_fraction"):
    S.schedule_from_dict({"kind": "cosine", "peak": 1.0, "decay_fraction": 0.1})
  with pytest.raises(ValueError, match="peak"):
    S.schedule_from_dict({"kind": "cosine"})
