"""Fused Adam/AdamW update of one leaf: reference, Triton and Mosaic-TPU kernels.

One pass over a leaf reads ``p, g, mu, nu`` once and writes ``mu, nu`` and
either the new parameter (``p`` given: the whole AdamW step) or the Adam
direction (``p=None``: :func:`optax.scale_by_adam`'s output) once. All
arithmetic is fp32 whatever the storage dtypes; the fp32 scalars (learning
rate, b1, b2, eps, eps_root, bias corrections, weight decay) travel as one
small fp32 array (SMEM on TPU), so the step count and a scheduled learning
rate may be traced.

bf16 outputs (moments, and parameters stored in bf16) are written with the
counter-hash stochastic rounding of :mod:`fuseopt.kernels.counter_hash`: the
random bits of element ``i`` of a leaf are ``hash_bits(i, seed_stream)`` with
``i`` the row-major flat index in the whole leaf and one seed per stream
(param, mu, nu) from :func:`derive_seed(seed, step, leaf_index, stream)
<fuseopt.kernels.counter_hash.derive_seed>`. The rounded mu is therefore
bitwise ``stochastic_round_bf16(mu_fp32_new, seed_mu)``, and every backend,
block size and grid gives the same bits.

Backends:

- ``xla``: the reference, plain ``jnp`` on the flattened leaf. It is single
  pass and memory-lean: each rounding builds its counter from a 1-D per-leaf
  iota inside its own expression, so XLA fuses it instead of materialising a
  shared index array (shared/ANCHORS.md: a shared per-axis index cost 235 MB
  of temporaries on the 1.2 B tree);
- ``triton``: a 1-D grid over the flattened leaf, ``block`` elements a
  program (power of two), ragged tail masked;
- ``mosaic_tpu``: the leaf viewed as ``(rows, 128)``, at most ``block_rows``
  rows a grid step, the block dividing the rows (or the whole leaf). Leaves
  whose size is not a multiple of 128, or whose row count has no multiple of
  16 up to ``block_rows`` as divisor, run the reference (on LLM trees these
  are at most biases and norms: small).

Non-finite gradients propagate as in optax: an element whose gradient is NaN
gets NaN mu, nu and parameter; ``+-Inf`` gives ``mu = +-Inf``, ``nu = +Inf``
and a NaN update (Inf/Inf). Other elements are unaffected. The rounding keeps
NaN and Inf (never turns a finite value into Inf). Skipping such steps is the
builder's job.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from fuseopt.kernels import _backend
from fuseopt.kernels import counter_hash
from fuseopt.kernels import _elementwise
from fuseopt.kernels._elementwise import LANES, MosaicConfig, TritonConfig, triton_heuristic

OP_NAME = "adam_update"

# Layout of the fp32 scalar vector handed to every backend.
NEG_LR, B1, OMB1, B2, OMB2, EPS, EPS_ROOT, BC1, BC2, BC1_NEXT, WD = range(11)
N_SCALARS = 16   # padded to a power of two (Triton block shapes)
N_SEEDS = 4      # seeds: param, mu, nu, unused

_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


# ----------------------------------------------------------------- configs --
# Block 4096 failed at run time inside XLA's CUDA graph on the H200
# (shared/ANCHORS.md): it stays in the search space, to be measured on the
# device, never in the heuristic.
TRITON_SEARCH_SPACE = tuple(TritonConfig(b, w) for b in (512, 1024, 2048, 4096)
                            for w in (4, 8))
# 7 streams double-buffered: 1024 fp32 rows are 7 MiB of VMEM, inside the
# 16 MiB default scoped limit of v5e.
MOSAIC_SEARCH_SPACE = tuple(MosaicConfig(r) for r in (128, 256, 512, 1024))


def mosaic_heuristic(size: int) -> MosaicConfig:
  rows = max(1, size // LANES)
  return MosaicConfig(block_rows=min(512, 16 * pl.cdiv(rows, 16)))


# ------------------------------------------------------------- shared math --
def _adam_math(s, p32, g32, mu32, nu32, *, nesterov: bool, apply: bool):
  """fp32 math of one element block; ``s`` indexes the scalar vector.

  The operation order follows optax (scale_by_adam, add_decayed_weights,
  scale_by_learning_rate, apply_updates), so fp32 moments match optax to the
  last bit wherever the compiler keeps that order.
  """
  mu_new = s(OMB1) * g32 + s(B1) * mu32
  nu_new = s(OMB2) * (g32 * g32) + s(B2) * nu32
  if nesterov:
    mu_hat = s(B1) * (mu_new / s(BC1_NEXT)) + s(OMB1) * (g32 / s(BC1))
  else:
    mu_hat = mu_new / s(BC1)
  nu_hat = nu_new / s(BC2)
  u = mu_hat / (jnp.sqrt(nu_hat + s(EPS_ROOT)) + s(EPS))
  if apply:
    u = u + s(WD) * p32
    out = p32 + s(NEG_LR) * u
  else:
    out = u
  return out, mu_new, nu_new


def _store(x32, dtype, index, seed):
  """fp32 → ``dtype``; bf16 with the counter-hash stochastic rounding."""
  if dtype == jnp.bfloat16:
    return counter_hash.stochastic_round_values(x32, index, seed)
  return x32.astype(dtype)


def _store_mosaic(x32, dtype, index, seed):
  if dtype == jnp.bfloat16:
    return counter_hash.stochastic_round_values_32bit(x32, index, seed)
  return x32.astype(dtype)


# --------------------------------------------------------------- reference --
def _reference(scalars, seeds, p, g, mu, nu, *, nesterov, out_dtype, order_for_in_place=False):
  s = lambda k: scalars[k]
  apply = p is not None
  f32 = lambda x: x.astype(jnp.float32)
  out, mu_new, nu_new = _adam_math(s, f32(p) if apply else None, f32(g), f32(mu), f32(nu),
                                   nesterov=nesterov, apply=apply)
  shape = g.shape
  # A fresh flat iota per rounding: XLA fuses each into its consumer rather
  # than materialising one shared index array (shared/ANCHORS.md).
  idx = lambda: jax.lax.iota(jnp.uint32, g.size).reshape(shape)
  out = _store(out, out_dtype, idx(), seeds[0] if apply else jnp.uint32(0))
  if order_for_in_place:
    # XLA's CPU backend emits the three outputs as three loop fusions, each
    # re-reading the old moments; unordered, they make XLA copy the donated
    # moments (a whole leaf of temporaries). The barrier runs the param
    # fusion first, so each moment fusion can then overwrite its input.
    # Not on GPU: there XLA can fuse all three outputs into one pass
    # (ANCHORS.md: 46 KB of temporaries), which the barrier would split.
    out, mu, nu = jax.lax.optimization_barrier((out, mu, nu))
    _, mu_new, nu_new = _adam_math(s, None, f32(g), f32(mu), f32(nu),
                                   nesterov=False, apply=False)
  return (out,
          _store(mu_new, mu.dtype, idx(), seeds[1]),
          _store(nu_new, nu.dtype, idx(), seeds[2]))


def _kernel_body(s_ref, refs, *, nesterov, apply):
  """The math of both kernels on one block; returns the outputs' refs too."""
  if apply:
    p_ref, *refs = refs
    p32 = p_ref[...].astype(jnp.float32)
  else:
    p32 = None
  g_ref, mu_ref, nu_ref, *out_refs = refs
  f32 = lambda r: r[...].astype(jnp.float32)
  out, mu_new, nu_new = _adam_math(lambda k: s_ref[k], p32, f32(g_ref), f32(mu_ref), f32(nu_ref),
                                   nesterov=nesterov, apply=apply)
  return out, mu_new, nu_new, out_refs


