"""One Muon update's leaves on their way through the step: momentum ->
Newton-Schulz input, and the orthogonalised result -> the leaf's update
(:class:`MuonStep`); the specs of the leaves; the stochastically rounded store."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from jax.experimental import layout as jax_layout

from fuseopt import kernels
from fuseopt.kernels import counter_hash
from fuseopt.kernels import fp_contract
from fuseopt.kernels.newton_schulz import layout as ns_layout
from fuseopt.optim import groups as groups_lib
from fuseopt.optim import mantissa
from fuseopt.optim.dtypes import KERNEL_DTYPES
from fuseopt.optim import matrix_views
from fuseopt.optim.matrix_views import (DIMENSION_NUMBER_TYPES, Experts, MatrixViews,
                                       MuonDimensionNumbers, unwrap_experts)
from fuseopt.optim.muon_newton_schulz import default_ns_max_elements


# Seed of Muon's stochastic roundings (momentum and, in the fused step,
# bf16 parameters), apart from the Adam side's default seed 0: "Muon".
MUON_SEED = 0x4D756F6E


@functools.partial(jax.jit, inline=True)
def _one_minus_pow(decay, count):
  return 1 - decay ** count


def _store(x32, dtype, count, leaf_index, stream):
  """fp32 -> ``dtype``; bf16 with the counter-hash stochastic rounding
  (seed ``derive_seed(MUON_SEED, count, leaf_index, stream)``), plain jnp so
  XLA fuses it into the pass that computes ``x32``."""
  if jnp.dtype(dtype) == jnp.bfloat16:
    seed = counter_hash.derive_seed(MUON_SEED, count, leaf_index, stream)
    return kernels.stochastic_round_bf16(x32, seed, implementation="xla")
  return x32.astype(dtype)


def _is_spec(x) -> bool:
  return isinstance(x, DIMENSION_NUMBER_TYPES + (MatrixViews, Experts))


def _is_spec_or_none(x) -> bool:
  return x is None or _is_spec(x) or groups_lib.is_masked(x)


def _piece_shapes(x, spec, path):
  """The ``(batch, rows, cols)`` shapes of :func:`matrix_views.split`'s pieces
  of ``x``, without computing them."""
  if isinstance(spec, DIMENSION_NUMBER_TYPES):
    red, out = matrix_views.normalize_dimension_numbers(spec, x.shape, path)
    size = lambda axes: math.prod(x.shape[a] for a in axes)
    return [(size(ns_layout.batch_axes(x.ndim, red, out)), size(red), size(out))]
  struct = jax.ShapeDtypeStruct(x.shape, x.dtype)
  pieces = jax.eval_shape(lambda v: [p.matrix for p in matrix_views.split(v, spec, path)[0]], struct)
  return [p.shape for p in pieces]


def _broadcast_specs(specs, tree):
  """Spreads a spec tree that may be a prefix of ``tree`` over its leaves."""
  def spread(spec, sub):
    if groups_lib.is_masked(spec):
      return spec
    return jax.tree.map(lambda _: spec, sub)
  return jax.tree.map(spread, specs, tree, is_leaf=_is_spec_or_none)


def _declared_specs(weight_dimension_numbers, updates, treedef):
  """Each leaf's spec as declared (:class:`Experts` kept), or None."""
  if weight_dimension_numbers is None:
    return [MuonDimensionNumbers()] * treedef.num_leaves
  specs = weight_dimension_numbers(updates) if callable(weight_dimension_numbers) else weight_dimension_numbers
  if _is_spec(specs):
    return [specs] * treedef.num_leaves
  return treedef.flatten_up_to(_broadcast_specs(specs, updates))


def _specs_and_experts(weight_dimension_numbers, updates, treedef):
  """Each leaf's cut into matrices (dimension numbers or views; None where
  Muon passes the leaf through), and the same cut where the leaf is
  declared :class:`Experts` (its matrices frozen while their gradient is all
  zero), else None: the specs read once."""
  unwrapped = [unwrap_experts(s) for s in _declared_specs(weight_dimension_numbers, updates, treedef)]
  return [s for s, _ in unwrapped], [s if experts else None for s, experts in unwrapped]


