"""Fused Adam/AdamW update: the public functions.

One pass over a leaf reads ``p, g, mu, nu`` once and writes ``mu, nu`` and
either the new parameter (``p`` given: the whole AdamW step) or the Adam
direction (``p=None``: :func:`optax.scale_by_adam`'s output) once. All
arithmetic is fp32 whatever the storage dtypes (:mod:`.math`, shared by every
backend); the fp32 scalars travel as one small fp32 array (SMEM on TPU), so
the step count and a scheduled learning rate may be traced.

bf16 outputs (moments, and parameters stored in bf16) are written with the
counter-hash stochastic rounding of :mod:`fuseopt.kernels.counter_hash`: the
random bits of element ``i`` of a leaf are ``hash_bits(i, seed_stream)`` with
``i`` the row-major flat index in the whole leaf and one seed per stream
(param, mu, nu) from :func:`derive_seed(seed, step, leaf_index, stream)
<fuseopt.kernels.counter_hash.derive_seed>`. The rounded mu is therefore
bitwise ``stochastic_round_bf16(mu_fp32_new, seed_mu)``, and every backend,
block size and grid gives the same bits.

Backends (one module each, chosen by :mod:`fuseopt.kernels.dispatch`):
``xla`` (:mod:`.reference`), ``triton`` (:mod:`.triton`, per leaf and
grouped), ``mosaic_tpu`` (:mod:`.mosaic_tpu`, per leaf) and ``mosaic_gpu``
(:mod:`.mosaic_gpu`, sm_90 only, per leaf or grouped with a config). How a
tree's leaves are placed and grouped: :mod:`.tree`.

Non-finite gradients propagate as in optax: an element whose gradient is NaN
gets NaN mu, nu and parameter; ``+-Inf`` gives ``mu = +-Inf``, ``nu = +Inf``
and a NaN update (Inf/Inf). Other elements are unaffected. The rounding keeps
NaN and Inf (never turns a finite value into Inf). Skipping such steps is the
builder's job.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from fuseopt.kernels import counter_hash
from fuseopt.kernels import dispatch
from fuseopt.kernels import sharding as sharding_lib
from fuseopt.kernels.adam.backends import BACKENDS
from fuseopt.kernels.adam import mosaic_tpu  # each backend's SEARCH_SPACE and heuristic
from fuseopt.kernels.adam import tree as _tree
from fuseopt.kernels.adam import triton
from fuseopt.kernels.adam.math import adam_scalars
from fuseopt.kernels.adam.math import adam_seeds
from fuseopt.kernels.adam.math import check_companion as _check_companion
from fuseopt.kernels.adam.math import check_leaf as _check
from fuseopt.kernels.adam.math import optax_safe_increment
from fuseopt.kernels.adam.int4 import PackedMoment
from fuseopt.kernels.adam.quantized import QuantizedMoment
from fuseopt.kernels.adam.triton import TritonGroupConfig
from fuseopt.kernels.elementwise_tiling import MosaicGPUConfig
from fuseopt.kernels.elementwise_tiling import MosaicTPUConfig
from fuseopt.kernels.elementwise_tiling import TritonConfig

OP_NAME = "adam_update"

# The grouped launch's config is part of the op's public API: this package
# is its home.
TritonGroupConfig.__module__ = __name__

__all__ = ["MosaicGPUConfig", "MosaicTPUConfig", "PackedMoment", "QuantizedMoment", "TritonConfig",
           "TritonGroupConfig", "adam_scalars", "adam_seeds", "adam_update",
           "adam_update_reference", "adam_update_tree", "optax_safe_increment"]


def adam_update(params, grads, mu, nu, *, count, learning_rate=0.0, b1=0.9, b2=0.999,
                eps=1e-8, eps_root=0.0, weight_decay=0.0, nesterov=False, seed=0,
                leaf_index=0, sharding=None, implementation=None, interpret=False, config=None,
                grad_scale=1.0, apply=True, cautious_weight_decay=False, params_lo=None):
  r"""One fused Adam/AdamW step of one leaf.

  With :math:`t` = ``count`` (the step number after increment, 1 first) and
  everything in fp32:

  .. math::
    m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t,\quad
    v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2,\\
    \hat m_t = m_t / (1-\beta_1^t)\ \ (\text{nesterov: }
      \beta_1 m_t/(1-\beta_1^{t+1}) + (1-\beta_1) g_t/(1-\beta_1^t)),\quad
    \hat v_t = v_t / (1-\beta_2^t),\\
    u_t = \hat m_t / (\sqrt{\hat v_t + \bar\varepsilon} + \varepsilon),\quad
    p_t = p_{t-1} - \alpha_t (u_t + \lambda\, c_t \odot p_{t-1}),\\
    c_t = 1\ \text{(AdamW)}\quad\text{or}\quad
    c_t = \mathbb{I}(u_t \odot p_{t-1} \ge 0)\ \text{(cautious weight decay)}

  (Kingma & Ba 2014, "Adam"; Loshchilov & Hutter 2019, "Decoupled Weight
  Decay Regularization"; Dozat 2016 for Nesterov; Chen et al. 2025,
  "Cautious Weight Decay", arXiv 2510.12402), exactly optax's
  ``scale_by_adam`` → ``add_decayed_weights`` → ``scale_by_learning_rate`` →
  ``apply_updates`` when :math:`c_t = 1`. bf16 outputs are stochastically
  rounded with seeds :func:`adam_seeds` ``(seed, count, leaf_index)``.

  Args:
    params: the leaf's parameters (fp32 or bf16), or ``None`` to return the
      Adam direction :math:`u_t` (no weight decay, no learning rate) in the
      gradient's dtype instead of new parameters.
    grads: the gradient, fp32 or bf16, same shape.
    mu, nu: the moments, fp32 or bf16, same shape; or both 8-bit,
      :class:`QuantizedMoment` (:mod:`.quantized`: int8 ``mu`` and uint8 ``nu``
      codes, one fp32 scale per block of 256), or both 4-bit,
      :class:`PackedMoment` (:mod:`.int4`: two codes a byte, one fp32 scale
      per block of 128); blocks lie along the last axis, or the trailing
      axes together where the last does not divide (:mod:`.blocks`). Returned
      in their format (:mod:`.formats`: the format a type, one driver).
    count: integer scalar (may be traced), the step number after increment;
      a concrete count must be >= 1.
    learning_rate, weight_decay: scalars (may be traced, e.g. a schedule's
      value); ignored when ``params`` is ``None``.
    b1, b2, eps, eps_root, nesterov: as in :func:`optax.scale_by_adam`:
      b1, b2 in [0, 1), eps, eps_root >= 0. Concrete values (numbers or
      arrays) are checked and must be finite, as must a concrete learning
      rate and weight decay; traced ones are used as they are.
    seed: integer scalar in [0, 2**32) mixed into the rounding seeds.
    leaf_index: the leaf's index in its tree (another seed input), an
      integer in [0, 2**32).
    sharding: the leaf's placement on an Auto mesh (``NamedSharding`` or
      ``PartitionSpec``); ``None`` reads it from the type (Explicit axes).
      On a multi-device mesh the kernel runs shard-local with global
      indices (:mod:`fuseopt.kernels.sharding`), bitwise the unsharded
      result; on an Auto mesh without it the reference runs and a warning
      says so.
    implementation: ``None`` (chosen by :mod:`fuseopt.kernels.dispatch`),
      ``"xla"``, ``"triton"``,
      ``"mosaic_tpu"`` or ``"mosaic_gpu"`` (sm_90 GPUs only: on any other
      target a ValueError names the device and its compute capability
      before anything is lowered; any machine in interpret mode).
    interpret: run a Pallas backend in interpret mode (CPU debugging).
    config: a :class:`TritonConfig` / :class:`MosaicTPUConfig` /
      :class:`MosaicGPUConfig`.
    grad_scale: fp32 scalar (may be traced) the gradient is multiplied by as
      it is read, before everything above (a global-norm clip factor).
    apply: bool scalar (may be traced); False returns ``params``, ``mu`` and
      ``nu`` bit for bit (a zero direction when ``params`` is ``None``), in
      the same single pass (a skipped non-finite step).
    cautious_weight_decay: bool (may be traced: a runtime scalar, the same
      kernel): decay only the elements where the Adam direction and the
      parameter agree in sign (:math:`c_t` above). False is bit for bit the
      plain AdamW step.
    params_lo: ``None``, or the companion of bfloat16 ``params`` (same
      shape; :mod:`fuseopt.kernels.mantissa`): int16 for an fp32 master,
      int8 for a 24-bit one. The step reads the master ``join(params,
      params_lo)``, runs the fp32 math, and writes the new master split:
      ``params`` the bf16 value nearest it, ``params_lo`` the difference, so
      with int16 the pair follows an fp32 run bit for bit ("mantissa
      tracking") and with int8 the master is the fp32 result rounded to 15
      mantissa bits. Both are written in place.

  Returns:
    ``(new_params or update, new_mu, new_nu)`` in the dtypes of
    ``params`` (or ``grads``), ``mu`` and ``nu``; with ``params_lo``
    ``(new_params, new_mu, new_nu, new_params_lo)``. Pallas backends write
    them in place of their inputs (``input_output_aliases``): donate the
    inputs to the enclosing ``jit`` to avoid copies. Only the ``xla``
    implementation has a derivative; differentiating through a kernel raises
    a TypeError.
  """
  mu, nu = _check(params, grads, mu, nu)
  if params_lo is not None:
    params_lo = _check_companion(None if params is None else jnp.asarray(params), params_lo)
  seed = counter_hash.uint32_scalar(seed, name="seed", owner="adam_update")
  leaf_index = counter_hash.uint32_scalar(leaf_index, name="leaf_index", owner="adam_update")
  grads = jnp.asarray(grads)
  if params is not None:
    params = jnp.asarray(params)
  scalars = adam_scalars(count=count, learning_rate=learning_rate, b1=b1, b2=b2, eps=eps,
                         eps_root=eps_root,
                         weight_decay=weight_decay if params is not None else 0.0,
                         nesterov=nesterov, grad_scale=grad_scale, apply=apply,
                         cautious=cautious_weight_decay)
  seeds = adam_seeds(seed, count, leaf_index)
  impl = dispatch.select(OP_NAME, BACKENDS, implementation, (grads,), interpret=interpret)
  if config is not None and impl == "triton" and not isinstance(config, TritonConfig):
    raise TypeError(f"adam_update: config must be a TritonConfig for triton, got {config!r}")
  placements = sharding_lib.resolve_placements(
      [grads if params is None else params], [sharding], op="adam_update", argument="sharding=")
  outs = _tree.update_leaves(impl, [scalars], [seeds], None if params is None else [params],
                             [grads], [mu], [nu], placements,
                             nesterov=nesterov, interpret=interpret, config=config, group=False,
                             los=[params_lo])
  outs = tuple(o[0] for o in outs)
  return outs if params_lo is not None else outs[:3]


def adam_update_reference(params, grads, mu, nu, *, count, learning_rate=0.0, b1=0.9,
                          b2=0.999, eps=1e-8, eps_root=0.0, weight_decay=0.0, nesterov=False,
                          seed=0, leaf_index=0):
  """The specification of :func:`adam_update`: plain jnp, any platform."""
  return adam_update(params, grads, mu, nu, count=count, learning_rate=learning_rate, b1=b1,
                     b2=b2, eps=eps, eps_root=eps_root, weight_decay=weight_decay,
                     nesterov=nesterov, seed=seed, leaf_index=leaf_index, implementation="xla")


def adam_update_tree(params, grads, mu, nu, *, count, learning_rate=0.0, b1=0.9, b2=0.999,
                     eps=1e-8, eps_root=0.0, weight_decay=0.0, nesterov=False, seed=0,
                     shardings=None, implementation=None, interpret=False, config=None,
                     group=False, grad_scale=1.0, apply=True, cautious_weight_decay=False,
                     params_lo=None):
  """:func:`adam_update` over lists of leaves sharing one step's scalars.

  ``params`` is a list of arrays or ``None`` (direction only);
  ``weight_decay`` a scalar or a list with one value per leaf (0 where masked).
  ``grad_scale``, ``apply`` and ``cautious_weight_decay`` (see
  :func:`adam_update`) hold for every leaf. ``params_lo`` is ``None`` or a
  list with one entry per leaf: the int16 or int8 companion of a bfloat16 leaf
  (mantissa tracking, see :func:`adam_update`), or ``None`` for a leaf
  stored as it is. Leaf ``i`` rounds with ``adam_seeds(seed, count, i)``.

  Launches: ``group=False`` (the default) runs one kernel per leaf, the
  faster measured on an H200 inside XLA's CUDA graphs (docs/measurements.md).
  With the ``triton`` implementation and ``group=True`` (or ``config`` a
  :class:`TritonGroupConfig`) the leaves of one dtype signature
  (params, grads, mu, nu) share one kernel launch, at most
  ``config.max_leaves_per_launch`` leaves a launch (``config``: a
  :class:`TritonGroupConfig`), each leaf read and written in place where it
  lies: fewer launches where no CUDA graph hides their cost. The bits are
  those of the per-leaf kernels. ``mosaic_gpu`` groups the same way, but only when
  ``config`` is an :class:`~fuseopt.kernels.adam.mosaic_gpu.MosaicGPUGroupConfig`
  (lowering a grouped Mosaic GPU launch takes tens of seconds).
  ``group=False`` and the other implementations run one
  kernel per leaf (``config``: a :class:`TritonConfig` /
  :class:`MosaicTPUConfig` / :class:`MosaicGPUConfig`). Mosaic TPU stays per leaf
  (:mod:`.mosaic_tpu`): its pipeline writes back the output blocks it holds,
  written or not, so another leaf's clamped, unwritten block would overwrite
  that leaf's memory.

  Sharding: ``shardings`` is ``None`` (placements read from the types:
  Explicit mesh axes) or a list with one ``NamedSharding`` /
  ``PartitionSpec`` / ``None`` per leaf (Auto axes). Evenly sharded leaves
  run shard-local inside one ``shard_map`` per mesh (grouped launches still
  apply, per device), with global indices: bitwise the unsharded result.

  Grouped launches hold leaves of one dtype signature, a companion or not
  being part of it (a tracked leaf has two more operands).

  Returns:
    Three lists: new params (or updates), new mu, new nu; with a
    ``params_lo`` list a fourth: the new companions (``None`` where a leaf
    has none).
  """
  n = len(grads)
  if params is not None and len(params) != n:
    raise ValueError(f"adam_update: params has {len(params)} leaves, grads has {n}")
  if len(mu) != n or len(nu) != n:
    raise ValueError(f"adam_update: mu/nu have {len(mu)}/{len(nu)} leaves, grads has {n}")
  wds = weight_decay if isinstance(weight_decay, (list, tuple)) else [weight_decay] * n
  if len(wds) != n:
    raise ValueError(f"adam_update: weight_decay has {len(wds)} values, grads has {n} leaves")
  seed = counter_hash.uint32_scalar(seed, name="seed", owner="adam_update")
  applies = apply  # the step's flag; `apply` below says whether params are given
  apply = params is not None
  grads = [jnp.asarray(g) for g in grads]
  impl = dispatch.select(OP_NAME, BACKENDS, implementation, grads, interpret=interpret)
  if impl == "triton" and group and config is not None and not isinstance(config,
                                                                          TritonGroupConfig):
    raise TypeError(f"adam_update: config must be a TritonGroupConfig for grouped triton "
                    f"launches (or pass group=False), got {config!r}")
  if impl == "mosaic_gpu" and config is not None:
    group_config = BACKENDS[impl].MosaicGPUGroupConfig
    if not isinstance(config, (MosaicGPUConfig, group_config)):
      raise TypeError(f"adam_update: config must be a MosaicGPUConfig (one launch per leaf) "
                      f"or a MosaicGPUGroupConfig (grouped launches) for mosaic_gpu, "
                      f"got {config!r}")
  ps = [jnp.asarray(p) for p in params] if apply else None
  los = _companions(params_lo, ps, n)
  mus, nus = list(mu), list(nu)
  # The step's scalars, packed once per distinct weight decay (a masked tree
  # has two: its value and 0) and shared by the leaves that have it.
  packed: dict = {}
  scalars, seeds = [], []
  for i in range(n):
    mus[i], nus[i] = _check(ps[i] if apply else None, grads[i], mus[i], nus[i])
    key = wds[i] if isinstance(wds[i], (int, float)) else id(wds[i])
    if key not in packed:
      packed[key] = adam_scalars(count=count, learning_rate=learning_rate, b1=b1, b2=b2, eps=eps,
                                 eps_root=eps_root, weight_decay=wds[i] if apply else 0.0,
                                 nesterov=nesterov, grad_scale=grad_scale, apply=applies,
                                 cautious=cautious_weight_decay)
    scalars.append(packed[key])
  # All leaves' seeds in one vector computation: per leaf, tracing the hash
  # was about half the tracing time of a 147-leaf step.
  seed_rows = adam_seeds(seed, count, np.arange(n, dtype=np.uint32))
  seeds = [seed_rows[i] for i in range(n)]
  placements = sharding_lib.resolve_placements(ps if apply else grads, shardings,
                                               op="adam_update_tree", argument="shardings=")
  outs = tuple(list(o) for o in _tree.update_leaves(
      impl, scalars, seeds, ps, grads, mus, nus, placements, nesterov=nesterov,
      interpret=interpret, config=config, group=group, los=los))
  return outs if params_lo is not None else outs[:3]


def _companions(params_lo, ps, n):
  """``params_lo`` checked: None, or one int16 or int8 companion (or None) per leaf."""
  if params_lo is None:
    return None
  if not isinstance(params_lo, (list, tuple)):
    raise TypeError(f"adam_update: params_lo must be None or a list with one int16 or int8 array "
                    f"(or None) per leaf, got {type(params_lo).__name__}")
  if len(params_lo) != n:
    raise ValueError(f"adam_update: params_lo has {len(params_lo)} entries, grads has {n} leaves")
  if ps is None and any(lo is not None for lo in params_lo):
    raise ValueError("adam_update: params_lo needs params (the bf16 halves of the fp32 "
                     "masters); the direction-only mode (params=None) has no parameter to track")
  return [None if lo is None else _check_companion(p, lo, name=f"params_lo[{i}]")
          for i, (p, lo) in enumerate(zip(ps or [None] * n, params_lo))]
