"""Adam on 4-bit moments (fuseopt.kernels.adam.int4): the Mosaic GPU kernel
(interpret mode on the CPU) against the reference, its configs, a skipped
step, and its lowering for an H200; the blockwise kernels (4-bit and 8-bit)
with a bf16 parameter's companion."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fuseopt import targets
from fuseopt.kernels import adam_update
from fuseopt.kernels import mantissa
from fuseopt.kernels.adam import int4
from fuseopt.kernels.adam import quantized
from tests.kernels import blockwise as bw
from tests.kernels import harness

F32, BF16 = jnp.float32, jnp.bfloat16
MGPU = "mosaic_gpu"


CASES = [  # shape, p dtype (None: direction only), g dtype, nesterov
    ((512,), F32, F32, False),
    ((3, 5, 256), BF16, F32, True),
    ((37, 512), F32, BF16, False),   # 74 rows: a ragged last program
    ((8, 256), None, F32, False),
    ((4, 8, 64), F32, F32, False),   # nnx-shaped: blocked over its last two axes
]


@pytest.mark.parametrize("shape,p_dtype,g_dtype,nesterov", CASES)
@pytest.mark.fma_off
def test_kernel_matches_reference(request, shape, p_dtype, g_dtype, nesterov):
  """Two steps: codes and scales bitwise the reference's (the same fp32
  operations on the same values, then the same hash on the same global
  index), the parameter within the few fp32 ulps two programs of Adam's
  division chain may differ by. Needs FMA off: in interpret mode XLA:CPU
  contracts the kernel body's unfenced ``b1 * mu + (1 - b1) * g`` into an
  FMA, which moves a block's absmax (its scale) by an ulp."""
  p, g, mu, nu = bw.inputs(request, shape, "int4", p_dtype, g_dtype)
  got = bw.steps(MGPU, p, g, mu, nu, nesterov=nesterov)
  want = bw.steps("xla", p, g, mu, nu, nesterov=nesterov)
  for a, b in zip(jax.tree.leaves(got[1:]), jax.tree.leaves(want[1:])):
    bw.same(a, b, f"moments {shape}")
  bw.params_close(got[0], want[0], f"params {shape}")


def test_runs_its_kernel_close_to_reference_with_fma(request, caplog):
  """No fallback: the Mosaic GPU kernel itself runs (in interpret mode, XLA's
  default FMA on), and lands near the reference: scales within a few fp32
  ulps (a contracted product in the moment update), the dequantised moments
  within one level of the codes where a moved scale tipped a rounding."""
  shape = (8, 512)
  p, g, mu, nu = bw.inputs(request, shape, "int4")
  fn = lambda p, g, mu, nu: adam_update(p, g, mu, nu, count=1, implementation=MGPU,
                                        interpret=True, **bw.HYPER)
  assert "fuseopt_adam_update_int4" in str(jax.make_jaxpr(fn)(p, g, mu, nu))
  with caplog.at_level("DEBUG", logger="fuseopt"):
    got = bw.steps(MGPU, p, g, mu, nu)
  assert "reference" not in caplog.text
  want = bw.steps("xla", p, g, mu, nu)
  bw.params_close(got[0], want[0], "params")
  for m, w, signed in ((got[1], want[1], True), (got[2], want[2], False)):
    s, t = np.asarray(m.scales), np.asarray(w.scales)
    np.testing.assert_allclose(s, t, rtol=2.0 ** -20, atol=0)
    a = np.asarray(int4.dequantize(m, signed=signed))
    b = np.asarray(int4.dequantize(w, signed=signed))
    # a level's width: (1/7)^2-spaced squares of mu's scale, (2k+1) s^2 for nu
    step = np.repeat(t, int4.BLOCK, axis=-1).reshape(shape)
    step = 0.3 * step if signed else 31.0 * step * step
    assert np.all(np.abs(a - b) <= step * (1 + 1e-5)), signed
    assert np.mean(np.asarray(m.codes) != np.asarray(w.codes)) < 0.01


