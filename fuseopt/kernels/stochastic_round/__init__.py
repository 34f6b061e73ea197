"""Counter-hash stochastic rounding fp32 → bf16: the public function.

The contract (docs/numerics.md, "Stochastic rounding") is implemented once in
:func:`fuseopt.kernels.counter_hash.stochastic_round_values`; the backends
(one module each, chosen by :mod:`fuseopt.kernels.dispatch`) differ only in
how they tile the flat index space:

- ``xla`` (:mod:`.reference`): plain ``jnp`` over the whole array;
- ``triton`` (:mod:`.triton`): a 1-D grid over the flattened array, ``block``
  elements a program; the ragged last block is masked;
- ``mosaic_tpu`` (:mod:`.mosaic_tpu`): the array in its own TPU layout, a
  tail of fewer than 128 elements rounded by the reference;
- ``mosaic_gpu`` (:mod:`.mosaic_gpu`): Pallas's Mosaic GPU lowering, sm_90
  only: a 1-D grid over the flattened array, the last ``size % 128`` rounded
  by the reference.

Because the random bits depend only on ``(seed, offset + flat index)``, every
backend and every block size gives bitwise the same result.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fuseopt.kernels import counter_hash
from fuseopt.kernels import dispatch
from fuseopt.kernels import sharding as sharding_lib
from fuseopt.kernels.elementwise_tiling import MosaicGPUConfig
from fuseopt.kernels.elementwise_tiling import MosaicTPUConfig
from fuseopt.kernels.elementwise_tiling import TritonConfig
from fuseopt.kernels.stochastic_round.backends import BACKENDS, ORDER
from fuseopt.kernels.stochastic_round import mosaic_tpu  # each backend's SEARCH_SPACE and heuristic
from fuseopt.kernels.stochastic_round import triton
from fuseopt.kernels.stochastic_round.reference import stochastic_round_reference

OP_NAME = "stochastic_round"

__all__ = ["MosaicGPUConfig", "MosaicTPUConfig", "TritonConfig",
           "stochastic_round_bf16", "stochastic_round_reference"]


def stochastic_round_bf16(x, seed, *, offset=0, sharding=None, implementation=None,
                          interpret=False, config=None) -> jax.Array:
  """Rounds fp32 ``x`` to bf16 with the counter-hash stochastic rounding.

  Element ``i`` (row-major position in ``x``) rounds up with probability
  (discarded fraction) / 2**16, using the low 16 bits of
  ``fmix32((offset + i) * 0x9E3779B1 + seed)``. Rounding a slice with the
  right ``offset`` gives the same bits as rounding the whole array, and so
  does rounding a sharded ``x``: on a multi-device mesh the kernel runs
  shard-local (:mod:`fuseopt.kernels.sharding`) with ``i`` the global index.

  Args:
    x: fp32 array of any shape (bf16 is returned unchanged).
    seed: an integer scalar in [0, 2**32) (Python int, NumPy or jax integer;
      a traced value is taken modulo 2**32).
    offset: index of ``x``'s first element in the logical array it belongs
      to, an integer in [0, 2**32) like ``seed`` (a float raises).
    sharding: ``x``'s placement when its mesh axes are Auto (a
      ``NamedSharding`` or a ``PartitionSpec``); ``None`` reads it from
      ``x``'s type (Explicit axes). On an Auto mesh without it the reference
      runs (XLA partitions it) and a warning says so.
    implementation: ``None`` (chosen by :mod:`fuseopt.kernels.dispatch`:
      on a GPU the reference, which XLA fuses into one streaming pass that
      measured faster than the Triton kernel; on a TPU Mosaic),
      ``"xla"``, ``"triton"``, ``"mosaic_tpu"`` or ``"mosaic_gpu"`` (sm_90
      GPUs only: on any other target a ValueError names the device and its
      compute capability before anything is lowered; any machine in
      interpret mode).
    interpret: run a Pallas backend in interpret mode (CPU debugging).
    config: a :class:`TritonConfig` / :class:`MosaicTPUConfig` /
      :class:`MosaicGPUConfig` overriding the shape heuristic.

  Returns:
    A bf16 array shaped (and sharded) like ``x``. Its derivative is the identity (the
    straight-through estimator: the rounding is unbiased, so that is the
    derivative of its expectation).
  """
  x = jnp.asarray(x)
  # checked before the bf16 early return: a bad seed is bad whatever x is
  seed = counter_hash.uint32_scalar(seed, name="seed", owner="stochastic_round_bf16")
  offset = counter_hash.uint32_scalar(offset, name="offset", owner="stochastic_round_bf16")
  if x.dtype == jnp.bfloat16:
    return x
  if x.dtype != jnp.float32:
    raise TypeError(f"stochastic_round_bf16: x must be float32 (or bfloat16, "
                    f"returned unchanged), got {x.dtype}")
  impl = dispatch.select(OP_NAME, BACKENDS, implementation, (x,), interpret=interpret,
                         order=ORDER, dtype=x.dtype, shape=x.shape)
  if impl != "xla":
    want = BACKENDS[impl].Config
    if config is not None and not isinstance(config, want):
      raise TypeError(f"stochastic_round_bf16: config must be a {want.__name__} for "
                      f"implementation={impl!r}, got {config!r}")
  return _straight_through(functools.partial(
      _round, impl=impl, interpret=interpret, config=config, sharding=sharding), x, seed, offset)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _straight_through(fn, x, seed, offset):
  return fn(x, seed, offset)


@_straight_through.defjvp
def _straight_through_jvp(fn, primals, tangents):
  # The rounding is unbiased, E[round(x)] = x: its derivative in expectation
  # is the identity (the straight-through estimator), where the bit
  # manipulation itself would give zero (xla) or no rule at all (kernels).
  x, seed, offset = primals
  return fn(x, seed, offset), tangents[0].astype(jnp.bfloat16)


def _round_local(x, seed, offset, *, index_map, impl, interpret, config):
  """Rounds one (local) array whose global indices ``index_map`` gives."""
  if impl == "xla" or x.size == 0:
    return stochastic_round_reference(x, seed, offset=offset, index_map=index_map)
  return BACKENDS[impl].round_leaf(
      x, seed, offset, jnp.stack([seed, offset]), config=config, index_map=index_map,
      interpret=dispatch.interpret_arg(impl, interpret))


def _round(x, seed, offset, *, impl, interpret, config, sharding):
  """Places the rounding: the kernel on an unsharded ``x``, shard-local
  kernels on an evenly sharded one, the reference otherwise."""
  run = functools.partial(_round_local, impl=impl, interpret=interpret, config=config)
  placement = sharding_lib.placement_of(x, sharding, what="stochastic_round_bf16: x")
  if placement is sharding_lib.UNKNOWN:
    if impl != "xla":   # asked for the reference anyway: nothing to warn about
      sharding_lib.warn_unknown("stochastic_round_bf16", "sharding=")
    return stochastic_round_reference(x, seed, offset=offset)
  if placement is sharding_lib.UNSHARDED:
    return run(x, seed, offset, index_map=None)
  if not placement.is_even(x.shape):
    if impl != "xla":
      dispatch.log_fallback(OP_NAME, impl, f"x's shape {x.shape} does not divide evenly "
                            f"over its mesh axes", runs="the reference, partitioned by XLA,")
    return stochastic_round_reference(x, seed, offset=offset)
  index_map = sharding_lib.index_map_of(x.shape, placement.local_shape(x.shape))
  shape = x.shape

  def body(xl, seed, offset):
    return run(xl, seed, offset + placement.base(shape), index_map=index_map)

  P = jax.sharding.PartitionSpec
  out = sharding_lib.shard_local(body, placement.mesh, (placement.spec, P(), P()),
                                 placement.spec)(sharding_lib.to_spec(x, placement), seed, offset)
  return sharding_lib.like(out, x)
