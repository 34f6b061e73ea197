"""adam_update's two variants: cautious weight decay and mantissa-tracked
bf16 parameters (a bf16 half and an int16 companion of an fp32 master, or an int8
one of a 24-bit master).

Cautious weight decay is one more scalar of the packed vector, read as a
select: off, the step is bit for bit the plain AdamW step. Mantissa tracking
is the point of its companion: a tracked parameter follows the fp32 run of
the same kernel bit for bit, step after step, on every backend (interpret
mode), grouped or not, sharded or not.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from fuseopt.kernels import adam as A
from fuseopt.kernels import adam_update, adam_update_tree, mantissa
from fuseopt.kernels.adam import math as adam_math_lib
from fuseopt.kernels.adam import mosaic_gpu as adam_mosaic_gpu
from fuseopt.kernels.adam import mosaic_tpu as adam_mosaic_tpu
from tests.kernels import harness
from tests.kernels.test_adam_kernel import _compare

F32, BF16, I16, I8 = jnp.float32, jnp.bfloat16, jnp.int16, jnp.int8
HYPER = dict(learning_rate=3e-3, b1=0.9, b2=0.999, eps=1e-8, eps_root=1e-12,
             weight_decay=0.1, seed=17)
STEPS = 5


def _leaf(key, shape, m_dtype=BF16, p_scale=1.0):
  """fp32 params (not bf16 values: their low bits matter), grads, moments."""
  k = jax.random.split(key, 4)
  p = p_scale * jax.random.normal(k[0], shape, F32)
  g = jax.random.normal(k[1], shape, F32)
  mu = (0.1 * jax.random.normal(k[2], shape, F32)).astype(m_dtype)
  nu = (0.1 * jax.random.uniform(k[3], shape, F32)).astype(m_dtype)
  return p, g, mu, nu


def _grads(key, shape, steps=STEPS):
  return [jax.random.normal(k, shape, F32) for k in jax.random.split(key, steps)]


# ----------------------------------------------------- cautious weight decay --
def _old_adam_math(s, p32, g32, mu32, nu32):
  """adam_math as it was before the cautious flag (nesterov off, apply on),
  its bias corrections written as adam_math writes them, multiplications by
  their reciprocals (the scalars carry them): XLA compiled the divisions
  ``x / bc`` to the same program up to jax 0.12.0.1, and keeps them as
  divisions from 0.12.1."""
  S = adam_math_lib
  keep_old = s(S.APPLY) == 0
  g32 = g32 * s(S.GRAD_SCALE)
  mu_new = s(S.OMB1) * g32 + s(S.B1) * mu32
  nu_new = s(S.OMB2) * (g32 * g32) + s(S.B2) * nu32
  u = mu_new * s(S.INV_BC1) / (jnp.sqrt(nu_new * s(S.INV_BC2) + s(S.EPS_ROOT)) + s(S.EPS))
  u = u + s(S.WD) * p32
  return (jnp.where(keep_old, p32, p32 + s(S.NEG_LR) * u), jnp.where(keep_old, mu32, mu_new),
          jnp.where(keep_old, nu32, nu_new))


def test_cautious_off_is_the_old_formula_bitwise(request):
  p, g, mu, nu = _leaf(harness.fresh_key(request), (64, 333), F32)
  p = p.at[0, :4].set(jnp.array([0.0, -0.0, jnp.inf, jnp.nan]))

  @jax.jit
  def both(scalars, p, g, mu, nu):
    s = lambda k: scalars[k]
    new = adam_math_lib.adam_math(s, p, g, mu, nu, nesterov=False, apply=True)
    return new, _old_adam_math(s, p, g, mu, nu)

  for flag in (False, jnp.bool_(False)):
    scalars = adam_math_lib.adam_scalars(count=3, learning_rate=1e-3, weight_decay=0.1,
                                         cautious=flag)
    assert float(scalars[adam_math_lib.CAUTIOUS]) == 0.0
    new, old = both(scalars, p, g, mu, nu)
    for a, b in zip(new, old):
      harness.assert_bitwise_equal(a, b, "cautious=False vs the plain AdamW formula")


def _cautious_expected(p, g, mu, nu, count):
  """p - lr (u + wd I(u p >= 0) p), from the reference's own direction."""
  u, mu_new, nu_new = adam_update(None, g, mu, nu, count=count, implementation="xla",
                                  **{k: v for k, v in HYPER.items()
                                     if k not in ("learning_rate", "weight_decay")})
  lr, wd = HYPER["learning_rate"], HYPER["weight_decay"]
  decay = jnp.where(u * p >= 0, wd * p, 0.0)
  return p + (-lr) * (u + decay), mu_new, nu_new, u


