"""The conformance job tests fuseopt, not optax: the substitutes are in place
inside a conformance test and gone outside it."""

import jax.numpy as jnp
import optax
import optax.contrib
import pytest
from optax._src import alias, transform, update
from optax.contrib import _muon  # the places optax's tests read

import fuseopt.optim as fo
from fuseopt.optim import adam_transforms
from tests.conformance import _optax_suite

_ORIGINAL = {name: [getattr(m, a) for m, a in places]
             for name, places in _optax_suite._targets().items()}


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_patched_replaces_every_place_and_restores(mode):
  with _optax_suite.patched(mode):
    assert isinstance(optax.adam(1e-3), adam_transforms.FusedAdamTransformation)
    assert isinstance(alias.adamw(1e-3), adam_transforms.FusedAdamTransformation)
    assert transform.scale_by_adam is optax.scale_by_adam
    assert update.apply_updates is fo.apply_updates
    assert _muon.muon is optax.contrib.muon and _muon.scale_by_muon is optax.contrib.scale_by_muon
    for name, places in _optax_suite._targets().items():
      for (module, attr), original in zip(places, _ORIGINAL[name]):
        assert getattr(module, attr) is not original, (name, module.__name__)
    # fp32 mode: moments in the parameters' dtype, as optax.
    state = optax.adam(1e-3).init({"w": jnp.zeros(3)})
    assert state[0].mu["w"].dtype == (jnp.float32 if mode == "fp32" else jnp.bfloat16)
  for name, places in _optax_suite._targets().items():
    for (module, attr), original in zip(places, _ORIGINAL[name]):
      assert getattr(module, attr) is original


def test_loaded_optax_tests_captured_the_substitutes():
  """float64_test lists (name, function) pairs at import time: the copy the
  job runs holds fuseopt's functions there."""
  classes = _optax_suite.load("fp32", "transforms")
  module = __import__("sys").modules[classes["Float64Test"].__module__]
  assert module.alias.adam is optax.adam  # restored after import
  test = classes["Float64Test"].test_mixed_dtype_input_outputs_adam
  captured = [c.cell_contents for c in test.__closure__ or ()]
  functions = [x for c in captured for x in (c if isinstance(c, (tuple, list)) else (c,))
               if callable(x)]
  assert any(getattr(f, "__module__", "") == "fuseopt.optim.adam_transforms" for f in functions), functions
