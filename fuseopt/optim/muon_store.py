"""The store stage of Muon's step: how a value computed in fp32 is written
back (the momentum, NorMuon's second moment, a bf16 parameter), and the
layout a finished leaf is pinned to.

bf16 values are stochastically rounded with the counter hash, seeded by the
step, the leaf and the stream (:data:`MUON_SEED`, ``STREAM_MU``,
``STREAM_NU``, ``STREAM_PARAM``), so a value's rounding does not depend on
where or how often the step runs (sharded, unsharded, fused or not). An
8-bit momentum (``mu_dtype="int8"``) is Adam's 8-bit ``mu``
(:mod:`fuseopt.kernels.adam.quantized`: int8 codes, an fp32 scale per block
of 256 along the last axis) written with the same hash and Muon's
``STREAM_MU`` seeds: :func:`store_int8`, :func:`load`. On Explicit mesh axes
whose shards split its blocks (a leaf's last axis sharded below 256 a
device), both run with the blocked axes gathered and put their results back
where the leaf lies, as Adam's blockwise moments do
(:mod:`fuseopt.kernels.adam.tree`): a block's scale is its absmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fuseopt import compat
from fuseopt import kernels
from fuseopt.kernels import counter_hash
from fuseopt.kernels import sharding as sharding_lib
from fuseopt.kernels.adam import blocks
from fuseopt.kernels.adam import formats
from fuseopt.kernels.adam import quantized

__all__ = ["MUON_SEED", "check_momentum_format", "in_leaf_layout", "init_momentum", "leaf_shaped",
           "load", "store", "store_int8"]

# Seed of Muon's stochastic roundings (momentum and, in the fused step,
# bf16 parameters), apart from the Adam side's default seed 0: "Muon".
MUON_SEED = 0x4D756F6E


def store(x32, dtype, count, leaf_index, stream):
  """fp32 ``x32`` in ``dtype``: bf16 with the counter-hash stochastic
  rounding (seed ``derive_seed(MUON_SEED, count, leaf_index, stream)``), plain
  jnp so that XLA fuses it into the pass that computes ``x32``; any other
  dtype by a cast."""
  if jnp.dtype(dtype) == jnp.bfloat16:
    seed = counter_hash.derive_seed(MUON_SEED, count, leaf_index, stream)
    return kernels.stochastic_round_bf16(x32, seed, implementation="xla")
  return x32.astype(dtype)


def _splitting(x):
  """The placement of a leaf-shaped ``x`` where it lies on Explicit mesh axes
  whose shards split its quantisation blocks (its blocked view's rows), else
  None. (On Auto axes XLA partitions the blocked reshape itself.)"""
  placement = sharding_lib.placement_of(x)
  shape = jnp.shape(x)
  if (not isinstance(placement, sharding_lib.Placement) or not blocks.fits(shape)
      or blocks.shard_fits(shape, placement.local_shape(shape))):
    return None
  return placement


def _placed(x, placement, spec):
  """``x`` resharded to ``spec`` on ``placement``'s mesh, fitted to its shape
  (an axis whose shards would split it stays whole)."""
  fitted = sharding_lib.Placement(placement.mesh, spec).dividing_spec(jnp.shape(x))
  return jax.sharding.reshard(x, jax.sharding.NamedSharding(placement.mesh, fitted))


def _gathered(m, placement, shape):
  """An 8-bit momentum ``m`` of a leaf of ``shape`` with its blocked axes
  whole: the codes placed as the gathered leaf, the scales as its blocked view."""
  spec = blocks.gathered_spec(placement.spec, shape)
  return quantized.QuantizedMoment(_placed(m.codes, placement, spec),
                                   _placed(m.scales, placement, blocks.blocked_spec(spec, shape)))


def load(m):
  """A stored momentum leaf as a value to compute with: an 8-bit one
  (:class:`~fuseopt.kernels.adam.quantized.QuantizedMoment`) decoded to fp32
  (plain jnp, fused by XLA into the pass that reads it), any other as it is."""
  if not quantized.is_quantized(m):
    return m
  placement = _splitting(m.codes)
  if placement is None:
    return quantized.dequantize(m, signed=True)
  x = quantized.dequantize(_gathered(m, placement, m.codes.shape), signed=True)
  return _placed(x, placement, placement.spec)


def store_int8(x32, count, leaf_index, stream, keep=None, old=None, offset=0):
  """fp32 ``x32`` as an 8-bit momentum: :func:`~fuseopt.kernels.adam.quantized.quantize_mu`
  over blocks of 256 of the leaf's blocked view (:mod:`fuseopt.kernels.adam.blocks`), element ``i`` (its flat index in
  the whole leaf) rounded with ``hash_bits(i, derive_seed(MUON_SEED, count,
  leaf_index, stream))``, so the codes do not depend on sharding or fusion.
  ``keep`` (broadcastable to ``x32``, or None): where true the ``old``
  :class:`~fuseopt.kernels.adam.quantized.QuantizedMoment` is kept, a whole
  block at a time where every element of the block is kept (a block that
  mixes both is quantised again from ``x32``, which holds the old values
  there). ``offset`` (uint32): the flat index in the whole leaf of ``x32``'s
  first element, where ``x32`` is a slice of the leaf's leading axis."""
  shape = x32.shape
  placement = _splitting(x32)
  if placement is not None:
    # (the blocked axes gathered, the result put back where the leaf lies)
    spec = blocks.gathered_spec(placement.spec, shape)
    x32 = _placed(x32, placement, spec)
    if keep is not None:
      keep = _placed(jnp.broadcast_to(keep, shape), placement, spec)
      old = _gathered(old, placement, shape)
    new = store_int8(x32, count, leaf_index, stream, keep, old)
    return quantized.QuantizedMoment(
        _placed(new.codes, placement, placement.spec),
        _placed(new.scales, placement, blocks.blocked_spec(placement.spec, shape)))
  bshape = quantized.scales_shape(shape) + (quantized.BLOCK,)
  seed = counter_hash.derive_seed(MUON_SEED, count, leaf_index, stream)
  index = (jax.lax.iota(jnp.uint32, x32.size) + jnp.asarray(offset, jnp.uint32)).reshape(bshape)
  codes, scale = quantized.quantize_mu(x32.reshape(bshape), counter_hash.hash_bits(index, seed))
  new = quantized.QuantizedMoment(codes.reshape(shape), scale[..., 0])
  if keep is None:
    return new
  kept = jnp.all(jnp.broadcast_to(keep, shape).reshape(bshape), axis=-1)
  return quantized.QuantizedMoment(
      quantized.kept_on_skip(jnp.repeat(kept, quantized.BLOCK, axis=-1).reshape(shape),
                             new.codes, old.codes),
      quantized.kept_on_skip(kept, new.scales, old.scales))