@pytest.mark.parametrize("moments", ["int8", "int4"])
@pytest.mark.parametrize("companion", [jnp.int16, jnp.int8], ids=["int16", "int8"])
@pytest.mark.fma_off
def test_companion_matches_reference(request, caplog, moments, companion):
  """A bf16 leaf with its companion (mantissa tracking) on blockwise moments:
  the kernel itself runs (no fallback) and, two steps on, the bf16 half, the
  companion, the codes and the scales are the reference's bit for bit (the
  master is split to nearest, no seed: nothing left to an ulp of rounding)."""
  shape = (8, 512)
  k = jax.random.split(harness.fresh_key(request), 2)
  hi, lo = mantissa.split(jax.random.normal(k[0], shape), companion)
  g = jax.random.normal(k[1], shape)
  if moments == "int4":
    mu, nu = int4.zeros(shape), int4.zeros(shape)
  else:
    mu, nu = quantized.zeros(shape, signed=True), quantized.zeros(shape, signed=False)

  def steps(impl):
    f = jax.jit(lambda p, g, mu, nu, lo, c: adam_update(
        p, g, mu, nu, count=c, implementation=impl, interpret=True, params_lo=lo, **bw.HYPER))
    state = (hi, mu, nu, lo)
    for c in (1, 2):
      state = f(state[0], g * c, state[1], state[2], state[3], c)
    return state

  with caplog.at_level("DEBUG", logger="fuseopt"):
    got = steps(MGPU)
  assert "reference" not in caplog.text
  want = steps("xla")
  assert got[3].dtype == companion
  for a, b, what in zip(jax.tree.leaves(got), jax.tree.leaves(want),
                        ("p", "mu codes", "mu scales", "nu codes", "nu scales", "lo")):
    bw.same(a, b, f"{moments} moments, {jnp.dtype(companion)} companion: {what}")


def test_every_config_same_bits(request):
  """Every block config of the search space writes the same codes, scales
  and params (10 rows: a ragged last program from block 1024 up, one
  program holding only the rest at 4096)."""
  from fuseopt.kernels.adam import mosaic_gpu
  p, g, mu, nu = bw.inputs(request, (5, 512), "int4")
  outs = [bw.steps(MGPU, p, g, mu, nu, config=cfg) for cfg in mosaic_gpu.SEARCH_SPACE]
  for cfg, out in zip(mosaic_gpu.SEARCH_SPACE[1:], outs[1:]):
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(outs[0])):
      bw.same(a, b, str(cfg))


def test_a_skipped_step_keeps_codes_and_scales(request):
  """``apply=False``: the parameter, the code bytes and the scales come back
  bit for bit (requantising the stored moments would move a scale by an ulp
  and redraw codes)."""
  p, g, mu, nu = bw.inputs(request, (3, 512), "int4")
  got = adam_update(p, g, mu, nu, count=2, implementation=MGPU, interpret=True,
                    apply=jnp.asarray(False), **bw.HYPER)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves((p, mu, nu))):
    bw.same(a, b, "skipped")


@pytest.mark.skipif(targets.missing("h200") is not None, reason="the CUDA plugin is not installed")
def test_lowers_for_h200_in_place():
  """Lowered for an H200 on the CPU: a Mosaic GPU kernel, the parameter and
  the code bytes and scales aliased to the outputs (in place)."""
  s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt)
  shape = (64, 512)
  moment = int4.PackedMoment(s(int4.codes_shape(shape), jnp.uint8),
                             s(int4.scales_shape(shape), F32))
  mesh = jax.sharding.AbstractMesh((), (), abstract_device=jax.sharding.AbstractDevice(
      device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
  fn = lambda p, g, mu, nu: adam_update(p, g, mu, nu, count=3, implementation=MGPU)
  with jax.sharding.use_abstract_mesh(mesh):
    text = jax.jit(fn, donate_argnums=(0, 2, 3)).trace(
        s(shape, F32), s(shape, BF16), moment, moment).lower(
            lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text and "fuseopt_adam_update_int4" in text
  assert text.count("tf.aliasing_output") + text.count("output_operand_aliases") >= 1
