"""Benchmark cases by op. Each module here defines
``cases(size: str, platform: str) -> list[Case]`` with ``size`` in
``("quick", "full")``; :func:`all_cases` gathers them."""

from __future__ import annotations

import importlib

CASE_MODULES = ("stochastic_round", "adam", "newton_schulz", "muon")


def all_cases(size: str = "quick", platform: str = "cpu", ops=None):
  out = []
  for name in CASE_MODULES:
    if ops and name not in ops:
      continue
    try:
      mod = importlib.import_module(f"fuseopt.benchmarks.cases.{name}")
    except ModuleNotFoundError as e:
      if e.name == f"fuseopt.benchmarks.cases.{name}":
        continue
      raise
    out.extend(mod.cases(size, platform))
  return out
