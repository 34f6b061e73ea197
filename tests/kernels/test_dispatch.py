"""The one dispatch: backends per op and platform, fallbacks logged, forced
backends refused with a reason, environment overrides read by one function."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh

from fuseopt.kernels import adam_update, dispatch, newton_schulz, stochastic_round_bf16
from fuseopt.kernels.adam.backends import BACKENDS as ADAM_BACKENDS
from fuseopt.kernels.newton_schulz import paths
from fuseopt.kernels.newton_schulz.backends import BACKENDS as NS_BACKENDS
from fuseopt.kernels.stochastic_round.backends import BACKENDS as SR_BACKENDS
from tests.kernels import harness

# Each op's one table, in its own folder (<op>/backends.py).
OPS = {"stochastic_round": SR_BACKENDS, "adam_update": ADAM_BACKENDS, "newton_schulz": NS_BACKENDS}


def _gpu_mesh(kind):
  return AbstractMesh((), (), abstract_device=AbstractDevice(device_kind=kind, num_cores=1,
                                                             platform="gpu"))


def test_every_backend_declares_what_it_supports():
  for op, backends in OPS.items():
    assert set(backends) == set(dispatch.IMPLEMENTATIONS), op
    for name, backend in backends.items():
      assert callable(backend.supports), (op, name)
    for order in dispatch.PLATFORM_ORDER.values():
      assert order[-1] == "xla"


@pytest.mark.parametrize("target", harness.TARGETS, ids=harness.TARGET_IDS)
def test_platform_order_picks_the_first_backend(target):
  with jax.sharding.use_abstract_mesh(harness.abstract_mesh(target)):
    for op, backends in OPS.items():
      assert dispatch.select(op, backends, None) == target.implementation


def test_an_op_order_puts_its_measured_fastest_first():
  """Stochastic rounding's own GPU and TPU order (stochastic_round/backends.py
  ``ORDER``): the reference, which XLA fuses into one streaming pass, is the
  default call there; the kernel runs when named; the other ops keep the
  common order."""
  from fuseopt.kernels.stochastic_round.backends import ORDER
  for kind in ("NVIDIA H200", "NVIDIA L4"):
    with jax.sharding.use_abstract_mesh(_gpu_mesh(kind)):
      assert dispatch.select("stochastic_round", SR_BACKENDS, None, order=ORDER) == "xla"
      assert dispatch.select("stochastic_round", SR_BACKENDS, "triton", order=ORDER) == "triton"
      assert dispatch.select("adam_update", ADAM_BACKENDS, None) == "triton"
  tpu = next(t for t in harness.TARGETS if t.implementation == "mosaic_tpu")
  with jax.sharding.use_abstract_mesh(harness.abstract_mesh(tpu)):
    assert dispatch.select("stochastic_round", SR_BACKENDS, None, order=ORDER) == "xla"
    assert dispatch.select("stochastic_round", SR_BACKENDS, "mosaic_tpu", order=ORDER) == "mosaic_tpu"
    assert dispatch.select("adam_update", ADAM_BACKENDS, None) == "mosaic_tpu"


def test_cpu_and_unknown_platforms_run_the_reference(monkeypatch):
  assert dispatch.select("adam_update", ADAM_BACKENDS, None, (jnp.ones(3),)) == "xla"
  monkeypatch.setattr(dispatch, "current_platform", lambda arrays=(): "metal")
  assert dispatch.resolve_implementation("adam_update", None, available=ADAM_BACKENDS) == "xla"


def test_a_refused_default_falls_back_and_is_logged(monkeypatch, caplog):
  monkeypatch.setattr(SR_BACKENDS["triton"], "supports", lambda call: "not today")
  with caplog.at_level(logging.DEBUG, logger="fuseopt"):
    with jax.sharding.use_abstract_mesh(_gpu_mesh("NVIDIA H200")):
      assert dispatch.select("stochastic_round", SR_BACKENDS, None) == "xla"
  assert any("stochastic_round" in r.getMessage() and "triton" in r.getMessage()
             and "not today" in r.getMessage() for r in caplog.records), caplog.records


def test_a_forced_backend_that_cannot_run_raises_with_op_backend_and_reason():
  with jax.sharding.use_abstract_mesh(_gpu_mesh("NVIDIA L4")):
    with pytest.raises(ValueError, match=r"adam_update: implementation='mosaic_gpu' cannot run"
                                         r".*compute capability 8\.9"):
      dispatch.select("adam_update", ADAM_BACKENDS, "mosaic_gpu")
    with pytest.raises(ValueError, match=r"newton_schulz: implementation='mosaic_gpu' cannot run"
                                         r".*compute capability 8\.9"):
      dispatch.select("newton_schulz", NS_BACKENDS, "mosaic_gpu")
  with pytest.raises(ValueError, match="not available for newton_schulz"):
    dispatch.select("newton_schulz", NS_BACKENDS, "mosaic")


@pytest.mark.mosaic_gpu_refusal
def test_mosaic_gpu_is_refused_on_a_release_without_what_its_kernels_use(monkeypatch):
  """Every op's mosaic_gpu backend, in interpret mode or for an H200, refuses
  with the release's reason (fuseopt.compat) where jax's Mosaic GPU lacks
  what the kernels use (jax 0.10.2), naming the op and the backend."""
  from fuseopt import compat
  if compat.mosaic_gpu_missing():        # such a release: its own reason
    reason = compat.mosaic_gpu_release_reason()
    assert "jax >= 0.11.2's Mosaic GPU" in reason and jax.__version__ in reason
  else:                                  # else as that release would say
    monkeypatch.setattr(compat, "mosaic_gpu_missing", lambda: ("plgpu.something",))
  for op, backends in OPS.items():
    with pytest.raises(ValueError, match=rf"{op}: implementation='mosaic_gpu' cannot run this "
                                         r"call: .*need jax >= 0\.11\.2's Mosaic GPU"):
      dispatch.select(op, backends, "mosaic_gpu", interpret=True)
    with jax.sharding.use_abstract_mesh(_gpu_mesh("NVIDIA H200")):
      with pytest.raises(ValueError, match=r"need jax >= 0\.11\.2's Mosaic GPU"):
        dispatch.select(op, backends, "mosaic_gpu")
  # The target is still checked first: an L4 is refused for its compute capability.
  with jax.sharding.use_abstract_mesh(_gpu_mesh("NVIDIA L4")):
    with pytest.raises(ValueError, match=r"compute capability 8\.9"):
      dispatch.select("adam_update", ADAM_BACKENDS, "mosaic_gpu")


def test_an_untileable_leaf_falls_back_to_the_reference_and_is_logged(caplog):
  p, g, mu, nu = (jnp.full((3, 5), v, jnp.float32) for v in (1.0, 0.5, 0.1, 0.2))
  with caplog.at_level(logging.DEBUG, logger="fuseopt"):
    got = adam_update(p, g, mu, nu, count=1, learning_rate=1e-3, implementation="mosaic_tpu",
                      interpret=True)
  want = adam_update(p, g, mu, nu, count=1, learning_rate=1e-3, implementation="xla")
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert any("mosaic_tpu" in r.getMessage() and "reference" in r.getMessage()
             for r in caplog.records), caplog.records


def test_environment_overrides_are_read_by_one_function(monkeypatch):
  monkeypatch.setenv("FUSEOPT_IMPLEMENTATION", "triton")
  monkeypatch.setenv("FUSEOPT_IMPLEMENTATION_ADAM_UPDATE", "xla")
  monkeypatch.setenv("FUSEOPT_NS_PATH", "tiled")
  o = dispatch.environment_overrides()
  assert o.implementation_for("adam_update") == ("FUSEOPT_IMPLEMENTATION_ADAM_UPDATE", "xla")
  assert o.implementation_for("newton_schulz") == ("FUSEOPT_IMPLEMENTATION", "triton")
  assert o.ns_path == "tiled"
  # never over an explicit argument
  assert dispatch.select("newton_schulz", NS_BACKENDS, "xla") == "xla"


def test_one_op_call_reads_the_environment_once(monkeypatch):
  reads = []
  real = dispatch.environment_overrides
  monkeypatch.setattr(dispatch, "environment_overrides", lambda: reads.append(1) or real())
  x = jax.random.normal(jax.random.key(0), (32, 64))
  newton_schulz(x, implementation="triton", interpret=True)   # select, then the kernel path
  assert len(reads) == 1
  reads.clear()
  stochastic_round_bf16(jnp.ones((8,)), 3)
  assert len(reads) == 1


def test_ns_path_never_overrides_gram_or_config(monkeypatch, caplog):
  assert paths.pick_path("triton", 64, 256, 1, None, False, "fused") == "fused"
  with caplog.at_level(logging.WARNING, logger="fuseopt"):
    assert paths.pick_path("triton", 64, 256, 1, None, True, "fused") == "tiled"
  assert any("FUSEOPT_NS_PATH=fused ignored" in r.getMessage() for r in caplog.records)
  assert paths.pick_path("triton", 64, 256, 1, paths.TiledConfig(), False, "fused") == "tiled"
  from fuseopt.kernels.newton_schulz import fused
  assert paths.pick_path("triton", 64, 256, 1, fused.TritonConfig(), False, "tiled") == "fused"
  with pytest.raises(ValueError, match="FUSEOPT_NS_PATH='bogus'"):
    paths.pick_path("triton", 64, 256, 1, None, False, "bogus")
  monkeypatch.setenv("FUSEOPT_NS_PATH", "bogus")
  x = jax.random.normal(jax.random.key(0), (32, 64))
  with pytest.raises(ValueError, match="FUSEOPT_NS_PATH"):
    newton_schulz(x, implementation="triton", interpret=True)


def test_overrides_are_read_at_trace_time_and_jit_keeps_what_it_traced(monkeypatch):
  """The documented rule: a function jitted before a variable changed keeps
  its traced choice until jax's caches are cleared."""
  monkeypatch.delenv("FUSEOPT_IMPLEMENTATION", raising=False)
  monkeypatch.delenv("FUSEOPT_IMPLEMENTATION_STOCHASTIC_ROUND", raising=False)
  f = jax.jit(lambda x: stochastic_round_bf16(x, 3))
  x = jnp.linspace(0.0, 1.0, 256, dtype=jnp.float32)
  want = f(x)
  monkeypatch.setenv("FUSEOPT_IMPLEMENTATION", "bogus")
  np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(want))   # the cached trace
  jax.clear_caches()
  with pytest.raises(ValueError, match="FUSEOPT_IMPLEMENTATION='bogus'"):
    f(x)
