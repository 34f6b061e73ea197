"""optax's own tests with fuseopt substituted: what this package runs, how.

optax ships its test files in its wheel. For each mode this module imports a
fresh copy of the selected files (``OPTAX_TEST_FILES``) while optax's
``adam``, ``adamw``, ``scale_by_adam``, ``contrib.muon``,
``contrib.scale_by_muon`` and ``apply_updates`` are replaced by fuseopt's --
in the public namespace and in the modules optax's tests import them from, so
a test that captures one of them at import time (a parameter list) captures
fuseopt's. :func:`patched` puts the substitutes in place around each test and
takes them out again, so the rest of the suite sees optax unchanged.

Modes (see docs/conformance.md):

* ``"fp32"``: fuseopt in fp32-equivalent settings (``moment_dtype=None``,
  ``ns_dtype="float32"``). Every selected test must pass.
* ``"bf16"``: fuseopt's defaults (bf16 moments, bf16 Newton-Schulz). The
  tests in ``BF16_EXPECTED_FAILURES`` fail (strict xfail), for the reason
  given there; every other selected test must pass.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import os
import pathlib
import re
import sys
import unittest

import optax
import optax.contrib
import pytest

import fuseopt.optim as fo

# What the job pins: the test files below are those of this optax release.
OPTAX_VERSION = "0.2.8"

# The optax test files that exercise what fuseopt replaces (paths inside the
# optax package) and the wrapper module that runs them in this directory.
OPTAX_TEST_FILES = {
    "alias": ["_src/alias_test.py"],
    "transforms": ["_src/transform_test.py", "_src/float64_test.py", "_src/combine_test.py",
                   "transforms/_combining_test.py", "transforms/_accumulation_test.py",
                   "schedules/_inject_test.py", "tree_utils/_state_utils_test.py",
                   "_src/sharding_test.py"],
    "contrib": ["contrib/_common_test.py", "contrib/_muon_test.py",
                "contrib/_schedule_free_test.py"],
}

# optax optimizers that run fuseopt code once the substitutes are in: the
# substituted functions themselves and optax's aliases built on
# transform.scale_by_adam (nadam, nadamw call it with nesterov=True).
SUBSTITUTED = frozenset({"adam", "adamw", "nadam", "nadamw", "scale_by_adam", "muon",
                         "scale_by_muon", "apply_updates"})
_CALLS = re.compile(r"\b(" + "|".join(sorted(SUBSTITUTED)) + r")\b")
_QUOTED = re.compile(r"'([A-Za-z_][A-Za-z_0-9]*)'")

# Left out to keep the job's share of CI small: each costs more than it tells
# about fuseopt (seconds of one CPU core with optax alone, optax 0.2.8).
TOO_COSTLY = {
    # 77 s and 47 s: MultiSteps over a bf16/fp32 model, optax's own code;
    # MultiSteps(adam) is covered by test_multi_steps and alias's
    # test_gradient_accumulation.
    "transforms/_accumulation_test.py::AccumulationTest::test_multi_steps_mixed_precision0",
    "transforms/_accumulation_test.py::AccumulationTest::test_multi_steps_mixed_precision1",
}
TOO_COSTLY_CLASSES = {
    # L-BFGS (4-6 s each): only optax's L-BFGS, which calls apply_updates.
    "_src/alias_test.py::LBFGSTest",
}

# Selected tests that optax 0.2.8 itself does not pass here (measured with
# FUSEOPT_CONFORMANCE_BASELINE=1): nothing to compare against.
OPTAX_FAILS: dict[str, str] = {}

# Tests that fail with fuseopt's bf16 defaults and pass in fp32-equivalent
# settings: optax's test, then the reason.
_BF16_MU = ("bf16 moments: with mu_dtype=None, fuseopt stores the moments of fp32 parameters in "
            "bfloat16 (moment_dtype's default); optax in the parameters' dtype")
BF16_EXPECTED_FAILURES: dict[str, str] = {
    # params float32 (or None: float32), mu_dtype None, adam / adamw
    "_src/alias_test.py::AliasTest::test_explicit_dtype22": _BF16_MU,
    "_src/alias_test.py::AliasTest::test_explicit_dtype23": _BF16_MU,
    "_src/alias_test.py::AliasTest::test_explicit_dtype46": _BF16_MU,
    "_src/alias_test.py::AliasTest::test_explicit_dtype47": _BF16_MU,
    "_src/transform_test.py::TransformTest::test_rms_match_adam":
        "bf16 moments: scale_by_adam(b1=0) against scale_by_rms to optax's fp32 tolerance; "
        "bf16 nu carries 8 bits of mantissa",
    "contrib/_schedule_free_test.py::ScheduleFreeTest::test_schedule_free_adamw":
        "bf16 moments: schedule_free_adamw (fp32 moments) against schedule_free(adam) "
        "to optax's fp32 tolerance",
}


def _optimizer_names() -> frozenset:
  """Every optimizer/transform name optax exports (to tell parameter lists
  over optimizers from other parameters)."""
  names = set()
  for mod in (optax, optax.contrib):
    names.update(n for n in dir(mod) if not n.startswith("_") and callable(getattr(mod, n)))
  return frozenset(names)


def _with_defaults(fn, **defaults):
  """``fn`` with other defaults, keeping a real signature (optax's
  inject_hyperparams and its tests read it)."""
  sig = inspect.signature(fn)
  params = [p.replace(default=defaults[p.name]) if p.name in defaults else p
            for p in sig.parameters.values()]

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    bound = wrapper.__signature__.bind(*args, **kwargs)
    bound.apply_defaults()
    return fn(*bound.args, **bound.kwargs)

  wrapper.__signature__ = sig.replace(parameters=params)
  del wrapper.__wrapped__  # inspect.signature must read __signature__, not fn's
  return wrapper


def substitutes(mode: str) -> dict[str, object]:
  """optax name -> fuseopt function, for ``mode``."""
  if os.environ.get("FUSEOPT_CONFORMANCE_BASELINE") == "1":
    return {}
  if mode == "fp32":
    f32 = {"moment_dtype": None}
    ns = {"execution": fo.Execution(newton_schulz=fo.NewtonSchulz(dtype="float32"))}
    return {"scale_by_adam": _with_defaults(fo.scale_by_adam, **f32),
            "adam": _with_defaults(fo.adam, **f32),
            "adamw": _with_defaults(fo.adamw, **f32),
            "muon": _with_defaults(fo.muon, **f32, **ns),
            "scale_by_muon": _with_defaults(fo.scale_by_muon, **ns),
            "apply_updates": fo.apply_updates}
  if mode == "bf16":
    return {"scale_by_adam": fo.scale_by_adam, "adam": fo.adam, "adamw": fo.adamw,
            "muon": fo.muon, "scale_by_muon": fo.scale_by_muon,
            "apply_updates": fo.apply_updates}
  raise ValueError(f"unknown conformance mode {mode!r}")


def _targets():
  """(module, attribute) pairs that hold each substituted name."""
  from optax._src import alias, transform, update
  from optax.contrib import _muon
  return {
      "scale_by_adam": [(optax, "scale_by_adam"), (transform, "scale_by_adam")],
      "adam": [(optax, "adam"), (alias, "adam")],
      "adamw": [(optax, "adamw"), (alias, "adamw")],
      "muon": [(optax.contrib, "muon"), (_muon, "muon")],
      "scale_by_muon": [(optax.contrib, "scale_by_muon"), (_muon, "scale_by_muon")],
      "apply_updates": [(optax, "apply_updates"), (update, "apply_updates")],
  }


@contextlib.contextmanager
def patched(mode: str):
  """optax with fuseopt's functions for ``mode``, restored on exit."""
  subs = substitutes(mode)
  saved = []
  try:
    for name, places in _targets().items():
      if name not in subs:
        continue
      for module, attr in places:
        saved.append((module, attr, getattr(module, attr)))
        setattr(module, attr, subs[name])
    yield
  finally:
    for module, attr, value in reversed(saved):
      setattr(module, attr, value)


