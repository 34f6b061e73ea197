"""Adam and AdamW with bf16-stored moments, as drop-in optax transforms.

(The module holds the drop-in transforms, whose ``update`` runs the unfused
Adam kernels, and the in-place rule through which :func:`fuseopt.optim.step`
fuses the whole step.)

The moments are stored in ``moment_dtype`` (bf16 by default) and widened to
fp32 inside :func:`fuseopt.kernels.adam_update`, which writes them back with
the counter-hash stochastic rounding. The state is optax's
``ScaleByAdamState(count, mu, nu)`` (and :func:`adamw`'s state has the same
structure as :func:`optax.adamw`'s), so checkpoints, sharding rules and
``optax.tree_map_params`` read it as they read fp32 state.

:func:`adam` and :func:`adamw` carry their hyperparameters (attribute
``fuseopt_adam``, for inspection) and an in-place rule (``fuseopt_in_place``,
:mod:`fuseopt.optim.fusion`), which lets :func:`fuseopt.optim.step` run the
whole update (clip factor, moments,
weight decay, learning rate, parameter write) as one fused pass, alone or
inside the wrappers the builder puts around it.
"""

# No `from __future__ import annotations`: optax's tests (and tools) read
# `learning_rate`'s annotation as the object optax.ScalarOrSchedule.
import dataclasses
import warnings
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax

from fuseopt import kernels
from fuseopt.kernels import sharding as kernel_sharding
from fuseopt.kernels.adam import blocks as kernel_blocks
from fuseopt.kernels.adam import formats as kernel_formats
from fuseopt.optim import _checks
from fuseopt.optim.dtypes import KERNEL_DTYPES
from fuseopt.optim import fusion
from fuseopt.optim.execution import Execution
from fuseopt.optim import learning_rate as learning_rate_lib
from fuseopt.optim import mantissa
from fuseopt.optim import weight_decay as weight_decay_lib


@dataclasses.dataclass(frozen=True)
class AdamHyperparams:
  """What :func:`fuseopt.optim.step` needs to fuse an :func:`adam`/:func:`adamw`."""
  learning_rate: Any
  b1: Any
  b2: Any
  eps: Any
  eps_root: Any
  weight_decay: Any      # None for adam (no add_decayed_weights in the chain)
  mask: Any
  nesterov: bool
  mu_dtype: Any
  nu_dtype: Any
  seed: int
  execution: Execution
  cautious: bool = False  # cautious weight decay (fuseopt.optim.weight_decay)


class FusedAdamTransformation(fusion.FusedTransformation):
  """An optax transformation that also carries its Adam hyperparameters.

  It behaves exactly like the ``GradientTransformationExtraArgs`` it wraps
  (``init``/``update``). ``fuseopt_adam`` holds its hyperparameters for
  inspection; :func:`fuseopt.optim.step` runs the fused kernel through its
  in-place rule (``fuseopt_in_place``), not through this attribute.
  """


# ``moment_dtype="int8"`` / ``"int4"``: both moments blockwise in 8 or 4 bits
# (fuseopt.kernels.adam.quantized, fuseopt.kernels.adam.int4).
INT8 = _checks.INT8
BLOCKWISE = _checks.BLOCKWISE


def _same_format(dtype, nu_dtype) -> bool:
  """Whether ``mu_dtype`` ``dtype`` names the blockwise format ``nu_dtype``."""
  try:
    return dtype is not None and _checks.moment_format("", "", dtype) == nu_dtype
  except (TypeError, ValueError):
    return False


def _format_name(nu_dtype) -> str:
  """A moment format as the messages name it."""
  if nu_dtype in BLOCKWISE:
    fmt = kernel_formats.BY_NAME[nu_dtype]
    return (f"{8 if nu_dtype == INT8 else 4}-bit moments ({fmt.moment_type.__name__} codes and "
            f"scales, moment_dtype={nu_dtype!r})")
  if nu_dtype is None:
    return "moments in optax's dtypes (moment_dtype=None)"
  return f"{jnp.dtype(nu_dtype).name} moments (moment_dtype={jnp.dtype(nu_dtype).name!r})"