def _leaf_specs(weight_dimension_numbers, updates, treedef):
  """Each leaf's cut (:func:`_specs_and_experts`)."""
  return _specs_and_experts(weight_dimension_numbers, updates, treedef)[0]


def _expert_specs(weight_dimension_numbers, updates, treedef):
  """Each experts leaf's cut, else None (:func:`_specs_and_experts`)."""
  return _specs_and_experts(weight_dimension_numbers, updates, treedef)[1]


def _matrix_axes(spec, ndim):
  red, out = matrix_views.normalize_dimension_numbers(
      matrix_views.base_dimension_numbers(spec), (1,) * ndim)
  return red + out


def _active(g, spec):
  """True for each matrix (index of the batch axes) whose gradient is not all zero."""
  return jnp.any(g != 0, axis=_matrix_axes(spec, g.ndim), keepdims=True)


@dataclasses.dataclass(frozen=True)
class _MuonConfig:
  """What :func:`scale_by_muon`'s direction needs of its arguments."""
  weight_dimension_numbers: Any
  beta: Any
  nesterov: bool
  adaptive: bool
  shape_scaling: bool
  consistent_rms: Any
  ns_max_elements: Optional[int]   # None: the platform's default
  shardings: Any
  ns: Callable[[jax.Array], jax.Array]   # Newton-Schulz on a (batch, rows, cols) array
  # What acts on the orthogonalised update (an UpdatePiece: NorMuon's), or None.
  piece: Any = None


class UpdatePiece:
  """The one extension point of Muon's direction: what happens to the
  orthogonalised update of a leaf before Muon's own scaling (the adaptive
  dual norm, the width factor, the frozen experts' mask), with a state of
  its own beside Muon's (a tree like the momentum). NorMuon's per-neuron
  normalisation (:mod:`fuseopt.optim.normuon_transforms`) is one.

  A piece says how its state is made and kept (:meth:`init_state`,
  :meth:`state_tree`, :meth:`with_state_tree`), what the Newton-Schulz call
  also returns where the matrices are whole (:meth:`wrap_ns`), and how a
  leaf's result is finished from it, in the two layouts the result comes in
  (:meth:`finish_grouped`, :meth:`finish_distributed`). Each finish records
  the leaf's new state in ``step.piece_new[i]``.
  """

  def init_state(self, count, mu, ns_coeffs, weight_dimension_numbers, params):
    raise NotImplementedError

  def state_tree(self, state):
    raise NotImplementedError

  def with_state_tree(self, state, tree):
    raise NotImplementedError

  def wrap_ns(self, ns):
    return ns

  def finish_grouped(self, step, i, results, a, dtype):
    """Leaf ``i``'s pieces' results (``results[j]`` for piece ``j``) -> the
    pieces' updates in ``dtype``."""
    raise NotImplementedError

  def finish_distributed(self, step, i, y, views, a, placement):
    """Leaf ``i``'s distributed result (in the leaf's layout) -> its update
    (fp32 or the result's dtype; cast by the caller)."""
    raise NotImplementedError


