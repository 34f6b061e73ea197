"""Muon: momentum orthogonalised by Newton-Schulz, batched across the tree.

Drop-in for :func:`optax.contrib.muon` / :func:`optax.contrib.scale_by_muon`
(same arguments, same state layout: one momentum leaf per parameter), with
three differences in how the work is done:

* Every Muon matrix of the tree is cut into ``(batch, rows, cols)`` families
  (batch axes such as a stacked-layers or experts axis stay a batch, never a
  Python loop), and all families of the same ``(rows, cols)`` across the
  tree go through batched calls of :func:`fuseopt.kernels.newton_schulz`
  (as few as ``ns_max_elements`` per call allows). A
  family that is alone in its shape is handed over as a reshape of the
  momentum (no copy); several are joined by a concatenate that XLA fuses
  into the elementwise momentum/Nesterov pass that produces them, so no
  separate stacked copy of the leaves exists (``jnp.stack`` of finished
  leaves is what cost optax-style code 14.5 GB of temp memory).
* The iteration runs in ``ns_dtype`` (bf16 by default, fp32 accumulation)
  with the coefficients of ``coeffs`` ("jordan", "polar_express" or a
  table); pass ``ns_dtype=jnp.float32`` for optax's fp32 numerics.
* :class:`~fuseopt.optim.matrix_views.MatrixViews` may stand where
  dimension numbers go, to orthogonalise several matrices held in one tensor
  independently; ``skip_inactive=True`` freezes matrices whose gradient is
  all zero this step (unrouted experts).

:func:`muon` declares an in-place rule (:mod:`fuseopt.optim.fusion`):
:func:`fuseopt.optim.step` runs its Muon leaves as one elementwise pass
(new momentum, stored in its dtype with stochastic rounding when bf16, and
the Nesterov NS input in ``ns_dtype``), the batched Newton-Schulz, and one
pass writing ``p - lr (scale O + wd p)`` over the parameter (stochastic
rounding for bf16 parameters), one NS call at a time (optimization barriers
order the calls, so the step holds one call's working set, not the tree's);
its AdamW leaves go through the fused Adam kernel.
"""

# No `from __future__ import annotations`: optax's tests (and tools) read
# `learning_rate`'s annotation as the object optax.ScalarOrSchedule.
import dataclasses
import functools
import math
import warnings
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import layout as jax_layout

from fuseopt import kernels
from fuseopt.kernels import counter_hash
from fuseopt.kernels import sharding as kernel_sharding
from fuseopt.kernels.newton_schulz import distributed as distributed_ns
from fuseopt.kernels.newton_schulz import layout as ns_layout
from fuseopt.optim import _checks
from fuseopt.optim import adam_transforms
from fuseopt.optim import fusion
from fuseopt.optim import groups as groups_lib
from fuseopt.optim import mantissa
from fuseopt.optim import matrix_views
from fuseopt.optim import muon_axes
from fuseopt.optim import neuron_norm
from fuseopt.optim import weight_decay as weight_decay_lib
from fuseopt.optim.matrix_views import DIMENSION_NUMBER_TYPES, MatrixViews, MuonDimensionNumbers

__all__ = ["MuonDimensionNumbers", "MatrixViews", "MuonState", "NorMuonState", "scale_by_muon",
           "muon"]

# Keller Jordan's triple, optax.contrib.muon's default ns_coeffs.
JORDAN_COEFFS = kernels.JORDAN
# Most matrix elements per Newton-Schulz call (see scale_by_muon), by the
# platform the step runs on. The fused step holds one call's working set.
# GPU and TPU: 2^23 (8 Mi elements, 16 MiB of bf16 input: two 2048 x 2048
# matrices a call; a 2048 x 8192 matrix, larger, runs alone, one a device a
# round when sharded). Temporaries of the 1.2 B tree's hybrid step
# (docs/fused_step.md): H200 0.16 GiB, 8 x H200 0.13 GiB a device; v6e
# 0.07 GiB, 8 x v5e 0.06 GiB a device. A TPU at 2^25 held 0.97 GiB on a
# v6e and 0.71 GiB a device on 8 x v5e (two 2048 x 8192 matrices a device:
# four fp32 products of the NS live at once); smaller calls on a TPU need
# the new parameter's layout pinned (_MuonStep.in_leaf_layout).
# Elsewhere (the CPU) 2^25.
DEFAULT_NS_MAX_ELEMENTS = {"gpu": 1 << 23, "cuda": 1 << 23, "rocm": 1 << 23, "tpu": 1 << 23}
DEFAULT_NS_MAX_ELEMENTS_ELSEWHERE = 1 << 25


def default_ns_max_elements(platform: str) -> int:
  """The default ``ns_max_elements`` for a step running on ``platform``."""
  return DEFAULT_NS_MAX_ELEMENTS.get(platform, DEFAULT_NS_MAX_ELEMENTS_ELSEWHERE)


_DION_COEFFS = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)
# optax.contrib.muon's preset names.
_OPTAX_PRESETS = {"standard": JORDAN_COEFFS, "dion": _DION_COEFFS}
_PRECONDITIONINGS = ("frobenius", "spectral", "aol", "schatten")
# The default of ns_steps (5, optax's): not an int, so that
# optax.inject_hyperparams leaves it static (see _checks.StaticDefault).
_NS_STEPS = _checks.StaticDefault(5)
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
  return isinstance(x, DIMENSION_NUMBER_TYPES + (MatrixViews,))


def _is_spec_or_none(x) -> bool:
  return x is None or _is_spec(x) or groups_lib.is_masked(x)


# The state of scale_by_muon is optax's own class, with optax's fields:
# ``count`` (int32), ``mu`` (one momentum leaf per parameter) and
# ``ns_coeffs`` (``jnp.asarray`` of the ``ns_coeffs`` argument, (3,) or
# (steps, 3), kept for inspection: the update uses the static table).
MuonState = optax.contrib.MuonState


class NorMuonState(NamedTuple):
  """NorMuon's state: Muon's fields and ``nu``, the per-neuron second
  moments (per leaf, the leaf's shape without its reduction axes, a matrix
  view axis among them kept with one entry per view; an empty array where
  Muon does not act)."""
  count: jax.Array
  mu: Any
  nu: Any
  ns_coeffs: jax.Array


def _coeff_table(ns_coeffs, ns_steps) -> tuple[tuple[float, float, float], ...]:
  """optax's ``ns_coeffs``/``ns_steps`` as a static (steps, 3) table."""
  if isinstance(ns_coeffs, str):
    if ns_coeffs not in _OPTAX_PRESETS:
      raise ValueError(f"muon: unknown ns_coeffs preset {ns_coeffs!r}; expected one of "
                       f"{sorted(_OPTAX_PRESETS)} or a (3,) / (steps, 3) table")
    ns_coeffs = _OPTAX_PRESETS[ns_coeffs]
  table = np.asarray(ns_coeffs, np.float64)
  if table.ndim not in (1, 2) or table.shape[-1] != 3:
    raise ValueError(f"muon: ns_coeffs must have shape (3,) or (steps, 3), got {table.shape}")
  steps = int(ns_steps)
  if table.ndim == 1:
    if steps < 1:
      raise ValueError(f"muon: ns_steps must be >= 1, got {ns_steps}")
    table = np.tile(table, (steps, 1))
  elif table.shape[0] > steps:
    raise ValueError(f"muon: ns_coeffs has {table.shape[0]} rows, more than ns_steps={ns_steps}")
  return tuple(tuple(float(c) for c in row) for row in table)


def _resolve_coeffs(coeffs, ns_coeffs, ns_steps):
  """What the kernel gets: ``(coeffs, steps)``."""
  if coeffs is None:
    return _coeff_table(ns_coeffs, ns_steps), None
  if isinstance(coeffs, str):
    if coeffs not in ("jordan", "polar_express"):
      raise ValueError(f"muon: coeffs must be 'jordan', 'polar_express' or a (steps, 3) table, got {coeffs!r}")
    return coeffs, int(ns_steps)
  table = np.asarray(coeffs, np.float64)
  if table.ndim != 2 or table.shape[-1] != 3:
    raise ValueError(f"muon: a coeffs table must have shape (steps, 3), got {table.shape}")
  return tuple(tuple(float(c) for c in row) for row in table), None