def leaf_shaped(mu):
  """The momentum tree with each 8-bit leaf as its codes: one array a
  parameter, in the parameter's shape (what per-leaf readers key on)."""
  return jax.tree.map(lambda m: m.codes if quantized.is_quantized(m) else m, mu,
                      is_leaf=quantized.is_quantized)


def init_momentum(p, mu_dtype, int8: bool):
  """A zero momentum for parameter ``p``: 8-bit where ``int8`` (placed like
  ``p``), else ``mu_dtype`` (None: ``p``'s)."""
  if int8:
    return quantized.zeros_like(p, signed=True)
  return jnp.zeros_like(p, dtype=mu_dtype)


def _momentum_name(mu_dtype) -> str:
  """A momentum format as the messages name it."""
  if mu_dtype == quantized.MOMENT_DTYPE_NAME:
    return (f"8-bit momentum ({quantized.QuantizedMoment.__name__} codes and scales, "
            f"mu_dtype={mu_dtype!r})")
  if mu_dtype is None:
    return "momentum in the parameters' dtype (mu_dtype=None)"
  return f"{jnp.dtype(mu_dtype).name} momentum (mu_dtype={jnp.dtype(mu_dtype).name!r})"


def check_momentum_format(owner: str, mu_dtype, mu) -> None:
  """Raises a ``ValueError`` naming the leaf, the format this Muon keeps
  (``mu_dtype``: a floating dtype, ``"int8"`` or None) and the one the state
  holds, where a momentum leaf of ``mu`` is in another: 8-bit codes to a
  dense ``mu_dtype`` or None, a dense momentum of a leaf that ``"int8"``
  keeps in 8 bits (one with whole blocks; the others keep bf16), a dense
  dtype other than a dense ``mu_dtype``. The AdamW side's refusal of moments
  in another format, on Muon's side: the step used to run on, the state
  keeping the format it came with. A check of types (free under ``jit``)."""
  int8 = mu_dtype == quantized.MOMENT_DTYPE_NAME
  for path, m in jax.tree_util.tree_flatten_with_path(mu, is_leaf=formats.is_blockwise)[0]:
    if formats.is_blockwise(m):
      if int8 and quantized.is_quantized(m):
        continue
      found = (_momentum_name(quantized.MOMENT_DTYPE_NAME) if quantized.is_quantized(m)
               else f"{formats.of(m).name} codes")
    else:
      dtype = jnp.result_type(m)
      if int8:
        wanted = None if quantized.fits(jnp.shape(m)) else jnp.dtype(jnp.bfloat16)
      else:
        wanted = None if mu_dtype is None else jnp.dtype(mu_dtype)
      if (wanted is None and not int8) or dtype == wanted:
        continue
      found = f"{dtype.name} momentum"
    raise ValueError(
        f"{owner}: the state holds {found} at {jax.tree_util.keystr(path) or '<the params>'}, "
        f"but this optimizer keeps {_momentum_name(mu_dtype)}: was the state built by another "
        f"optimizer's init? Build it with this one's tx.init, or this optimizer with the "
        f"state's momentum format (fuseopt.optim.convert_moments(state, "
        f"momentum_dtype=...) converts it)")


def in_leaf_layout(x, platform: str):
  """``x`` (a Muon leaf's update or new parameter) pinned to the leaf's
  row-major layout on a TPU.

  Unpinned, libtpu lays out a tall matrix's update as the Newton-Schulz
  call's transposed result is laid out (column-major) when the call holds
  that matrix alone: the fused step then copies the parameter into that
  layout, updates it out of place and copies it back into the donated
  output at the end of the step, so every such leaf's new parameter stays
  live until then (docs/fused_step.md has the measured cost). A layout
  changes no value; on other platforms nothing is pinned, so their programs
  stay as they were. The pin is :func:`fuseopt.compat.pin_layout`, which a
  jitted step may return and donate into on every supported release (a bare
  ``with_layout_constraint`` as a donated step's output raises on jax
  0.10.2).
  """
  if platform != "tpu":
    return x
  # (a mantissa-tracked parameter is a pair: both halves pinned)
  return jax.tree.map(lambda t: compat.pin_layout(t, tuple(range(jnp.ndim(t)))), x)