@pytest.mark.parametrize("impl", ["xla", "triton", "mosaic_tpu", "mosaic_gpu"])
def test_cautious_decays_only_where_update_and_param_agree(request, impl):
  p, g, mu, nu = _leaf(harness.fresh_key(request), (32, 384), F32)
  run = jax.jit(lambda p, g, mu, nu, flag: adam_update(
      p, g, mu, nu, count=4, implementation=impl, interpret=True,
      cautious_weight_decay=flag, **HYPER))
  got = run(p, g, mu, nu, jnp.bool_(True))   # traced: the same kernel as False
  want_p, want_mu, want_nu, u = _cautious_expected(p, g, mu, nu, 4)
  _compare(got, (want_p, want_mu, want_nu), f"{impl} cautious")
  # The flag matters where the signs disagree, and only there.
  plain = run(p, g, mu, nu, jnp.bool_(False))
  disagree = np.asarray(u * p < 0)
  assert 0.2 < disagree.mean() < 0.8
  ulps = np.abs(harness.bits(got[0]).astype(np.int64) - harness.bits(plain[0]).astype(np.int64))
  # Where the signs agree the decay is the plain step's; XLA's CPU compiler
  # may still contract the two programs' products differently (1 ulp, rare).
  assert ulps[~disagree].max() <= 1 and (ulps[~disagree] != 0).sum() <= p.size // 500
  # Where they disagree the decay is gone (unless too small to show).
  assert (ulps[disagree & (np.abs(np.asarray(p)) > 1e-3)] > 1).all()
  # A static flag is the traced one.
  static = adam_update(p, g, mu, nu, count=4, implementation=impl, interpret=True,
                       cautious_weight_decay=True, **HYPER)
  _compare(static, got, f"{impl} static flag")


def test_cautious_applies_to_the_whole_tree(request):
  key = harness.fresh_key(request)
  leaves = [_leaf(k, s) for k, s in zip(jax.random.split(key, 2), [(300,), (8, 128)])]
  ps, gs, mus, nus = (list(x) for x in zip(*leaves))
  got = adam_update_tree(ps, gs, mus, nus, count=2, implementation="xla",
                         cautious_weight_decay=True, **HYPER)
  for i in range(2):
    want = adam_update(ps[i], gs[i], mus[i], nus[i], count=2, leaf_index=i,
                       implementation="xla", cautious_weight_decay=True, **HYPER)
    for a, b in zip((o[i] for o in got), want):
      harness.assert_bitwise_equal(a, b, f"tree leaf {i}")


@pytest.mark.parametrize("bad", [1, 0, 1.0, "yes", None, jnp.float32(1), jnp.array([True])],
                         ids=repr)
def test_cautious_flag_must_be_a_bool(bad):
  p, g, mu, nu = _leaf(jax.random.key(0), (8,))
  with pytest.raises(TypeError, match="cautious_weight_decay"):
    adam_update(p, g, mu, nu, count=1, cautious_weight_decay=bad)
  with pytest.raises(TypeError, match="cautious_weight_decay"):
    adam_update_tree([p], [g], [mu], [nu], count=1, cautious_weight_decay=bad)
  adam_update(p, g, mu, nu, count=1, cautious_weight_decay=np.bool_(True))


# --------------------------------------------------------- mantissa tracking --
def _step_pair(run, p32, lo_state, gs, mu, nu, tracked_grad_dtype=None, **kw):
  """``STEPS`` steps of the fp32 run on ``p32`` and of the tracked run on
  ``split(p32)`` (fed the same gradient values in ``tracked_grad_dtype``, if
  given); asserts after every step that the tracked pair is the fp32 master
  bit for bit, and the moments the same bits."""
  hi, lo = mantissa.split(p32)
  mu_t, nu_t = mu, nu
  for step, g in enumerate(gs, start=1):
    p32, mu, nu = run(p32, g, mu, nu, step, None, **kw)
    g_t = g if tracked_grad_dtype is None else g.astype(tracked_grad_dtype)
    hi, mu_t, nu_t, lo = run(hi, g_t, mu_t, nu_t, step, lo, **kw)
    assert hi.dtype == BF16 and lo.dtype == I16
    what = f"{lo_state} step {step}"
    harness.assert_bitwise_equal(mantissa.join(hi, lo), p32, f"{what}: join(hi, lo) vs fp32")
    harness.assert_bitwise_equal(mu_t, mu, f"{what}: mu")
    harness.assert_bitwise_equal(nu_t, nu, f"{what}: nu")
  return p32


