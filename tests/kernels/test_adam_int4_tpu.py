"""Adam on 4-bit moments, the Mosaic TPU kernel (interpret mode) against the
reference (fuseopt.kernels.adam.reference.update_int4, the specification):
both scale layouts, a leaf blocked over its trailing axes, the direction
only, bf16 params, two steps each; and a bf16 leaf with a companion (8-bit
and 4-bit moments) against the reference bit for bit."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fuseopt.kernels import adam_update
from fuseopt.kernels.adam import int4
from fuseopt.kernels.adam import mosaic_tpu
from fuseopt.kernels.adam import quantized
from fuseopt.kernels.elementwise_tiling import MosaicTPUConfig
from tests.kernels import blockwise as bw
from tests.kernels import harness

F32, BF16 = jnp.float32, jnp.bfloat16


CASES = [  # shape, p dtype (None: direction only), g dtype, nesterov, block_rows, grid
    ((256, 256), F32, F32, False, 128, (2, 1)),      # two 128-row steps, scales (2, 128) blocks
    ((160, 256), F32, BF16, False, 128, (1, 1)),     # no 128-row step divides: all 160 rows
    ((128, 5120), F32, F32, False, None, (1, 5)),    # 20 row groups: five column steps of 4
    ((16, 32, 64), F32, F32, True, None, (1, 1)),    # nnx-shaped: blocked over (32, 64)
    ((4, 8, 64), None, F32, False, None, (1, 1)),    # the direction only, blocked over (8, 64)
    ((1024,), BF16, F32, False, None, (1, 1)),       # 1-D: (4, 256) rows, bf16 params
]


@pytest.mark.parametrize("shape,p_dtype,g_dtype,nesterov,block_rows,grid", CASES)
@pytest.mark.fma_off
def test_mosaic_tpu_4bit_matches_reference(request, shape, p_dtype, g_dtype, nesterov,
                                           block_rows, grid):
  """Codes and scales bitwise against the reference over two steps (the same
  fp32 operations on the same values, then the same hash), in the state's
  own shapes; the parameter within a few ulps."""
  cfg = None if block_rows is None else MosaicTPUConfig(block_rows=block_rows)
  view = mosaic_tpu.quantized_view(shape)
  assert mosaic_tpu.int4_leaf_reason(jnp.zeros(shape), cfg or mosaic_tpu.heuristic(0), None,
                                     interpret=True) is None
  assert mosaic_tpu.quantized_tiling(view, cfg or mosaic_tpu.heuristic(0), "int4",
                                     ragged=False).grid == grid
  p, g, mu, nu = bw.inputs(request, shape, "int4", p_dtype, g_dtype)
  got = bw.steps("mosaic_tpu", p, g, mu, nu, nesterov=nesterov, config=cfg)
  want = bw.steps("xla", p, g, mu, nu, nesterov=nesterov)
  for a, b, like in zip(jax.tree.leaves(got[1:]), jax.tree.leaves(want[1:]),
                        jax.tree.leaves((mu, nu))):
    assert a.shape == like.shape and a.dtype == like.dtype
    bw.same(a, b, f"moments {shape}")
  bw.params_close(got[0], want[0])


def test_mosaic_tpu_4bit_runs_its_kernel(request, caplog):
  """With the CPU's FMA on (the default, which the fma_off tests leave out):
  the kernel itself runs, no fallback, and lands next to the reference (the
  kernel's products may be contracted into FMAs in interpret mode, the
  reference's never: scales a few ulps apart, a rare code one level apart)."""
  shape = (16, 32, 64)
  p, g, mu, nu = bw.inputs(request, shape, "int4", F32, F32)
  fn = lambda p, g, mu, nu: adam_update(p, g, mu, nu, count=1, implementation="mosaic_tpu",
                                        interpret=True, **bw.HYPER)
  assert "fuseopt_adam_update_int4" in str(jax.make_jaxpr(fn)(p, g, mu, nu))
  with caplog.at_level("DEBUG", logger="fuseopt"):
    got = bw.steps("mosaic_tpu", p, g, mu, nu)
  assert "reference" not in caplog.text
  want = bw.steps("xla", p, g, mu, nu)
  bw.params_close(got[0], want[0])
  for a, b, signed in ((got[1], want[1], True), (got[2], want[2], False)):
    np.testing.assert_allclose(a.scales, b.scales, rtol=4 * 2.0 ** -23)
    assert np.mean(np.asarray(a.codes) != np.asarray(b.codes)) <= 1e-3
    x, y = int4.dequantize(a, signed=signed), int4.dequantize(b, signed=signed)
    np.testing.assert_allclose(x, y, atol=0.3 * float(jnp.max(jnp.abs(y))))


def test_mosaic_tpu_4bit_skipped_step_keeps_codes_and_scales(request):
  """``apply=False`` (a skipped step): the parameter, the packed codes and the
  scales come back bit for bit (the stored state selected, not requantised)."""
  p, g, mu, nu = bw.inputs(request, (4, 512), "int4", F32, F32)
  got = adam_update(p, g, mu, nu, count=2, implementation="mosaic_tpu", interpret=True,
                    apply=jnp.asarray(False), **bw.HYPER)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves((p, mu, nu))):
    bw.same(a, b, "skipped step")