def _optax_newton_schulz(x, table, preconditioning, eps):
  """optax.contrib's Newton-Schulz iteration on one ``(rows, cols)`` matrix,
  in ``x``'s dtype (Jordan 2024; AOL preconditioning: Boissin et al. 2025,
  arXiv 2512.04632; Schatten-4 rescaling: Grishina et al. 2025, arXiv
  2506.10935): the same expressions in the same order as optax 0.2.8's
  ``orthogonalize_via_newton_schulz``, for what the kernel does not cover."""
  def base(x, c):
    a = x @ x.T.conj()
    b = c[1] * a + c[2] * a @ a
    return c[0] * x + b @ x

  def aol_first(x, c):
    a = x @ x.T.conj()
    s = jnp.expand_dims(jax.lax.rsqrt(jnp.clip(jnp.abs(a).sum(axis=-1), min=1e-8)), -1)
    x, a = x * s, a * s * s.transpose(-1, -2)
    b = c[1] * a + c[2] * a @ a
    return c[0] * x + b @ x

  def schatten_first(x, c):
    a = x @ x.T
    s = jnp.expand_dims(jax.lax.rsqrt(jnp.clip(jnp.linalg.norm(a, ord="fro", axis=(-2, -1)),
                                               min=1e-8)), (0, -1))
    x, a = x * s, a * s ** 2
    b = c[1] * a + c[2] * a @ a
    return c[0] * x + b @ x

  transposed = x.shape[0] > x.shape[1]
  if transposed:
    x = x.T
  if preconditioning == "frobenius":
    x /= jnp.linalg.norm(x, ord="fro") + eps
  elif preconditioning == "spectral":
    # The SVD behind ord=2 takes no bf16/f16 (jnp.linalg raises): the norm is
    # taken in fp32, the division stays in the iteration's dtype.
    wide = jnp.promote_types(x.dtype, jnp.float32)
    x /= (jnp.linalg.norm(x.astype(wide), ord=2) + eps).astype(x.dtype)
  first = {"aol": aol_first, "schatten": schatten_first}.get(preconditioning, base)
  table = table.astype(x.dtype)
  for i in range(table.shape[0]):
    x = (first if i == 0 else base)(x, table[i])
  return x.T if transposed else x


def _orthogonalize(x, *, coeffs, steps, ns_dtype, eps, preconditioning, gram, implementation, interpret,
                   ns_matmul="xla"):
  """Newton-Schulz on a ``(batch, rows, cols)`` array."""
  if preconditioning == "frobenius" and jnp.dtype(x.dtype) in adam_transforms.KERNEL_DTYPES:
    config = None if ns_matmul == "xla" else kernels.TiledConfig(matmul=ns_matmul)
    return kernels.newton_schulz(x, coeffs=coeffs, steps=steps, ns_dtype=ns_dtype, eps=eps,
                                 gram=gram, implementation=implementation, interpret=interpret,
                                 config=config)
  # What the kernel does not cover runs optax's iteration: optax's other
  # preconditionings (in ns_dtype), and float16, float64 or complex matrices
  # (in their own dtype, as optax).
  if isinstance(coeffs, str):
    raise ValueError(f"muon: preconditioning={preconditioning!r} and {x.dtype} matrices need a "
                     f"numeric coefficient table, got coeffs={coeffs!r}")
  if jnp.dtype(x.dtype) in adam_transforms.KERNEL_DTYPES:
    x = x.astype(ns_dtype)
  table = jnp.asarray(coeffs)
  return jax.vmap(lambda m: _optax_newton_schulz(m, table, preconditioning, eps))(x)


def _call_plan(batches, matrix_elements, max_elements):
  """How a family of same-shaped matrices (``batches[k]`` of them in member
  ``k``) goes into NS calls of at most ``max_elements`` elements: a list of
  calls, each a list of ``(k, start, stop)`` batch ranges."""
  total = sum(batches)
  per_call = distributed_ns.matrices_per_call(max_elements, matrix_elements) or total
  sizes = [per_call] * (total // per_call) + ([total % per_call] if total % per_call else [])
  if per_call > 1 and len(sizes) > 1 and sizes[-1] == 1:
    # No lone matrix in a batched family: the sharded step runs every
    # family batched (distributed_ns.orthogonalize_sharded), and a batch of
    # one may round differently. With two per call, the last call takes three.
    sizes[-2:] = [sizes[-2] - 1, 2] if sizes[-2] > 2 else [sizes[-2] + 1]
  calls, current = [], []
  room = sizes[0] if sizes else 0
  for k, batch in enumerate(batches):
    start = 0
    while start < batch:
      take = min(room, batch - start)
      current.append((k, start, start + take))
      start += take
      room -= take
      if room == 0:
        calls.append(current)
        current = []
        room = sizes[len(calls)] if len(calls) < len(sizes) else 0
  if current:
    calls.append(current)
  return calls


def _slice(y, a, b):
  """Batch rows ``[a, b)`` of an NS result (or of a ``(result, column
  sums)`` pair: both have the batch first)."""
  return jax.tree.map(lambda t: jax.lax.slice_in_dim(t, a, b), y)


def _concat(parts):
  """NS results (or pairs) joined along the batch."""
  if len(parts) == 1:
    return parts[0]
  return jax.tree.map(lambda *t: jnp.concatenate(t, axis=0), *parts)


def _chunked(mats, max_elements, ns):
  """Runs ``ns`` over the matrices of ``mats`` (same (rows, cols), each a
  (batch, rows, cols) array), as few calls as ``max_elements`` per call
  allows; yields ``(index into mats, [result parts in batch order])``."""
  rows, cols = mats[0].shape[1:]
  calls = _call_plan([m.shape[0] for m in mats], rows * cols, max_elements)
  parts: dict[int, list] = {}
  for call in calls:
    xs = [mats[k] if (a, b) == (0, mats[k].shape[0]) else jax.lax.slice_in_dim(mats[k], a, b)
          for k, a, b in call]
    y = ns(xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=0))
    offset = 0
    for k, a, b in call:
      parts.setdefault(k, []).append(y if len(call) == 1 else _slice(y, offset, offset + b - a))
      offset += b - a
  return list(parts.items())


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


def _leaf_specs(weight_dimension_numbers, updates, treedef):
  if weight_dimension_numbers is None:
    return [MuonDimensionNumbers()] * treedef.num_leaves
  specs = weight_dimension_numbers(updates) if callable(weight_dimension_numbers) else weight_dimension_numbers
  if _is_spec(specs):
    return [specs] * treedef.num_leaves
  return treedef.flatten_up_to(_broadcast_specs(specs, updates))


def _matrix_axes(spec, ndim):
  red, out = matrix_views.normalize_dimension_numbers(
      matrix_views.base_dimension_numbers(spec), (1,) * ndim)
  return red + out


def _active(g, spec):
  """True for each matrix (index of the batch axes) whose gradient is not all zero."""
  return jnp.any(g != 0, axis=_matrix_axes(spec, g.ndim), keepdims=True)


def _place_ns_inputs(mu_hat, specs, leaf_shardings, paths, ns_budget, ns_input_dtype=None):
  """Which Muon leaves take the distributed (all-to-all) Newton-Schulz.

  Returns ``(plan, {leaf: position in the plan})``: the
  :class:`~fuseopt.kernels.newton_schulz.distributed.Plan` of every Muon
  leaf on a multi-device mesh whose placement is known (plain matrices and
  matrix views alike), or ``(None, {})``. Leaves not in it run the
  single-device path: one device, or an Auto mesh without ``shardings``
  (XLA partitions it, with a warning), or a layout the plan cannot take
  (uneven shards: replicated, with a warning naming the leaf).
  """
  taken, placements, views, structs = {}, [], [], []
  for i, (h, s) in enumerate(zip(mu_hat, specs)):
    if s is None:
      continue
    where = kernel_sharding.placement_of(
        h, leaf_shardings[i] if leaf_shardings else None,
        what=f"scale_by_muon: shardings of the leaf at {paths[i]!r}")
    if where is kernel_sharding.UNKNOWN:
      kernel_sharding.warn_unknown("scale_by_muon", "shardings=")
      continue
    if not isinstance(where, kernel_sharding.Placement):
      continue
    geometry = matrix_views.geometry(s, h.shape, paths[i])
    why = distributed_ns.why_not(h.shape, where, geometry)
    if why is not None:
      _warn_replicated(paths[i], why)
      continue
    taken[i] = len(placements)
    placements.append(where)
    views.append(geometry)
    structs.append(jax.ShapeDtypeStruct(h.shape, ns_input_dtype or h.dtype))
  if not taken:
    return None, {}
  return distributed_ns.Plan(structs, placements, views, ns_budget), taken


