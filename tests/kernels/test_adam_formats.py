"""The moment format as a type (fuseopt/kernels/adam/formats.py): what each
format says about a leaf, and one driver for both (a tree mixing the formats
runs each leaf as it runs alone)."""

import jax
import jax.numpy as jnp
import numpy as np

from fuseopt.kernels import adam
from fuseopt.kernels.adam import blocks, formats, int4, quantized
from tests.kernels.harness import assert_bitwise_equal


def test_each_moment_has_its_format():
  dense = jnp.zeros((4, 256), jnp.bfloat16)
  q = quantized.zeros((4, 256), signed=True)
  assert formats.of(dense) is formats.DENSE and formats.of(q) is formats.INT8
  assert formats.INT8.quantized and not formats.DENSE.quantized
  assert formats.DENSE.signature(dense) == jnp.dtype(jnp.bfloat16)
  assert formats.INT8.signature(q) == "int8"


def test_fits_says_whether_a_leaf_and_its_shards_keep_whole_blocks():
  assert formats.DENSE.fits((3, 5))
  assert formats.INT8.fits((8, 512)) and formats.INT4.fits((8, 512))
  # Blocks over the trailing axes where the last does not divide (nnx q/k/v).
  assert formats.INT8.fits((8, 128)) and formats.INT8.fits((16, 32, 64))
  assert blocks.trailing_axes((16, 32, 64)) == 2 and blocks.trailing_axes((4, 512)) == 1
  assert quantized.scales_shape((16, 32, 64)) == (16, 8)
  assert int4.codes_shape((16, 32, 64)) == (16, 32, 32) and int4.scales_shape((16, 32, 64)) == (16, 16)
  assert not formats.INT8.fits((8, 300)) and not formats.INT4.fits((8, 300))
  assert formats.INT8.fits((512, 3)) and not formats.INT4.fits((512, 3))   # an odd last axis
  # A shard keeps whole rows: the group's inner axes whole, its first one's shard whole rows.
  assert formats.INT8.shard_fits((16, 32, 64), (16, 8, 64))
  assert not formats.INT8.shard_fits((16, 32, 64), (16, 2, 64))
  assert not formats.INT4.shard_fits((16, 32, 64), (16, 32, 32))
  assert formats.INT8.shard_fits((8, 1024), (2, 1024)) and formats.INT8.shard_fits((8, 1024), (8, 256))
  assert not formats.INT8.shard_fits((8, 1024), (8, 128))


def test_kernel_layout_round_trips_and_specs_follow_the_leaf():
  q = quantized.QuantizedMoment(jnp.arange(2 * 512, dtype=jnp.int32).astype(jnp.int8)
                                .reshape(2, 512), jnp.arange(4, dtype=jnp.float32).reshape(2, 2))
  flat = formats.INT8.kernel_layout(q)
  assert flat.codes.shape == (4, quantized.BLOCK) and flat.scales.shape == (4,)
  back = formats.INT8.restore(flat, q)
  np.testing.assert_array_equal(back.codes, q.codes)
  np.testing.assert_array_equal(back.scales, q.scales)
  d = jnp.ones((3, 5))
  assert formats.DENSE.kernel_layout(d).shape == (15,)
  assert formats.DENSE.restore(formats.DENSE.kernel_layout(d), d).shape == (3, 5)
  spec = jax.sharding.PartitionSpec("x", None)
  assert formats.INT8.spec(spec, (2, 512)) == quantized.QuantizedMoment(spec, spec)
  assert formats.DENSE.spec(spec, (2, 512)) == spec
  P = jax.sharding.PartitionSpec
  # The scales of a leaf blocked over its trailing axes: its blocked view's spec.
  assert formats.INT4.spec(P(None, "x", None), (16, 32, 64)) == int4.PackedMoment(
      P(None, "x", None), P(None, "x"))
  p4 = int4.PackedMoment(jnp.zeros((16, 32, 32), jnp.uint8), jnp.zeros((16, 16), jnp.float32))
  rows = formats.INT4.kernel_layout(p4)
  assert rows.codes.shape == (128, int4.BLOCK) and rows.scales.shape == (128, 2)
  assert formats.INT4.restore(rows, p4).codes.shape == (16, 32, 32)