def _leaf_runner(impl, config=None):
  @functools.partial(jax.jit, static_argnames=("nesterov", "cautious"))
  def run(p, g, mu, nu, count, lo, nesterov=False, cautious=False):
    return adam_update(p, g, mu, nu, count=count, implementation=impl, interpret=True,
                       config=config, nesterov=nesterov, cautious_weight_decay=cautious,
                       params_lo=lo, leaf_index=3, **HYPER)
  return run


# Ragged: 4773 and 1505 elements are multiples of neither a Triton block nor
# Mosaic GPU's 128 (a tail in XLA); Mosaic TPU needs a tiling that divides
# the leaf ((40, 384): 16-row blocks of bf16 and int16).
LEAF_CASES = [
    ("xla", (37, 129), BF16, {}),
    ("xla", (5, 301), F32, dict(nesterov=True, cautious=True)),
    ("triton", (37, 129), BF16, {}),
    ("triton", (5, 301), F32, dict(cautious=True)),
    ("mosaic_tpu", (40, 384), BF16, {}),
    ("mosaic_tpu", (48, 256), F32, dict(nesterov=True, cautious=True)),
    ("mosaic_gpu", (5, 301), BF16, {}),
    ("mosaic_gpu", (37, 129), F32, dict(cautious=True)),
]


@pytest.mark.parametrize("impl,shape,m_dtype,kw", LEAF_CASES,
                         ids=lambda x: str(x) if not isinstance(x, dict) else
                         "-".join(k for k, v in x.items() if v) or "plain")
def test_tracked_params_follow_the_fp32_run_bitwise(request, impl, shape, m_dtype, kw):
  key = harness.fresh_key(request)
  p, _, mu, nu = _leaf(key, shape, m_dtype)
  _step_pair(_leaf_runner(impl), p, impl, _grads(jax.random.fold_in(key, 1), shape), mu, nu, **kw)


@pytest.mark.parametrize("impl,shape,m_dtype,kw", LEAF_CASES,
                         ids=lambda x: str(x) if not isinstance(x, dict) else
                         "-".join(k for k, v in x.items() if v) or "plain")
def test_tracked_params_with_bf16_grads_follow_the_fp32_run_bitwise(request, impl, shape,
                                                                   m_dtype, kw):
  """bf16 parameters have bf16 gradients: the tracked run fed them in bf16
  is the fp32 run fed the same values in fp32, bit for bit. In interpret
  mode XLA compiles the kernel's pass, so the gradient is widened once in
  memory (kernels.mantissa.widen_once); without it XLA's CPU backend
  contracts Adam's multiply-adds differently for the two programs."""
  key = harness.fresh_key(request)
  p, _, mu, nu = _leaf(key, shape, m_dtype)
  gs = [g.astype(BF16).astype(F32) for g in _grads(jax.random.fold_in(key, 1), shape)]
  _step_pair(_leaf_runner(impl), p, impl, gs, mu, nu, tracked_grad_dtype=BF16, **kw)


@pytest.mark.parametrize("impl,shape", [("triton", (37, 129)), ("mosaic_tpu", (40, 384)),
                                        ("mosaic_gpu", (5, 301))])
@pytest.mark.fma_off
def test_tracked_kernels_with_bf16_grads_are_the_reference(request, impl, shape):
  """A tracked leaf with bf16 gradients: each kernel (interpret mode) gives
  the reference's outputs (fp32 masters within an ulp: two programs; the
  halves, moments and companion dtypes exact)."""
  key = harness.fresh_key(request)
  p, g, mu, nu = _leaf(key, shape)
  hi, lo = mantissa.split(p)
  g = g.astype(BF16)
  got = _leaf_runner(impl)(hi, g, mu, nu, 2, lo, cautious=True)
  want = _leaf_runner("xla")(hi, g, mu, nu, 2, lo, cautious=True)
  assert [x.dtype for x in got] == [BF16, mu.dtype, mu.dtype, I16]
  _compare([mantissa.join(got[0], got[3])] + list(got[1:3]),
           [mantissa.join(want[0], want[3])] + list(want[1:3]), f"{impl} tracked, bf16 grads")