_warned_replicated: set[str] = set()


def _warn_replicated(path, why):
  """Once per leaf: its Newton-Schulz runs replicated (gathered whole on
  every device), and why."""
  if path in _warned_replicated:
    return
  _warned_replicated.add(path)
  warnings.warn(f"scale_by_muon: the Muon leaf at {path or '<root>'} is gathered whole onto every "
                f"device for its Newton-Schulz: {why}", stacklevel=3)


def _replicated_ns(ns):
  """``ns`` for a stack that may live on a multi-device mesh: gathered, then
  run whole on every device (the fallback for layouts the all-to-all path
  does not take; a Pallas kernel must never see a sharded operand)."""
  def run(x):
    where = kernel_sharding.placement_of(x)
    if not isinstance(where, kernel_sharding.Placement):
      return ns(x)
    replicated = kernel_sharding.Placement(where.mesh,
                                           jax.sharding.PartitionSpec(*[None] * x.ndim))
    out_specs = jax.tree.map(lambda t: jax.sharding.PartitionSpec(*[None] * t.ndim),
                             jax.eval_shape(ns, x))
    return kernel_sharding.shard_local(ns, where.mesh, replicated.spec, out_specs)(
        kernel_sharding.to_spec(x, replicated))
  return run


@dataclasses.dataclass(frozen=True)
class _MuonConfig:
  """What :func:`scale_by_muon`'s direction needs of its arguments."""
  weight_dimension_numbers: Any
  beta: Any
  nesterov: bool
  adaptive: bool
  shape_scaling: bool
  consistent_rms: Any
  skip_inactive: bool
  ns_max_elements: Optional[int]   # None: the platform's default
  shardings: Any
  ns: Callable[[jax.Array], jax.Array]   # Newton-Schulz on a (batch, rows, cols) array
  # NorMuon's (b2, eps, v dtype), or None for Muon; with it ``ns`` also
  # returns the result's column sums of squares (neuron_norm.column_sums).
  normuon: Any = None


class _MuonStep:
  """One update's view of the Muon leaves: the gradient and old momentum
  leaves, their specs and paths, the step's bias corrections; and the
  per-leaf pieces of the direction (:meth:`momentum`, :meth:`assemble`)."""

  def __init__(self, config: _MuonConfig, updates, mu, count, ns_input_dtype, grad_fn=None,
               nu=None, param_leaves=None):
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
    self.specs = _leaf_specs(config.weight_dimension_numbers, updates, self.treedef)
    if config.weight_dimension_numbers is None:
      _check_matrices(self.paths, self.g_leaves)
    self.m_old = self.treedef.flatten_up_to(mu)
    # NorMuon's per-neuron second moments (old, and new as leaves finish).
    self.nu_old = None if nu is None else self.treedef.flatten_up_to(nu)
    self.nu_new = None if nu is None else list(self.nu_old)
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
    values; and the leaf's active mask (``skip_inactive``)."""
    beta, s = self.config.beta, self.specs[i]
    a = _active(g, s) if self.config.skip_inactive and s is not None else None
    # fp32 math for fp32/bf16 (bf16 momentum is stored stochastically
    # rounded); other dtypes keep optax's arithmetic in their own dtype.
    wide = (jnp.float32 if {jnp.result_type(g), jnp.result_type(m)} <= set(adam_transforms.KERNEL_DTYPES)
            else jnp.promote_types(jnp.result_type(g), jnp.result_type(m)))
    g32, m32 = g.astype(wide), m.astype(wide)
    m_new = (1 - beta) * g32 + beta * m32
    stored = _store(m_new, m.dtype, self.count_inc, i, counter_hash.STREAM_MU)
    if a is not None:
      m_new = jnp.where(a, m_new, m32)
      stored = jnp.where(a, stored, m)
    if self.config.nesterov:
      h = beta * (m_new / self.bc2.astype(wide)) + (1 - beta) * (g32 / self.bc1.astype(wide))
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
      ys = [dual * y for y in ys]
    if config.shape_scaling:
      scaled = []
      for y, (fan_in, fan_out) in zip(ys, fans):
        scaled.append(self.width_scale(fan_in, fan_out) * y)
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

  def neuron_scale(self, i, stat, views, a, placement=None):
    """NorMuon: leaf ``i``'s per-neuron factor from the NS result's column
    sums, both in the statistic layout of ``views``
    (:class:`~fuseopt.kernels.newton_schulz.layout.Views`); records the
    leaf's new second moment. On a mesh (``placement``) the small per-neuron
    arithmetic runs replicated, as the unsharded step runs it."""
    b2, eps, _ = self.config.normuon
    shape = self.g_leaves[i].shape
    v_old = jnp.reshape(self.nu_old[i], views.statistic_shape(shape))
    fn = functools.partial(neuron_norm.normalize_views, views=views, shape=shape, b2=b2, eps=eps)
    if isinstance(placement, kernel_sharding.Placement):
      whole = kernel_sharding.Placement(placement.mesh,
                                        jax.sharding.PartitionSpec(*[None] * len(shape)))
      fn = kernel_sharding.shard_local(fn, placement.mesh, (whole.spec, whole.spec),
                                       (whole.spec, whole.spec))
      stat, v_old = (kernel_sharding.to_spec(x, whole) for x in (stat, v_old))
    scale, v_new = fn(stat, v_old)
    if a is not None:   # a frozen matrix keeps its second moment too
      v_new = jnp.where(jnp.broadcast_to(a, v_new.shape), v_new, v_old)
    v_leaf = jnp.reshape(v_new, self.nu_old[i].shape)
    self.nu_new[i] = _store(v_leaf, self.nu_old[i].dtype, self.count_inc, i,
                            counter_hash.STREAM_NU)
    return scale

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
    if config.normuon is not None:
      y, stat = y
      scale = views.expand(self.neuron_scale(i, stat, views, a, placement))
      y = y.astype(jnp.float32) * scale
    y = y.astype(dtype)
    if config.adaptive:
      # optax's dual-norm scale <mu_hat, NS(mu_hat)> over the whole leaf, before shape scaling.
      y = jnp.sum(h * y) * y
    if config.shape_scaling:
      red, out = views.piece_axes()
      fans = [(math.prod(p[ax] for ax in red), math.prod(p[ax] for ax in out))
              for p in views.piece_shapes(h.shape)]
      if len(set(fans)) == 1:   # one factor (every view alike): the scalar of finish_grouped
        y = self.width_scale(*fans[0]) * y
      else:   # each view's factor over its rows or columns, cast as a scalar factor would be
        along = jnp.concatenate([jnp.broadcast_to(jnp.asarray(self.width_scale(*f), y.dtype), (n,))
                                 for f, n in zip(fans, views.sizes)])
        shape = [1] * y.ndim
        shape[views.axis] = y.shape[views.axis]
        y = jnp.reshape(jnp.tile(along, views.groups), shape) * y
    if a is not None:
      y = jnp.where(a, y, jnp.zeros((), y.dtype))
    return y

  def finish_grouped(self, i, plan, results, a):
    """Leaf ``i``'s update from its pieces' results of the batched NS calls."""
    pieces, merge = plan
    dtype = self.out_dtypes[i]
    if self.config.normuon is not None:
      views = matrix_views.geometry(self.specs[i], self.g_leaves[i].shape, self.paths[i])
      sv = views.statistic()
      red, out = views.piece_axes()
      stat_shapes = sv.piece_shapes(views.statistic_shape(self.g_leaves[i].shape))
      pairs = [results[(i, j)] for j in range(len(pieces))]
      stat = sv.merge([neuron_norm.from_matrix(c, shape, red, out, keepdims=True)
                       for (_, c), shape in zip(pairs, stat_shapes)])
      scales = sv.split(self.neuron_scale(i, stat, views, a))
      ys = [(y.astype(jnp.float32) * neuron_norm.to_matrix(f, shape, red, out)[:, None, :]
             ).astype(dtype) for (y, _), f, shape in zip(pairs, scales, stat_shapes)]
    else:
      ys = [results[(i, j)].astype(dtype) for j in range(len(pieces))]
    return self.assemble(pieces, merge, ys, [y.shape[1:] for y in ys], a)


