r"""The momentum stage of Muon's step: one elementwise pass a leaf.

.. math::
  m_t = \beta m_{t-1} + (1-\beta) g_t, \qquad
  \hat m_t = \beta \frac{m_t}{1-\beta^{t+1}} + (1-\beta)\frac{g_t}{1-\beta^t}
  \ (\text{Nesterov; else } m_t/(1-\beta^t))

The pass reads the gradient and the old momentum once and writes the new
momentum (in the state's dtype, ``mu_dtype``: stochastically rounded when
bf16; with ``mu_dtype="int8"`` decoded from and written back as 8-bit codes
and block scales, :func:`fuseopt.optim.muon_store.store_int8`) and the Newton-Schulz input :math:`\hat m_t` (in the plan's dtype for
it) from the same fp32 values. A leaf declared
:class:`~fuseopt.optim.Experts` keeps the momentum of each matrix whose
gradient is all zero this step.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fuseopt.kernels import counter_hash
from fuseopt.kernels import fp_contract
from fuseopt.kernels.adam import quantized
from fuseopt.optim import matrix_views
from fuseopt.optim import muon_store
from fuseopt.optim.dtypes import KERNEL_DTYPES

__all__ = ["BiasCorrection", "Moved", "bias_correction", "momentum"]


@functools.partial(jax.jit, inline=True)
def _one_minus_pow(decay, count):
  return 1 - decay ** count


class BiasCorrection(NamedTuple):
  """A step's count and bias corrections: ``count`` is :math:`t`, ``bc1``
  :math:`1-\\beta^t`, ``bc2`` :math:`1-\\beta^{t+1}`."""
  count: jax.Array
  bc1: jax.Array
  bc2: jax.Array


def bias_correction(beta, count) -> BiasCorrection:
  """The corrections of the step after ``count``: optax.tree.bias_correction's
  ``1 - beta**t``, jitted so that an eager call rounds as optax's does (and
  applied leaf by leaf rather than through optax's tree function, which lets
  XLA fuse the pass with less temporary memory)."""
  count_inc = optax.safe_increment(count)
  return BiasCorrection(count_inc, _one_minus_pow(beta, count_inc),
                        _one_minus_pow(beta, optax.safe_increment(count_inc)))


class Moved(NamedTuple):
  """One leaf after its momentum pass: ``stored``, the new momentum in the
  state's format (a ``QuantizedMoment`` where 8-bit); ``ns_input``, :math:`\\hat m_t`; ``active``, for a leaf of
  experts, True for each matrix whose gradient is not all zero (else None)."""
  stored: Any
  ns_input: jax.Array
  active: jax.Array | None


def momentum(g, m, *, beta, nesterov: bool, correction: BiasCorrection, leaf_index: int,
             ns_dtype, experts=None, slices=None) -> Moved:
  """Leaf ``leaf_index``'s momentum pass (the module docstring): gradient
  ``g``, old momentum ``m``, the Newton-Schulz input in ``ns_dtype``;
  ``experts``: the leaf's cut where it is a stack of experts; ``slices``:
  the plan's :attr:`~fuseopt.optim.muon_plan.LeafPlan.momentum_slices` (an
  8-bit momentum's pass runs ``slices`` of the leading axis at a time)."""
  kw = dict(beta=beta, nesterov=nesterov, correction=correction, leaf_index=leaf_index,
            ns_dtype=ns_dtype)
  if slices is not None and quantized.is_quantized(m):
    return _sliced(g, m, slices, **kw)
  return _pass(g, m, experts=experts, **kw)


def _sliced(g, m, slices, **kw) -> Moved:
  """:func:`_pass` over ``slices`` of the leading axis at a time (a
  ``lax.map``): the fp32 values one pass holds are a slice's, not the
  leaf's; each slice's hash indices are offset to its place in the leaf."""
  n = g.shape[0]
  chunk = g.size // n * slices

  def cut(x):
    return x.reshape((n // slices, slices) + x.shape[1:])

  def body(args):
    k, gk, codes, scales = args
    mv = _pass(gk, quantized.QuantizedMoment(codes, scales), offset=k * jnp.uint32(chunk), **kw)
    return mv.stored.codes, mv.stored.scales, mv.ns_input

  codes, scales, h = jax.lax.map(
      body, (jnp.arange(n // slices, dtype=jnp.uint32), cut(g), cut(m.codes), cut(m.scales)))

  def whole(x):
    return x.reshape((n,) + x.shape[2:])
  return Moved(quantized.QuantizedMoment(whole(codes), whole(scales)), whole(h), None)


def _pass(g, m, *, beta, nesterov, correction, leaf_index, ns_dtype, experts=None,
          offset=0) -> Moved:
  """The pass over ``g`` and ``m`` whole (``offset``: the flat index of their
  first element in the leaf, for the 8-bit store's hash)."""
  a = None if experts is None else matrix_views.active(g, experts)
  int8 = quantized.is_quantized(m)
  # fp32 math for fp32/bf16/8-bit (bf16 momentum is stored stochastically
  # rounded); other dtypes keep optax's arithmetic in their own dtype.
  m_value = muon_store.load(m)
  wide = (jnp.float32 if int8 or {jnp.result_type(g), jnp.result_type(m)} <= set(KERNEL_DTYPES)
          else jnp.promote_types(jnp.result_type(g), jnp.result_type(m)))
  g32, m32 = g.astype(wide), m_value.astype(wide)
  # Every product that meets an add is rounded first (fp_contract): the
  # same bits in a sharded and an unsharded program on a CPU with FMA.
  r = fp_contract.rounded
  m_new = r((1 - beta) * g32) + r(beta * m32)
  if int8:
    if a is not None:
      m_new = jnp.where(a, m_new, m32)
    stored = muon_store.store_int8(m_new, correction.count, leaf_index, counter_hash.STREAM_MU,
                                   keep=None if a is None else ~a, old=m, offset=offset)
  else:
    stored = muon_store.store(m_new, m.dtype, correction.count, leaf_index, counter_hash.STREAM_MU)
  if a is not None and not int8:
    m_new = jnp.where(a, m_new, m32)
    stored = jnp.where(a, stored, m)
  # The bias corrections as multiplications by their reciprocals, as Adam's
  # (adam.math.adam_math): XLA up to jax 0.12.0.1 made a division by a
  # broadcast scalar that multiplication in every program; 0.12.1's keeps the
  # division and rewrites it by the program around it (an 8-bit momentum on
  # both axes of an Explicit mesh stepped otherwise than unsharded), as does
  # a slice's pass in a loop: every program must round alike.
  inv = lambda bc: 1 / bc.astype(wide)
  if nesterov:
    h = (r(beta * (m_new * inv(correction.bc2)))
         + r((1 - beta) * (g32 * inv(correction.bc1))))
  else:
    h = m_new * inv(correction.bc1)
  return Moved(stored, h.astype(ns_dtype), a)