# The bf16 mode of the alias group (its 112 tests are most of the job's time)
# runs when FUSEOPT_CONFORMANCE_FULL=1; CI runs the rest. Its expected
# failures above were measured on the full selection.
CI_SKIPPED = {("bf16", "alias")}


def load(mode: str, group: str) -> dict[str, type]:
  """The TestCase classes of ``OPTAX_TEST_FILES[group]``, imported afresh
  under the substitutes of ``mode``; keys are unique class names."""
  if (mode, group) in CI_SKIPPED and os.environ.get("FUSEOPT_CONFORMANCE_FULL") != "1":
    pytest.skip(f"{mode} mode of the {group} group: set FUSEOPT_CONFORMANCE_FULL=1",
                allow_module_level=True)
  if optax.__version__ != OPTAX_VERSION:
    pytest.skip(f"the conformance lists are those of optax {OPTAX_VERSION}, "
                f"found {optax.__version__}", allow_module_level=True)
  root = pathlib.Path(optax.__file__).parent
  classes: dict[str, type] = {}
  for rel in OPTAX_TEST_FILES[group]:
    stem = rel.replace("/", "_").removesuffix(".py").lstrip("_")
    name = f"_optax_conformance_{mode}_{stem}"
    spec = importlib.util.spec_from_file_location(name, root / rel)
    module = importlib.util.module_from_spec(spec)
    xla_flags = os.environ.get("XLA_FLAGS")
    try:
      with patched(mode):
        sys.modules[name] = module
        spec.loader.exec_module(module)
    finally:
      # sharding_test.py sets XLA_FLAGS at import (for its own process).
      if xla_flags is None:
        os.environ.pop("XLA_FLAGS", None)
      else:
        os.environ["XLA_FLAGS"] = xla_flags
    for attr, obj in vars(module).items():
      if (isinstance(obj, type) and issubclass(obj, unittest.TestCase)
          and obj.__module__ == name and attr not in classes):
        classes[attr] = obj
  return classes


def optax_test_id(item) -> str:
  """``<file in optax>::<Class>::<test>`` of a collected conformance item."""
  module = item.getparent(pytest.Class).obj.__module__
  rel = next(r for files in OPTAX_TEST_FILES.values() for r in files
             if module.endswith(r.replace("/", "_").removesuffix(".py").lstrip("_")))
  return f"{rel}::{item.parent.name}::{item.name}"


@functools.cache
def _names():
  return _optimizer_names() | SUBSTITUTED


def selected(item) -> bool:
  """Whether an optax test exercises a substituted function: its parameters
  name a substituted optimizer, or (not parameterized over optimizers) its
  source calls one."""
  fn = item.obj
  params = getattr(fn, "__x_params_repr__", "") or ""
  quoted = set(_QUOTED.findall(params)) & _names()
  base = inspect.unwrap(fn).__name__
  if getattr(fn, "__x_use_name__", False) and item.name.startswith(base + "_"):
    quoted |= {item.name[len(base) + 1:]} & _names()  # a named case: test_x_<optimizer>
  if quoted:
    return bool(quoted & SUBSTITUTED)
  try:
    source = inspect.getsource(inspect.unwrap(fn))
  except (OSError, TypeError):
    return False
  return bool(_CALLS.search(source))


def uses_subtests(item) -> bool:
  try:
    return "subTest(" in inspect.getsource(inspect.unwrap(item.obj))
  except (OSError, TypeError):
    return False