def _check_moment_format(owner, nu_dtype, mu):
  """Raises a ``ValueError`` naming the leaf, the format this optimizer keeps
  and the one the state holds, where ``mu`` (the state's first moments) is
  not in ``nu_dtype``'s format: 8-bit moments given to an optimizer of
  dtype moments, or a float32/bfloat16 moment of a leaf that this 8-bit
  optimizer keeps in 8 bits (one whose last axis divides into blocks). Either
  used to run: the kernel takes both formats leaf by leaf, so the state kept
  the format it came with and ``moment_dtype`` was silently ignored.
  :func:`fuseopt.optim.step` refuses such a state by its structure; this is
  the same refusal at ``update``. A check of types and shapes only (free
  under ``jit``)."""
  blockwise = kernel_formats.is_blockwise
  for path, m in jax.tree_util.tree_flatten_with_path(mu, is_leaf=blockwise)[0]:
    if blockwise(m):
      if kernel_formats.of(m).name == nu_dtype:
        continue
      found = _format_name(kernel_formats.of(m).name)
    elif (nu_dtype in BLOCKWISE and jnp.result_type(m) in KERNEL_DTYPES
          and kernel_formats.BY_NAME[nu_dtype].fits(jnp.shape(m))):
      found = f"{jnp.result_type(m).name} moments"
    else:
      continue
    raise ValueError(
        f"{owner}: the state holds {found} at {jax.tree_util.keystr(path) or '<the params>'}, "
        f"but this optimizer keeps {_format_name(nu_dtype)}: was the state built by another "
        f"optimizer's init? Build it with this one's tx.init, or this optimizer with the "
        f"state's moment format")


def _blockwise_moments(params, fmt):
  """Zero moments for a blockwise ``moment_dtype`` (format ``fmt``): its
  moment pairs for float32/bfloat16 leaves with quantisation blocks
  (:mod:`fuseopt.kernels.adam.blocks`), bf16 moments for the other such
  leaves (returned by name), optax's for leaves of other dtypes."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  mu, nu, fallback = [], [], []
  for path, p in leaves:
    shape, dtype = jnp.shape(p), jnp.result_type(p)
    if dtype in KERNEL_DTYPES and fmt.fits(shape):
      # (placed like the leaf: a sharded leaf's blockwise moments are sharded too)
      mu.append(fmt.zeros_like(p, signed=True))
      nu.append(fmt.zeros_like(p, signed=False))
      continue
    moment = jnp.bfloat16 if dtype in KERNEL_DTYPES else dtype
    if dtype in KERNEL_DTYPES:
      fallback.append(jax.tree_util.keystr(path) or "<the params>")
    mu.append(jnp.zeros(shape, moment))
    nu.append(jnp.zeros(shape, moment))
  return treedef.unflatten(mu), treedef.unflatten(nu), fallback


def _moment_dtypes(param, mu_dtype, nu_dtype):
  """The ``(mu, nu)`` dtypes of one leaf: ``moment_dtype`` (``nu_dtype``) for
  a float32/bfloat16 parameter, optax's (mu in ``mu_dtype``, nu in the
  parameter's dtype) for any other."""
  dtype = param.dtype if hasattr(param, "dtype") else jnp.asarray(param).dtype  # a Python scalar
  if jnp.dtype(dtype) in KERNEL_DTYPES:
    return mu_dtype or nu_dtype, nu_dtype
  return mu_dtype, None


def _optax_adam(g, mu, nu, count_inc, *, b1, b2, eps, eps_root, nesterov, mu_dtype):
  """optax.scale_by_adam's update on lists of leaves, with optax's public tree
  functions: the same expressions in the same order, so the results are
  optax's bit for bit, jitted or not."""
  new_mu = optax.tree.update_moment(g, mu, b1, 1)
  new_nu = optax.tree.update_moment_per_elem_norm(g, nu, b2, 2)
  if nesterov:
    mu_hat = jax.tree.map(
        lambda m, x: b1 * m + (1 - b1) * x,
        optax.tree.bias_correction(new_mu, b1, optax.safe_increment(count_inc)),
        optax.tree.bias_correction(g, b1, count_inc))
  else:
    mu_hat = optax.tree.bias_correction(new_mu, b1, count_inc)
  nu_hat = optax.tree.bias_correction(new_nu, b2, count_inc)
  u = jax.tree.map(lambda m, v: m / (jnp.sqrt(v + eps_root) + eps), mu_hat, nu_hat)
  return u, optax.tree.cast(new_mu, mu_dtype), optax.tree.cast_like(new_nu, nu)