# ------------------------------------------------------------------ triton --
def _triton_kernel(s_ref, seed_ref, *refs, block, nesterov, apply):
  out, mu_new, nu_new, (o_ref, mu_out, nu_out) = _kernel_body(s_ref, refs, nesterov=nesterov,
                                                              apply=apply)
  index = _elementwise.triton_flat_index(block)
  o_ref[...] = _store(out, o_ref.dtype, index, seed_ref[0])
  mu_out[...] = _store(mu_new, mu_out.dtype, index, seed_ref[1])
  nu_out[...] = _store(nu_new, nu_out.dtype, index, seed_ref[2])


def _adam_triton(scalars, seeds, p, g, mu, nu, *, nesterov, out_dtype, config, interpret):
  from jax.experimental.pallas import triton as plgpu
  (n,) = g.shape
  block = config.block
  apply = p is not None
  spec = pl.BlockSpec((block,), lambda i: (i,))
  arrays = (p, g, mu, nu) if apply else (g, mu, nu)
  # In place: the new param overwrites p, the moments overwrite themselves.
  # The Adam direction (p=None) gets a fresh buffer rather than aliasing g,
  # which the caller usually still holds (XLA would copy it).
  first = 2
  aliases = ({first: 0, first + 2: 1, first + 3: 2} if apply
             else {first + 1: 1, first + 2: 2})
  return pl.pallas_call(
      functools.partial(_triton_kernel, block=block, nesterov=nesterov, apply=apply),
      out_shape=(jax.ShapeDtypeStruct((n,), out_dtype),
                 jax.ShapeDtypeStruct((n,), mu.dtype),
                 jax.ShapeDtypeStruct((n,), nu.dtype)),
      grid=(pl.cdiv(n, block),),
      in_specs=[pl.BlockSpec((N_SCALARS,), lambda i: (0,)),
                pl.BlockSpec((N_SEEDS,), lambda i: (0,))] + [spec] * len(arrays),
      out_specs=(spec, spec, spec),
      input_output_aliases=aliases,
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1),
      interpret=interpret,
      name="fuseopt_adam_update",
  )(scalars, seeds, *arrays)


