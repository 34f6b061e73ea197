"""The optax conformance job: selection, expected failures, substitution."""

import jax
import pytest

from tests.conformance import _optax_suite


def _mode(item):
  return getattr(item.module, "OPTAX_CONFORMANCE_MODE", None) if hasattr(item, "module") else None


def pytest_collection_modifyitems(config, items):
  keep, drop = [], []
  for item in items:
    mode = _mode(item)
    if mode is None:
      keep.append(item)
      continue
    test_id = _optax_suite.optax_test_id(item)
    if (not _optax_suite.selected(item) or test_id in _optax_suite.OPTAX_FAILS
        or test_id in _optax_suite.TOO_COSTLY
        or test_id.rsplit("::", 1)[0] in _optax_suite.TOO_COSTLY_CLASSES):
      drop.append(item)
      continue
    if mode == "bf16" and test_id in _optax_suite.BF16_EXPECTED_FAILURES:
      # Strict: a listed test that passes fails the job, so the list stays
      # exact. A test whose failure is inside a ``self.subTest`` is reported
      # as SUBXFAIL and its parent passes, so it cannot be strict.
      item.add_marker(pytest.mark.xfail(
          reason=_optax_suite.BF16_EXPECTED_FAILURES[test_id],
          strict=not _optax_suite.uses_subtests(item)))
    keep.append(item)
  if drop:
    config.hook.pytest_deselected(items=drop)
    items[:] = keep


@pytest.fixture(autouse=True)
def _fuseopt_in_optax(request):
  mode = _mode(request.node)
  if mode is None:
    yield
    return
  # float64_test.py turns jax_enable_x64 on and off inside the test: a
  # failure in between must not leave it on for the tests that follow.
  x64 = jax.config.jax_enable_x64
  try:
    with _optax_suite.patched(mode):
      yield
  finally:
    jax.config.update("jax_enable_x64", x64)