def _adam_execution(owner: str, value):
  """An Adam transform's ``execution`` (:func:`as_record` of
  :class:`~fuseopt.optim.Execution`), refused where it sets ``newton_schulz``:
  Adam runs no Newton-Schulz, and a setting it would ignore is an error."""
  execution = _checks.as_record(owner, "execution", value, Execution)
  if execution.newton_schulz is not None:
    raise ValueError(f"{owner}: execution.newton_schulz is the Muon family's (muon, normuon, "
                     f"muonclip, scale_by_muon); {owner} runs no Newton-Schulz: leave it None")
  return execution


def _check_hyper(b1, b2, eps, eps_root, owner="scale_by_adam"):
  _checks.check_decay(owner, "b1", b1)
  _checks.check_decay(owner, "b2", b2)
  _checks.check_nonnegative(owner, "eps", eps)
  _checks.check_nonnegative(owner, "eps_root", eps_root)


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                  eps_root: float = 0.0, mu_dtype: Any = None, *, nesterov: bool = False,
                  moment_dtype: Any = "bfloat16", seed: Optional[int] = None,
                  execution: Optional[Execution] = None) -> optax.GradientTransformation:
  r"""Drop-in for :func:`optax.scale_by_adam` with moments stored in ``moment_dtype``.

  .. math::
    m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t,\quad
    v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2,\quad
    u_t = \frac{m_t / (1-\beta_1^t)}{\sqrt{v_t/(1-\beta_2^t) + \bar\varepsilon} + \varepsilon}

  (Kingma & Ba 2014, "Adam: A Method for Stochastic Optimization";
  ``nesterov=True``: Dozat 2016, "Incorporating Nesterov Momentum into
  Adam"). All arithmetic is fp32 with fp32 scalars; a bf16 moment is written
  back stochastically rounded (Gupta et al. 2015), so ``nu`` keeps decaying
  with ``b2 = 0.999`` where a round-to-nearest bf16 store would stall. Leaf
  ``i`` (in ``jax.tree.leaves`` order) at step ``t`` rounds bf16 mu and nu
  with one hash of ``derive_seed(seed, t, i, STREAM_MU)``, mu with its low
  16 bits and nu with its high 16 (a lone bf16 moment beside an fp32 one
  with its own stream, ``STREAM_MU`` or ``STREAM_NU``).

  Which leaves the kernel takes: a leaf whose parameter is float32 or bfloat16
  gets its moments in ``moment_dtype`` and runs the kernel (fp32 arithmetic);
  a leaf of any other dtype (float16, float64 under ``jax_enable_x64``,
  complex, integer) -- or whose gradient or ``mu_dtype`` is one -- keeps
  optax's moment dtypes and runs optax's expressions in its own dtypes,
  bit for bit :func:`optax.scale_by_adam`.

  Args:
    b1, b2, eps, eps_root, nesterov: as in :func:`optax.scale_by_adam`.
    mu_dtype: optax's argument: the dtype of ``mu`` alone (default:
      ``moment_dtype``), a floating dtype or None. An integer one is refused
      (optax casts the momentum to it, which rounds it to 0): 8-bit moments
      are ``moment_dtype="int8"``.
    moment_dtype: dtype of both moments of float32/bfloat16 leaves,
      ``"bfloat16"`` (default), ``"float32"``, ``None`` (the parameters'
      dtype, as optax), a dtype, its name or its scalar type; ``"int8"``:
      both moments in 8 bits, each a
      :class:`~fuseopt.kernels.adam.quantized.QuantizedMoment` (``codes``,
      ``scales``: int8 ``mu``, uint8 ``nu`` with square-root companding, one
      fp32 scale per block of 256; 2.03 bytes of state per parameter); or
      ``"int4"``: both in 4 bits, each a
      :class:`~fuseopt.kernels.adam.int4.PackedMoment` (two codes a byte,
      ``mu`` signed square-root companded, ``nu`` 16 levels without a zero
      code, one fp32 scale per block of 128; 1.06 bytes of state per
      parameter). Blocks lie along the last axis, or the trailing axes taken
      together where the last does not divide (:mod:`fuseopt.kernels.adam.blocks`);
      a leaf with no such blocks (its size not a multiple of 256; for 4 bits,
      an odd last axis too) keeps bf16 moments (one warning at ``init`` names
      such leaves); ``mu_dtype`` must then be None (or the same format).
    seed: integer mixed into the rounding seeds (``None``: 0).
    execution: an :class:`~fuseopt.optim.Execution` record (or a mapping of
      its fields; ``None``: its defaults): a forced backend of
      :func:`fuseopt.kernels.adam_update`, interpret mode, and the
      parameters' shardings on an Auto mesh (docs/scaling.md).

  The defaults of ``moment_dtype``, ``seed`` and ``execution`` are neither
  numbers nor callables, so :func:`optax.inject_hyperparams` leaves them
  alone and injects what it injects into :func:`optax.scale_by_adam` (pass a
  non-default ``seed`` or a dtype *type* such as ``jnp.float32`` in
  ``static_args``, or give the dtype by name).

  Returns:
    An :class:`optax.GradientTransformation` whose state is
    ``optax.ScaleByAdamState(count, mu, nu)``; updates have the gradients'
    dtype. ``update`` refuses a state whose moments are in another format
    (8-bit against bf16/fp32, either way): a ``ValueError`` naming the leaf
    and both formats.
  """
  _check_hyper(b1, b2, eps, eps_root)
  nu_dtype = _checks.moment_format("scale_by_adam", "moment_dtype", moment_dtype)
  mu_dtype = _check_blockwise(nu_dtype, mu_dtype, "scale_by_adam")
  execution = _adam_execution("scale_by_adam", execution)
  return _scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov, nu_dtype, seed, execution,
                        owner="scale_by_adam")