@pytest.mark.parametrize("moments", ["int8", "int4"])
@pytest.mark.parametrize("companion", [jnp.int16, jnp.int8], ids=["int16", "int8"])
@pytest.mark.fma_off
def test_mosaic_tpu_with_a_companion_is_the_reference(request, moments, companion):
  """A bf16 leaf with a companion (an fp32 or 24-bit master) on 8-bit or
  4-bit moments: the Mosaic TPU kernel in the leaf's own shape (not a
  fallback) gives the reference's p, lo, codes and scales bit for bit over
  two steps (the same master read, the same fp32 step, the same split)."""
  import re
  from fuseopt.kernels import mantissa
  from fuseopt.kernels.adam import quantized
  shape = (256, 256)
  k = jax.random.split(harness.fresh_key(request), 2)
  hi, lo = mantissa.split(jax.random.normal(k[0], shape), companion)
  g = jax.random.normal(k[1], shape)
  if moments == "int4":
    mu, nu = int4.zeros(shape), int4.zeros(shape)
  else:
    mu, nu = quantized.zeros(shape, signed=True), quantized.zeros(shape, signed=False)

  def step(impl, p, g, mu, nu, lo, c):
    return adam_update(p, g, mu, nu, count=c, implementation=impl, interpret=True,
                       params_lo=lo, **bw.HYPER)

  jaxpr = str(jax.make_jaxpr(lambda: step("mosaic_tpu", hi, g, mu, nu, lo, 1))())
  assert re.findall(r"name=(fuseopt_\w+)", jaxpr) == [f"fuseopt_adam_update_{moments}"]
  got, want = [], []
  for impl, res in (("mosaic_tpu", got), ("xla", want)):
    f = jax.jit(lambda p, g, mu, nu, lo, c, impl=impl: step(impl, p, g, mu, nu, lo, c))
    state = (hi, mu, nu, lo)
    for c in (1, 2):
      state = f(state[0], g * c, *state[1:], c)
    res += jax.tree.leaves(state)
  assert got[0].dtype == BF16 and got[-1].dtype == companion
  for a, b in zip(got, want):
    bw.same(a, b, f"{moments} moments, {jnp.dtype(companion)} companion")


@pytest.mark.parametrize("layout", ["int8", "int4"])
def test_mosaic_tpu_blockwise_loops_land_on_the_reference(request, monkeypatch, layout):
  """The compiled kernel's loops (row groups, then chunks of 32 rows at
  dynamic offsets), run in interpret mode: 2 row-group steps of 2 groups,
  4 chunks each, land next to the reference as the unrolled body does (a
  chunk at a wrong offset would move whole rows). With the CPU's FMA on, a
  code may land one level apart (at most 1e-3 of them), and the second
  step's parameter there moves by a step's share of that level: at most as
  many parameters, by at most the learning rate."""
  monkeypatch.setattr(mosaic_tpu, "LOOPS_IN_INTERPRET", True)
  shape = (256, 512)
  cfg = MosaicTPUConfig(128)
  assert mosaic_tpu.quantized_tiling(mosaic_tpu.quantized_view(shape), cfg, layout,
                                     ragged=False) == mosaic_tpu.BlockwiseTiling(128, 2, (2, 1))
  fmt = int4 if layout == "int4" else quantized
  p, g, mu, nu = bw.inputs(request, shape, layout, F32, F32)
  got = bw.steps("mosaic_tpu", p, g, mu, nu, config=cfg)
  want = bw.steps("xla", p, g, mu, nu)
  diff = np.abs(np.asarray(got[0]) - np.asarray(want[0]))
  apart = diff > 1e-6 * np.abs(np.asarray(want[0])) + 1e-7
  assert np.mean(apart) <= 1e-3 and diff.max() <= bw.HYPER["learning_rate"], (
      np.mean(apart), diff.max())
  for a, b, signed in ((got[1], want[1], True), (got[2], want[2], False)):
    np.testing.assert_allclose(a.scales, b.scales, rtol=4 * 2.0 ** -23)
    assert np.mean(np.asarray(a.codes) != np.asarray(b.codes)) <= 1e-3
    x, y = fmt.dequantize(a, signed=signed), fmt.dequantize(b, signed=signed)
    np.testing.assert_allclose(x, y, atol=0.3 * float(jnp.max(jnp.abs(y))))
