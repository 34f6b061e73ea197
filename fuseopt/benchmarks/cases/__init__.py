"""Benchmark cases by op. Each module here defines
``cases(size: str, platform: str) -> list[Case]`` with ``size`` in
``("quick", "full")`` and ``platform`` a JAX backend name ("cpu", "gpu",
"tpu"); :func:`all_cases` gathers them. Modules that do not exist (yet) are
skipped, so an op's cases appear as soon as its module lands."""

from __future__ import annotations

import importlib

CASE_MODULES = ("stochastic_round", "adam", "newton_schulz", "muon", "sharded_muon", "step")
SIZES = ("quick", "full")


def available_ops() -> list[str]:
  """The case modules that import."""
  return [n for n in CASE_MODULES if _load(n, errors={}) is not None]


def _load(name, errors):
  try:
    return importlib.import_module(f"fuseopt.benchmarks.cases.{name}")
  except ModuleNotFoundError as e:
    if e.name == f"fuseopt.benchmarks.cases.{name}":
      return None
    if errors is None:
      raise
    errors[name] = f"{type(e).__name__}: {e}"
  except Exception as e:  # noqa: BLE001 - a broken module is reported, not fatal, when asked
    if errors is None:
      raise
    errors[name] = f"{type(e).__name__}: {e}"
  return None


def all_cases(size: str = "quick", platform: str = "cpu", ops=None, *, errors: dict | None = None):
  """Cases of every available op module (or of ``ops`` only).

  With ``errors`` (a dict), a module that fails to import or to build its
  cases is recorded there as ``{op: message}`` instead of raising.
  """
  if size not in SIZES:
    raise ValueError(f"size must be one of {SIZES}, got {size!r}")
  if ops:
    unknown = [o for o in ops if o not in CASE_MODULES]
    if unknown:
      raise ValueError(f"ops must be among {CASE_MODULES}, got unknown {unknown}")
  out = []
  for name in CASE_MODULES:
    if ops and name not in ops:
      continue
    mod = _load(name, errors)
    if mod is None:
      continue
    try:
      out.extend(mod.cases(size, platform))
    except Exception as e:  # noqa: BLE001
      if errors is None:
        raise
      errors[name] = f"{type(e).__name__}: {e}"
  return out
