"""Muon: momentum orthogonalised by Newton-Schulz, batched across the tree.

Drop-in for :func:`optax.contrib.muon` / :func:`optax.contrib.scale_by_muon`
(same arguments, same state layout: one momentum leaf per parameter), with
three differences in how the work is done:

* Every Muon matrix of the tree is cut into ``(batch, rows, cols)`` families
  (batch axes such as a stacked-layers or experts axis stay a batch, never a
  Python loop), and all families of the same ``(rows, cols)`` across the
  tree go through batched calls of :func:`fuseopt.kernels.newton_schulz`
  (as few as :class:`~fuseopt.optim.NewtonSchulz`'s ``max_elements`` per
  call allows). A
  family that is alone in its shape is handed over as a reshape of the
  momentum (no copy); several are joined by a concatenate that XLA fuses
  into the elementwise momentum/Nesterov pass that produces them, so no
  separate stacked copy of the leaves exists (``jnp.stack`` of finished
  leaves is what cost optax-style code 14.5 GB of temp memory).
* The iteration runs in the record's ``dtype`` (bf16 by default, fp32
  accumulation) with the coefficients of ``ns_coeffs`` (optax's presets and
  tables, or "jordan", "polar_express"); ``NewtonSchulz(dtype=jnp.float32)``
  gives optax's fp32 numerics.
* :class:`~fuseopt.optim.matrix_views.MatrixViews` may stand where
  dimension numbers go, to orthogonalise several matrices held in one tensor
  independently; :class:`~fuseopt.optim.matrix_views.Experts` around either
  freezes the matrices of a stacked experts weight whose gradient is all zero
  this step (unrouted experts).

:func:`muon` declares an in-place rule (:mod:`fuseopt.optim.fusion`):
:func:`fuseopt.optim.step` runs its Muon leaves as one elementwise pass
(new momentum, stored in its dtype with stochastic rounding when bf16, and
the Nesterov NS input in the record's dtype), the batched Newton-Schulz, and one
pass writing ``p - lr (scale O + wd p)`` over the parameter (stochastic
rounding for bf16 parameters), one NS call at a time (optimization barriers
order the calls, so the step holds one call's working set, not the tree's);
its AdamW leaves go through the fused Adam kernel.

The rooms: this module holds the public transforms, the in-place rule and
the Muon family's one signature (:func:`bind_arguments`,
:func:`variant_signature`: NorMuon and MuonClip take muon's arguments through
it, and :func:`muon_direction`, :func:`direction_transform` and
:func:`build_muon` build them); :mod:`fuseopt.optim.muon_settings` the
Newton-Schulz record; :mod:`fuseopt.optim.muon_pipeline` the step, one loop
over its stages: :mod:`~fuseopt.optim.muon_plan` (each leaf's spec,
placement and calls, decided once), :mod:`~fuseopt.optim.muon_momentum`,
:mod:`~fuseopt.optim.muon_newton_schulz` (the calls and the iteration),
:mod:`~fuseopt.optim.muon_finish` and :mod:`~fuseopt.optim.muon_store`.
"""

# No `from __future__ import annotations`: optax's tests (and tools) read
# `learning_rate`'s annotation as the object optax.ScalarOrSchedule.
import dataclasses
import functools
import inspect
import types
import warnings
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fuseopt.kernels import counter_hash
from fuseopt.kernels import fp_contract
from fuseopt.kernels.adam import quantized
from fuseopt.kernels.newton_schulz import coefficients as ns_coefficients
from fuseopt.optim import _checks
from fuseopt.optim import adam_transforms
from fuseopt.optim import fusion
from fuseopt.optim import learning_rate as learning_rate_lib
from fuseopt.optim import mantissa
from fuseopt.optim import matrix_views
from fuseopt.optim import muon_axes
from fuseopt.optim import muon_pipeline
from fuseopt.optim import muon_plan
from fuseopt.optim import muon_store
from fuseopt.optim import weight_decay as weight_decay_lib
from fuseopt.optim.matrix_views import Experts, MatrixViews, MuonDimensionNumbers
from fuseopt.optim.muon_newton_schulz import NS_STEPS, PRECONDITIONINGS, newton_schulz_stack
from fuseopt.optim.execution import Execution
from fuseopt.optim.muon_settings import NewtonSchulz