# -------------------------------------------------------------- mosaic_tpu --
def _mosaic_kernel(s_ref, seed_ref, *refs, block_rows, nesterov, apply):
  out, mu_new, nu_new, (o_ref, mu_out, nu_out) = _kernel_body(s_ref, refs, nesterov=nesterov,
                                                              apply=apply)
  index = _elementwise.mosaic_flat_index(block_rows)
  seed = lambda k: seed_ref[k].astype(jnp.uint32)
  o_ref[...] = _store_mosaic(out, o_ref.dtype, index, seed(0))
  mu_out[...] = _store_mosaic(mu_new, mu_out.dtype, index, seed(1))
  nu_out[...] = _store_mosaic(nu_new, nu_out.dtype, index, seed(2))


def _mosaic_block_rows(rows: int, most: int) -> int | None:
  """Rows a grid step: the whole leaf if it fits in ``most`` rows (a
  full-extent block is legal for any count), else the largest multiple of 16
  (bf16 sublane packing) up to ``most`` that divides ``rows``; ``None`` if
  there is none (the leaf then runs the reference). Dividing blocks keep the
  in-place outputs free of padded edge blocks."""
  if rows <= most:
    return rows
  for b in range(most - most % 16, 15, -16):
    if rows % b == 0:
      return b
  return None


def _adam_mosaic(scalars, seeds, p, g, mu, nu, *, nesterov, out_dtype, config, interpret):
  from jax.experimental.pallas import tpu as pltpu
  (n,) = g.shape
  rows = n // LANES
  block_rows = _mosaic_block_rows(rows, config.block_rows)
  apply = p is not None
  arrays = tuple(a.reshape(rows, LANES) for a in ((p, g, mu, nu) if apply else (g, mu, nu)))
  spec = pl.BlockSpec((block_rows, LANES), lambda i: (i, 0))
  first = 2
  aliases = ({first: 0, first + 2: 1, first + 3: 2} if apply
             else {first + 1: 1, first + 2: 2})
  outs = pl.pallas_call(
      functools.partial(_mosaic_kernel, block_rows=block_rows, nesterov=nesterov, apply=apply),
      out_shape=(jax.ShapeDtypeStruct((rows, LANES), out_dtype),
                 jax.ShapeDtypeStruct((rows, LANES), mu.dtype),
                 jax.ShapeDtypeStruct((rows, LANES), nu.dtype)),
      grid=(pl.cdiv(rows, block_rows),),
      in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM),
                pl.BlockSpec(memory_space=pltpu.SMEM)] + [spec] * len(arrays),
      out_specs=(spec, spec, spec),
      input_output_aliases=aliases,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
      interpret=interpret,
      name="fuseopt_adam_update",
  )(scalars, jax.lax.bitcast_convert_type(seeds, jnp.int32), *arrays)
  return tuple(o.reshape(-1) for o in outs)


# ------------------------------------------------------------------ public --
def _f32(x) -> jax.Array:
  return jnp.asarray(x, jnp.float32)


def adam_scalars(*, count, learning_rate=0.0, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0,
                 weight_decay=0.0, nesterov=False) -> jax.Array:
  """The fp32 scalar vector of one step (shared by all leaves of a tree).

  ``count`` is the step number after increment (1 on the first step), as in
  optax; bias corrections are ``1 - b**count`` computed in fp32 as optax does
  (a bf16 ``0.999`` would be 1.0 and nu would never decay).
  """
  count = jnp.asarray(count)
  if count.ndim or not jnp.issubdtype(count.dtype, jnp.integer):
    raise TypeError(f"adam_update: count must be an integer scalar, got "
                    f"{count.dtype}{list(count.shape)}")
  # Same expressions as optax.tree.bias_correction / update_moment, so the
  # fp32 values agree bit for bit with optax's (python floats stay exact
  # until they meet the fp32 operand).
  bc1 = 1 - b1 ** count
  bc2 = 1 - b2 ** count
  bc1_next = 1 - b1 ** optax_safe_increment(count) if nesterov else bc1
  vals = [-learning_rate if not isinstance(learning_rate, (int, float)) else -float(learning_rate),
          b1, 1 - b1, b2, 1 - b2, eps, eps_root, bc1, bc2, bc1_next, weight_decay]
  vals = [_f32(v) for v in vals]
  return jnp.stack(vals + [jnp.float32(0)] * (N_SCALARS - len(vals)))