def _scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov, nu_dtype, seed,
                   execution: Execution, *, owner):
  """:func:`scale_by_adam` of checked arguments (``nu_dtype`` the moment
  format as :func:`fuseopt.optim._checks.moment_format` returns it, read once
  by the public function), its errors at ``update`` naming ``owner`` (the
  function the user called: ``adam``, ``adamw``)."""
  mu_dtype = _checks.canonical_mu_dtype(owner, mu_dtype)
  seed = 0 if seed is None else seed
  warned = []

  def init_fn(params):
    if nu_dtype in BLOCKWISE:
      mu, nu, fallback = _blockwise_moments(params, kernel_formats.BY_NAME[nu_dtype])
      if fallback and not warned:
        warned.append(True)
        odd = " and an even last axis" if nu_dtype == _checks.INT4 else ""
        warnings.warn(f"scale_by_adam: moment_dtype={nu_dtype!r} needs trailing axes whose "
                      f"product divides by {kernel_blocks.ROW}{odd}; these leaves keep bf16 "
                      f"moments: {', '.join(fallback)}", stacklevel=2)
      return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=mu, nu=nu)
    def zeros(p, which):
      return optax.tree.zeros_like(p, dtype=_moment_dtypes(p, mu_dtype, nu_dtype)[which])
    mu = jax.tree.map(lambda p: zeros(p, 0), params)
    nu = jax.tree.map(lambda p: zeros(p, 1), params)
    return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=mu, nu=nu)

  def update_fn(updates, state, params=None):
    del params
    _check_moment_format(owner, nu_dtype, state.mu)
    treedef = jax.tree.structure(state.mu, is_leaf=kernel_formats.is_blockwise)
    g = [jnp.asarray(x) for x in treedef.flatten_up_to(updates)]
    mu, nu = treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu)
    count = optax.safe_increment(state.count)
    # An integer leaf (its nu in the parameter's dtype) gets a zero update in
    # that dtype and keeps its moments as init made them.
    idle = {i for i in range(len(g)) if not kernel_formats.is_blockwise(nu[i])
            and _checks.passes_through(nu[i])}
    # (blockwise moments always take the kernel, which names a gradient dtype it cannot read)
    fused = {i for i in range(len(g)) if i not in idle and (kernel_formats.is_blockwise(mu[i])
             or {g[i].dtype, mu[i].dtype, nu[i].dtype} <= set(KERNEL_DTYPES))}
    rest = [i for i in range(len(g)) if i not in fused and i not in idle]
    u, new_mu, new_nu = [None] * len(g), list(mu), list(nu)
    for i in idle:
      u[i] = jnp.zeros(jnp.shape(nu[i]), jnp.result_type(nu[i]))
    leaf_shardings = kernel_sharding.flatten_shardings(execution.shardings, treedef.unflatten(g),
                                                       owner="scale_by_adam", strict=True)
    if fused:
      # Other leaves stand in as empty arrays, so leaf i keeps rounding seed i.
      empty = jnp.zeros((0,), jnp.float32)
      pick = lambda xs: [x if i in fused else empty for i, x in enumerate(xs)]
      outs = kernels.adam_update_tree(
          None, pick(g), pick(mu), pick(nu), count=count, b1=b1, b2=b2, eps=eps,
          eps_root=eps_root, nesterov=nesterov, seed=seed,
          implementation=execution.implementation, interpret=execution.interpret,
          shardings=None if leaf_shardings is None else [
              s if i in fused else None for i, s in enumerate(leaf_shardings)])
      for i in fused:
        u[i], new_mu[i], new_nu[i] = outs[0][i], outs[1][i], outs[2][i]
    if rest:
      outs = _optax_adam([g[i] for i in rest], [mu[i] for i in rest], [nu[i] for i in rest],
                         count, b1=b1, b2=b2, eps=eps, eps_root=eps_root, nesterov=nesterov,
                         mu_dtype=mu_dtype)
      for k, i in enumerate(rest):
        u[i], new_mu[i], new_nu[i] = outs[0][k], outs[1][k], outs[2][k]
    return treedef.unflatten(u), optax.ScaleByAdamState(
        count=count, mu=treedef.unflatten(new_mu), nu=treedef.unflatten(new_nu))

  return optax.GradientTransformation(init_fn, update_fn)