def test_a_tree_of_both_formats_runs_each_leaf_as_alone():
  """One call of adam_update_tree over dense and 8-bit leaves gives each leaf
  the bits of its own single-leaf call (the reference: the driver, not a
  kernel body, is under test)."""
  k = jax.random.split(jax.random.key(0), 6)
  shapes = [(4, 256), (7,), (2, 512)]
  ps = [jax.random.normal(k[i], s) for i, s in enumerate(shapes)]
  gs = [jax.random.normal(k[3 + i], s) for i, s in enumerate(shapes)]
  mus = [quantized.zeros(shapes[0], signed=True), jnp.zeros(shapes[1], jnp.bfloat16),
         quantized.zeros(shapes[2], signed=True)]
  nus = [quantized.zeros(shapes[0], signed=False), jnp.zeros(shapes[1], jnp.bfloat16),
         quantized.zeros(shapes[2], signed=False)]
  kw = dict(count=2, learning_rate=1e-2, weight_decay=0.1, implementation="xla", seed=5)
  out, mu, nu = jax.jit(lambda *a: adam.adam_update_tree(*a, **kw))(ps, gs, mus, nus)
  for i in range(3):
    one = jax.jit(lambda *a, i=i: adam.adam_update(*a, leaf_index=i, **kw))(
        ps[i], gs[i], mus[i], nus[i])
    for got, want in zip(jax.tree.leaves((out[i], mu[i], nu[i])), jax.tree.leaves(one)):
      if jnp.issubdtype(got.dtype, jnp.integer):   # 8-bit codes
        np.testing.assert_array_equal(got, want, f"leaf {i}")
      else:
        assert_bitwise_equal(got, want, f"leaf {i}")


def test_leaf_layout_is_flat_or_whole_block_rows():
  a = jnp.ones((4, 512))
  assert formats.DENSE.leaf_layout(a).shape == (2048,)
  assert formats.INT8.leaf_layout(a).shape == (8, quantized.BLOCK)


def test_integral_codes_convert_exactly():
  # blocks.integral_to_int32: the codes' conversion, -0.0 and both ends included.
  y = jnp.array([-127.0, -1.0, -0.0, 0.0, 1.0, 127.0, 255.0, 2.0**22 - 1, -(2.0**22) + 1])
  np.testing.assert_array_equal(np.asarray(blocks.integral_to_int32(y)),
                                np.asarray(y).astype(np.int32))


def test_top_code_stays_the_top_with_the_largest_uniform():
  # A stochastic code floor(y + u): with every hash bit set, u is the largest
  # uniform, and the element at its block's maximum (y = 127, t = 16) keeps
  # the top code (a 24-bit u would round 127 + u to 128: an int8 -128).
  ones = jnp.full((2, quantized.BLOCK), 0xFFFFFFFF, jnp.uint32)
  x = jnp.tile(jnp.array([[0.3], [-0.7]], jnp.float32), (1, quantized.BLOCK))
  codes, _ = quantized.quantize_mu(x, ones)
  np.testing.assert_array_equal(np.asarray(codes[:, 0]), [127, -127])
  assert int(jnp.max(codes)) == 127 and int(jnp.min(codes)) == -127
  x = jnp.full((2, int4.BLOCK), 0.25, jnp.float32)
  codes, _ = int4.quantize_nu(x, jnp.full(x.shape, 0xFFFFFFFF, jnp.uint32))
  assert int(jnp.max(codes)) == int4.NU_LEVELS - 1 and int(jnp.min(codes)) == int4.NU_LEVELS - 1