def test_mosaic_tpu_runs_the_tracked_leaf_in_its_kernel():
  """The cases above are not the reference in disguise: Mosaic TPU tiles
  the tracked leaf (no fallback), with the companion's 2 bytes counted."""
  p = jnp.zeros((40, 384), BF16)
  lo = jnp.zeros((40, 384), I16)
  m = jnp.zeros((40, 384), BF16)
  config = adam_mosaic_tpu.heuristic(p.size)
  assert adam_mosaic_tpu.leaf_reason(p, p, m, m, BF16, config, None, lo) is None


def test_tracked_step_can_be_skipped_bitwise():
  """apply=False returns the pair as it was (NaN and Inf masters included)."""
  p, g, mu, nu = _leaf(jax.random.key(11), (16, 128))
  p = p.at[0, :3].set(jnp.array([jnp.nan, jnp.inf, -0.0]))
  hi, lo = mantissa.split(p)
  for impl in harness.runnable("xla", "triton", "mosaic_tpu", "mosaic_gpu"):
    got = jax.jit(lambda hi, g, mu, nu, lo, a: adam_update(
        hi, g, mu, nu, count=2, apply=a, params_lo=lo, implementation=impl, interpret=True,
        **HYPER))(hi, g, mu, nu, lo, jnp.bool_(False))
    for a, b, what in zip(got, (hi, mu, nu, lo), ("p", "mu", "nu", "lo")):
      harness.assert_bitwise_equal(a, b, f"{impl} apply=False {what}")


def test_bf16_half_is_the_bf16_value_nearest_the_master():
  p, g, mu, nu = _leaf(jax.random.key(12), (4096,))
  hi, lo = mantissa.split(p)
  new_hi, _, _, new_lo = adam_update(hi, g, mu, nu, count=1, params_lo=lo, **HYPER)
  master = np.asarray(mantissa.join(new_hi, new_lo), np.float64)
  nearest = np.asarray(mantissa.join(new_hi, new_lo).astype(BF16), np.float64)
  assert (np.abs(np.asarray(new_hi, np.float64) - master) <= np.abs(nearest - master)).all()


# Mosaic TPU tiles an int8 companion in 32-row blocks.
MASTER24_CASES = [("xla", (37, 129)), ("triton", (37, 129)), ("mosaic_tpu", (64, 256)),
                  ("mosaic_gpu", (5, 301))]


@pytest.mark.parametrize("impl,shape", MASTER24_CASES, ids=lambda x: str(x))
def test_24_bit_masters_are_the_fp32_step_rounded(request, impl, shape):
  """With an int8 companion every backend's step stores the master the fp32
  step of the previous master makes, rounded to 15 mantissa bits
  (``mantissa.master``), and the fp32 step's moments."""
  key = harness.fresh_key(request)
  p, _, mu, nu = _leaf(key, shape, BF16)
  run = _leaf_runner(impl)
  hi, lo = mantissa.split(p, I8)
  for step, g in enumerate(_grads(jax.random.fold_in(key, 1), shape), start=1):
    want_p, want_mu, want_nu = run(mantissa.join(hi, lo), g, mu, nu, step, None)
    hi, mu, nu, lo = run(hi, g, mu, nu, step, lo)
    assert hi.dtype == BF16 and lo.dtype == I8
    harness.assert_bitwise_equal(mantissa.join(hi, lo), mantissa.master(want_p, I8),
                                 f"{impl} step {step}: 24-bit master")
    harness.assert_bitwise_equal(mu, want_mu, f"{impl} step {step}: mu")
    harness.assert_bitwise_equal(nu, want_nu, f"{impl} step {step}: nu")


# A grouped launch mixing tracked and untracked leaves (and dtypes), ragged
# at block 512, with a leaf under Mosaic GPU's 128 elements.
TREE_SHAPES = [(37, 129), (300,), (3, 129), (5, 301), (7,)]
TRACKED = [True, False, True, False, True]


def _tree_inputs(key, m_dtype=BF16):
  leaves = [_leaf(k, s, m_dtype) for k, s in zip(jax.random.split(key, len(TREE_SHAPES)),
                                                   TREE_SHAPES)]
  ps, _, mus, nus = (list(x) for x in zip(*leaves))
  # Untracked leaves: one bf16 (rounded stochastically), one fp32.
  ps = [p if t or i == 3 else p.astype(BF16) for i, (p, t) in enumerate(zip(ps, TRACKED))]
  gs = [_grads(jax.random.fold_in(key, i), s) for i, s in enumerate(TREE_SHAPES)]
  return ps, gs, mus, nus