def optax_safe_increment(count):
  """``count + 1`` saturating at the dtype's maximum (optax.safe_increment)."""
  count = jnp.asarray(count)
  max_value = jnp.iinfo(count.dtype).max
  return jnp.where(count < max_value, count + 1, max_value).astype(count.dtype)


def adam_seeds(seed, step, leaf_index) -> jax.Array:
  """uint32 seeds ``[param, mu, nu, 0]`` of one leaf at one step."""
  return jnp.stack([counter_hash.derive_seed(seed, step, leaf_index, counter_hash.STREAM_PARAM),
                    counter_hash.derive_seed(seed, step, leaf_index, counter_hash.STREAM_MU),
                    counter_hash.derive_seed(seed, step, leaf_index, counter_hash.STREAM_NU),
                    jnp.uint32(0)])


def _check(p, g, mu, nu):
  g = jnp.asarray(g)
  for name, a in (("grads", g), ("mu", mu), ("nu", nu)) + ((("params", p),) if p is not None else ()):
    a = jnp.asarray(a)
    if a.dtype not in _FLOAT_DTYPES:
      raise TypeError(f"adam_update: {name} must be float32 or bfloat16, got {a.dtype}")
    if a.shape != g.shape:
      raise ValueError(f"adam_update: {name} has shape {a.shape}, expected the gradient's {g.shape}")