def _with_column_sums(ns, on: bool):
  """``ns``, returning NorMuon's column sums of squares of its result too
  (computed where the matrices are whole: the same numbers on any sharding)."""
  if not on:
    return ns

  def run(x):
    y = ns(x)
    return y, neuron_norm.column_sums(y)
  return run


def _normuon_nu_init(weight_dimension_numbers, params, dtype):
  """NorMuon's ``nu``: per Muon leaf the leaf's shape without its reduction
  axes (one entry per output neuron of each matrix; a view axis on the
  reduction side stays, one entry per view), zeros; an empty array for
  leaves Muon passes through."""
  leaves, treedef = jax.tree.flatten(params)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  specs = _leaf_specs(weight_dimension_numbers, params, treedef)
  out = []
  for x, s, path in zip(leaves, specs, paths):
    if s is None:
      out.append(jnp.zeros((0,), dtype or jnp.float32))
      continue
    views = matrix_views.geometry(s, jnp.shape(x), path)
    out.append(jnp.zeros(neuron_norm.state_shape(jnp.shape(x), views), dtype or jnp.float32))
  return treedef.unflatten(out)


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


def _direction(config: _MuonConfig, updates, mu, count, ns_input_dtype=None, placement=None,
               finish=None, grad_fn=None, param_leaves=None, nu=None):
  """The Muon direction of ``updates``: ``(u leaves, treedef, new mu
  leaves, count + 1, new nu leaves or None)``; the new mu leaves keep their
  stored dtype, the NS input is in ``ns_input_dtype`` (None: the gradient's).
  ``nu``: NorMuon's per-neuron second moments (a tree like ``mu``).

  With ``finish`` (``(leaf index, u, parameter) -> new parameter``, and
  ``param_leaves``) the leaves are finished as their Newton-Schulz call
  completes and the first element is the finished leaves: see
  :func:`_sequenced`. ``grad_fn`` maps each gradient leaf before use (the
  clip factor of the fused step).
  """
  if grad_fn is None:
    grad_fn = lambda g: g
  step = _MuonStep(config, updates, mu, count, ns_input_dtype,
                   grad_fn=grad_fn if finish is None else None, nu=nu,
                   param_leaves=param_leaves if finish is not None else None)
  leaf_shardings = kernel_sharding.flatten_shardings(
      config.shardings if placement is None else placement, mu, owner="scale_by_muon",
      strict=True)
  if finish is not None:
    new_p, mu_leaves = _sequenced(step, param_leaves, leaf_shardings, grad_fn, finish)
    return new_p, step.treedef, mu_leaves, step.count_inc, step.nu_new
  out, mu_leaves = _unsequenced(step, leaf_shardings)
  return out, step.treedef, mu_leaves, step.count_inc, step.nu_new


def _unsequenced(step: _MuonStep, leaf_shardings):
  """The direction of every leaf, the momentum passes first, then the NS
  calls (``update``'s path); returns ``(u leaves, new mu leaves)``."""
  config, specs, paths = step.config, step.specs, step.paths
  mu_leaves, mu_hat, active = [], [], []
  for i, (g, m) in enumerate(zip(step.g_leaves, step.m_old)):
    stored, h, a = step.momentum(i, g, m)
    mu_leaves.append(stored)
    mu_hat.append(h)
    active.append(a)

  # Leaves on a multi-device mesh: whole matrices per device (all-to-all).
  plan, distributed = _place_ns_inputs(mu_hat, specs, leaf_shardings, paths, step.ns_budget)
  # Cut every other Muon leaf into (batch, rows, cols) families; group them by shape.
  plans = [None] * len(mu_hat)
  groups: dict[tuple, list[tuple[int, int]]] = {}
  for i, (h, s) in enumerate(zip(mu_hat, specs)):
    if s is None or i in distributed:
      continue
    pieces, merge = matrix_views.split(h, s, paths[i])
    plans[i] = (pieces, merge)
    for j, p in enumerate(pieces):
      groups.setdefault(p.matrix.shape[1:] + (p.matrix.dtype,), []).append((i, j))

  results: dict[tuple[int, int], jax.Array] = {}
  if distributed:
    leaf_of = {k: i for i, k in distributed.items()}
    for members in plan.rounds():
      ys = plan.orthogonalize([mu_hat[leaf_of[k]] for k in members], config.ns, members)
      for k, y in zip(members, ys):
        results[(leaf_of[k], 0)] = y
  for members in groups.values():
    mats = [plans[i][0][j].matrix for i, j in members]
    for k, parts in _chunked(mats, step.ns_budget, _replicated_ns(config.ns)):
      results[members[k]] = _concat(parts)

  out = []
  for i, (h, s) in enumerate(zip(mu_hat, specs)):
    if s is None:
      out.append(h)
    elif i in distributed:
      leaf = plan.leaves[distributed[i]]
      out.append(step.in_leaf_layout(
          step.finish_distributed(i, h, results[(i, 0)], leaf.views, active[i], leaf.placement)))
    else:
      out.append(step.in_leaf_layout(step.finish_grouped(i, plans[i], results, active[i])))
  return out, mu_leaves


class _Sequencer:
  """The state of :func:`_sequenced`: finished parameters, new momenta, and
  the leaves the previous NS call finished."""

  def __init__(self, step: _MuonStep, p_leaves, grad_fn, finish):
    n = len(step.g_leaves)
    self.step, self.p_leaves, self.grad_fn, self.finish = step, p_leaves, grad_fn, finish
    self.new_p, self.mu_leaves = [None] * n, [None] * n
    self.done = []   # the leaves finished by the previous call

  def barrier(self, starting):
    """Every input of the call's leaves (gradient, momentum, parameter),
    tied to the previous call's finished parameters: whatever the compiler
    makes of the inputs (a TPU re-lays out a tall matrix for its transposed
    NS input) is made within the call. The finished parameters are taken
    from the barrier too, or the compiler drops that half."""
    step = self.step
    inputs = [(step.g_leaves[i], step.m_old[i], self.p_leaves[i]) for i in starting]
    inputs, finished = jax.lax.optimization_barrier((inputs, [self.new_p[i] for i in self.done]))
    for i, p in zip(self.done, finished):
      self.new_p[i] = p
    return inputs

  def finished(self, i, u, p):
    """Leaf ``i``'s new parameter (``finish``), in the leaf's layout."""
    return self.step.in_leaf_layout(self.finish(i, u, p))


def _sequenced(step: _MuonStep, p_leaves, leaf_shardings, grad_fn, finish):
  """The fused step's Muon leaves, one Newton-Schulz call at a time.

  Each call's leaves get their momentum pass (new momentum and NS input)
  just before the call and are finished (``finish``: the parameter update)
  right after it; an ``optimization_barrier`` ties every call's inputs to
  the previous call's finished parameters, so the compiler can neither hoist
  a later momentum pass nor defer an earlier update. Only one call's NS
  input, working set and result are live at a time, whatever the size of the
  tree. The arithmetic is the unsequenced path's. Returns ``(new parameter
  leaves, new momentum leaves)``.
  """
  seq = _Sequencer(step, p_leaves, grad_fn, finish)
  plan, distributed = _place_ns_inputs(step.g_leaves, step.specs, leaf_shardings, step.paths,
                                       step.ns_budget, step.ns_input_dtype)
  if distributed:
    _sequenced_distributed(seq, plan, distributed)
  _sequenced_grouped(seq, distributed)
  return seq.new_p, seq.mu_leaves


