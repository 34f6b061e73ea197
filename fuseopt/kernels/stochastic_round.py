"""Counter-hash stochastic rounding fp32 → bf16: reference, Triton and Mosaic-TPU kernels.

The contract (docs/numerics.md, "Stochastic rounding") is implemented once in
:func:`fuseopt.kernels.counter_hash.round_fp32_bits_to_bf16`; the backends
differ only in how they tile the flat index space:

- ``xla``: the reference, plain ``jnp`` over the whole array;
- ``triton``: a 1-D grid over the flattened array, ``block`` elements a
  program (a power of two); the ragged last block is masked;
- ``mosaic_tpu``: the array in its own TPU layout, blocks of its last two dims
  (:func:`fuseopt.kernels._elementwise.mosaic_tiling`) when the last dim
  spans the 128 lanes (any width past that); other arrays are viewed as
  flat ``(rows, 128)`` lanes, and a tail of fewer than 128 elements (sizes
  that are not a multiple of 128) is rounded by the reference, with its
  offset.
- ``mosaic_gpu``: Pallas's Mosaic GPU lowering, sm_90 only
  (:mod:`fuseopt.kernels.stochastic_round_mosaic_gpu`): a 1-D grid over the
  flattened array, ``block`` elements a program, the last ``size % 128``
  rounded by the reference.

Because the random bits depend only on ``(seed, offset + flat index)``, every
backend and every block size gives bitwise the same result.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from fuseopt.kernels import _backend
from fuseopt.kernels._elementwise import (LANES, MosaicConfig, MosaicGPUConfig, TritonConfig,
                                          triton_heuristic)
from fuseopt.kernels import _elementwise
from fuseopt.kernels import counter_hash
from fuseopt.kernels import sharding as sharding_lib

OP_NAME = "stochastic_round"
# ----------------------------------------------------------------- configs --
TRITON_SEARCH_SPACE = tuple(TritonConfig(b, w) for b in (512, 1024, 2048, 4096)
                            for w in (4, 8))
MOSAIC_SEARCH_SPACE = tuple(MosaicConfig(r) for r in (256, 512, 1024, 2048))


def mosaic_heuristic(size: int) -> MosaicConfig:
  # One budget for every size: an array under it is one full-extent block anyway.
  del size
  return MosaicConfig(block_rows=1024)


# --------------------------------------------------------------- reference --
def stochastic_round_reference(x: jax.Array, seed, *, offset=0, index_map=None) -> jax.Array:
  """The specification: plain jnp over the whole array.

  ``index_map`` (:mod:`fuseopt.kernels.sharding`) maps ``x``'s local flat
  indices to those of the global array ``x`` is a shard of; ``None``: ``x``
  is contiguous in it, from ``offset`` on.
  """
  x = jnp.asarray(x)
  seed = counter_hash.uint32_scalar(seed, name="seed", owner="stochastic_round_reference")
  offset = counter_hash.uint32_scalar(offset, name="offset", owner="stochastic_round_reference")
  local = jax.lax.iota(jnp.uint32, x.size).reshape(x.shape) if x.ndim else jnp.uint32(0)
  index = sharding_lib.global_index(local, index_map, offset)
  return counter_hash.stochastic_round_values(x, index, seed)


# ------------------------------------------------------------------ triton --
def _triton_kernel(scalars_ref, x_ref, o_ref, *, block, index_map):
  seed = scalars_ref[0]
  offset = scalars_ref[1]
  index = sharding_lib.global_index(_elementwise.triton_flat_index(block), index_map, offset)
  o_ref[...] = counter_hash.stochastic_round_values(x_ref[...], index, seed)


def _round_triton(flat, scalars, *, config: TritonConfig, interpret, index_map=None):
  from jax.experimental.pallas import triton as plgpu
  (n,) = flat.shape
  block = config.block
  return pl.pallas_call(
      functools.partial(_triton_kernel, block=block, index_map=index_map),
      out_shape=jax.ShapeDtypeStruct((n,), jnp.bfloat16),
      grid=(pl.cdiv(n, block),),
      in_specs=[pl.BlockSpec((2,), lambda i: (0,)),
                pl.BlockSpec((block,), lambda i: (i,))],
      out_specs=pl.BlockSpec((block,), lambda i: (i,)),
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1),
      interpret=interpret,
      name="fuseopt_stochastic_round",
      cost_estimate=_backend.cost_estimate(flops=0, bytes_accessed=n * (flat.dtype.itemsize + 2)),
  )(scalars, flat)


# -------------------------------------------------------------- mosaic_tpu --
# fp32 in, bf16 out; no output is aliased, so a ragged last block is fine.
_TILING = dict(stream_bytes=4 + 2, ragged_edge=True)


def _mosaic_kernel(scalars_ref, x_ref, o_ref, *, tiling, index_map):
  seed = scalars_ref[0].astype(jnp.uint32)
  offset = scalars_ref[1].astype(jnp.uint32)
  index = sharding_lib.global_index(tiling.flat_index(), index_map, offset)
  o_ref[...] = counter_hash.stochastic_round_values_32bit(x_ref[...], index, seed)


def _round_mosaic(x, scalars, *, tiling: _elementwise.MosaicTiling, interpret, index_map=None):
  from jax.experimental.pallas import tpu as pltpu
  out = pl.pallas_call(
      functools.partial(_mosaic_kernel, tiling=tiling, index_map=index_map),
      out_shape=jax.ShapeDtypeStruct(tiling.view, jnp.bfloat16),
      grid=tiling.grid,
      in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), tiling.spec()],
      out_specs=tiling.spec(),
      compiler_params=_backend.mosaic_compiler_params(interpret, tiling.semantics),
      interpret=interpret,
      name="fuseopt_stochastic_round",
      cost_estimate=_backend.cost_estimate(flops=0, bytes_accessed=x.size * (x.dtype.itemsize + 2)),
  )(scalars.astype(jnp.int32), x.reshape(tiling.view))
  return out.reshape(x.shape)


# ------------------------------------------------------------------ public --
def _round_local(x, seed, offset, *, index_map, impl, interpret, config):
  """Rounds one (local) array whose global indices ``index_map`` gives."""
  if impl == "mosaic_tpu" and sharding_lib.needs_division(index_map):
    # Mosaic has no vector integer division to rebuild the global index of a
    # shard cut along a later axis whose sizes are not powers of two: the
    # shard-local reference runs instead.
    impl = "xla"
  if impl == "xla" or x.size == 0:
    return stochastic_round_reference(x, seed, offset=offset, index_map=index_map)
  interp = _backend.interpret_arg(impl, interpret)
  scalars = jnp.stack([seed, offset])
  n = x.size
  if impl == "triton":
    config = config or triton_heuristic(n)
    out = _round_triton(x.reshape(-1), scalars, config=config, interpret=interp, index_map=index_map)
  elif impl == "mosaic_gpu":
    from fuseopt.kernels import stochastic_round_mosaic_gpu as mgpu
    out = mgpu.round_flat(x.reshape(-1), scalars, config=config or mgpu.heuristic(n),
                          interpret=interp, index_map=index_map)
  else:
    config = config or mosaic_heuristic(n)
    tiling = _elementwise.mosaic_tiling(x.shape, config, **_TILING)
    if tiling is not None:
      return _round_mosaic(x, scalars, tiling=tiling, interpret=interp, index_map=index_map)
    # No tiling of the whole array (a size that is not a multiple of 128, 1-D
    # or with a last dim under 128): flat lanes and a tail.
    flat = x.reshape(-1)
    main = (n // LANES) * LANES
    parts = []
    if main:
      parts.append(_round_mosaic(
          flat[:main], scalars, interpret=interp, index_map=index_map,
          tiling=_elementwise.mosaic_tiling((main,), config, **_TILING)))
    if main < n:
      # The tail's local indices continue from ``main``.
      tail = jax.lax.iota(jnp.uint32, n - main) + jnp.uint32(main)
      parts.append(counter_hash.stochastic_round_values(
          flat[main:], sharding_lib.global_index(tail, index_map, offset), seed))
    out = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
  return out.reshape(x.shape)


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
    implementation: ``None`` (by platform), ``"xla"``, ``"triton"``,
      ``"mosaic_tpu"`` or ``"mosaic_gpu"`` (sm_90 GPUs only: on any other
      target a ValueError names the device and its compute capability
      before anything is lowered; any machine in interpret mode).
    interpret: run a Pallas backend in interpret mode (CPU debugging).
    config: a :class:`TritonConfig` / :class:`MosaicConfig` /
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
  impl = _backend.resolve_implementation(OP_NAME, implementation, (x,),
                                         available=_backend.IMPLEMENTATIONS)
  if impl == "mosaic_gpu":
    _backend.check_mosaic_gpu_target("stochastic_round_bf16", interpret, (x,))
  want = {"triton": TritonConfig, "mosaic_tpu": MosaicConfig,
          "mosaic_gpu": MosaicGPUConfig}.get(impl)
  if config is not None and want is not None and not isinstance(config, want):
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
    return stochastic_round_reference(x, seed, offset=offset)
  index_map = sharding_lib.index_map_of(x.shape, placement.local_shape(x.shape))
  shape = x.shape

  def body(xl, seed, offset):
    return run(xl, seed, offset + placement.base(shape), index_map=index_map)

  P = jax.sharding.PartitionSpec
  out = sharding_lib.shard_local(body, placement.mesh, (placement.spec, P(), P()),
                                 placement.spec)(sharding_lib.to_spec(x, placement), seed, offset)
  return sharding_lib.like(out, x)