class _MuonStep:
  """One update's view of the Muon leaves: the gradient and old momentum
  leaves, their specs and paths, the step's bias corrections; and the
  per-leaf pieces of the direction (:meth:`momentum`, :meth:`assemble`)."""

  def __init__(self, config: _MuonConfig, updates, mu, count, ns_input_dtype, grad_fn=None,
               piece_state=None, param_leaves=None):
    self.config = config
    self.ns_input_dtype = ns_input_dtype
    self.g_leaves, self.treedef = jax.tree.flatten(updates)
    # The dtype a leaf's direction is finished in: the gradient's (optax's
    # convention for the updates it returns), except for a mantissa-tracked
    # parameter in the fused step, whose master is fp32: there the direction
    # stays fp32, as an fp32 run's would (a bf16 one would round the step
    # before it reaches the master). It lives only inside the fused pass.
    self.out_dtypes = [jnp.float32 if p is not None and mantissa.is_tracked(p) else g.dtype
                       for g, p in zip(self.g_leaves, param_leaves or [None] * len(self.g_leaves))]
    # The most matrix elements one NS call takes, on this step's platform.
    self.platform = kernels.current_platform(self.g_leaves)
    self.ns_budget = (config.ns_max_elements if config.ns_max_elements is not None else
                      default_ns_max_elements(self.platform))
    self.paths = [jax.tree_util.keystr(p)
                  for p, _ in jax.tree_util.tree_flatten_with_path(updates)[0]]
    self.specs, self.expert_specs = _specs_and_experts(config.weight_dimension_numbers, updates,
                                                       self.treedef)
    if config.weight_dimension_numbers is None:
      _check_matrices(self.paths, self.g_leaves)
    self.m_old = self.treedef.flatten_up_to(mu)
    # The piece's state leaves (NorMuon's nu: old, and new as leaves finish).
    self.piece_old = None if piece_state is None else self.treedef.flatten_up_to(piece_state)
    self.piece_new = None if piece_state is None else list(self.piece_old)
    if grad_fn is not None:   # (the sequenced path maps each leaf as its call starts)
      self.g_leaves = [grad_fn(g) for g in self.g_leaves]
    self.count_inc = optax.safe_increment(count)
    # optax.tree.bias_correction's ``1 - beta**t``, jitted so that an eager
    # call rounds as optax's does; dividing leaf by leaf (rather than through
    # optax's tree function) lets XLA fuse the pass with less temporary memory.
    self.bc1 = _one_minus_pow(config.beta, self.count_inc)
    self.bc2 = _one_minus_pow(config.beta, optax.safe_increment(self.count_inc))

  def momentum(self, i, g, m):
    """One elementwise pass: the fp32 momentum, stored in the state's dtype
    (stochastically rounded when bf16), and the NS input from the same
    values; and, for a leaf declared :class:`Experts`, its active mask."""
    beta, s, e = self.config.beta, self.specs[i], self.expert_specs[i]
    a = None if e is None else _active(g, e)
    # fp32 math for fp32/bf16 (bf16 momentum is stored stochastically
    # rounded); other dtypes keep optax's arithmetic in their own dtype.
    wide = (jnp.float32 if {jnp.result_type(g), jnp.result_type(m)} <= set(KERNEL_DTYPES)
            else jnp.promote_types(jnp.result_type(g), jnp.result_type(m)))
    g32, m32 = g.astype(wide), m.astype(wide)
    # Every product that meets an add is rounded first (fp_contract): the
    # same bits in a sharded and an unsharded program on a CPU with FMA.
    r = fp_contract.rounded
    m_new = r((1 - beta) * g32) + r(beta * m32)
    stored = _store(m_new, m.dtype, self.count_inc, i, counter_hash.STREAM_MU)
    if a is not None:
      m_new = jnp.where(a, m_new, m32)
      stored = jnp.where(a, stored, m)
    if self.config.nesterov:
      h = (r(beta * (m_new / self.bc2.astype(wide)))
           + r((1 - beta) * (g32 / self.bc1.astype(wide))))
    else:
      h = m_new / self.bc1.astype(wide)
    ns_dtype = (self.ns_input_dtype if s is not None and self.ns_input_dtype
                else self.out_dtypes[i])
    return stored, h.astype(ns_dtype), a

  def assemble(self, pieces, merge, ys, fans, a):
    """The leaf's update from its pieces' NS results."""
    config = self.config
    if config.adaptive:
      # optax's dual-norm scale <mu_hat, NS(mu_hat)> over the whole leaf, before shape scaling.
      dual = sum(jnp.sum(p.matrix * y) for p, y in zip(pieces, ys))
      ys = [fp_contract.rounded(dual * y) for y in ys]
    if config.shape_scaling:
      scaled = []
      for y, (fan_in, fan_out) in zip(ys, fans):
        # (rounded: the decay's add follows; fp_contract)
        scaled.append(fp_contract.rounded(self.width_scale(fan_in, fan_out) * y))
      ys = scaled
    u = merge([p.unflatten(y) for p, y in zip(pieces, ys)])
    if a is not None:
      u = jnp.where(a, u, jnp.zeros((), u.dtype))
    return u

  def width_scale(self, fan_in, fan_out):
    """Muon's width factor of a ``(fan_in, fan_out)`` matrix."""
    if self.config.consistent_rms is not None:
      return jnp.sqrt(jnp.maximum(fan_in, fan_out)) * self.config.consistent_rms
    return jnp.sqrt(jnp.maximum(1, fan_out / fan_in))

  def in_leaf_layout(self, x):
    """``x`` (a Muon leaf's update or new parameter) pinned to the leaf's
    row-major layout on a TPU. Unpinned, libtpu lays out a tall matrix's
    update as the NS's transposed result is laid out (column-major) when
    the NS call holds that matrix alone: the fused step then copies the
    parameter into that layout, updates it out of place and copies it back
    into the donated output at the end of the step, so every such leaf's new
    parameter stays live until then (the 1.2 B tree's sixteen down
    projections, 64 MiB each: v6e 1.12 GiB at 2^23 elements a call, 70 MiB
    pinned; ``update`` + ``apply_updates`` 3.12 GiB, 0.51 GiB pinned). A
    layout changes no value; elsewhere nothing is pinned (the GPU programs
    stay what they were)."""
    if self.platform != "tpu":
      return x
    # (a mantissa-tracked parameter is a pair: both halves pinned)
    return jax.tree.map(lambda t: jax_layout.with_layout_constraint(
        t, jax_layout.Layout(tuple(range(jnp.ndim(t))))), x)

  def finish_distributed(self, i, h, y, views, a, placement=None):
    """Leaf ``i``'s update from the distributed NS result ``y``, already in
    the leaf's layout, its views merged (NorMuon: ``(result, column sums in
    the statistic layout)``). The same arithmetic as :meth:`finish_grouped`,
    per element: per-view factors are broadcast along the view axis."""
    config = self.config
    dtype = self.out_dtypes[i]
    if config.piece is not None:
      y = config.piece.finish_distributed(self, i, y, views, a, placement)
    y = y.astype(dtype)
    if config.adaptive:
      # optax's dual-norm scale <mu_hat, NS(mu_hat)> over the whole leaf, before shape scaling.
      y = fp_contract.rounded(jnp.sum(h * y) * y)
    if config.shape_scaling:
      red, out = views.piece_axes()
      fans = [(math.prod(p[ax] for ax in red), math.prod(p[ax] for ax in out))
              for p in views.piece_shapes(h.shape)]
      if len(set(fans)) == 1:   # one factor (every view alike): the scalar of finish_grouped
        y = fp_contract.rounded(self.width_scale(*fans[0]) * y)
      else:   # each view's factor over its rows or columns, cast as a scalar factor would be
        along = jnp.concatenate([jnp.broadcast_to(jnp.asarray(self.width_scale(*f), y.dtype), (n,))
                                 for f, n in zip(fans, views.sizes)])
        shape = [1] * y.ndim
        shape[views.axis] = y.shape[views.axis]
        y = fp_contract.rounded(jnp.reshape(jnp.tile(along, views.groups), shape) * y)
    if a is not None:
      y = jnp.where(a, y, jnp.zeros((), y.dtype))
    return y

  def finish_grouped(self, i, plan, results, a):
    """Leaf ``i``'s update from its pieces' results of the batched NS calls."""
    pieces, merge = plan
    dtype = self.out_dtypes[i]
    if self.config.piece is not None:
      ys = self.config.piece.finish_grouped(self, i, [results[(i, j)] for j in range(len(pieces))],
                                            a, dtype)
    else:
      ys = [results[(i, j)].astype(dtype) for j in range(len(pieces))]
    return self.assemble(pieces, merge, ys, [y.shape[1:] for y in ys], a)


def _check_matrices(paths, leaves):
  """``weight_dimension_numbers=None`` promises 2-D leaves; the default
  dimension numbers would read a 3-D leaf as a batch of matrices over its
  last axis."""
  for path, g in zip(paths, leaves):
    if jnp.ndim(g) != 2:
      raise ValueError(
          f"scale_by_muon: leaf {path or '<root>'} has shape {jnp.shape(g)}, but "
          "weight_dimension_numbers=None means every leaf is a 2-D matrix; pass "
          "weight_dimension_numbers (e.g. MuonDimensionNumbers(reduction_axis=1, "
          "output_axis=2) for a stack of matrices, None for a leaf Muon should not touch)")