__all__ = ["Execution", "Experts", "MuonDimensionNumbers", "MatrixViews", "MuonState", "NewtonSchulz",
           "bind_arguments", "build_muon", "direction_transform", "muon", "muon_direction",
           "scale_by_muon", "variant_signature"]


# The state of scale_by_muon is optax's own class, with optax's fields:
# ``count`` (int32), ``mu`` (one momentum leaf per parameter) and
# ``ns_coeffs`` (``jnp.asarray`` of the ``ns_coeffs`` argument, (3,) or
# (steps, 3), kept for inspection: the update uses the static table).
MuonState = optax.contrib.MuonState


def scale_by_muon(
    ns_coeffs=ns_coefficients.JORDAN,
    ns_steps: int = NS_STEPS,
    beta: float = 0.95,
    eps: float = 1e-8,
    mu_dtype: Optional[Any] = None,
    *,
    nesterov: bool = True,
    adaptive: bool = False,
    preconditioning: str = "frobenius",
    weight_dimension_numbers=None,
    shape_scaling: bool = False,
    consistent_rms: Optional[float] = None,
    execution: Optional[Execution] = None,
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
      ``None`` argument means every leaf is a 2-D matrix). A spec wrapped in
      :class:`~fuseopt.optim.Experts` declares a stack of experts: a matrix
      whose gradient is all zero this step (an expert no token reached)
      keeps its momentum and gets a zero update. ``ns_coeffs``
      also takes fuseopt's schedules: ``"jordan"`` (Jordan's triple x
      ``ns_steps``, with Jordan's Gram restarts) and ``"polar_express"``
      (Amsel et al. 2025, arXiv 2505.16932); optax's ``"standard"`` and
      ``"dion"`` and tables as optax
      (:func:`fuseopt.kernels.newton_schulz.coefficients.muon_coefficients`).
    shape_scaling: multiply each matrix's result by optax's width factor
      ``sqrt(max(1, fan_out/fan_in))``, or by ``sqrt(max(fan_in, fan_out)) *
      consistent_rms`` when ``consistent_rms`` is set (Liu et al. 2025, arXiv
      2502.16982); fan-in/out are those of the matrix (of the view).
      :func:`muon` turns this on; optax does it in a separate transform.
    execution: an :class:`~fuseopt.optim.Execution` record (or a mapping;
      ``None``: its defaults): a forced backend, interpret mode, the
      parameters' shardings on an Auto mesh, and ``newton_schulz``, a
      :class:`~fuseopt.optim.NewtonSchulz` record: the iteration's dtype
      (bf16 by default), Gram Newton-Schulz, the most elements a call, the
      matmul of the Pallas backends.

  ``mu_dtype="int8"`` (or ``jnp.int8``) stores the momentum in 8 bits: each
  leaf a :class:`~fuseopt.kernels.adam.quantized.QuantizedMoment` (int8
  ``codes`` in the leaf's shape, fp32 ``scales`` one per block of 256 along
  the last axis; 1 + 4/256 bytes a parameter), Adam's 8-bit ``mu`` format,
  written with counter-hash stochastic rounding (seeds ``derive_seed(MUON_SEED,
  t, i, STREAM_MU)``); the step decodes it, updates in fp32 and feeds the NS
  input from the fp32 value. A leaf whose last axis does not divide by 256
  keeps bf16 momentum (one warning at ``init`` names it).

  Dtypes: float32 and bfloat16 matrices (frobenius preconditioning) go
  through the kernel; float16, float64 (x64) and complex matrices, and
  optax's other preconditionings, run optax's iteration (in the matrix's
  own dtype; the other preconditionings in the record's dtype). The records
  are not injected by :func:`optax.inject_hyperparams`, nor is the default of
  ``ns_steps`` (5, held in a wrapper that is not an ``int``: the step count
  sizes the kernel); a number passed for ``ns_steps`` is injected, and
  refused under ``jit`` unless listed in ``static_args``.
  """
  return direction_transform(muon_direction(dict(locals())))


def muon_direction(args, piece=None) -> muon_pipeline.Direction:
  """:func:`scale_by_muon`'s arguments (by name), checked, as the value the
  pipeline runs (:class:`fuseopt.optim.muon_pipeline.Direction`), with
  ``piece`` (an :class:`~fuseopt.optim.muon_finish.UpdatePiece`, e.g.
  NorMuon's) acting on the orthogonalised update. ``weight_dimension_numbers``
  may be a :class:`~fuseopt.optim.muon_plan.SpecReader` already (:func:`muon`'s,
  shared with its labels)."""
  preconditioning, beta, eps = args["preconditioning"], args["beta"], args["eps"]
  if preconditioning not in PRECONDITIONINGS:
    raise ValueError(f"scale_by_muon: unknown preconditioning {preconditioning!r}; "
                     f"expected one of {PRECONDITIONINGS}")
  # beta = 1 makes the bias corrections 1 - beta**t zero (NaN updates);
  # ns_steps=2.5 would be truncated to 2 by int().
  _checks.check_decay("scale_by_muon", "beta", beta)
  _checks.check_nonnegative("scale_by_muon", "eps", eps)
  # A negative consistent_rms flips the update's sign; NaN/inf make it non-finite.
  _checks.check_positive("scale_by_muon", "consistent_rms", args["consistent_rms"], optional=True)
  ns_steps = _checks.static_value(args["ns_steps"])
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
  kernel_coeffs, kernel_steps, state_coeffs = ns_coefficients.muon_coefficients(
      args["ns_coeffs"], ns_steps)
  mu_dtype = _checks.muon_mu_dtype("scale_by_muon", args["mu_dtype"])
  execution = _checks.as_record("scale_by_muon", "execution", args["execution"], Execution)
  ns = execution.newton_schulz or NewtonSchulz()
  dims = args["weight_dimension_numbers"]
  specs = (dims if isinstance(dims, muon_plan.SpecReader) else
           muon_plan.SpecReader(functools.partial(muon_plan.declared_specs, dims)))

  # The fused step's NS input in the record's dtype (half the bytes in
  # bf16), straight from the momentum pass; optax's other preconditionings
  # and the adaptive dual norm read it in the gradient's dtype. update()
  # keeps the gradient's dtype: there XLA's CPU schedule held more
  # temporaries with a bf16 input (the direction leaves as a tree before
  # apply_updates).
  fused_ns_input = ns.dtype if preconditioning == "frobenius" and not args["adaptive"] else None

  ns_stack = functools.partial(
      newton_schulz_stack, coeffs=kernel_coeffs, steps=kernel_steps, ns_dtype=ns.dtype, eps=eps,
      preconditioning=preconditioning, gram=ns.gram, implementation=execution.implementation,
      interpret=execution.interpret, ns_matmul=ns.matmul)
  return muon_pipeline.Direction(
      specs=specs, matrices_only=dims is None, beta=beta, nesterov=args["nesterov"],
      adaptive=args["adaptive"], shape_scaling=args["shape_scaling"],
      consistent_rms=args["consistent_rms"], ns_max_elements=ns.max_elements,
      shardings=execution.shardings,
      # Jitted: a step's NS calls of one shape (a model's layers repeat a
      # handful) are traced and lowered once, and their kernels compiled once.
      ns=jax.jit(ns_stack if piece is None else piece.wrap_ns(ns_stack)),
      fused_ns_input_dtype=fused_ns_input, mu_dtype=mu_dtype, state_coeffs=state_coeffs,
      piece=piece)


def direction_transform(direction: muon_pipeline.Direction) -> optax.GradientTransformation:
  """The optax transformation of ``direction`` (:func:`muon_direction`): its
  state (optax's :class:`MuonState`, or the piece's) and its update, the
  pipeline without a store. The fused step runs the same pipeline through
  :func:`muon`'s rule, from the same value."""
  piece = direction.piece
  warned = []

  def init_fn(params):
    count = jnp.zeros([], jnp.int32)
    if direction.mu_dtype == _checks.INT8:
      mu = _int8_momentum(params, warned)
    else:
      mu = optax.tree.zeros_like(params, dtype=direction.mu_dtype)
    # optax keeps its ns_coeffs argument as given ((3,) or (steps, 3)).
    if piece is not None:
      return piece.init_state(count, mu, jnp.asarray(direction.state_coeffs), params,
                              muon_plan.cuts(direction.specs(params)))
    return MuonState(count=count, mu=mu, ns_coeffs=jnp.asarray(direction.state_coeffs))

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    muon_store.check_momentum_format("scale_by_muon", direction.mu_dtype, state.mu)
    out, treedef, new_state = muon_pipeline.run(direction, updates, state)
    return treedef.unflatten(out), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _int8_momentum(params, warned):
  """8-bit momentum leaves for ``params`` (``mu_dtype="int8"``): a leaf without
  quantisation blocks (its size not a multiple of 256) keeps bf16 momentum,
  named in one warning (the first ``init``)."""
  fallback = []

  def one(path, p):
    fits = quantized.fits(jnp.shape(p))
    if not fits:
      fallback.append(jax.tree_util.keystr(path))
    return muon_store.init_momentum(p, jnp.bfloat16, fits)

  mu = jax.tree_util.tree_map_with_path(one, params)
  if fallback and not warned:
    warned.append(True)
    warnings.warn(f"scale_by_muon: mu_dtype='int8' needs trailing axes whose product divides "
                  f"by {quantized.BLOCK}; these leaves keep bf16 momentum: {', '.join(fallback)}",
                  stacklevel=3)
  return mu


def _add_decayed_weights(weight_decay, weight_decay_mask, specs: muon_plan.SpecReader,
                         cautious: bool) -> optax.GradientTransformation:
  """Muon's decay, ``u + wd * p``: :func:`fuseopt.optim.weight_decay.add_decayed_weights`
  (optax's state, the product rounded before its add) gated off the frozen
  matrices of leaves declared :class:`~fuseopt.optim.Experts` (known at the
  update: the specs may come from a callable)."""
  def gate(updates):
    experts = muon_plan.expert_cuts(specs(updates))
    return [None if e is None else functools.partial(matrix_views.active, spec=e) for e in experts]
  return weight_decay_lib.add_decayed_weights(weight_decay, weight_decay_mask, cautious=cautious,
                                              gate=gate)


def _adamw(learning_rate, b1, b2, eps, eps_root, weight_decay, mu_dtype, moment_dtype, nesterov,
           execution):
  """fuseopt's AdamW, as :func:`fuseopt.optim.adamw` keeps it: ``moment_dtype=None``
  keeps optax's dtypes (mu in ``mu_dtype`` or the parameter's, nu in the
  parameter's); a leaf the kernel cannot take (float16, say) runs optax's
  arithmetic with ``mu_dtype``, so its update keeps the parameter's dtype.
  With any ``moment_dtype`` but None both of the AdamW side's moments are in
  that format, mu included: ``mu_dtype`` is then Muon's momentum's alone
  (so a state whose Muon momentum :func:`~fuseopt.optim.convert_moments`
  converted is taken by the ``muon`` of the new ``mu_dtype``)."""
  if moment_dtype is not None:
    mu_dtype = None
  # (the Newton-Schulz settings are the Muon side's: the AdamW side runs none)
  return adam_transforms.adamw(learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                               mu_dtype=mu_dtype, weight_decay=weight_decay, nesterov=nesterov,
                               moment_dtype=moment_dtype,
                               execution=dataclasses.replace(execution, newton_schulz=None))


def _muon_branch(direction, decay, learning_rate, weight_decay, weight_decay_mask, cautious=False):
  """``chain(scale_by_muon, decay, scale_by_learning_rate)`` with its in-place
  rule: after the momentum pass and Newton-Schulz of ``direction``, one
  elementwise pass a leaf computes ``p + (-lr) * (u + wd * p)`` in fp32 (the
  fallback's operation order) and stores it in the parameter's dtype,
  stochastically rounded when bf16 (``derive_seed(MUON_SEED, t, i,
  STREAM_PARAM)``; a mantissa-tracked leaf is written as its two halves);
  under a donating jit XLA writes it in place. ``cautious``: the decay term
  is a select (:func:`fuseopt.optim.weight_decay.decay_term`)."""
  lr_tx = learning_rate_lib.scale_by_learning_rate(learning_rate)
  # optax.identity() where optax's chain has scale_by_shape (done inside
  # scale_by_muon here): its EmptyState, so the whole state has
  # optax.contrib.muon's structure and checkpoints interoperate.
  tx = optax.chain(direction_transform(direction), optax.identity(), decay, lr_tx)

  def apply(grads, state, params, ctx):
    muon_state, shape_state, decay_state, lr_state = state  # the chain above
    muon_store.check_momentum_format("scale_by_muon", direction.mu_dtype, muon_state.mu)
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

    def store(i, u, p, leaf):
      d, s = decayed[i], leaf.experts   # frozen matrices get no decay
      # A mantissa-tracked leaf is a (bf16, uint16) pair: its fp32 master.
      p32 = mantissa.master_of(p)
      if d and s is not None:
        u = u + jnp.where(matrix_views.active(u, s),
                          weight_decay_lib.decay_term(u, p32, weight_decay, cautious), 0.0)
      elif d:
        u = u + weight_decay_lib.decay_term(u, p32, weight_decay, cautious)
      # (the step rounded before the add: no FMA, the same bits in every program)
      step = fp_contract.rounded(neg_lr * u)
      if mantissa.is_tracked(p):
        new = mantissa.store(p32 + step, p)
      else:
        new = muon_store.store(p32 + step, p.dtype, count_inc, i, counter_hash.STREAM_PARAM)
      if ctx.apply is None:
        return new
      return jax.tree.map(lambda n, o: jnp.where(ctx.apply, n, o), new, p)

    scale = ctx.grad_scale
    new_p, _, new_muon = muon_pipeline.run(
        direction, grads, muon_state, store=store, shardings=ctx.shardings,
        grad_fn=None if scale is None else (lambda g: (g * scale).astype(g.dtype)),
        params=p_leaves)
    # count, mu (and a piece's state, NorMuon's nu) where the step applies;
    # ns_coeffs, for inspection, as it was.
    muon_state = new_muon._replace(**{f: ctx.keep(getattr(new_muon, f), getattr(muon_state, f))
                                      for f in new_muon._fields if f != "ns_coeffs"})
    new_state = (
        muon_state,
        shape_state,
        decay_state,
        ctx.keep(jax.tree.map(optax.safe_increment, lr_state), lr_state))
    return treedef.unflatten(new_p), new_state

  return fusion.with_in_place(tx, fusion.InPlace("muon", apply=apply))


def muon(
    learning_rate: optax.ScalarOrSchedule,
    ns_coeffs=ns_coefficients.JORDAN,
    ns_steps: int = NS_STEPS,
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
    moment_dtype: Any = "bfloat16",
    execution: Optional[Execution] = None,
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
  ``moment_dtype``, as :func:`~fuseopt.optim.adamw`'s: ``"bfloat16"``
  (default, written back with stochastic rounding), ``"float32"``,
  ``"int8"`` (8-bit codes) or ``None`` (optax's dtypes: mu in ``mu_dtype``,
  nu in the parameter's). Muon's own momentum is in ``mu_dtype``: a floating
  dtype, None (the parameter's), or ``"int8"`` (blockwise 8-bit, as
  :func:`scale_by_muon`'s; the AdamW side then keeps ``moment_dtype``'s
  moments, its mu included).

  ``muon_weight_dimension_numbers`` picks the sides: a tree (or prefix) of
  :class:`MuonDimensionNumbers` / :class:`MatrixViews` with ``None`` where
  AdamW steps in, or a callable of the params returning one; ``None`` means
  "every 2-D leaf is a Muon matrix, the rest AdamW" -- all as in
  :func:`optax.contrib.muon`, whose arguments this accepts (the first 18);
  then the AdamW side's ``moment_dtype`` and fuseopt's one record,
  ``execution`` (:class:`~fuseopt.optim.Execution`, both sides: where the
  kernels run, and how the Newton-Schulz iteration runs, its
  ``newton_schulz`` field, a :class:`~fuseopt.optim.NewtonSchulz`). The variants are pieces
  where they act, not flags: a spec wrapped in :class:`~fuseopt.optim.Experts`
  freezes that leaf's matrices while their gradient is all zero (no update,
  no weight decay); a ``weight_decay`` or ``adam_weight_decay`` given as
  :func:`~fuseopt.optim.cautious` decays that side only where the update and
  the parameter agree in sign (Chen et al. 2025, arXiv 2510.12402); exact
  bf16 parameters are ``track_mantissa(muon(...))``.

  Tied weights (one embedding used again as the LM head) are ONE leaf of the
  params tree used twice by the model: ``jax.grad`` sums both uses into its
  gradient and it gets one optimizer state. Two leaves holding the same
  array are two parameters to optax and to fuseopt.
  """
  return build_muon(dict(locals()))


def build_muon(args, piece=None, owner="muon") -> optax.GradientTransformation:
  """:func:`muon` of ``args`` (its arguments by name), with ``piece`` acting
  on the Muon side's orthogonalised update (see :func:`muon_direction`);
  ``owner`` names the variant in messages (``normuon``, ``muonclip``)."""
  a = types.SimpleNamespace(**args)
  weight_decay, cautious = weight_decay_lib.split_rate(a.weight_decay)
  adam_weight_decay, _ = weight_decay_lib.split_rate(a.adam_weight_decay)   # adamw reads the piece
  for name, rate in (("learning_rate", a.learning_rate), ("weight_decay", weight_decay),
                     ("adam_weight_decay", adam_weight_decay)):
    _checks.check_rate(owner, name, rate)
  _checks.check_rate(owner, "adam_learning_rate", a.adam_learning_rate, optional=True)
  for name in ("beta", "adam_b1", "adam_b2"):
    _checks.check_decay(owner, name, args[name])
  _checks.check_nonnegative(owner, "eps", a.eps)
  _checks.check_nonnegative(owner, "adam_eps_root", a.adam_eps_root)
  _checks.check_positive(owner, "consistent_rms", a.consistent_rms, optional=True)
  moment_dtype = _checks.moment_format(owner, "moment_dtype", a.moment_dtype)
  execution = _checks.as_record(owner, "execution", a.execution, Execution)
  adam_learning_rate = a.learning_rate if a.adam_learning_rate is None else a.adam_learning_rate
  weight_decay_mask = a.weight_decay_mask
  specs, param_labels = _muon_split(a.muon_weight_dimension_numbers, owner)
  decay = _add_decayed_weights(weight_decay, weight_decay_mask, specs, cautious)

  direction = muon_direction(dict(
      ns_coeffs=a.ns_coeffs, ns_steps=a.ns_steps, beta=a.beta, eps=a.eps, mu_dtype=a.mu_dtype,
      nesterov=a.nesterov, adaptive=a.adaptive, preconditioning=a.preconditioning,
      weight_dimension_numbers=specs, shape_scaling=True, consistent_rms=a.consistent_rms,
      execution=execution), piece)
  return fusion.partition(
      transforms={
          "muon": _muon_branch(direction, decay, a.learning_rate, weight_decay, weight_decay_mask,
                               cautious),
          "adam": _adamw(adam_learning_rate, a.adam_b1, a.adam_b2, a.eps, a.adam_eps_root,
                         a.adam_weight_decay, a.mu_dtype, moment_dtype, a.nesterov, execution),
      },
      param_labels=param_labels,
      name=owner,
  )


def _muon_split(muon_weight_dimension_numbers, owner="muon"):
  """``(specs, param_labels)``: the leaves' specs (a
  :class:`~fuseopt.optim.muon_plan.SpecReader`) and the labels that send each
  leaf to Muon or AdamW, both from one read of the declaration a tree. The
  labels read the whole tree and record what the Muon side will be handed
  (the tree with AdamW's leaves masked), so that the side's plan, its
  experts' decay gate and NorMuon's state take that same read."""
  if muon_weight_dimension_numbers is None:
    def read(tree):
      # (an integer leaf goes to the AdamW side, which passes it through)
      return [MuonDimensionNumbers() if jnp.ndim(x) == 2 and not _checks.passes_through(x)
              else None for x in jax.tree.leaves(tree)]
  else:
    def dims_fn(tree):
      # ``tree`` the whole tree, or the Muon side's view of it (MaskedNode
      # where AdamW owns a leaf): the specs spread over it, MaskedNode kept.
      dims = (muon_weight_dimension_numbers(tree) if callable(muon_weight_dimension_numbers)
              else muon_weight_dimension_numbers)
      if muon_plan.is_spec(dims):
        return jax.tree.map(lambda _: dims, tree)
      aligned = muon_axes.align_to(dims, tree, muon_plan.is_spec_or_none)  # a dict on nnx state
      return muon_plan.broadcast_specs(aligned, tree)
    declared = functools.partial(muon_plan.declared_specs, dims_fn)

    def read(tree):
      specs = declared(tree)
      flat = jax.tree_util.tree_flatten_with_path(tree)[0]
      for (path, x), spec in zip(flat, specs):
        if spec is not None and _checks.passes_through(x):
          raise ValueError(
              f"{owner}: muon_weight_dimension_numbers declares the leaf at "
              f"{jax.tree_util.keystr(path) or '<root>'} a Muon matrix, but it is "
              f"{jnp.result_type(x)}: integer and bool leaves get no update; declare None for "
              f"it (the AdamW side passes it through)")
      return specs
  specs = muon_plan.SpecReader(read)

  def param_labels(params):
    declared = specs(params)
    leaves, treedef = jax.tree.flatten(params)
    specs.remember(treedef.unflatten([x if s is not None else optax.MaskedNode()
                                      for x, s in zip(leaves, declared)]),
                   [s for s in declared if s is not None])
    return treedef.unflatten(["adam" if s is None else "muon" for s in declared])

  return specs, param_labels


def bind_arguments(owner, fn, args, kwargs, refused=()):
  """``fn``'s arguments by name (defaults applied) from a variant's call:
  the variants of the Muon family (:func:`~fuseopt.optim.normuon`,
  :func:`~fuseopt.optim.muonclip`) take the family's arguments through
  ``fn``'s one signature rather than a copy of it."""
  bad = sorted(set(kwargs) & set(refused))
  if bad:
    raise TypeError(f"{owner}: got unexpected keyword arguments {bad} (not part of {owner})")
  try:
    bound = inspect.signature(fn).bind(*args, **kwargs)
  except TypeError as e:
    raise TypeError(f"{owner}: {e}") from None
  bound.apply_defaults()
  return dict(bound.arguments)


def variant_signature(variant, base, own, dropped=(), keyword_only=False) -> inspect.Signature:
  """``variant``'s signature: ``base``'s positional arguments (with
  ``keyword_only``, only its first), then ``variant``'s own (``own``, keyword
  only), then ``base``'s other arguments but ``dropped``. What
  :func:`optax.inject_hyperparams` and the docs read."""
  mine = inspect.signature(variant).parameters
  theirs = [p for n, p in inspect.signature(base).parameters.items() if n not in dropped]
  positional = [p for p in theirs if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]
  if keyword_only:
    positional = positional[:1]
  rest = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in theirs if p not in positional]
  params = positional + [mine[n].replace(kind=inspect.Parameter.KEYWORD_ONLY) for n in own] + rest
  return inspect.signature(variant).replace(parameters=params)