def _sequenced_distributed(seq: _Sequencer, plan, distributed):
  """The leaves of the all-to-all Newton-Schulz, one round at a time: a
  device's share of a round is at most ``ns_max_elements`` a family, so
  the sharded step too holds one round at a time."""
  step = seq.step
  leaf_of = {k: i for i, k in distributed.items()}
  for members in plan.rounds():
    leaves = [leaf_of[k] for k in members]
    started = {}
    for i, (g, m, p) in zip(leaves, seq.barrier(leaves)):
      started[i] = step.momentum(i, seq.grad_fn(g), m) + (p,)
    ys = plan.orthogonalize([started[i][1] for i in leaves], step.config.ns, members)
    for i, k, y in zip(leaves, members, ys):
      stored, h, a, p = started[i]
      leaf = plan.leaves[k]
      seq.mu_leaves[i] = stored
      seq.new_p[i] = seq.finished(
          i, step.finish_distributed(i, h, y, leaf.views, a, leaf.placement), p)
    seq.done = leaves


def _ns_stages(step: _MuonStep, seq: _Sequencer, distributed):
  """The batched NS calls of the single-device leaves, in order, as
  ``(members, call)`` (a family's members and one call's batch ranges of
  them); leaves without a spec are finished on the way."""
  groups: dict[tuple, list[tuple[int, int, int]]] = {}
  for i, (g, s) in enumerate(zip(step.g_leaves, step.specs)):
    if s is None:
      stored, h, _ = step.momentum(i, seq.grad_fn(g), step.m_old[i])
      seq.mu_leaves[i], seq.new_p[i] = stored, seq.finish(i, h, seq.p_leaves[i])
    elif i not in distributed:
      dtype = jnp.dtype(step.ns_input_dtype or step.out_dtypes[i])
      for j, shape in enumerate(_piece_shapes(g, s, step.paths[i])):
        groups.setdefault(shape[1:] + (dtype,), []).append((i, j, shape[0]))
  stages = []
  for (rows, cols, _), members in groups.items():
    for call in _call_plan([b for _, _, b in members], rows * cols, step.ns_budget):
      stages.append((members, call))
  return stages


def _sequenced_grouped(seq: _Sequencer, distributed):
  """The single-device leaves, one batched NS call at a time: a leaf's
  momentum pass just before its first call, its parameter update right
  after its last."""
  step = seq.step
  stages = _ns_stages(step, seq, distributed)
  first, last = {}, {}
  for st, (members, call) in enumerate(stages):
    for k, _, _ in call:
      i = members[k][0]
      first.setdefault(i, st)
      last[i] = st
  plans, active, parts, held = {}, {}, {}, {}
  run = _replicated_ns(step.config.ns)
  for st, (members, call) in enumerate(stages):
    starting = sorted({members[k][0] for k, _, _ in call if first[members[k][0]] == st})
    for i, (g, m, p) in zip(starting, seq.barrier(starting)):
      held[i] = p
      stored, h, a = step.momentum(i, seq.grad_fn(g), m)
      # Materialise the NS input in the leaf's layout, in the pass that
      # writes the momentum in place: else the compiler splits the pass
      # around the NS orientation's transpose, and the two halves both
      # reading the old momentum cost a copy of it (64 MiB a down projection
      # of the 1.2 B tree). Plain layouts too: with one matrix a call and
      # bf16 momentum, XLA's GPU backend otherwise copied every MLP leaf's
      # old momentum at the start of the step (1.06 GiB of the builder
      # recipe's 1.2 B step, 0.14 GiB with the barrier).
      stored, h = jax.lax.optimization_barrier((stored, h))
      seq.mu_leaves[i], active[i] = stored, a
      plans[i] = matrix_views.split(h, step.specs[i], step.paths[i])
    xs = []
    for k, a, b in call:
      i, j, batch = members[k]
      x = plans[i][0][j].matrix
      xs.append(x if (a, b) == (0, batch) else jax.lax.slice_in_dim(x, a, b))
    y = run(xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=0))
    offset = 0
    for k, a, b in call:
      i, j, _ = members[k]
      parts.setdefault((i, j), []).append(
          y if len(call) == 1 else _slice(y, offset, offset + b - a))
      offset += b - a
    seq.done = []
    for i in sorted({members[k][0] for k, _, _ in call if last[members[k][0]] == st}):
      results = {(i, j): _concat(ps) for (ii, j), ps in parts.items() if ii == i}
      seq.new_p[i] = seq.finished(i, step.finish_grouped(i, plans[i], results, active[i]), held[i])
      seq.done.append(i)


def scale_by_muon(
    ns_coeffs=JORDAN_COEFFS,
    ns_steps: int = _NS_STEPS,
    beta: float = 0.95,
    eps: float = 1e-8,
    mu_dtype: Optional[Any] = None,
    *,
    nesterov: bool = True,
    adaptive: bool = False,
    preconditioning: str = "frobenius",
    weight_dimension_numbers=None,
    coeffs=None,
    ns_dtype="bfloat16",
    shape_scaling: bool = False,
    consistent_rms: Optional[float] = None,
    skip_inactive: bool = False,
    gram: bool | str = False,
    ns_max_elements: Optional[int] = None,
    ns_matmul: str = "xla",
    implementation: Optional[str] = None,
    interpret: bool = False,
    shardings: Any = None,
) -> optax.GradientTransformation:
  r"""Muon's direction: Newton-Schulz orthogonalised (Nesterov) momentum.

  .. math::
    m_t = \beta m_{t-1} + (1-\beta) g_t, \qquad
    \hat m_t = \beta \frac{m_t}{1-\beta^{t+1}} + (1-\beta)\frac{g_t}{1-\beta^t}
    \ (\text{Nesterov; else } m_t/(1-\beta^t)), \qquad
    u_t = \mathrm{NS}_5(\hat m_t / \|\hat m_t\|_F)

  where NS applies ``X <- aX + (bA + cA^2)X``, ``A = XX^T``, per step of the
  coefficient table, to each matrix that ``weight_dimension_numbers`` cuts
  from a leaf (Jordan 2024, modded-nanogpt; Bernstein & Newhouse 2024,
  arXiv 2409.20325). Same arguments and state as
  :func:`optax.contrib.scale_by_muon`, plus:

  Args:
    ns_coeffs, ns_steps, beta, eps, mu_dtype, nesterov, adaptive,
      preconditioning, weight_dimension_numbers: as in optax (a tree of
      :class:`MuonDimensionNumbers` -- optax's or fuseopt's -- or of
      :class:`MatrixViews`, a prefix of the updates, or a callable of the
      updates returning one; ``None`` leaves pass the momentum through; a
      ``None`` argument means every leaf is a 2-D matrix).
    coeffs: ``"jordan"`` (Jordan's (3.4445, -4.7750, 2.0315) x ``ns_steps``),
      ``"polar_express"`` (Amsel et al. 2025, arXiv 2505.16932) or a
      ``(steps, 3)`` table; overrides ``ns_coeffs`` when given.
    ns_dtype: dtype of the iteration (fp32 accumulation); bf16 by default.
    shape_scaling: multiply each matrix's result by optax's width factor
      ``sqrt(max(1, fan_out/fan_in))``, or by ``sqrt(max(fan_in, fan_out)) *
      consistent_rms`` when ``consistent_rms`` is set (Liu et al. 2025, arXiv
      2502.16982); fan-in/out are those of the matrix (of the view).
      :func:`muon` turns this on; optax does it in a separate transform.
    skip_inactive: a matrix whose gradient is all zero this step (an expert
      that no token reached) keeps its momentum and gets a zero update.
    ns_max_elements: the most matrix elements one NS call takes (``None``:
      the platform's default, :func:`default_ns_max_elements`: 2^23 = 16 MiB
      of bf16 input on a GPU or a TPU, two of the 1.2 B Llama tree's
      2048x2048 matrices a call, its 2048x8192 ones alone; 2^25 on the
      CPU). Same-shaped matrices beyond it go into several calls, each
      still batched (never one lone matrix of a larger family), so XLA
      can free one call's temporaries before the next; in
      :func:`fuseopt.optim.step` the calls run one after the other, each with
      its own momentum pass and parameter update, so the step's temporary
      memory is one call's working set. A Python int: under
      :func:`optax.inject_hyperparams` list a non-default value in
      ``static_args`` (as optax's own ``ns_steps``).
    ns_dtype: ``"bfloat16"`` (default) or ``"float32"`` (optax's numerics);
      a dtype, its name or its scalar type.
    ns_matmul: how the Pallas backends compute ``X' = a·X + B·X``: ``"xla"``
      (default: XLA's GEMM with a fused add) or ``"pallas"`` (the update
      kernel, ``a·X`` in its epilogue, bf16 out only). On a GPU ``"pallas"``
      needs less memory: XLA's GEMM holds fp32 products and an fp32 copy of
      X per call (at 2^25 elements a call, the 1.2 B tree's hybrid step on
      an H200: 0.25 GiB of temporaries against 0.52 GiB; 8 H200s: 0.19
      against 0.50 GiB a device); on a TPU v6e it needs more (1.25 against
      0.97 GiB). It accumulates in its own order, so results on hardware
      differ from the default's by bf16 rounding. No effect on the CPU.

  Dtypes: float32 and bfloat16 matrices (frobenius preconditioning) go
  through the kernel; float16, float64 (x64) and complex matrices, and
  optax's other preconditionings, run optax's iteration (in the matrix's
  own dtype; the other preconditionings in ``ns_dtype``). Non-numeric
  defaults (``ns_dtype``, ``ns_max_elements``, ``implementation``) are not
  injected by :func:`optax.inject_hyperparams`, nor is the default of
  ``ns_steps`` (5, held in a wrapper that is not an ``int``: the step count
  sizes the kernel); a number passed for ``ns_steps`` is injected, and
  refused under ``jit`` unless listed in ``static_args``.
    gram, implementation, interpret: forwarded to
      :func:`fuseopt.kernels.newton_schulz` (``gram="auto"``: Gram
      Newton-Schulz for matrices of aspect ratio >= 2).
    shardings: where the parameters live when the mesh axes are Auto (a tree
      of ``NamedSharding`` / ``PartitionSpec`` shaped like the params, a
      prefix, or one for all); ``None`` reads the placement from the types
      (Explicit axes). Sharded Muon leaves keep their momentum sharded; for
      the Newton-Schulz, same-shaped matrices are re-laid out with
      ``all_to_all`` so that each device orthogonalises about 1/N of them,
      whole, then laid back (:mod:`fuseopt.kernels.newton_schulz.distributed`,
      docs/scaling.md).
  """
  return _scale_by_muon(
      ns_coeffs=ns_coeffs, ns_steps=ns_steps, beta=beta, eps=eps, mu_dtype=mu_dtype,
      nesterov=nesterov, adaptive=adaptive, preconditioning=preconditioning,
      weight_dimension_numbers=weight_dimension_numbers, coeffs=coeffs, ns_dtype=ns_dtype,
      shape_scaling=shape_scaling, consistent_rms=consistent_rms, skip_inactive=skip_inactive,
      gram=gram, ns_max_elements=ns_max_elements, ns_matmul=ns_matmul,
      implementation=implementation, interpret=interpret, shardings=shardings)


