"""Parametrising a pytest-benchmark suite over one case module's variants."""

from __future__ import annotations

import jax
import pytest


class CaseTable:
  """Every (case, variant) of a ``cases(size, platform)`` function, at both sizes.

  ``parametrize`` gives one test per (case name, variant) over the union of
  the sizes; ``get`` returns the case of the session's size, or skips.
  """

  def __init__(self, cases_fn):
    platform = jax.default_backend()
    self.by_size = {size: cases_fn(size, platform) for size in ("quick", "full")}
    self.ids = sorted({(c.name, v) for cs in self.by_size.values() for c in cs for v in c.variants})

  @property
  def parametrize(self):
    return pytest.mark.parametrize("name,variant", self.ids, ids=[f"{n}-{v}" for n, v in self.ids])

  def get(self, size, name, variant):
    case = next((c for c in self.by_size[size] if c.name == name), None)
    if case is None or variant not in case.variants:
      pytest.skip(f"{name}/{variant} is not a {size} case")
    return case