def _check_blockwise(nu_dtype, mu_dtype, owner):
  """The ``mu_dtype`` to use: with a blockwise ``moment_dtype`` ("int8",
  "int4") None (it may be given as None or that format too; any other is a
  ValueError naming it), else ``mu_dtype``, a floating dtype or None
  (:func:`fuseopt.optim._checks.check_mu_dtype`)."""
  if nu_dtype not in BLOCKWISE:
    return _checks.check_mu_dtype(owner, mu_dtype)
  if mu_dtype is not None and not _same_format(mu_dtype, nu_dtype):
    raise ValueError(f"{owner}: mu_dtype must be None with moment_dtype={nu_dtype!r} (both "
                     f"moments are stored in that format), got {mu_dtype!r}")
  return None


def bf16_moments(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                 eps_root: float = 0.0, nesterov: bool = False) -> optax.GradientTransformation:
  """:func:`scale_by_adam` with both moments in bf16: a piece for ``optax.chain``."""
  return scale_by_adam(b1, b2, eps, eps_root, nesterov=nesterov, moment_dtype=jnp.bfloat16)


def _schedule_count(s):
  """The count of a (possibly masked) schedule state."""
  return getattr(s, "inner_state", s).count


def _in_place(hp: AdamHyperparams, decay_at: Optional[int], lr_at: int):
  """The rule of the chain ``scale_by_adam [, add_decayed_weights],
  scale_by_learning_rate`` built below (``decay_at``/``lr_at``: where its
  pieces sit in that chain): one kernel pass reads p, g, mu, nu and writes
  p, mu, nu, with the clip factor, learning rate and per-leaf decay in its
  scalars."""

  def apply(grads, state, params, ctx):
    adam_state = state[0]
    count = optax.safe_increment(adam_state.count)
    lr = hp.learning_rate
    if callable(lr):
      lr = lr(_schedule_count(state[lr_at]))
    p_leaves, treedef = jax.tree.flatten(params, is_leaf=mantissa.is_tracked)
    p_leaves, lo_leaves = mantissa.halves(p_leaves)
    visible = mantissa.visible(params)   # the bf16 halves of mantissa-tracked leaves
    n = len(p_leaves)
    if decay_at is None:
      wds = [0.0] * n
    else:
      wd = hp.weight_decay
      if callable(wd):
        wd = wd(_schedule_count(state[decay_at]))
      skip = isinstance(wd, (int, float)) and wd == 0.0
      wds = [wd if (m and not skip) else 0.0 for m in fusion.per_leaf_mask(hp.mask, visible)]
    g_leaves = treedef.flatten_up_to(grads)
    _check_moment_format(name, hp.nu_dtype, adam_state.mu)
    mu_leaves = treedef.flatten_up_to(adam_state.mu)
    nu_leaves = treedef.flatten_up_to(adam_state.nu)
    # Integer leaves stand in as empty arrays (leaf i keeps rounding seed i, as
    # in update) and come back as they were: no update, moments as init made them.
    idle = [_checks.passes_through(p) for p in p_leaves]
    kept = (list(p_leaves), list(mu_leaves), list(nu_leaves))
    if any(idle):
      empty = jnp.zeros((0,), jnp.float32)
      pick = lambda xs: [empty if d else x for d, x in zip(idle, xs)]
      p_leaves, g_leaves, mu_leaves, nu_leaves = map(pick, (p_leaves, g_leaves, mu_leaves,
                                                            nu_leaves))
      wds = [0.0 if d else w for d, w in zip(idle, wds)]
    for leaves in (p_leaves, g_leaves, mu_leaves, nu_leaves):
      for x in leaves:
        if not kernel_formats.is_blockwise(x) and jnp.result_type(x) not in KERNEL_DTYPES:
          raise fusion.NotFusable(f"a {jnp.result_type(x)} leaf: the kernels take float32 "
                                  f"and bfloat16 only")
    # Only variants in use are asked for, so the plain call is today's (a
    # cautious rate of zero decays nothing: the plain kernel, its bits).
    variants = {}
    if hp.cautious and any(not (isinstance(w, (int, float)) and w == 0.0) for w in wds):
      variants["cautious_weight_decay"] = True
    # (a tracked leaf's companion goes to the kernel whatever its moments'
    # format: the master is read and written in the step's one pass)
    if any(lo is not None for lo in lo_leaves):
      variants["params_lo"] = lo_leaves
    outs = kernels.adam_update_tree(
        p_leaves, g_leaves, mu_leaves, nu_leaves, count=count, learning_rate=lr, b1=hp.b1,
        b2=hp.b2, eps=hp.eps, eps_root=hp.eps_root, weight_decay=wds, nesterov=hp.nesterov,
        seed=hp.seed, implementation=hp.execution.implementation,
        interpret=hp.execution.interpret,
        group=ctx.group, grad_scale=1.0 if ctx.grad_scale is None else ctx.grad_scale,
        apply=True if ctx.apply is None else ctx.apply,
        shardings=_but_idle(kernel_sharding.flatten_shardings(
            hp.execution.shardings if ctx.shardings is None else ctx.shardings, visible,
            owner=name if ctx.shardings is None else "step", strict=True), idle),
        **variants)
    new_p, mu, nu = outs[:3]
    if "params_lo" in variants:
      new_p = mantissa.pair(new_p, outs[3])
    new_p, mu, nu = ([k if d else x for d, k, x in zip(idle, old, new)]
                     for old, new in zip(kept, (new_p, mu, nu)))
    new_adam = optax.ScaleByAdamState(count=ctx.keep(count, adam_state.count),
                                      mu=treedef.unflatten(mu), nu=treedef.unflatten(nu))
    # The chain's other states (weight-decay and learning-rate schedules,
    # masks) hold only step counters, all advanced once per update.
    rest = tuple(ctx.keep(jax.tree.map(optax.safe_increment, s), s) for s in state[1:])
    return treedef.unflatten(new_p), (new_adam,) + rest

  name = "adamw" if decay_at is not None else "adam"
  return fusion.InPlace(name, apply=apply)


