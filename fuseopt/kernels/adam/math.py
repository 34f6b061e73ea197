"""The fp32 Adam/AdamW step shared by every backend, and its packed scalars.

Every backend (:mod:`.reference`, :mod:`.triton`, :mod:`.mosaic_tpu`,
:mod:`.mosaic_gpu`) runs :func:`adam_math` on its blocks and stores the
results with :func:`store`. The fp32 scalars of a step (learning rate, b1,
b2, eps, eps_root, bias corrections, weight decay, gradient scale, apply
flag, cautious weight decay flag) travel as one small fp32 vector (:func:`adam_scalars`, laid out by the
index constants below; SMEM on TPU), the rounding seeds of a leaf as one
uint32 vector (:func:`adam_seeds`), so the step count and a scheduled
learning rate may be traced.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fuseopt.kernels import _validate
from fuseopt.kernels import counter_hash
from fuseopt.kernels import mantissa
from fuseopt.kernels import pallas_common
from fuseopt.kernels.adam import formats

# Layout of the fp32 scalar vector handed to every backend. GRAD_SCALE
# multiplies g as it is loaded (a global-norm clip factor, 1.0 otherwise);
# APPLY is 1.0, or 0.0 to keep p, mu and nu as they are (a skipped step);
# CAUTIOUS is 1.0 to decay only where the update and the parameter agree in
# sign (cautious weight decay), 0.0 for the plain decoupled decay.
(NEG_LR, B1, OMB1, B2, OMB2, EPS, EPS_ROOT, INV_BC1, INV_BC2, INV_BC1_NEXT, WD, GRAD_SCALE, APPLY,
 CAUTIOUS) = range(14)
N_SCALARS_USED = CAUTIOUS + 1
N_SCALARS = 16   # padded to a power of two (Triton block shapes)
N_SEEDS = 4      # uint32s: the param, mu and nu seeds, then the leaf's global index base
SEED_BASE = 3    # (sharding: the shard's first element's global flat index)

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))

# Per-element work of the kernels, for their cost estimates (XLA's cost
# analysis, and a TPU's optimal_seconds, count a Pallas kernel only by what
# it declares): the two moment updates (3 + 4), the bias-corrected step
# (sqrt, eps, divide, lr: 4), the weight decay and the parameter write (3);
# one square root. Integer hashing of the stochastic rounding is not
# floating-point work.
ADAM_FLOPS_PER_ELEMENT = 14
ADAM_TRANSCENDENTALS_PER_ELEMENT = 1


def adam_math(s, p32, g32, mu32, nu32, *, nesterov: bool, apply: bool, fence=None):
  """fp32 math of one element block; ``s`` indexes the scalar vector.

  The operation order follows optax (clip's ``g * scale``, scale_by_adam,
  add_decayed_weights, scale_by_learning_rate, apply_updates), so fp32
  moments match optax to the last bit wherever the compiler keeps that order.
  Where ``APPLY`` is 0 the outputs are the inputs (the direction is 0): a
  select, so a skipped step costs no second pass; a stored bf16 value comes
  back bit for bit through the stochastic rounding, which leaves values that
  are already bf16 unchanged.

  The bias corrections divide as multiplications by their reciprocals (each
  a scalar division in :func:`adam_scalars`): XLA rewrites a division by a broadcast scalar into a
  multiplication by its reciprocal, and ``(a / b) / c`` into ``a / (b * c)``,
  choosing between the two by the program around them, so two programs of
  optax's ``mu / bc1 / (sqrt(nu / bc2) + eps)`` (a leaf alone, the same leaf
  inside a ``shard_map`` where every leaf of the tree is sharded; a kernel in
  interpret mode alone and in a ``shard_map``) rounded the parameter
  differently in the last bit. Written as multiplications there is nothing
  left to rewrite; they are what XLA makes of optax's divisions wherever it
  takes the first rewrite, so fp32 moments keep optax's bits there.

  ``fence``: :func:`fuseopt.kernels.fp_contract.rounded` where the math runs
  as an XLA program (the reference): every product that feeds an add is
  rounded before the add, so no compiler contracts it into an FMA and two
  programs (a leaf and its shards) give the same bits on a CPU or GPU with
  FMA. The Pallas kernels pass none: one instruction sequence per element on
  any grid.
  """
  r = (lambda x: x) if fence is None else fence
  keep_old = s(APPLY) == 0
  g32 = g32 * s(GRAD_SCALE)
  mu_new = r(s(OMB1) * g32) + r(s(B1) * mu32)
  nu_new = r(s(OMB2) * (g32 * g32)) + r(s(B2) * nu32)
  if nesterov:
    mu_hat = r(s(B1) * (mu_new * s(INV_BC1_NEXT))) + r(s(OMB1) * (g32 * s(INV_BC1)))
  else:
    mu_hat = r(mu_new * s(INV_BC1))
  nu_hat = r(nu_new * s(INV_BC2))
  u = mu_hat / (jnp.sqrt(nu_hat + s(EPS_ROOT)) + s(EPS))
  if apply:
    u = u + r(s(WD) * decayed_param(s, u, p32))
    out = jnp.where(keep_old, p32, p32 + r(s(NEG_LR) * u))
  else:
    out = jnp.where(keep_old, jnp.zeros_like(u), u)
  return out, jnp.where(keep_old, mu32, mu_new), jnp.where(keep_old, nu32, nu_new)


def decayed_param(s, u, p32):
  """The parameter the weight decay scales: ``p``, or with ``CAUTIOUS`` set
  ``I(u * p >= 0) * p`` (Chen et al. 2025, "Cautious Weight Decay", arXiv
  2510.12402: no decay where the update already moves the parameter toward
  zero).

  Selects on ``p``, before the product by ``wd``, never a multiply by the
  flag: the step stays ``u + wd * p'``, which a compiler contracts into an
  FMA exactly as it did ``u + wd * p``, so with the flag off the step is bit
  for bit the plain AdamW step on every compiler, and with it on an element
  that keeps its decay has the plain step's bits too. A NaN ``u * p`` is not
  below 0: NaN keeps its decay and propagates as in the plain step.

  The flag is tested with ``==`` and the branches swapped, the same select
  as ``!=`` for every value: jax 0.12.1 lowers a float ``!=`` in a Mosaic
  TPU kernel to ``arith.cmpf une``, which libtpu 0.0.52 cannot legalize
  (docs/compatibility.md).
  """
  masked = jnp.where(u * p32 < 0, jnp.zeros_like(p32), p32)
  return jnp.where(s(CAUTIOUS) == 0, p32, masked)


def load_param(p, lo):
  """The fp32 parameter: ``p`` widened, or with a companion ``lo`` (int16 or
  int8) the master ``join(p, lo)`` (:mod:`fuseopt.kernels.mantissa`)."""
  return p.astype(jnp.float32) if lo is None else mantissa.join(p, lo)


def store(x32, dtype, index, seed):
  """fp32 → ``dtype``; bf16 with the counter-hash stochastic rounding."""
  if dtype == jnp.bfloat16:
    return counter_hash.stochastic_round_values(x32, index, seed)
  return x32.astype(dtype)


def store_moments(mu_new, nu_new, mu_dtype, nu_dtype, index, seed_mu, seed_nu):
  """Both new moments in their dtypes. Two bf16 moments round with one hash
  of the mu stream's seed, mu with its low 16 bits and nu with its high 16
  (a hash is a third of a bf16 kernel's vector work on a TPU); otherwise
  each with its own stream (:func:`store`)."""
  if jnp.dtype(mu_dtype) == jnp.bfloat16 and jnp.dtype(nu_dtype) == jnp.bfloat16:
    bits = counter_hash.hash_bits(index, seed_mu)
    return (counter_hash.round_with_bits(mu_new, bits),
            counter_hash.round_with_bits(nu_new, bits >> 16))
  return store(mu_new, mu_dtype, index, seed_mu), store(nu_new, nu_dtype, index, seed_nu)


def kernel_body(s_ref, refs, *, nesterov, apply, tracked=False):
  """The math of the Triton and Mosaic TPU kernels on one block; returns
  the outputs' refs too. ``refs``: ``(p,) g, mu, nu, (lo,)`` then the
  outputs (``tracked``: the companion ``lo`` last among the inputs)."""
  n_in = (4 if apply else 3) + tracked
  ins, out_refs = refs[:n_in], refs[n_in:]
  if apply:
    p_ref, *ins = ins
    p32 = load_param(p_ref[...], ins[3][...] if tracked else None)
  else:
    p32 = None
  g_ref, mu_ref, nu_ref = ins[:3]
  f32 = lambda r: r[...].astype(jnp.float32)
  out, mu_new, nu_new = adam_math(lambda k: s_ref[k], p32, f32(g_ref), f32(mu_ref), f32(nu_ref),
                                  nesterov=nesterov, apply=apply)
  return out, mu_new, nu_new, out_refs


def store_outputs(out_refs, out, mu_new, nu_new, index, seed, *, tracked=False):
  """Writes a block's results: ``out_refs`` = ``(out, mu, nu, (lo,))``;
  ``seed(k)`` the leaf's ``k``-th rounding seed. A tracked parameter is
  written split (no rounding), bf16 moments rounded stochastically
  (:func:`store_moments`)."""
  o_ref, mu_out, nu_out = out_refs[:3]
  if tracked:
    o_ref[...], out_refs[3][...] = mantissa.split(out, out_refs[3].dtype)
  else:
    o_ref[...] = store(out, o_ref.dtype, index, seed(0))
  mu_out[...], nu_out[...] = store_moments(mu_new, nu_new, mu_out.dtype, nu_out.dtype, index,
                                          seed(1), seed(2))


def in_place_aliases(first: int, out0: int, *, apply: bool, tracked: bool) -> dict[int, int]:
  """In-place outputs of one leaf whose operands start at ``first`` (order
  ``(p,) g, mu, nu, (lo)``) and outputs at ``out0`` (``out, mu, nu, (lo)``):
  the new param overwrites p, the moments and the companion themselves. The
  Adam direction (p=None) gets a fresh buffer rather than aliasing g, which
  the caller usually still holds (XLA would copy it)."""
  if not apply:
    return {first + 1: out0 + 1, first + 2: out0 + 2}
  aliases = {first: out0, first + 2: out0 + 1, first + 3: out0 + 2}
  if tracked:
    aliases[first + 4] = out0 + 3
  return aliases


def adam_cost(arrays, out_shape, *, n=None):
  """Adam's work per element (:data:`ADAM_FLOPS_PER_ELEMENT`, one square
  root) and its compulsory traffic: every stream read once, p, mu, nu
  (and a tracked parameter's companion) written once (20 B per parameter
  for fp32 p/g with bf16 moments; 4 more with an int16 companion (2 with int8), read and
  written). ``n``: the elements updated (default: a third of the outputs')."""
  if n is None:
    n = sum(o.size for o in out_shape) // 3
  return pallas_common.cost_estimate(
      flops=n * ADAM_FLOPS_PER_ELEMENT,
      transcendentals=n * ADAM_TRANSCENDENTALS_PER_ELEMENT,
      bytes_accessed=pallas_common.nbytes(*arrays, *out_shape))


# ----------------------------------------------------------------- scalars --
def _f32(x) -> jax.Array:
  return jnp.asarray(x, jnp.float32)


@functools.partial(jax.jit, inline=True)
def _bias_correction(decay, count):
  """``1 - decay**count`` inside a jit, as optax.tree.bias_correction computes
  it: called eagerly, ``decay ** count`` with a concrete integer ``count``
  takes ``lax.integer_pow`` (repeated multiplication), which rounds
  differently (1e-5 relative for b2 = 0.999) from the ``pow`` of a jitted
  call."""
  return 1 - decay ** count


def adam_scalars(*, count, learning_rate=0.0, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0,
                 weight_decay=0.0, nesterov=False, grad_scale=1.0, apply=True,
                 cautious=False) -> jax.Array:
  """The fp32 scalar vector of one step (shared by all leaves of a tree).

  ``grad_scale`` (fp32, may be traced) multiplies the gradient inside the
  kernel; ``apply`` (bool, may be traced) False returns p, mu and nu unchanged;
  ``cautious`` (bool, may be traced) True applies the weight decay only where
  the Adam direction and the parameter agree in sign (:func:`decayed_param`).
  A traced flag is a runtime scalar: no other kernel is compiled.

  ``count`` is the step number after increment (1 on the first step), as in
  optax; bias corrections are ``1 - b**count`` computed in fp32 as optax does
  (a bf16 ``0.999`` would be 1.0 and nu would never decay).
  """
  if isinstance(count, (bool, float)):
    raise TypeError(f"adam_update: count must be an integer scalar, got {count!r}")
  if isinstance(count, int) and not 1 <= count < 2**31:
    # (a Python int past int32 would otherwise fail inside jnp.asarray)
    raise ValueError(f"adam_update: count must be >= 1 (the step number after increment, "
                     f"1 on the first step) and < 2**31, got {count}")
  count = jnp.asarray(count)
  if count.ndim or not jnp.issubdtype(count.dtype, jnp.integer):
    raise TypeError(f"adam_update: count must be an integer scalar, got "
                    f"{count.dtype}{list(count.shape)}")
  if not isinstance(count, jax.core.Tracer) and int(count) < 1:
    # 1 - b ** 0 = 0: the bias corrections would divide by zero.
    raise ValueError(f"adam_update: count must be >= 1 (the step number after increment, "
                     f"1 on the first step), got {int(count)}")
  _validate.check_real("adam_update", "b1", b1, lo=0.0, hi=1.0, hi_open=True)
  _validate.check_real("adam_update", "b2", b2, lo=0.0, hi=1.0, hi_open=True)
  _validate.check_real("adam_update", "eps", eps, lo=0.0)
  _validate.check_real("adam_update", "eps_root", eps_root, lo=0.0)
  _validate.check_real("adam_update", "learning_rate", learning_rate)
  _validate.check_real("adam_update", "weight_decay", weight_decay)
  cautious = check_cautious(cautious)
  # Same expressions as optax.tree.bias_correction / update_moment, so the
  # fp32 values agree bit for bit with optax's (python floats stay exact
  # until they meet the fp32 operand).
  bc1 = _bias_correction(b1, count)
  bc2 = _bias_correction(b2, count)
  bc1_next = _bias_correction(b1, optax_safe_increment(count)) if nesterov else bc1
  # The bias corrections travel as their fp32 reciprocals (adam_math), each
  # one scalar division here rather than one in every kernel step (on a TPU
  # a scalar division in a kernel is a vector reciprocal and its Newton
  # steps, a round trip through the vector unit).
  inv = lambda bc: 1 / _f32(bc)
  vals = [-learning_rate if not isinstance(learning_rate, (int, float)) else -float(learning_rate),
          b1, 1 - b1, b2, 1 - b2, eps, eps_root, inv(bc1), inv(bc2), inv(bc1_next), weight_decay,
          grad_scale,
          jnp.where(apply, 1.0, 0.0) if isinstance(apply, jax.Array) else float(bool(apply)),
          jnp.where(cautious, 1.0, 0.0) if isinstance(cautious, jax.Array) else float(cautious)]
  vals = [_f32(v) for v in vals]
  return jnp.stack(vals + [jnp.float32(0)] * (N_SCALARS - len(vals)))


def check_cautious(flag):
  """The cautious weight decay flag: a Python/NumPy bool, or a bool array
  scalar (may be traced). Anything else is a TypeError naming the argument
  (``1`` or ``"yes"`` would silently mean True)."""
  if isinstance(flag, (bool, np.bool_)):
    return bool(flag)
  if isinstance(flag, jax.Array) and flag.dtype == jnp.bool_ and flag.ndim == 0:
    return flag
  raise TypeError(f"adam_update: cautious_weight_decay must be a bool (or a bool scalar "
                  f"array, which may be traced), got {flag!r}")


def optax_safe_increment(count):
  """``count + 1`` saturating at the dtype's maximum (optax.safe_increment)."""
  count = jnp.asarray(count)
  max_value = jnp.iinfo(count.dtype).max
  return jnp.where(count < max_value, count + 1, max_value).astype(count.dtype)


def adam_seeds(seed, step, leaf_index) -> jax.Array:
  """uint32 seeds ``[param, mu, nu, 0]`` of one leaf at one step; with an
  array of leaf indices, one such row per index (shape ``(*index, 4)``)."""
  if not isinstance(leaf_index, int):
    leaf_index = jnp.asarray(leaf_index, jnp.uint32)
  streams = [counter_hash.derive_seed(seed, step, leaf_index, s)
             for s in (counter_hash.STREAM_PARAM, counter_hash.STREAM_MU, counter_hash.STREAM_NU)]
  return jnp.stack(streams + [jnp.zeros_like(streams[0])], axis=-1)


def check_leaf(p, g, mu, nu):
  """The operands of one leaf; returns ``(mu, nu)`` as arrays, or checked
  moments of one blockwise format (8-bit
  :class:`~fuseopt.kernels.adam.quantized.QuantizedMoment` or 4-bit
  :class:`~fuseopt.kernels.adam.int4.PackedMoment`: both moments of one)."""
  g = jnp.asarray(g)
  moments = (("mu", mu), ("nu", nu))
  fmt = formats.of(mu) if formats.is_blockwise(mu) else formats.of(nu)
  if fmt.quantized:
    mu = fmt.check("mu", mu, g.shape, signed=True)
    nu = fmt.check("nu", nu, g.shape, signed=False)
    moments = ()
  for name, a in (("grads", g),) + moments + ((("params", p),) if p is not None else ()):
    a = jnp.asarray(a)
    if a.dtype not in FLOAT_DTYPES:
      raise TypeError(f"adam_update: {name} must be float32 or bfloat16, got {a.dtype}")
    if a.shape != g.shape:
      raise ValueError(f"adam_update: {name} has shape {a.shape}, expected the gradient's {g.shape}")
  if moments:
    return jnp.asarray(mu), jnp.asarray(nu)
  return mu, nu


def check_companion(p, lo, name="params_lo"):
  """A mantissa-tracked leaf: ``p`` bfloat16 and ``lo`` a companion (int16:
  an fp32 master; int8: a 24-bit one) of its shape."""
  if p is None:
    raise ValueError(f"adam_update: {name} needs params (the bf16 half of the fp32 master); "
                     f"the direction-only mode (params=None) has no parameter to track")
  lo = jnp.asarray(lo)
  if p.dtype != jnp.bfloat16:
    raise TypeError(f"adam_update: {name} is the companion of bfloat16 params, but "
                    f"params are {p.dtype}")
  if lo.dtype not in mantissa.COMPANION_DTYPES:
    raise TypeError(f"adam_update: {name} must be int16 (an fp32 master) or int8 (a 24-bit "
                    f"master), got {lo.dtype}")
  if lo.shape != p.shape:
    raise ValueError(f"adam_update: {name} has shape {lo.shape}, expected the params' {p.shape}")
  return lo


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def no_derivative(impl, fn, *args):
  return fn(*args)


@no_derivative.defjvp
def no_derivative_jvp(impl, fn, primals, tangents):
  # pallas_call's own rule fails with "JVP with aliasing not supported".
  raise TypeError(f"adam_update: implementation={impl!r} has no derivative (its kernels "
                  "write their outputs in place of their inputs); differentiate through "
                  "implementation='xla', the plain-jnp reference")
