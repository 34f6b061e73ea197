"""The shared harness every kernel op's tests reuse.

Two checks per op:

- ``check_against_reference``: run a Pallas backend in interpret mode
  (``interpret=True`` for triton, ``pltpu.InterpretParams()`` for
  mosaic_tpu, both via the op's ``interpret=True``) on fresh random inputs and
  compare with the plain-jnp reference;
- ``lower_for``: lower a jitted call for a real accelerator from the CPU,
  under an abstract mesh whose device is an H200 (``cuda``) or a TPU v5e /
  v6e (``tpu``). This catches block-shape and lowering errors of every config
  in an op's search space without hardware.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from fuseopt import compat


def runnable(*implementations: str) -> tuple[str, ...]:
  """``implementations`` less ``"mosaic_gpu"`` where the installed jax's
  Mosaic GPU lacks what fuseopt's kernels use (jax 0.10.2: the backend
  refuses there, :func:`fuseopt.compat.mosaic_gpu_release_reason`), for a
  test that checks several backends in one body; a test of one backend
  whose id names mosaic_gpu is skipped instead (tests/conftest.py)."""
  missing = compat.mosaic_gpu_release_reason()
  return tuple(i for i in implementations if not (missing and i == "mosaic_gpu"))


@dataclasses.dataclass(frozen=True)
class Target:
  name: str
  device_kind: str
  platform: str           # AbstractDevice platform
  lowering_platform: str  # jax lowering platform
  implementation: str     # fuseopt backend that runs there
  num_cores: int = 1


TARGETS = (
    Target("h200", "NVIDIA H200", "gpu", "cuda", "triton", 132),
    Target("tpu_v5e", "TPU v5 lite", "tpu", "tpu", "mosaic_tpu"),
    Target("tpu_v6e", "TPU v6 lite", "tpu", "tpu", "mosaic_tpu"),
)
TARGET_IDS = [t.name for t in TARGETS]

_KERNEL_CALL = {"cuda": r"custom_call @__gpu\$xla\.gpu\.triton|__gpu", "tpu": r"tpu_custom_call"}


def targets_for(implementation: str):
  return [t for t in TARGETS if t.implementation == implementation]


def abstract_mesh(target: Target) -> AbstractMesh:
  return AbstractMesh((), (), abstract_device=AbstractDevice(
      device_kind=target.device_kind, num_cores=target.num_cores,
      platform=target.platform))


def lower_for(target: Target, fn: Callable, *avals: Any, expect_kernel: bool = True) -> str:
  """Lowers ``jax.jit(fn)(*avals)`` for ``target``; returns the StableHLO text.

  Asserts the text holds a Pallas kernel call for that platform, so a silent
  fallback to XLA fails the test.
  """
  with use_abstract_mesh(abstract_mesh(target)):
    text = jax.jit(fn).trace(*avals).lower(
        lowering_platforms=(target.lowering_platform,)).as_text()
  if expect_kernel:
    assert re.search(_KERNEL_CALL[target.lowering_platform], text), (
        f"no {target.implementation} kernel in the lowering for {target.name}")
  return text


def bits(x: jax.Array) -> np.ndarray:
  """The bit patterns of a float array, for bitwise comparisons (NaN-safe)."""
  x = np.asarray(jax.device_get(x))
  width = {2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize]
  return x.view(width)


def assert_bitwise_equal(actual, expected, what: str = ""):
  a, e = bits(actual), bits(expected)
  assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
  bad = np.flatnonzero(a.reshape(-1) != e.reshape(-1))
  assert bad.size == 0, (f"{what}: {bad.size} of {a.size} elements differ, first at flat "
                         f"{bad[:5]}: {a.reshape(-1)[bad[:5]]} vs {e.reshape(-1)[bad[:5]]}")


def assert_close(actual, expected, *, rtol, atol, what: str = ""):
  np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32),
                             rtol=rtol, atol=atol, err_msg=what)


def check_against_reference(kernel_fn: Callable, reference_fn: Callable, inputs, *,
                            bitwise: bool = True, rtol=0.0, atol=0.0, what=""):
  """Runs ``kernel_fn(*inputs)`` (interpret mode is the caller's argument) and
  the reference, and compares every output leaf."""
  got = kernel_fn(*inputs)
  want = reference_fn(*inputs)
  got_leaves, got_def = jax.tree.flatten(got)
  want_leaves, want_def = jax.tree.flatten(want)
  assert got_def == want_def, f"{what}: output structure {got_def} != {want_def}"
  for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
    assert g.dtype == w.dtype, f"{what}[{i}]: dtype {g.dtype} != {w.dtype}"
    if bitwise:
      assert_bitwise_equal(g, w, f"{what}[{i}]")
    else:
      assert_close(g, w, rtol=rtol, atol=atol, what=f"{what}[{i}]")
  return got, want


def fresh_key(request) -> jax.Array:
  """A PRNG key that differs per test and per run (fresh random inputs), and is
  printed on failure via the test id so a failure can be replayed:
  ``FUSEOPT_TEST_SEED=<seed> scripts/test <test id>`` draws that seed again.

  A test on fresh inputs asserts only what holds for every seed
  (docs/testing.md); ``scripts/seed-sweep`` runs these tests many times.
  """
  replay = os.environ.get("FUSEOPT_TEST_SEED")
  seed = int(replay) if replay else np.random.SeedSequence().entropy % (2**31)
  request.node.user_properties.append(("seed", seed))
  print(f"random seed for {request.node.nodeid}: {seed}")
  return jax.random.key(seed)