def _but_idle(leaf_shardings, idle):
  """Each leaf's sharding, None for the empty stand-ins of integer leaves."""
  if leaf_shardings is None:
    return None
  return [None if d else s for d, s in zip(idle, leaf_shardings)]


def _fused(chain, hp: AdamHyperparams, decay_at=None, lr_at=1) -> FusedAdamTransformation:
  tx = FusedAdamTransformation(chain.init, chain.update)
  tx.fuseopt_adam = hp
  tx.fuseopt_in_place = _in_place(hp, decay_at, lr_at)
  return tx


def adam(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
         eps: float = 1e-8, eps_root: float = 0.0, mu_dtype: Any = None, *,
         nesterov: bool = False, moment_dtype: Any = "bfloat16", seed: Optional[int] = None,
         execution: Optional[Execution] = None) -> FusedAdamTransformation:
  r"""Adam (Kingma & Ba 2014) with bf16-stored moments: drop-in for :func:`optax.adam`.

  ``chain(scale_by_adam(...), scale_by_learning_rate(learning_rate))``, so
  :math:`p_t = p_{t-1} - \alpha_t u_t` with :math:`u_t` of
  :func:`scale_by_adam`; the state has :func:`optax.adam`'s structure. Pass
  it to :func:`fuseopt.optim.step` for the fused in-place update; bf16
  parameters are written with the counter-hash stochastic rounding there,
  exact bf16 parameters are ``track_mantissa(adam(...))``
  (:func:`~fuseopt.optim.track_mantissa`).

  Args:
    learning_rate: a scalar or an optax schedule.
    b1, b2, eps, eps_root, mu_dtype, nesterov: as in :func:`optax.adam`.
    moment_dtype, seed, execution: see :func:`scale_by_adam`.
  """
  _checks.check_rate("adam", "learning_rate", learning_rate)
  _check_hyper(b1, b2, eps, eps_root, "adam")
  nu_dtype = _checks.moment_format("adam", "moment_dtype", moment_dtype)
  mu_dtype = _check_blockwise(nu_dtype, mu_dtype, "adam")
  execution = _adam_execution("adam", execution)
  chain = optax.chain(
      _scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov, nu_dtype, seed, execution,
                     owner="adam"),
      learning_rate_lib.scale_by_learning_rate(learning_rate))
  return _fused(chain, AdamHyperparams(
      learning_rate, b1, b2, eps, eps_root, None, None, nesterov,
      _checks.canonical_mu_dtype("adam", mu_dtype) or nu_dtype, nu_dtype, 0 if seed is None else seed,
      execution))