def _scale_by_muon(
    ns_coeffs=JORDAN_COEFFS,
    ns_steps: int = _NS_STEPS,
    beta: float = 0.95,
    eps: float = 1e-8,
    mu_dtype: Optional[Any] = None,
    *,
    nesterov: bool = True,
    adaptive: bool = False,
    preconditioning: str = "frobenius",
    weight_dimension_numbers=None,
    coeffs=None,
    ns_dtype="bfloat16",
    shape_scaling: bool = False,
    consistent_rms: Optional[float] = None,
    skip_inactive: bool = False,
    gram: bool | str = False,
    ns_max_elements: Optional[int] = None,
    ns_matmul: str = "xla",
    implementation: Optional[str] = None,
    interpret: bool = False,
    shardings: Any = None,
    normuon: Any = None,
) -> optax.GradientTransformation:
  """:func:`scale_by_muon`, or NorMuon's direction with ``normuon`` (see
  :func:`scale_by_normuon`)."""
  if preconditioning not in _PRECONDITIONINGS:
    raise ValueError(f"scale_by_muon: unknown preconditioning {preconditioning!r}; "
                     f"expected one of {_PRECONDITIONINGS}")
  # beta = 1 makes the bias corrections 1 - beta**t zero (NaN updates);
  # ns_steps=2.5 would be truncated to 2 by int().
  _checks.check_decay("scale_by_muon", "beta", beta)
  _checks.check_nonnegative("scale_by_muon", "eps", eps)
  # A negative consistent_rms flips the update's sign; NaN/inf make it non-finite.
  _checks.check_positive("scale_by_muon", "consistent_rms", consistent_rms, optional=True)
  ns_steps = _checks.static_value(ns_steps)
  if isinstance(ns_steps, jax.core.Tracer):
    # The step count sizes the kernel's unrolled iteration and its
    # coefficient table, so it cannot follow a traced value.
    raise TypeError(
        f"scale_by_muon: ns_steps must be a static integer >= 1, got a traced value "
        f"{ns_steps!r}: under optax.inject_hyperparams pass ns_steps only to change it, and "
        f"then list it in static_args=('ns_steps',) (its default stays static by itself)")
  steps_arr = np.asarray(ns_steps)
  if (isinstance(ns_steps, bool) or steps_arr.shape
      or not np.issubdtype(steps_arr.dtype, np.integer) or int(steps_arr) < 1):
    raise ValueError(f"scale_by_muon: ns_steps must be an integer >= 1 (a static value), "
                     f"got {ns_steps!r}")
  kernel_coeffs, kernel_steps = _resolve_coeffs(coeffs, ns_coeffs, ns_steps)
  mu_dtype = adam_transforms._optax_dtype(mu_dtype)
  ns_dtype = jnp.dtype(ns_dtype)
  if ns_matmul not in ("xla", "pallas"):
    raise ValueError(f"scale_by_muon: ns_matmul must be 'xla' or 'pallas', got {ns_matmul!r}")
  if ns_max_elements is None:
    pass   # the platform's default, read when the step is traced
  elif isinstance(ns_max_elements, bool) or not isinstance(ns_max_elements, (int, np.integer)) \
      or ns_max_elements < 1:
    raise TypeError(f"scale_by_muon: ns_max_elements must be a Python int >= 1 or None, got "
                    f"{ns_max_elements!r} (under optax.inject_hyperparams, list it in static_args)")
  # optax keeps its ns_coeffs argument as given ((3,) or (steps, 3)).
  state_coeffs = (_OPTAX_PRESETS[ns_coeffs] if isinstance(ns_coeffs, str) else ns_coeffs)

  def init_fn(params):
    mu = optax.tree.zeros_like(params, dtype=mu_dtype)
    if normuon is not None:
      return NorMuonState(count=jnp.zeros([], jnp.int32), mu=mu,
                          nu=_normuon_nu_init(weight_dimension_numbers, params, normuon[2]),
                          ns_coeffs=jnp.asarray(state_coeffs))
    return MuonState(count=jnp.zeros([], jnp.int32), mu=mu, ns_coeffs=jnp.asarray(state_coeffs))

  # The fused step's NS input in ns_dtype (half the bytes in bf16), straight
  # from the momentum pass; optax's other preconditionings and the adaptive
  # dual norm read it in the gradient's dtype. update() keeps the gradient's
  # dtype: there XLA's CPU schedule held more temporaries with a bf16 input
  # (the direction leaves as a tree before apply_updates).
  fused_ns_input = ns_dtype if preconditioning == "frobenius" and not adaptive else None

  config = _MuonConfig(
      weight_dimension_numbers=weight_dimension_numbers, beta=beta, nesterov=nesterov,
      adaptive=adaptive, shape_scaling=shape_scaling, consistent_rms=consistent_rms,
      skip_inactive=skip_inactive, ns_max_elements=ns_max_elements, shardings=shardings,
      # Jitted: a step's NS calls of one shape (a model's layers repeat a
      # handful) are traced and lowered once, and their kernels compiled once.
      ns=jax.jit(_with_column_sums(functools.partial(
          _orthogonalize, coeffs=kernel_coeffs, steps=kernel_steps, ns_dtype=ns_dtype, eps=eps,
          preconditioning=preconditioning, gram=gram, implementation=implementation,
          interpret=interpret, ns_matmul=ns_matmul), normuon is not None)),
      normuon=normuon)
  direction = functools.partial(_direction, config)

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    nu = state.nu if normuon is not None else None
    out, treedef, mu_leaves, count_inc, nu_leaves = direction(updates, state.mu, state.count,
                                                              nu=nu)
    new_state = state._replace(count=count_inc, mu=treedef.unflatten(mu_leaves))
    if normuon is not None:
      new_state = new_state._replace(nu=treedef.unflatten(nu_leaves))
    return treedef.unflatten(out), new_state

  tx = fusion.FusedTransformation(init_fn, update_fn)
  # Not a rule (the direction alone moves no parameter): what muon()'s rule calls.
  tx.fuseopt_muon_direction = functools.partial(direction, ns_input_dtype=fused_ns_input)
  return tx