def _tree_runner(impl, config, shardings=None):
  @jax.jit
  def run(ps, gs, mus, nus, count, los):
    return adam_update_tree(ps, gs, mus, nus, count=count, implementation=impl,
                            interpret=True, config=config, group=True, params_lo=los,
                            shardings=shardings, cautious_weight_decay=True, **HYPER)
  return run


def _tree_pair(run, ps, gs, mus, nus, what, steps=STEPS):
  """The tree with fp32 masters for its tracked leaves, and the same tree
  split; asserts the tracked leaves follow the fp32 ones bit for bit and
  every other output is the same bits. Returns the tracked run's outputs."""
  split = [mantissa.split(p) if t else (p, None) for p, t in zip(ps, TRACKED)]
  hs, los = [s[0] for s in split], [s[1] for s in split]
  mus_t, nus_t = list(mus), list(nus)
  for step in range(1, steps + 1):
    g = [x[step - 1] for x in gs]
    ps, mus, nus = run(ps, g, mus, nus, step, None)
    hs, mus_t, nus_t, los = run(hs, g, mus_t, nus_t, step, los)
    for i, t in enumerate(TRACKED):
      at = f"{what} step {step} leaf {i}"
      if t:
        harness.assert_bitwise_equal(mantissa.join(hs[i], los[i]), ps[i], f"{at}: join")
      else:
        assert los[i] is None
        harness.assert_bitwise_equal(hs[i], ps[i], f"{at}: untracked p")
      harness.assert_bitwise_equal(mus_t[i], mus[i], f"{at}: mu")
      harness.assert_bitwise_equal(nus_t[i], nus[i], f"{at}: nu")
  return hs, mus_t, nus_t, los


@pytest.mark.parametrize("impl,config", [
    ("xla", None),
    ("triton", A.TritonGroupConfig(block=512, num_warps=4, max_leaves_per_launch=16)),
], ids=["xla", "triton-grouped"])
def test_grouped_tracked_leaves_with_bf16_grads_follow_the_fp32_run_bitwise(request, impl,
                                                                           config):
  """The grouped launch, its tracked leaves fed bf16 gradients and the fp32
  run the same values in fp32: the same bits (untracked leaves see bf16
  gradients in both runs)."""
  key = harness.fresh_key(request)
  ps, gs, mus, nus = _tree_inputs(key)
  gs = [[g.astype(BF16).astype(F32) for g in steps] for steps in gs]
  run = _tree_runner(impl, config)
  split = [mantissa.split(p) if t else (p, None) for p, t in zip(ps, TRACKED)]
  hs, los = [s[0] for s in split], [s[1] for s in split]
  mus_t, nus_t = list(mus), list(nus)
  for step in range(1, 4):
    g = [x[step - 1] for x in gs]
    ps, mus, nus = run(ps, g, mus, nus, step, None)
    hs, mus_t, nus_t, los = run(hs, [x.astype(BF16) if t else x for x, t in zip(g, TRACKED)],
                                mus_t, nus_t, step, los)
    for i in (i for i, t in enumerate(TRACKED) if t):
      at = f"{impl} step {step} leaf {i}"
      harness.assert_bitwise_equal(mantissa.join(hs[i], los[i]), ps[i], f"{at}: join")
      harness.assert_bitwise_equal(mus_t[i], mus[i], f"{at}: mu")
      harness.assert_bitwise_equal(nus_t[i], nus[i], f"{at}: nu")