def adamw(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
          eps: float = 1e-8, eps_root: float = 0.0, mu_dtype: Any = None,
          weight_decay: optax.ScalarOrSchedule = 1e-4,
          mask: Optional[Any | Callable[[optax.Params], Any]] = None, *,
          nesterov: bool = False, moment_dtype: Any = "bfloat16", seed: Optional[int] = None,
          execution: Optional[Execution] = None) -> FusedAdamTransformation:
  r"""AdamW (Loshchilov & Hutter 2019) with bf16 moments: drop-in for :func:`optax.adamw`.

  :math:`p_t = p_{t-1} - \alpha_t (u_t + \lambda p_{t-1})` with :math:`u_t`
  of :func:`scale_by_adam` and decoupled weight decay :math:`\lambda` applied
  where ``mask`` is True. Same chain, hence same state structure, as
  :func:`optax.adamw`. Pass it to :func:`fuseopt.optim.step` for the fused
  in-place update (exact bf16 parameters: ``track_mantissa(adamw(...))``,
  see :func:`adam`).

  Args:
    learning_rate, weight_decay: scalars or optax schedules; a
      ``weight_decay`` given as :func:`~fuseopt.optim.cautious` decays only
      where the Adam direction and the parameter have the same sign,
      :math:`p_t = p_{t-1} - \alpha_t (u_t + \lambda\,1[u_t p_{t-1} \ge 0]\,p_{t-1})`
      (Chen et al. 2025, "Cautious Weight Decay", arXiv 2510.12402); one
      select inside the fused kernel.
    mask: a pytree of bools (prefix of the params) or a callable returning
      one; True where weight decay applies.
    b1, b2, eps, eps_root, mu_dtype, nesterov: as in :func:`optax.adamw`.
    moment_dtype, seed, execution: see :func:`scale_by_adam`.
  """
  _checks.check_rate("adamw", "learning_rate", learning_rate)
  weight_decay, cautious = weight_decay_lib.split_rate(weight_decay)
  _checks.check_rate("adamw", "weight_decay", weight_decay)
  _check_hyper(b1, b2, eps, eps_root, "adamw")
  nu_dtype = _checks.moment_format("adamw", "moment_dtype", moment_dtype)
  mu_dtype = _check_blockwise(nu_dtype, mu_dtype, "adamw")
  execution = _adam_execution("adamw", execution)
  chain = optax.chain(
      _scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov, nu_dtype, seed, execution,
                     owner="adamw"),
      weight_decay_lib.add_decayed_weights(weight_decay, mask, cautious=cautious),
      learning_rate_lib.scale_by_learning_rate(learning_rate))
  return _fused(chain, AdamHyperparams(
      learning_rate, b1, b2, eps, eps_root, weight_decay, mask, nesterov,
      _checks.canonical_mu_dtype("adamw", mu_dtype) or nu_dtype, nu_dtype, 0 if seed is None else seed,
      execution, cautious), decay_at=1, lr_at=2)