def _add_decayed_weights_active(weight_decay, dims_fn,
                                cautious=False) -> optax.GradientTransformation:
  """``u + wd * p`` except on matrices whose Muon update is exactly zero
  (the ones :func:`scale_by_muon` froze with ``skip_inactive``); ``cautious``
  as :func:`fuseopt.optim.weight_decay.add_cautious_decayed_weights`."""
  def update_fn(updates, state, params):
    if params is None:
      raise ValueError("muon: weight decay needs params; pass params= to update()")
    leaves, treedef = jax.tree.flatten(updates)
    specs = _leaf_specs(dims_fn, updates, treedef)
    p_leaves = treedef.flatten_up_to(params)
    out = []
    for u, p, s in zip(leaves, p_leaves, specs):
      d = weight_decay_lib.decay_term(u, p, weight_decay, cautious)
      if s is None:
        out.append(u + d)
      else:
        out.append(u + jnp.where(_active(u, s), d, jnp.zeros((), p.dtype)))
    return treedef.unflatten(out), state
  return optax.GradientTransformation(optax.init_empty_state, update_fn)


def _adamw(learning_rate, b1, b2, eps, eps_root, weight_decay, mu_dtype, moment_dtype, nesterov,
           implementation=None, interpret=False, shardings=None, cautious=False):
  """fuseopt's AdamW; ``moment_dtype=None`` keeps optax's dtypes (mu in
  ``mu_dtype`` or the parameter's, nu in the parameter's)."""
  if moment_dtype is not None:
    mu_dtype = moment_dtype
  return adam_transforms.adamw(learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype,
                         weight_decay=weight_decay, nesterov=nesterov, moment_dtype=moment_dtype,
                         implementation=implementation, interpret=interpret,
                         shardings=shardings, cautious_weight_decay=cautious)


def _muon_branch(direction_tx, decay, learning_rate, weight_decay, weight_decay_mask, dims_fn,
                 skip_inactive, cautious=False):
  """``chain(scale_by_muon, decay, scale_by_learning_rate)`` with its in-place
  rule: after the momentum pass and Newton-Schulz of ``direction_tx``, one
  elementwise pass a leaf computes ``p + (-lr) * (u + wd * p)`` in fp32 (the
  fallback's operation order) and stores it in the parameter's dtype,
  stochastically rounded when bf16 (``derive_seed(MUON_SEED, t, i,
  STREAM_PARAM)``; a mantissa-tracked leaf is written as its two halves);
  under a donating jit XLA writes it in place. ``cautious``: the decay term
  is a select (:func:`fuseopt.optim.weight_decay.decay_term`)."""
  lr_tx = optax.scale_by_learning_rate(learning_rate)
  # optax.identity() where optax's chain has scale_by_shape (done inside
  # scale_by_muon here): its EmptyState, so the whole state has
  # optax.contrib.muon's structure and checkpoints interoperate.
  tx = optax.chain(direction_tx, optax.identity(), decay, lr_tx)

  def apply(grads, state, params, ctx):
    muon_state, shape_state, decay_state, lr_state = state  # the chain above
    if callable(weight_decay):
      raise fusion.NotFusable("muon: a weight-decay schedule has no in-place rule")
    treedef = jax.tree.structure(grads)
    p_leaves = treedef.flatten_up_to(params)
    count_inc = optax.safe_increment(muon_state.count)
    neg_lr = -(learning_rate(lr_state.count) if callable(learning_rate) else learning_rate)
    if weight_decay_mask is None:
      decayed = [True] * len(p_leaves)
    else:
      decayed = fusion.per_leaf_mask(weight_decay_mask, grads)
    specs = _leaf_specs(dims_fn, grads, treedef) if skip_inactive else [None] * len(p_leaves)

    def finish(i, u, p):
      d, s = decayed[i], specs[i]
      # A mantissa-tracked leaf is a (bf16, uint16) pair: its fp32 master.
      p32 = mantissa.master_of(p)
      if d and s is not None:
        u = u + jnp.where(_active(u, s), weight_decay_lib.decay_term(u, p32, weight_decay, cautious),
                          0.0)
      elif d:
        u = u + weight_decay_lib.decay_term(u, p32, weight_decay, cautious)
      if mantissa.is_tracked(p):
        new = mantissa.store(p32 + neg_lr * u, p)
      else:
        new = _store(p32 + neg_lr * u, p.dtype, count_inc, i, counter_hash.STREAM_PARAM)
      if ctx.apply is None:
        return new
      return jax.tree.map(lambda n, o: jnp.where(ctx.apply, n, o), new, p)

    scale = ctx.grad_scale
    nu = getattr(muon_state, "nu", None)   # NorMuon's
    new_p, _, mu_leaves, count_inc, nu_leaves = direction_tx.fuseopt_muon_direction(
        grads, muon_state.mu, muon_state.count, placement=ctx.shardings, finish=finish,
        grad_fn=None if scale is None else (lambda g: (g * scale).astype(g.dtype)),
        param_leaves=p_leaves, nu=nu)
    mu_old = treedef.flatten_up_to(muon_state.mu)
    muon_state = muon_state._replace(count=ctx.keep(count_inc, muon_state.count),
                                     mu=treedef.unflatten(ctx.keep(mu_leaves, mu_old)))
    if nu is not None:
      muon_state = muon_state._replace(
          nu=treedef.unflatten(ctx.keep(nu_leaves, treedef.flatten_up_to(nu))))
    new_state = (
        muon_state,
        shape_state,
        decay_state,
        ctx.keep(jax.tree.map(optax.safe_increment, lr_state), lr_state))
    return treedef.unflatten(new_p), new_state

  return fusion.with_in_place(tx, fusion.InPlace("muon", apply=apply))


