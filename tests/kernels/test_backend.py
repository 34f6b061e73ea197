"""Choosing an implementation: by platform, by argument, by environment."""

import jax
import jax.numpy as jnp
import pytest

from fuseopt.kernels import dispatch as _backend
from tests.kernels import harness


def test_cpu_picks_xla():
  assert _backend.resolve_implementation("op", None, (jnp.ones(3),)) == "xla"


@pytest.mark.parametrize("target", harness.TARGETS, ids=harness.TARGET_IDS)
def test_abstract_device_picks_its_backend(target):
  with jax.sharding.use_abstract_mesh(harness.abstract_mesh(target)):
    assert _backend.resolve_implementation("op", None) == target.implementation


def test_explicit_name_wins_and_bad_names_raise():
  assert _backend.resolve_implementation("op", "triton") == "triton"
  with pytest.raises(ValueError, match="implementation='cuda'"):
    _backend.resolve_implementation("op", "cuda")
  with pytest.raises(ValueError, match="not available"):
    _backend.resolve_implementation("op", "mosaic_tpu", available=("xla", "triton"))


def test_environment_overrides(monkeypatch):
  monkeypatch.setenv("FUSEOPT_IMPLEMENTATION", "triton")
  assert _backend.resolve_implementation("some_op", None) == "triton"
  monkeypatch.setenv("FUSEOPT_IMPLEMENTATION_SOME_OP", "mosaic_tpu")
  assert _backend.resolve_implementation("some_op", None) == "mosaic_tpu"
  assert _backend.resolve_implementation("other_op", None) == "triton"
  assert _backend.resolve_implementation("some_op", "xla") == "xla"  # an argument still wins
  monkeypatch.setenv("FUSEOPT_IMPLEMENTATION", "bogus")
  with pytest.raises(ValueError, match="FUSEOPT_IMPLEMENTATION='bogus'"):
    _backend.resolve_implementation("other_op", None)


def test_interpret_arg():
  from jax.experimental.pallas import tpu as pltpu
  assert _backend.interpret_arg("triton", True) is True
  assert isinstance(_backend.interpret_arg("mosaic_tpu", True), pltpu.InterpretParams)
  assert _backend.interpret_arg("mosaic_tpu", False) is False