def _run(impl, scalars, seeds, p, g, mu, nu, *, nesterov, out_dtype, interpret, config):
  shape = g.shape
  n = g.size
  kw = dict(nesterov=nesterov, out_dtype=out_dtype)
  if impl == "mosaic_tpu" and (n % LANES or _mosaic_block_rows(
      n // LANES, (config or mosaic_heuristic(n)).block_rows) is None):
    impl = "xla"
  if n == 0 or impl == "xla":
    # In the leaf's own shape: a reshape between a donated input and its
    # in-place output makes XLA copy the leaf.
    return _reference(scalars, seeds, p, g, mu, nu,
                      order_for_in_place=_backend.current_platform((g,)) == "cpu", **kw)
  flat = lambda a: None if a is None else a.reshape(-1)
  p, g, mu, nu = flat(p), flat(g), flat(mu), flat(nu)
  if impl == "triton":
    config = config or triton_heuristic(n)
    if not isinstance(config, TritonConfig):
      raise TypeError(f"adam_update: config must be a TritonConfig for triton, got {config!r}")
    outs = _adam_triton(scalars, seeds, p, g, mu, nu, config=config,
                        interpret=_backend.interpret_arg(impl, interpret), **kw)
  else:
    config = config or mosaic_heuristic(n)
    if not isinstance(config, MosaicConfig):
      raise TypeError(f"adam_update: config must be a MosaicConfig for mosaic_tpu, got {config!r}")
    outs = _adam_mosaic(scalars, seeds, p, g, mu, nu, config=config,
                        interpret=_backend.interpret_arg(impl, interpret), **kw)
  return tuple(o.reshape(shape) for o in outs)


def adam_update(params, grads, mu, nu, *, count, learning_rate=0.0, b1=0.9, b2=0.999,
                eps=1e-8, eps_root=0.0, weight_decay=0.0, nesterov=False, seed=0,
                leaf_index=0, implementation=None, interpret=False, config=None):
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
    p_t = p_{t-1} - \alpha_t (u_t + \lambda p_{t-1})

  (Kingma & Ba 2014, "Adam"; Loshchilov & Hutter 2019, "Decoupled Weight
  Decay Regularization"; Dozat 2016 for Nesterov), exactly optax's
  ``scale_by_adam`` → ``add_decayed_weights`` → ``scale_by_learning_rate`` →
  ``apply_updates``. bf16 outputs are stochastically rounded with seeds
  :func:`adam_seeds` ``(seed, count, leaf_index)``.

  Args:
    params: the leaf's parameters (fp32 or bf16), or ``None`` to return the
      Adam direction :math:`u_t` (no weight decay, no learning rate) in the
      gradient's dtype instead of new parameters.
    grads: the gradient, fp32 or bf16, same shape.
    mu, nu: the moments, fp32 or bf16, same shape.
    count: integer scalar (may be traced), the step number after increment.
    learning_rate, weight_decay: scalars (may be traced, e.g. a schedule's
      value); ignored when ``params`` is ``None``.
    b1, b2, eps, eps_root, nesterov: as in :func:`optax.scale_by_adam`.
    seed: integer scalar mixed into the rounding seeds.
    leaf_index: the leaf's index in its tree (another seed input).
    implementation: ``None`` (by platform), ``"xla"``, ``"triton"`` or
      ``"mosaic_tpu"``.
    interpret: run a Pallas backend in interpret mode (CPU debugging).
    config: a :class:`TritonConfig` / :class:`MosaicConfig`.

  Returns:
    ``(new_params or update, new_mu, new_nu)`` in the dtypes of
    ``params`` (or ``grads``), ``mu`` and ``nu``. Pallas backends write them
    in place of their inputs (``input_output_aliases``): donate the inputs to
    the enclosing ``jit`` to avoid copies.
  """
  _check(params, grads, mu, nu)
  grads = jnp.asarray(grads)
  if params is not None:
    params = jnp.asarray(params)
  out_dtype = (params if params is not None else grads).dtype
  scalars = adam_scalars(count=count, learning_rate=learning_rate, b1=b1, b2=b2, eps=eps,
                         eps_root=eps_root,
                         weight_decay=weight_decay if params is not None else 0.0,
                         nesterov=nesterov)
  seeds = adam_seeds(seed, count, leaf_index)
  impl = _backend.resolve_implementation(OP_NAME, implementation, (grads,))
  return _run(impl, scalars, seeds, params, grads, jnp.asarray(mu), jnp.asarray(nu),
              nesterov=nesterov, out_dtype=out_dtype, interpret=interpret, config=config)


def adam_update_reference(params, grads, mu, nu, *, count, learning_rate=0.0, b1=0.9,
                          b2=0.999, eps=1e-8, eps_root=0.0, weight_decay=0.0, nesterov=False,
                          seed=0, leaf_index=0):
  """The specification of :func:`adam_update`: plain jnp, any platform."""
  return adam_update(params, grads, mu, nu, count=count, learning_rate=learning_rate, b1=b1,
                     b2=b2, eps=eps, eps_root=eps_root, weight_decay=weight_decay,
                     nesterov=nesterov, seed=seed, leaf_index=leaf_index, implementation="xla")


def adam_update_tree(params, grads, mu, nu, *, count, learning_rate=0.0, b1=0.9, b2=0.999,
                     eps=1e-8, eps_root=0.0, weight_decay=0.0, nesterov=False, seed=0,
                     implementation=None, interpret=False, config=None):
  """:func:`adam_update` over lists of leaves sharing one step's scalars.

  ``params`` is a list of arrays or ``None`` (direction only);
  ``weight_decay`` a scalar or a list with one value per leaf (0 where masked).
  Leaf ``i`` rounds with ``adam_seeds(seed, count, i)``. One kernel per leaf:
  on the 1.2 B tree (147 leaves) the launches cost about 15% over one flat
  buffer (shared/ANCHORS.md).

  Returns:
    Three lists: new params (or updates), new mu, new nu.
  """
  n = len(grads)
  if params is not None and len(params) != n:
    raise ValueError(f"adam_update: params has {len(params)} leaves, grads has {n}")
  if len(mu) != n or len(nu) != n:
    raise ValueError(f"adam_update: mu/nu have {len(mu)}/{len(nu)} leaves, grads has {n}")
  wds = weight_decay if isinstance(weight_decay, (list, tuple)) else [weight_decay] * n
  apply = params is not None
  impl = _backend.resolve_implementation(OP_NAME, implementation, list(grads))
  base = None
  outs = ([], [], [])
  for i in range(n):
    g = jnp.asarray(grads[i])
    p = jnp.asarray(params[i]) if apply else None
    _check(p, g, mu[i], nu[i])
    key = wds[i] if isinstance(wds[i], (int, float)) else id(wds[i])
    if base is None or base[0] != key:
      base = (key, adam_scalars(count=count, learning_rate=learning_rate, b1=b1, b2=b2, eps=eps,
                                eps_root=eps_root, weight_decay=wds[i] if apply else 0.0,
                                nesterov=nesterov))
    r = _run(impl, base[1], adam_seeds(seed, count, i), p, g, jnp.asarray(mu[i]),
             jnp.asarray(nu[i]), nesterov=nesterov, out_dtype=(p if apply else g).dtype,
             interpret=interpret, config=config)
    for lst, v in zip(outs, r):
      lst.append(v)
  return outs
