"""Fused Adam/AdamW update of one leaf: the reference (the specification and the CPU path).

Plain ``jnp`` on the leaf in its own shape, single pass and memory-lean:
each rounding builds its counter from a 1-D per-leaf iota inside its own
expression, so XLA fuses it instead of materialising a shared index array
(docs/measurements.md: a shared per-axis index cost 235 MB of temporaries on
the 1.2 B tree).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fuseopt.kernels import counter_hash
from fuseopt.kernels import dispatch
from fuseopt.kernels import fp_contract
from fuseopt.kernels import mantissa
from fuseopt.kernels import sharding as sharding_lib
from fuseopt.kernels.adam import blocks
from fuseopt.kernels.adam import int4
from fuseopt.kernels.adam import quantized
from fuseopt.kernels.adam.math import (APPLY, SEED_BASE, adam_math, load_param, store,
                                       store_moments)

# The reference runs every call.
supports = dispatch.supports_every_call


def update(scalars, seeds, p, g, mu, nu, *, nesterov, out_dtype, order_for_in_place=False,
           index_map=None, lo=None):
  """One leaf in its own shape; ``p`` None: the direction. Returns ``(out, mu, nu)``,
  and with ``lo`` (a bf16 ``p``'s int16 or int8 companion) ``(out, mu, nu, lo)``:
  the new fp32 master split, not rounded."""
  s = lambda k: scalars[k]
  apply = p is not None
  f32 = lambda x: x.astype(jnp.float32)
  out, mu_new, nu_new = adam_math(s, load_param(p, lo) if apply else None, f32(g), f32(mu),
                                   f32(nu), nesterov=nesterov, apply=apply,
                                   fence=fp_contract.rounded)
  shape = g.shape
  # A fresh flat iota per rounding: XLA fuses each into its consumer rather
  # than materialising one shared index array (docs/measurements.md).
  idx = lambda: sharding_lib.global_index(jax.lax.iota(jnp.uint32, g.size).reshape(shape),
                                          index_map, seeds[SEED_BASE])
  # The param stream's seed whether ``out`` is the parameter or the
  # direction, as the kernels do.
  if lo is not None:
    # One fp32 master for both halves (mantissa.split_once).
    out, new_lo = mantissa.split_once(out, lo.dtype)
  else:
    out, new_lo = store(out, out_dtype, idx(), seeds[0]), None
  if order_for_in_place:
    # XLA's CPU backend emits the three outputs as three loop fusions, each
    # re-reading the old moments; unordered, they make XLA copy the donated
    # moments (a whole leaf of temporaries). The barrier runs the param
    # fusion first, so each moment fusion can then overwrite its input.
    # Not on GPU: there XLA can fuse all three outputs into one pass
    # (docs/measurements.md: 46 KB of temporaries), which the barrier would split.
    out, new_lo, mu, nu = jax.lax.optimization_barrier((out, new_lo, mu, nu))
    _, mu_new, nu_new = adam_math(s, None, f32(g), f32(mu), f32(nu),
                                   nesterov=False, apply=False, fence=fp_contract.rounded)
  res = (out,) + store_moments(mu_new, nu_new, mu.dtype, nu.dtype, idx(), seeds[1], seeds[2])
  return res if lo is None else res + (new_lo,)


def _stored_param(out, out_dtype, index, seed, lo, shape):
  """A blockwise step's fp32 ``out`` in the leaf's ``shape``: rounded into
  ``out_dtype`` (bf16 stochastically), or with a companion ``lo`` the new
  master split (:func:`fuseopt.kernels.mantissa.split_once`), no rounding."""
  if lo is None:
    return store(out, out_dtype, index, seed).reshape(shape), None
  hi, new_lo = mantissa.split_once(out, lo.dtype)
  return hi.reshape(shape), new_lo.reshape(shape)


def update_quantized(scalars, seeds, p, g, mu, nu, *, nesterov, out_dtype, index_map=None,
                     lo=None):
  """One leaf with 8-bit moments (:mod:`.quantized`; ``mu``, ``nu``
  :class:`QuantizedMoment`); returns ``(out, mu, nu)``, the moments
  quantised again, and ``(out, mu, nu, lo)`` with a companion ``lo`` of a
  bf16 ``p`` (the step reads the master ``join(p, lo)`` and writes it split).
  The leaf is viewed as blocks ``(..., L / BLOCK, BLOCK)`` and its scales as
  ``(..., L / BLOCK, 1)``: the kernels' arithmetic, block by block."""
  s = lambda k: scalars[k]
  apply = p is not None
  shape = g.shape
  bshape = quantized.scales_shape(shape) + (quantized.BLOCK,)
  blocks = lambda x: x.reshape(bshape).astype(jnp.float32)
  mu32 = quantized.dequantize_mu(mu.codes.reshape(bshape), mu.scales[..., None])
  nu32 = quantized.dequantize_nu(nu.codes.reshape(bshape), nu.scales[..., None])
  p32 = (load_param(p.reshape(bshape), None if lo is None else lo.reshape(bshape))
         if apply else None)
  out, mu_new, nu_new = adam_math(s, p32, blocks(g), mu32, nu32,
                                  nesterov=nesterov, apply=apply,
                                  fence=fp_contract.rounded)
  idx = lambda: sharding_lib.global_index(jax.lax.iota(jnp.uint32, g.size).reshape(bshape),
                                          index_map, seeds[SEED_BASE])
  out, new_lo = _stored_param(out, out_dtype, idx(), seeds[0], lo, shape)
  mu_codes, mu_scale = quantized.quantize_mu(mu_new, counter_hash.hash_bits(idx(), seeds[1]))
  nu_codes, nu_scale = quantized.quantize_nu(nu_new, counter_hash.hash_bits(idx(), seeds[2]),
                                             fence=fp_contract.rounded)
  keep = lambda new, old: quantized.kept_on_skip(scalars[APPLY] == 0, new, old)
  res = (out, quantized.QuantizedMoment(keep(mu_codes.reshape(shape), mu.codes),
                                        keep(mu_scale[..., 0], mu.scales)),
         quantized.QuantizedMoment(keep(nu_codes.reshape(shape), nu.codes),
                                   keep(nu_scale[..., 0], nu.scales)))
  return res if lo is None else res + (new_lo,)


def update_int4(scalars, seeds, p, g, mu, nu, *, nesterov, out_dtype, index_map=None,
                lo=None):
  """One leaf with 4-bit moments (:mod:`.int4`; ``mu``, ``nu``
  :class:`PackedMoment`); returns ``(out, mu, nu)``, the moments packed
  again (with a companion ``lo``: ``(out, mu, nu, lo)``, as
  :func:`update_quantized`). The leaf is viewed as rows of two blocks, each
  half ``(..., R, BLOCK)`` with its scale ``(..., R, 1)``: the kernels'
  arithmetic, half by half."""
  s = lambda k: scalars[k]
  apply = p is not None
  shape = g.shape
  f32 = lambda x: x.astype(jnp.float32)
  idx = lambda: sharding_lib.global_index(jax.lax.iota(jnp.uint32, g.size).reshape(shape),
                                          index_map, seeds[SEED_BASE])
  halves = lambda x: int4.halves(x, shape)
  code_rows = lambda m: int4.unpack(m.codes.reshape(int4.row_view(shape)[:-2] + (int4.BLOCK,)))
  mu_lo, mu_hi = code_rows(mu)
  nu_lo, nu_hi = code_rows(nu)
  mus_lo, mus_hi = int4.scale_halves(mu.scales, shape)
  nus_lo, nus_hi = int4.scale_halves(nu.scales, shape)
  mu32 = (int4.dequantize_mu(mu_lo, mus_lo), int4.dequantize_mu(mu_hi, mus_hi))
  nu32 = (int4.dequantize_nu(nu_lo, nus_lo), int4.dequantize_nu(nu_hi, nus_hi))
  p_h = (halves(load_param(p, lo)) if apply else (None, None))
  g_h = halves(f32(g))
  i_h = halves(idx())
  keep_old = scalars[APPLY] == 0
  outs, mu_c, mu_s, nu_c, nu_s = [], [], [], [], []
  for h in range(2):
    out, mu_new, nu_new = adam_math(s, p_h[h], g_h[h], mu32[h], nu32[h], nesterov=nesterov,
                                    apply=apply, fence=fp_contract.rounded)
    outs.append(out if lo is not None else store(out, out_dtype, i_h[h], seeds[0]))
    c, sc = int4.quantize_mu(mu_new, counter_hash.hash_bits(i_h[h], seeds[1]),
                             fence=fp_contract.rounded)
    mu_c.append(c)
    mu_s.append(sc)
    c, sc = int4.quantize_nu(nu_new, counter_hash.hash_bits(i_h[h], seeds[2]),
                             fence=fp_contract.rounded)
    nu_c.append(c)
    nu_s.append(sc)
  keep = lambda new, old: blocks.kept_on_skip(keep_old, new, old)
  packed = lambda c, sc, old: int4.PackedMoment(
      keep(int4.pack(*c).reshape(old.codes.shape), old.codes),
      keep(int4.join_halves(*sc, shape), old.scales))
  out = int4.join_halves(*outs, shape)
  new_lo = None
  if lo is not None:
    out, new_lo = mantissa.split_once(out, lo.dtype)
  res = (out, packed(mu_c, mu_s, mu), packed(nu_c, nu_s, nu))
  return res if lo is None else res + (new_lo,)
