"""QK-Clip: Kimi K2's MuonClip weight rescaling of attention projections."""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from fuseopt.optim import _checks
from fuseopt.optim import groups as groups_lib
from fuseopt.optim import fusion
from fuseopt.optim import muon_transforms

__all__ = [
    "QK_PROJECTIONS",
    "PROJECTION_ROLES",
    "MLAHeadDims",
    "scale_by_qk_clip",
    "muonclip",
]

# The projection names the clip rescales: the query and key projections of
# multi-head and grouped-query attention and, for latent attention (MLA), the
# per-head up-projections of the query (q_b_proj) and of the key/value
# latent (kv_b_proj). Anything else keeps its update untouched.
QK_PROJECTIONS = frozenset({"q_proj", "q_b_proj", "k_proj", "kv_b_proj"})

# What each default projection computes: 'q' per-head queries, 'k' per-head
# (or per-group) keys, 'kv' MLA's per-head [k_nope | v] rows. A module with a
# 'kv' projection is latent attention.
PROJECTION_ROLES = types.MappingProxyType(
    {"q_proj": "q", "q_b_proj": "q", "k_proj": "k", "kv_b_proj": "kv"})
_ROLES = ("q", "k", "kv")


@dataclasses.dataclass(frozen=True)
class MLAHeadDims:
  """Per-head widths of multi-head latent attention (DeepSeek-V2, Kimi K2).

  Each head's query (the output of ``q_b_proj``, or ``q_proj`` without a
  query latent) is ``[q_nope (qk_nope_head_dim) | q_rope
  (qk_rope_head_dim)]``; each head's rows of ``kv_b_proj`` are ``[k_nope
  (qk_nope_head_dim) | v (v_head_dim)]``. ``v_head_dim`` is read off the
  kernel's width; the shared rope key comes from another projection
  (``kv_a_proj_with_mqa``) that the clip leaves alone.
  """
  qk_nope_head_dim: int
  qk_rope_head_dim: int

  def __post_init__(self):
    for name in ("qk_nope_head_dim", "qk_rope_head_dim"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 0:
        raise ValueError(f"MLAHeadDims: {name} must be a non-negative int, got {value!r}")
    if self.qk_nope_head_dim + self.qk_rope_head_dim == 0:
      raise ValueError("MLAHeadDims: qk_nope_head_dim + qk_rope_head_dim must be positive")


def _resolve_roles(projections) -> dict[str, str]:
  if isinstance(projections, Mapping):
    roles = dict(projections)
    for name, role in roles.items():
      if role not in _ROLES:
        raise ValueError(f"scale_by_qk_clip: projections[{name!r}] must be one of {_ROLES}, "
                         f"got {role!r}")
    return roles
  if isinstance(projections, str) or not isinstance(projections, Iterable):
    raise TypeError("scale_by_qk_clip: projections must be a collection of projection names or "
                    f"a mapping name -> role, got {projections!r}")
  unknown = sorted(set(projections) - set(PROJECTION_ROLES))
  if unknown:
    raise ValueError(
        f"scale_by_qk_clip: projections {unknown} have no known role; pass a mapping name -> role "
        f"(roles {_ROLES}), e.g. {{'wq': 'q', 'wk': 'k'}}; known names: {sorted(PROJECTION_ROLES)}")
  return {name: PROJECTION_ROLES[name] for name in projections}


_is_masked = groups_lib.is_masked  # a leaf of another partition (optax.partition)


def _keys_of(path) -> tuple[str, ...]:
  """A key path as its components (a key holding '/' counts as several)."""
  return tuple(k for k in groups_lib.path_str(path).split("/") if k)


def _find_module(params, keys):
  """The deepest params node along ``keys``; trailing keys that params does
  not have (a sow collection's variable name, its tuple index) are dropped."""
  node, found = params, []
  for k in keys:
    if isinstance(node, Mapping) and k in node:
      node = node[k]
      found.append(k)
    else:
      break
  return tuple(found), node


def _projection_leaves(module_path, name, node):
  """(path keys, leaf, is_bias) of every array under one projection."""
  if not isinstance(node, Mapping):
    return [(module_path + (name,), node, False)]
  out = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(node)[0]:
    keys = _keys_of(path)
    out.append((module_path + (name,) + keys, leaf, bool(keys) and keys[-1] == "bias"))
  return out


def _module_updates(stats_path, stats, module_path, module, roles, tau, mla):
  """{path keys of a leaf: (per-column scale, stack + (out,); rank of the
  leaf's leading axes before its output axes)} for one attention module."""
  where = "/".join(module_path) or "<root>"
  s_max = jnp.asarray(stats, jnp.float32)
  if s_max.ndim < 1:
    raise ValueError(f"scale_by_qk_clip: qk_stats[{stats_path!r}] must have shape (..., heads), "
                     f"got a scalar")
  stack, heads = s_max.shape[:-1], s_max.shape[-1]
  # A non-finite maximum means a broken step, which the non-finite guard
  # (not the clip) handles: zeroing q/k on an Inf would be unrecoverable.
  gamma = jnp.where(jnp.isfinite(s_max) & (s_max > tau), tau / s_max, 1.0)

  present = {}
  if isinstance(module, Mapping):
    present = {name: roles[name] for name in module if name in roles}
  if not present:
    raise ValueError(
        f"scale_by_qk_clip: qk_stats[{stats_path!r}] names module {where!r}, which holds none of "
        f"the projections {sorted(roles)}")
  mode = "mla" if "kv" in present.values() else "mha"
  if mode == "mla":
    if mla is None:
      raise ValueError(f"scale_by_qk_clip: module {where!r} is latent attention (it has "
                       f"{[n for n, r in present.items() if r == 'kv']}); pass mla=MLAHeadDims(...)")
    if "k" in present.values():
      raise ValueError(f"scale_by_qk_clip: module {where!r} has both a 'kv' (MLA) and a 'k' "
                       f"projection {sorted(present)}; the clip cannot tell its layout")

  leaves = []
  widths: dict[str, int] = {}
  for name, role in present.items():
    for keys, leaf, is_bias in _projection_leaves(module_path, name, module[name]):
      if leaf is None or _is_masked(leaf):  # another parameter group's leaf
        continue
      shape = tuple(jnp.shape(leaf))
      lead = len(stack) + (0 if is_bias else 1)
      path_s = "/".join(keys)
      if len(shape) <= lead or shape[:len(stack)] != stack:
        raise ValueError(
            f"scale_by_qk_clip: {path_s} has shape {shape}; with qk_stats of shape "
            f"{tuple(s_max.shape)} (stack {stack}, {heads} heads) expected "
            f"{'stack + (heads*width...)' if is_bias else 'stack + (in, heads*width...)'}")
      width = math.prod(shape[lead:])
      if width % heads and not (role == "k" and mode == "mha"):
        raise ValueError(f"scale_by_qk_clip: {path_s} has output width {width}, not a multiple of "
                         f"the {heads} heads of qk_stats[{stats_path!r}]")
      if role in widths and widths[role] != width:
        raise ValueError(f"scale_by_qk_clip: {path_s} has output width {width}, but another "
                         f"'{role}' leaf of {where!r} has {widths[role]}")
      widths[role] = width
      leaves.append((keys, shape, lead, role, path_s))

  if not leaves:
    return {}
  scales = _column_scales(gamma, widths, mode, mla, where)
  return {keys: (scales[role], lead) for keys, shape, lead, role, path_s in leaves}


def _column_scales(gamma, widths, mode, mla, where):
  """role -> per-column scale of shape stack + (width,), heads-major."""
  heads = gamma.shape[-1]
  stack = gamma.shape[:-1]
  sqrt_g = jnp.sqrt(gamma)

  def per_column(parts):  # [(per-head scale, columns)] -> stack + (heads * sum(columns),)
    cols = [jnp.broadcast_to(s[..., None], s.shape + (w,)) for s, w in parts if w]
    return jnp.concatenate(cols, axis=-1).reshape(stack + (-1,))

  if mode == "mla":
    dn, dr = mla.qk_nope_head_dim, mla.qk_rope_head_dim
    out = {}
    if "q" in widths:
      if widths["q"] != heads * (dn + dr):
        raise ValueError(
            f"scale_by_qk_clip: the query projection of {where!r} has width {widths['q']}, expected "
            f"heads * (qk_nope_head_dim + qk_rope_head_dim) = {heads} * {dn + dr}")
      out["q"] = per_column([(sqrt_g, dn), (gamma, dr)])
    if "kv" in widths:
      dkv = widths["kv"] // heads
      if widths["kv"] % heads or dkv < dn:
        raise ValueError(
            f"scale_by_qk_clip: the kv_b projection of {where!r} has width {widths['kv']}, expected "
            f"heads * (qk_nope_head_dim + v_head_dim) with {heads} heads and qk_nope_head_dim {dn}")
      out["kv"] = per_column([(sqrt_g, dn), (jnp.ones_like(gamma), dkv - dn)])
    return out

  # Multi-head / grouped-query: a query and its key share one head_dim, so a
  # key's head count is its width over the query's head_dim.
  head_dim = widths["q"] // heads if "q" in widths else widths["k"] // heads
  if "k" not in widths or "q" not in widths:
    if widths.get("k", 0) % heads:
      raise ValueError(f"scale_by_qk_clip: the key projection of {where!r} has width "
                       f"{widths['k']}, not a multiple of {heads} heads (a key without its "
                       "query takes the MHA split)")
    return {role: per_column([(sqrt_g, head_dim)]) for role in widths}
  kv_heads, rem = divmod(widths["k"], head_dim)
  if rem or not kv_heads or heads % kv_heads:
    raise ValueError(
        f"scale_by_qk_clip: the key projection of {where!r} has width {widths['k']}: with head_dim "
        f"{head_dim} ({widths['q']} query columns / {heads} heads) that is not a number of key "
        f"heads dividing {heads}")
  if kv_heads == heads:
    return {"q": per_column([(sqrt_g, head_dim)]), "k": per_column([(sqrt_g, head_dim)])}
  # GQA: key head g serves query heads [g*n, (g+1)*n) (repeat_kv order).
  grouped = gamma.reshape(stack + (kv_heads, heads // kv_heads))
  k_scale = jnp.sqrt(grouped.min(axis=-1))
  q_scale = jnp.minimum(1.0, grouped / k_scale[..., None]).reshape(gamma.shape)
  return {"q": per_column([(q_scale, head_dim)]), "k": per_column([(k_scale, head_dim)])}


def _clipped_update(update, param, scale, lead):
  """``s*u + (s-1)*W``, i.e. ``s*(W+u) - W``: ``W + u'`` is ``s*(W + u)``,
  and a column with s = 1 keeps its update bit for bit."""
  shape = jnp.shape(update)
  if jnp.shape(param) != shape:
    raise ValueError(f"scale_by_qk_clip: update of shape {shape} for a parameter of shape "
                     f"{jnp.shape(param)}")
  s = scale.reshape(scale.shape[:-1] + (1,) * (lead - scale.ndim + 1) + scale.shape[-1:])
  u = jnp.asarray(update, jnp.float32).reshape(shape[:lead] + (-1,))
  w = jnp.asarray(param, jnp.float32).reshape(shape[:lead] + (-1,))
  return (s * u + (s - 1.0) * w).reshape(shape).astype(jnp.result_type(update))


def scale_by_qk_clip(
    tau: float = 100.0,
    projections: Iterable[str] | Mapping[str, str] = QK_PROJECTIONS,
    *,
    mla: MLAHeadDims | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Rescale the query and key projections of every head whose logits pass tau.

  Kimi K2's MuonClip (Kimi Team, "Kimi K2: Open Agentic Intelligence",
  arXiv 2507.20534, Sec. 2.1), chained after Muon. With ``S_h`` the largest
  attention logit head ``h`` produced in this step's forward passes (already
  maxed across micro-batches),

  .. math::
    \gamma_h = \min(1, \tau / S_h)  \quad (1 \text{ where } S_h \le 0,
    \text{ non-finite, or absent}),

  and the query/key columns of head ``h`` are rescaled after the update so
  that its logits scale by (at most) ``gamma_h``:

  - MHA: the q and k columns of head h each by ``sqrt(gamma_h)``.
  - GQA (``kv_heads`` key heads, key head g shared by query heads
    ``[g*n, (g+1)*n)``, n = heads / kv_heads, the ``repeat_kv`` order): with
    ``m_g = min_{h in g} gamma_h``, key head g by ``sqrt(m_g)`` and query
    head h by ``min(1, gamma_h / sqrt(m_g))``. Head h's logits then scale by
    ``min(gamma_h, sqrt(m_g)) <= gamma_h``: every head ends at or below tau,
    the group's worst head gets exactly the MHA split, no weight is ever
    scaled up (so q and k cannot drift apart in norm over repeated clips),
    and with n = 1 this is the MHA rule. The price: a head below tau that
    shares its key with a clipped head shrinks by ``sqrt(m_g)`` too.
  - MLA (``mla`` given; a module with a ``'kv'`` projection): q_nope and
    k_nope by ``sqrt(gamma_h)``, q_rope by ``gamma_h``; the shared k_rope
    (another projection) and v untouched.

  It is written as an update: for a clipped column ``W + u' = s (W + u)``,
  i.e. ``u' = s u + (s - 1) W`` with ``W`` the ``params`` argument, and
  every other update passes through bit for bit.

  Layout (Linen ``Dense``/``DenseGeneral``): a projection is an array or a
  dict of arrays (``kernel``, ``bias``, ...) under an attention module. A
  kernel is ``stack + (in,) + out`` and a leaf named ``bias`` is
  ``stack + out``, where ``stack`` is the leading shape of the module's
  ``S`` (a scanned layer stack: ``S`` of shape (layers, heads)) and ``out``
  flattens heads-major to ``heads * per-head width`` ([embed, heads,
  head_dim] and [embed, heads*head_dim] both work). A module whose clipped
  projections hold only a query or only a key uses the MHA split.

  Args:
    tau: the logit threshold, > 0 (Kimi K2 uses 100).
    projections: names of the projections to rescale, each with a role in
      :data:`PROJECTION_ROLES`, or a mapping name -> role (``'q'``, ``'k'``
      or ``'kv'``, the last MLA's per-head ``[k_nope | v]`` up-projection).
    mla: the per-head widths of latent attention; required when a module
      has a ``'kv'`` projection.

  Returns:
    A stateless ``GradientTransformationExtraArgs`` whose update takes
    ``params=`` and ``qk_stats=``: a tree (nested dicts mirroring params, or
    a flat dict keyed by '/'-joined module paths) whose leaves are the
    per-head maxima ``S`` of shape ``stack + (heads,)``. A leaf's path names
    its attention module; trailing keys params lacks (a ``sow`` collection's
    variable name and tuple index) are ignored. Without ``qk_stats`` or
    ``params`` the updates pass through unchanged.
  """
  if isinstance(tau, jax.core.Tracer):
    # optax.inject_hyperparams traces it: the clip only compares and divides
    # by it, so the traced scalar serves as it is (its range is the caller's).
    dtype = jnp.result_type(tau)
    if jnp.shape(tau) != () or not (jnp.issubdtype(dtype, jnp.floating)
                                    or jnp.issubdtype(dtype, jnp.integer)):
      raise TypeError(f"scale_by_qk_clip: tau must be a positive number, got {tau!r}")
    tau_value = tau
  else:
    # A string or a bool is refused by name (float('5') would take the string).
    tau_value = _checks.number("scale_by_qk_clip", "tau", tau)
    if not tau_value > 0:
      raise ValueError(f"scale_by_qk_clip: tau must be > 0, got {tau!r}")
  roles = _resolve_roles(projections)
  if mla is not None and not isinstance(mla, MLAHeadDims):
    raise TypeError(f"scale_by_qk_clip: mla must be an MLAHeadDims or None, got {mla!r}")

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None, *, qk_stats=None, **extra_args):
    del extra_args
    if qk_stats is None or params is None:
      return updates, state
    if not isinstance(params, Mapping):
      raise TypeError(f"scale_by_qk_clip: params must be a mapping of modules, got "
                      f"{type(params).__name__}")
    clips: dict[tuple[str, ...], Any] = {}
    owner: dict[tuple[str, ...], str] = {}
    for path, stats in jax.tree_util.tree_flatten_with_path(qk_stats)[0]:
      stats_path = "/".join(_keys_of(path))
      module_path, module = _find_module(params, _keys_of(path))
      if module_path in owner:
        raise ValueError(f"scale_by_qk_clip: qk_stats[{stats_path!r}] and "
                         f"qk_stats[{owner[module_path]!r}] both name module "
                         f"{'/'.join(module_path)!r}")
      owner[module_path] = stats_path
      clips.update(_module_updates(stats_path, stats, module_path, module, roles, tau_value, mla))
    if not clips:
      return updates, state

    param_leaves = {}
    for path, p in jax.tree_util.tree_flatten_with_path(params)[0]:
      keys = _keys_of(path)
      if keys in clips:
        param_leaves[keys] = p

    def clip(path, u):
      keys = _keys_of(path)
      if u is None or keys not in clips:
        return u
      scale, lead = clips[keys]
      return _clipped_update(u, param_leaves[keys], scale, lead)

    new_updates = jax.tree_util.tree_map_with_path(clip, updates)
    return new_updates, state

  def prepare(grads, state, ctx):
    # Without qk_stats the clip passes updates through: nothing to fuse. With
    # them it rescales q/k columns after the update, which has no in-place rule.
    if ctx.extra_args.get("qk_stats") is not None:
      raise fusion.NotFusable("scale_by_qk_clip: qk_stats given (the rescale has no in-place rule)")
    return ctx, state

  return fusion.with_in_place(optax.GradientTransformationExtraArgs(init_fn, update_fn),
                              fusion.InPlace("scale_by_qk_clip", prepare=prepare, identity=True))


def muonclip(learning_rate, *, tau: float = 100.0,
             projections: Iterable[str] | Mapping[str, str] = QK_PROJECTIONS,
             mla: MLAHeadDims | None = None, **muon_kwargs) -> optax.GradientTransformationExtraArgs:
  """MuonClip (Kimi K2, arXiv 2507.20534): Muon, then :func:`scale_by_qk_clip`.

  ``muon_kwargs`` are :func:`fuseopt.optim.muon`'s arguments, e.g.
  ``muon_weight_dimension_numbers=muon_weight_dimension_numbers(params,
  axes)``. The update takes ``params=`` and ``qk_stats=``, which
  ``optax.chain`` forwards to the clip. The signature lists muon's
  arguments one by one (keyword only), so :func:`optax.inject_hyperparams`
  injects the same hyperparameters as into ``muon`` (and ``tau``). Not for
  exact bf16 parameters (:func:`~fuseopt.optim.track_mantissa`): QK-Clip
  rescales the parameters after the update, outside a mantissa companion
  (the builder refuses the pair).
  """
  clip = scale_by_qk_clip(tau, projections, mla=mla)
  arguments = muon_transforms.bind_arguments("muonclip", muon_transforms.muon, (learning_rate,),
                                             muon_kwargs)
  return fusion.chain(muon_transforms.build_muon(arguments, owner="muonclip"), clip)


muonclip.__signature__ = muon_transforms.variant_signature(
    muonclip, muon_transforms.muon, ("tau", "projections", "mla"), keyword_only=True)
