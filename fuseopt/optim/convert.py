"""A run's Adam moments converted to another format: resume in a smaller one.

:func:`convert_moments` takes an optimizer state (what ``tx.init`` returned
and ``update`` / :func:`fuseopt.optim.step` advanced, or a checkpoint of it)
and gives the same state with every Adam moment (``ScaleByAdamState.mu`` and
``nu``, wherever they are: the AdamW side of the Muon family included) in
another format: fp32, bf16, 8-bit (:mod:`fuseopt.kernels.adam.quantized`) or
4-bit (:mod:`fuseopt.kernels.adam.int4`).
The result has the structure, shapes and dtypes ``tx.init`` gives for that
format, so a transform built with the new ``moment_dtype`` takes it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fuseopt.kernels import counter_hash
from fuseopt.kernels import fp_contract
from fuseopt.kernels.adam import formats
from fuseopt.optim import _checks
from fuseopt.optim.normuon_transforms import NorMuonState

__all__ = ["convert_moments"]


def convert_moments(state: Any, moment_dtype: Any = None, *, momentum_dtype: Any = None,
                    seed: int = 0) -> Any:
  """``state`` with its Adam moments in ``moment_dtype`` and (with
  ``momentum_dtype``) the Muon family's momentum in that format.

  Args:
    state: an optimizer state of fuseopt's (or optax's) Adam family, any
      nesting of chains, partitions and masks.
    moment_dtype: ``"float32"``, ``"bfloat16"``, ``"int8"`` or ``"int4"``
      (the ``moment_dtype`` of :func:`fuseopt.optim.adamw`: a dtype, its name
      or its scalar type), or None to keep the Adam moments as they are. To 8
      or 4 bits, a leaf without quantisation blocks keeps bf16 moments, as
      ``tx.init`` does.
    momentum_dtype: the format of Muon's momentum (``MuonState.mu``,
      ``NorMuonState.mu``): a floating dtype (``"float32"``, ``"bfloat16"``)
      or ``"int8"`` (the ``mu_dtype`` of :func:`fuseopt.optim.muon`), or None
      (the default) to keep it. To 8 bits, a leaf without quantisation blocks
      keeps bf16 momentum, as ``tx.init`` does.
    seed: the counter-hash seed of the blockwise codes' stochastic rounding
      (leaf ``i``'s codes are rounded with ``derive_seed(seed, 0, i,
      STREAM_MU / STREAM_NU)``, ``i`` its position among the state's moment
      leaves): the same state and seed give the same codes. Any uint32 value
      (an integer in [0, 2**32), an integer jax scalar); a float, a bool, a
      non-scalar (``TypeError``) or an integer outside that range
      (``ValueError``) is refused naming ``seed``.

  Returns:
    The state, every ``mu`` and ``nu`` (and Muon momentum) converted:
    blockwise moments dequantised, then cast (fp32 exactly; bf16 rounded to
    nearest) or quantised again; the counts and every other part of the state
    as they were.
  """
  target = _checks.moment_format("convert_moments", "moment_dtype", moment_dtype)
  momentum = (None if momentum_dtype is None
              else _checks.muon_mu_dtype("convert_moments", momentum_dtype, "momentum_dtype"))
  # Every uint32 is a seed; a float, a bool, a non-scalar or an integer
  # outside [0, 2**32) is refused naming it (docs/validation.md, "Seeds").
  seed = counter_hash.uint32_scalar(seed, name="seed", owner="convert_moments")
  if target is None and momentum is None:
    raise ValueError("convert_moments: name a format: moment_dtype (float32, bfloat16, 'int8' or "
                     "'int4') for Adam's moments, momentum_dtype (a floating dtype or 'int8') "
                     "for Muon's momentum, or both; got neither")
  counter = [0]

  def moments(tree, signed, to):
    def one(m):
      if isinstance(m, optax.MaskedNode) or m is None:
        return m
      i = counter[0]
      counter[0] += 1
      return _convert(m, to, signed=signed, seed=seed, leaf_index=i)
    return jax.tree.map(one, tree, is_leaf=lambda x: formats.is_blockwise(x)
                        or isinstance(x, optax.MaskedNode))

  def convert(s):
    if isinstance(s, optax.ScaleByAdamState) and target is not None:
      return s._replace(mu=moments(s.mu, True, target), nu=moments(s.nu, False, target))
    if isinstance(s, _MUON_STATES) and momentum is not None:
      return s._replace(mu=moments(s.mu, True, momentum))
    return s

  return jax.tree.map(convert, state, is_leaf=lambda x: isinstance(x, _STATES))


# The Muon family's states (their ``mu``: the momentum).
_MUON_STATES = (optax.contrib.MuonState, NorMuonState)
_STATES = (optax.ScaleByAdamState,) + _MUON_STATES


def _convert(m, target, *, signed: bool, seed: int, leaf_index: int):
  value = (formats.of(m).dequantize(m, signed=signed) if formats.is_blockwise(m)
           else jnp.asarray(m).astype(jnp.float32))
  if target not in _checks.BLOCKWISE:
    return value.astype(target)
  fmt = formats.BY_NAME[target]
  shape = value.shape
  if not fmt.fits(shape):
    return value.astype(jnp.bfloat16)   # as tx.init: a leaf without whole blocks
  stream = counter_hash.STREAM_MU if signed else counter_hash.STREAM_NU
  leaf_seed = counter_hash.derive_seed(seed, 0, np.uint32(leaf_index), stream)
  index = jax.lax.iota(jnp.uint32, value.size).reshape(shape)
  # (squares rounded before their subtractions: the same codes in any program)
  return fmt.quantize(value, counter_hash.hash_bits(index, leaf_seed), signed=signed,
                      fence=fp_contract.rounded)