def muon(
    learning_rate: optax.ScalarOrSchedule,
    ns_coeffs=JORDAN_COEFFS,
    ns_steps: int = _NS_STEPS,
    beta: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    weight_decay_mask: Optional[Any] = None,
    mu_dtype: Optional[Any] = None,
    *,
    nesterov: bool = True,
    adaptive: bool = False,
    preconditioning: str = "frobenius",
    adam_b1: float = 0.9,
    adam_b2: float = 0.999,
    adam_eps_root: float = 0.0,
    adam_weight_decay: float = 0.0,
    adam_learning_rate: Optional[optax.ScalarOrSchedule] = None,
    muon_weight_dimension_numbers=None,
    consistent_rms: Optional[float] = None,
    coeffs=None,
    ns_dtype="bfloat16",
    adam_moment_dtype: Optional[Any] = None,
    skip_inactive: bool = False,
    gram: bool | str = False,
    ns_max_elements: Optional[int] = None,
    ns_matmul: str = "xla",
    implementation: Optional[str] = None,
    interpret: bool = False,
    shardings: Any = None,
    cautious_weight_decay: bool = False,
    bf16_params: str = "stochastic",
) -> optax.GradientTransformation:
  r"""Muon for the matrices, AdamW for everything else.

  Muon branch: :func:`scale_by_muon` (with the width scaling
  ``sqrt(max(1, fan_out/fan_in))``, or ``sqrt(max(fan_in, fan_out)) *
  consistent_rms``), then ``+ weight_decay * p`` (``weight_decay_mask``
  selects leaves) and ``* -learning_rate``:

  .. math::
    W \leftarrow W - \eta\,(s\,\mathrm{NS}(\hat m) + \lambda W)

  AdamW branch (Loshchilov & Hutter 2019): fuseopt's :func:`~fuseopt.optim.adamw`
  with ``adam_b1, adam_b2, eps, adam_eps_root, adam_weight_decay`` at
  ``adam_learning_rate`` (default: ``learning_rate``); both moments in
  ``adam_moment_dtype`` when given (``jnp.bfloat16`` halves its state,
  written back with stochastic rounding), else optax's dtypes (mu in
  ``mu_dtype``, nu in the parameter's dtype).

  ``muon_weight_dimension_numbers`` picks the sides: a tree (or prefix) of
  :class:`MuonDimensionNumbers` / :class:`MatrixViews` with ``None`` where
  AdamW steps in, or a callable of the params returning one; ``None`` means
  "every 2-D leaf is a Muon matrix, the rest AdamW" -- all as in
  :func:`optax.contrib.muon`, whose arguments this accepts. Extra arguments
  (``coeffs``, ``ns_dtype``, ``skip_inactive``, ``gram``,
  ``ns_max_elements``, ``ns_matmul``, ``implementation``, ``interpret``, ``shardings``) are described in
  :func:`scale_by_muon` (``shardings`` reaches the AdamW side too); with
  ``skip_inactive`` a frozen matrix also gets no weight decay.

  Tied weights (one embedding used again as the LM head) are ONE leaf of the
  params tree used twice by the model: ``jax.grad`` sums both uses into its
  gradient and it gets one optimizer state. Two leaves holding the same
  array are two parameters to optax and to fuseopt.
  """
  return _muon(
      learning_rate=learning_rate, ns_coeffs=ns_coeffs, ns_steps=ns_steps, beta=beta, eps=eps,
      weight_decay=weight_decay, weight_decay_mask=weight_decay_mask, mu_dtype=mu_dtype,
      nesterov=nesterov, adaptive=adaptive, preconditioning=preconditioning, adam_b1=adam_b1,
      adam_b2=adam_b2, adam_eps_root=adam_eps_root, adam_weight_decay=adam_weight_decay,
      adam_learning_rate=adam_learning_rate,
      muon_weight_dimension_numbers=muon_weight_dimension_numbers, consistent_rms=consistent_rms,
      coeffs=coeffs, ns_dtype=ns_dtype, adam_moment_dtype=adam_moment_dtype,
      skip_inactive=skip_inactive, gram=gram, ns_max_elements=ns_max_elements, ns_matmul=ns_matmul,
      implementation=implementation, interpret=interpret, shardings=shardings,
      cautious_weight_decay=cautious_weight_decay, bf16_params=bf16_params)


def _muon(
    learning_rate: optax.ScalarOrSchedule,
    ns_coeffs=JORDAN_COEFFS,
    ns_steps: int = _NS_STEPS,
    beta: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    weight_decay_mask: Optional[Any] = None,
    mu_dtype: Optional[Any] = None,
    *,
    nesterov: bool = True,
    adaptive: bool = False,
    preconditioning: str = "frobenius",
    adam_b1: float = 0.9,
    adam_b2: float = 0.999,
    adam_eps_root: float = 0.0,
    adam_weight_decay: float = 0.0,
    adam_learning_rate: Optional[optax.ScalarOrSchedule] = None,
    muon_weight_dimension_numbers=None,
    consistent_rms: Optional[float] = None,
    coeffs=None,
    ns_dtype="bfloat16",
    adam_moment_dtype: Optional[Any] = None,
    skip_inactive: bool = False,
    gram: bool | str = False,
    ns_max_elements: Optional[int] = None,
    ns_matmul: str = "xla",
    implementation: Optional[str] = None,
    interpret: bool = False,
    shardings: Any = None,
    cautious_weight_decay: bool = False,
    bf16_params: str = "stochastic",
    normuon: Any = None,
    owner: str = "muon",
) -> optax.GradientTransformation:
  """:func:`muon`, or :func:`normuon` with ``normuon`` = NorMuon's (b2, eps, v dtype)."""
  for name, rate in (("learning_rate", learning_rate), ("weight_decay", weight_decay),
                     ("adam_weight_decay", adam_weight_decay)):
    _checks.check_rate(owner, name, rate)
  _checks.check_rate(owner, "adam_learning_rate", adam_learning_rate, optional=True)
  for name, decay in (("beta", beta), ("adam_b1", adam_b1), ("adam_b2", adam_b2)):
    _checks.check_decay(owner, name, decay)
  _checks.check_nonnegative(owner, "eps", eps)
  _checks.check_nonnegative(owner, "adam_eps_root", adam_eps_root)
  _checks.check_positive(owner, "consistent_rms", consistent_rms, optional=True)
  cautious = weight_decay_lib.check_cautious(owner, cautious_weight_decay)
  mantissa.check_mode(owner, bf16_params)
  if adam_learning_rate is None:
    adam_learning_rate = learning_rate

  if muon_weight_dimension_numbers is None:
    def param_labels(params):
      return jax.tree.map(lambda x: "muon" if jnp.ndim(x) == 2 else "adam", params)
    dims_source = MuonDimensionNumbers()
  else:
    def param_labels(params):
      dims = (muon_weight_dimension_numbers(params) if callable(muon_weight_dimension_numbers)
              else muon_weight_dimension_numbers)
      dims = muon_axes.align_to(dims, params, _is_spec_or_none)  # a dict on nnx state
      return jax.tree.map(
          lambda d, sub: jax.tree.map(lambda _: "adam" if d is None else "muon", sub),
          dims, params, is_leaf=_is_spec_or_none)
    dims_source = muon_weight_dimension_numbers

  def dims_fn(tree):
    # ``tree`` is the Muon branch's view of the updates (MaskedNode where AdamW
    # owns a leaf): spread the specs over it, keeping MaskedNode in place.
    dims = dims_source(tree) if callable(dims_source) else dims_source
    if _is_spec(dims):
      return jax.tree.map(lambda _: dims, tree)
    return _broadcast_specs(muon_axes.align_to(dims, tree, _is_spec_or_none), tree)

  if skip_inactive:
    decay = _add_decayed_weights_active(weight_decay, dims_fn, cautious)
    if weight_decay_mask is not None:
      decay = optax.masked(decay, weight_decay_mask)
  elif cautious:
    decay = weight_decay_lib.add_cautious_decayed_weights(weight_decay, weight_decay_mask)
  else:
    decay = optax.add_decayed_weights(weight_decay, weight_decay_mask)

  tx = fusion.partition(
      transforms={
          "muon": _muon_branch(
              _scale_by_muon(
                  ns_coeffs=ns_coeffs, ns_steps=ns_steps, beta=beta, eps=eps, mu_dtype=mu_dtype,
                  nesterov=nesterov, adaptive=adaptive, preconditioning=preconditioning,
                  weight_dimension_numbers=dims_fn, coeffs=coeffs, ns_dtype=ns_dtype,
                  shape_scaling=True, consistent_rms=consistent_rms,
                  skip_inactive=skip_inactive, gram=gram, ns_max_elements=ns_max_elements,
                  ns_matmul=ns_matmul,
                  implementation=implementation,
                  interpret=interpret, shardings=shardings, normuon=normuon),
              decay, learning_rate, weight_decay, weight_decay_mask, dims_fn, skip_inactive,
              cautious,
          ),
          "adam": _adamw(adam_learning_rate, adam_b1, adam_b2, eps, adam_eps_root,
                         adam_weight_decay, mu_dtype, adam_moment_dtype, nesterov,
                         implementation=implementation, interpret=interpret,
                         shardings=shardings, cautious=cautious),
      },
      param_labels=param_labels,
      name=owner,
  )
  return mantissa.with_bf16_params(tx, bf16_params, owner)