@pytest.mark.parametrize("impl,config", [
    ("xla", None),
    ("triton", A.TritonGroupConfig(block=512, num_warps=4, max_leaves_per_launch=16)),
    ("mosaic_gpu", adam_mosaic_gpu.MosaicGPUGroupConfig(block=256, max_leaves_per_launch=8)),
], ids=["xla", "triton-grouped", "mosaic_gpu-grouped"])
def test_grouped_tracked_leaves_follow_the_fp32_run_bitwise(request, impl, config):
  key = harness.fresh_key(request)
  ps, gs, mus, nus = _tree_inputs(key)
  steps = STEPS if impl != "mosaic_gpu" else 2   # (a grouped Mosaic GPU lowering: ~10 s a run)
  got = _tree_pair(_tree_runner(impl, config), ps, gs, mus, nus, impl, steps)
  if impl != "xla":   # the grouped kernel's bits are the reference's (fp32 within an ulp)
    split = [mantissa.split(p) if t else (p, None) for p, t in zip(ps, TRACKED)]
    want = _tree_runner("xla", None)([s[0] for s in split], [g[0] for g in gs], mus, nus, 1,
                                     [s[1] for s in split])
    got1 = _tree_runner(impl, config)([s[0] for s in split], [g[0] for g in gs], mus, nus, 1,
                                      [s[1] for s in split])
    for i in range(len(TREE_SHAPES)):
      _compare([o[i] for o in got1[:3]], [o[i] for o in want[:3]], f"{impl} leaf {i}")
  assert [x is None for x in got[3]] == [not t for t in TRACKED]


def test_grouped_launches_split_tracked_from_untracked_leaves(monkeypatch):
  """Tracked leaves have two more operands: their own launches."""
  from fuseopt.kernels.adam import triton as adam_triton
  launches = []
  real = adam_triton.update_group

  def spy(scalars, seeds, ps, gs, mus, nus, **kw):
    launches.append((len(gs), kw.get("los") is not None))
    return real(scalars, seeds, ps, gs, mus, nus, **kw)
  monkeypatch.setattr(adam_triton, "update_group_jit", spy)
  s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt)
  shapes = [(256,), (512,), (128,)]
  ps = [s(x, BF16) for x in shapes]
  los = [s(shapes[0], I16), None, s(shapes[2], I16)]
  jax.eval_shape(lambda ps, los: adam_update_tree(ps, ps, ps, ps, count=1, params_lo=los,
                                                  group=True, implementation="triton",
                                                  interpret=True),
                 ps, los)
  assert sorted(launches) == [(1, False), (2, True)]


@pytest.mark.parametrize("impl", ["xla", "triton", "mosaic_tpu"])
def test_sharded_tracked_tree_is_the_unsharded_one_bitwise(request, impl):
  """FSDP over 8 CPU devices (Auto axes, shardings=): the companions are
  sharded as their params, and every output is the unsharded run's bits."""
  key = harness.fresh_key(request)
  # (Mosaic TPU: shards whose last dim is a power of two and a tiling that
  # divides them, so both runs are the kernel's, not the reference's)
  shapes = ([(64, 256), (16, 384), (8 * 129,)] if impl != "mosaic_tpu" else
            [(64, 256), (16, 1024), (8 * 2048,)])
  tracked = [True, False, True]
  leaves = [_leaf(k, s) for k, s in zip(jax.random.split(key, 3), shapes)]
  ps, gs, mus, nus = (list(x) for x in zip(*leaves))
  split = [mantissa.split(p) for p in ps]
  hs = [h if t else p for (h, _), p, t in zip(split, ps, tracked)]
  los = [lo if t else None for (_, lo), t in zip(split, tracked)]
  mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
  specs = [P("x", None), P(None, "x"), P("x")]
  shardings = [NamedSharding(mesh, s) for s in specs]
  put = lambda xs: [None if x is None else jax.device_put(x, s) for x, s in zip(xs, shardings)]
  config = A.TritonGroupConfig(512, 4, 16) if impl == "triton" else None

  def run(hs, gs, mus, nus, los, shardings):
    return jax.jit(lambda *a: adam_update_tree(
        *a[:4], count=3, params_lo=a[4], implementation=impl, interpret=True, config=config,
        shardings=shardings, **HYPER))(hs, gs, mus, nus, los)

  want = run(hs, gs, mus, nus, los, None)
  got = run(put(hs), put(gs), put(mus), put(nus), put(los), shardings)
  for k, (a_list, b_list) in enumerate(zip(got, want)):
    for i, (a, b) in enumerate(zip(a_list, b_list)):
      if b is None:
        assert a is None
        continue
      harness.assert_bitwise_equal(a, b, f"{impl} output {k} leaf {i}")
      if k == 3:
        assert a.sharding.is_equivalent_to(shardings[i], a.ndim)


def test_companion_errors_name_the_parameter():
  p, g, mu, nu = _leaf(jax.random.key(13), (8, 16))
  hi, lo = mantissa.split(p)
  with pytest.raises(TypeError, match="params_lo.*bfloat16.*float32"):
    adam_update(p, g, mu, nu, count=1, params_lo=lo)
  with pytest.raises(ValueError, match="params_lo needs params"):
    adam_update(None, g, mu, nu, count=1, params_lo=lo)
  with pytest.raises(TypeError, match="params_lo must be int16.*or int8.*got uint16"):
    adam_update(hi, g, mu, nu, count=1, params_lo=lo.astype(jnp.uint16))
  with pytest.raises(ValueError, match="params_lo has shape"):
    adam_update(hi, g, mu, nu, count=1, params_lo=lo[:4])
  with pytest.raises(ValueError, match="params_lo has 2 entries"):
    adam_update_tree([hi], [g], [mu], [nu], count=1, params_lo=[lo, None])
  with pytest.raises(TypeError, match=r"params_lo\[1\].*bfloat16"):
    adam_update_tree([hi, p], [g, g], [mu, mu], [nu, nu], count=1, params_lo=[lo, lo])
  with pytest.raises(TypeError, match="params_lo must be None or a list"):
    adam_update_tree([hi], [g], [mu], [nu], count=1, params_lo=lo)
  # Without params_lo the results are three, as before.
  assert len(adam_update(hi, g, mu, nu, count=1)) == 3
  assert len(adam_update_tree([hi], [g], [mu], [nu], count=1)) == 3
  assert len(adam_update_tree([hi], [g], [mu], [nu], count=1, params_lo=[None])) == 4


@pytest.fixture
def estimates(monkeypatch):
  from jax.experimental import pallas as pl
  seen = []
  real = pl.pallas_call

  def spy(*args, **kwargs):
    seen.append(kwargs.get("cost_estimate"))
    return real(*args, **kwargs)
  monkeypatch.setattr(pl, "pallas_call", spy)
  return seen


@pytest.mark.parametrize("impl", ["triton", "mosaic_tpu"])
def test_cost_counts_the_companion(estimates, impl):
  """bf16 p, fp32 g, bf16 moments: 16 bytes a parameter (p, mu, nu read and
  written, g read), 20 with the companion read and written (2 + 2)."""
  n = 4096
  s = lambda dt: jax.ShapeDtypeStruct((16, n // 16), dt)
  jax.eval_shape(lambda p, g, m, lo: adam_update(p, g, m, m, count=1, params_lo=lo,
                                                 implementation=impl, interpret=True),
                 s(BF16), s(F32), s(BF16), s(I16))
  jax.eval_shape(lambda p, g, m: adam_update(p, g, m, m, count=1, implementation=impl,
                                             interpret=True), s(BF16), s(F32), s(BF16))
  tracked, plain = estimates
  assert plain.bytes_accessed == 16 * n and tracked.bytes_accessed == 20 * n
  assert tracked.flops == plain.flops == n * adam_math_lib.ADAM_FLOPS_PER_ELEMENT


def test_grouped_cost_counts_every_leaf_and_companion(estimates):
  shapes = [(64, 32), (128,), (32, 8)]
  ps = [jax.ShapeDtypeStruct(s, BF16) for s in shapes]
  gs = [jax.ShapeDtypeStruct(s, F32) for s in shapes]
  los = [jax.ShapeDtypeStruct(s, I16) for s in shapes]
  jax.eval_shape(lambda ps, gs, los: adam_update_tree(
      ps, gs, ps, ps, count=1, params_lo=los, implementation="triton", interpret=True,
      group=True), ps, gs, los)
  n = sum(a.size for a in ps)
  (est,) = estimates
  assert est.bytes_accessed == 20 * n


@pytest.mark.parametrize("target", harness.TARGETS, ids=harness.TARGET_IDS)
def test_tracked_and_cautious_kernels_lower_in_place(target):
  s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt)
  shape = (512, 1024)
  fn = lambda p, g, mu, nu, lo, c: adam_update(
      p, g, mu, nu, count=3, learning_rate=1e-3, weight_decay=0.1, params_lo=lo,
      cautious_weight_decay=c, implementation=target.implementation)
  text = harness.lower_for(target, fn, s(shape, BF16), s(shape, F32), s(shape, BF16),
                           s(shape, BF16), s(shape, I16), s((), jnp.bool_))
  # Four in-place outputs: p, mu, nu and the companion.
  assert text.count("output_operand_aliases") or text.count("input_output_alias")
  assert "ui16" in text or "i16" in text
