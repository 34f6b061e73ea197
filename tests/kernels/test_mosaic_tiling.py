"""Mosaic TPU elementwise kernels on each leaf's own layout: the tiling's
rules, and bitwise equality with the reference and with the flat view on
ragged, 3-D and column-split leaves, edge blocks included."""

import math

import jax
import jax.numpy as jnp
import pytest

from fuseopt.kernels import elementwise_tiling as E
from fuseopt.kernels import adam as A
from fuseopt.kernels import adam_update, stochastic_round_bf16
from fuseopt.kernels import stochastic_round as sr
from tests.kernels import harness

F32, BF16 = jnp.float32, jnp.bfloat16
HYPER = dict(learning_rate=3e-3, b1=0.9, b2=0.999, eps=1e-8, eps_root=1e-12,
             weight_decay=0.1, seed=17, leaf_index=5)

# shape, config, the tiling without ragged edge blocks (Adam) and with them
# (stochastic rounding): (view, block)
CASES = [
    # ragged last dim: full-extent columns; rows a multiple of 8 dividing them
    ((40, 300), A.MosaicTPUConfig(16), ((40, 300), (8, 300)), ((40, 300), (8, 300))),
    # rows with no such divisor: the whole extent, or a ragged edge block
    ((50, 300), A.MosaicTPUConfig(16), ((50, 300), (50, 300)), ((50, 300), (8, 300))),
    # whole tiles per slab: leading dims merged into the rows; columns split
    ((4, 32, 256), A.MosaicTPUConfig(16), ((128, 256), (16, 128)), ((128, 256), (16, 128))),
    # rows not a multiple of 16: one slab a step, rows and columns split
    ((3, 40, 256), A.MosaicTPUConfig(16), ((3, 40, 256), (None, 8, 128)),
     ((3, 40, 256), (None, 8, 128))),
    # small slabs: several a step
    ((6, 5, 128), A.MosaicTPUConfig(64), ((6, 5, 128), (3, 5, 128)), ((6, 5, 128), (3, 5, 128))),
    # the whole leaf in one block
    ((37, 129), A.MosaicTPUConfig(512), ((37, 129), (37, 129)), ((37, 129), (37, 129))),
    # 1-D: flat lanes
    ((4096,), A.MosaicTPUConfig(16), ((32, 128), (16, 128)), ((32, 128), (16, 128))),
    # blocks of several chunks (E.CHUNK), a loop of 2 x 4 of them a step
    ((64, 2048), A.MosaicTPUConfig(512), ((64, 2048), (32, 2048)), ((64, 2048), (32, 2048))),
    # chunks and the rest: 40 rows (2 x 16 + 8), 1152 lanes (2 x 512 + 128);
    # 130 rows (8 x 16 + 2) by 1000 lanes (512 + 488), or stochastic
    # rounding's ragged blocks of 64 rows, the last padded
    ((40, 1152), A.MosaicTPUConfig(512), ((40, 1152), (40, 1152)), ((40, 1152), (40, 1152))),
    ((130, 1000), A.MosaicTPUConfig(512), ((130, 1000), (130, 1000)), ((130, 1000), (64, 1000))),
]
IDS = [f"{s}-{c.block_rows}" for s, c, _, _ in CASES]


def _inputs(key, shape, p_dtype, g_dtype, m_dtype):
  k = jax.random.split(key, 4)
  p = jax.random.normal(k[0], shape, F32).astype(p_dtype) if p_dtype else None
  g = jax.random.normal(k[1], shape, F32).astype(g_dtype)
  mu = (0.1 * jax.random.normal(k[2], shape, F32)).astype(m_dtype)
  nu = (0.1 * jax.random.uniform(k[3], shape, F32)).astype(m_dtype)
  return p, g, mu, nu


@pytest.mark.parametrize("shape,config,want,want_ragged", CASES, ids=IDS)
def test_tiling_keeps_the_layout_and_the_block_rules(shape, config, want, want_ragged):
  t = E.mosaic_tiling(shape, config, stream_bytes=4 + 4 + 2 + 2 + 4 + 2 + 2)
  assert (t.view, t.block) == want
  t = E.mosaic_tiling(shape, config, stream_bytes=4 + 2, ragged_edge=True)
  assert (t.view, t.block) == want_ragged


@pytest.mark.parametrize("shape", [(2048, 8192), (1000, 3001), (50257, 768), (8, 24, 256),
                                   (3, 5, 129), (4, 1000, 3001), (1, 4096), (2, 1000)], ids=str)
@pytest.mark.parametrize("config", sorted(set(A.mosaic_tpu.SEARCH_SPACE + sr.mosaic_tpu.SEARCH_SPACE),
                                          key=lambda c: c.block_rows), ids=str)
@pytest.mark.parametrize("stream_bytes,ragged_edge", [(28, False), (6, True)],
                         ids=["adam-fp32", "stochastic-round"])
def test_every_config_tiles_natively_within_vmem(shape, config, stream_bytes, ragged_edge):
  t = E.mosaic_tiling(shape, config, stream_bytes=stream_bytes, ragged_edge=ragged_edge)
  if t is None:
    # 50257 rows have no divisor that is a multiple of 8, and are too many
    # for one block; the flat rows neither.
    assert shape == (50257, 768) and not ragged_edge
    return
  *lead, r, c = shape
  assert t.view[-1] == c, "the last dim stays the lanes"
  assert t.view in ((math.prod(lead) * r, c), (math.prod(lead), r, c))
  if len(t.view) == 2 and lead:
    assert r % 16 == 0 or math.prod(lead) == 1, "merged rows must be whole tiles"
  *b_lead, br, bc = t.block
  assert bc == c or (bc % 128 == 0 and c % bc == 0)
  assert br == t.view[-2] or br % 8 == 0
  if not ragged_edge:
    assert t.view[-2] % br == 0 and all(d % (b or 1) == 0 for d, b in zip(t.view, b_lead))
  padded = math.prod(b or 1 for b in b_lead) * -(-br // 8) * 8 * -(-bc // 128) * 128
  assert 2 * stream_bytes * padded <= E.MOSAIC_VMEM_BYTES


def test_tiling_falls_back_to_flat_lanes_or_none():
  cfg = A.MosaicTPUConfig(512)
  # 16 rows of a 100k-wide ragged last dim overflow VMEM: flat lanes if they exist
  assert E.mosaic_tiling((1024, 100_001), cfg, stream_bytes=28).view == (800_008, 128)
  assert E.mosaic_tiling((16, 100_001), cfg, stream_bytes=28) is None
  # a last dim under 128 lanes (stored last-dim-major by XLA on TPU): flat
  assert E.mosaic_tiling((16, 64), cfg, stream_bytes=28).view == (8, 128)
  assert E.mosaic_tiling((6, 10), cfg, stream_bytes=28) is None
  # split columns keep a wide last dim that is a multiple of 128 native
  assert E.mosaic_tiling((16, 1_000_064), cfg, stream_bytes=28).view == (16, 1_000_064)
  assert E.mosaic_tiling((7,), cfg, stream_bytes=28) is None
  assert E.mosaic_tiling((), cfg, stream_bytes=28) is None
  assert E.mosaic_tiling((0, 128), cfg, stream_bytes=28) is None


@pytest.mark.parametrize("shape,config,want,want_ragged", CASES, ids=IDS)
@pytest.mark.parametrize("dtypes", [(F32, F32, BF16), (BF16, BF16, F32), (None, F32, BF16)],
                         ids=["pf32-gf32-mbf16", "pbf16-gbf16-mf32", "direction-gf32-mbf16"])
@pytest.mark.fma_off
def test_adam_native_tiling_is_bitwise_the_reference_and_the_flat_view(shape, config, want,
                                                                       want_ragged, dtypes):
  p, g, mu, nu = _inputs(jax.random.key(sum(shape)), shape, *dtypes)
  run = jax.jit(lambda p, g, mu, nu, impl, cfg: adam_update(
      p, g, mu, nu, count=jnp.int32(7), implementation=impl, interpret=True, config=cfg,
      **HYPER), static_argnames=("impl", "cfg"))
  got = run(p, g, mu, nu, "mosaic_tpu", config)
  want_ref = run(p, g, mu, nu, "xla", None)
  flat = lambda a: None if a is None else a.reshape(-1)
  # The flat (rows, 128) view: the kernel's tiling before it kept the layout.
  want_flat = run(flat(p), flat(g), flat(mu), flat(nu), "mosaic_tpu", A.MosaicTPUConfig(16))
  for i, (a, b, c) in enumerate(zip(got, want_ref, want_flat)):
    harness.assert_bitwise_equal(a, b, f"{shape} out {i} vs reference")
    harness.assert_bitwise_equal(a.reshape(-1), c, f"{shape} out {i} vs flat view")


@pytest.mark.parametrize("shape,config,want,want_ragged", CASES, ids=IDS)
def test_stochastic_round_native_tiling_is_bitwise_the_reference(shape, config, want,
                                                                 want_ragged):
  x = jax.random.normal(jax.random.key(sum(shape) + 1), shape, F32) * 10.0
  f = jax.jit(lambda x, o: stochastic_round_bf16(x, 9, offset=o, implementation="mosaic_tpu",
                                                 interpret=True, config=config))
  got = f(x, jnp.uint32(123))
  harness.assert_bitwise_equal(got, sr.stochastic_round_reference(x, 9, offset=123), str(shape))
  if x.size % 128 == 0:
    harness.assert_bitwise_equal(got.reshape(-1), f(x.reshape(-1), jnp.uint32(123)), "flat")


@pytest.mark.parametrize("target", harness.targets_for("mosaic_tpu"), ids=lambda t: t.name)
def test_native_tilings_lower_for_tpu(target):
  s = jax.ShapeDtypeStruct
  for shape, config, *_ in CASES + [((1000, 3001), None), ((4, 1000, 3001), None)]:
    harness.lower_for(target, lambda p, g, m, v, config=config: adam_update(
        p, g, m, v, count=3, implementation="mosaic_tpu", config=config),
        s(shape, F32), s(shape, F32), s(shape, BF16), s(shape, BF16))
    harness.lower_for(target, lambda x, config=config: stochastic_round_bf16(
        x, 3, implementation="mosaic_tpu", config=config), s(shape, F32))


@pytest.mark.parametrize("shape,config,want,want_ragged", CASES, ids=IDS)
@pytest.mark.parametrize("unrolled", [False, True], ids=["loop", "unrolled"])
def test_chunks_cover_the_block_with_their_flat_indices(shape, config, want, want_ragged,
                                                        unrolled):
  """Every element of every grid step is written once, by the chunk that
  holds it, with its flat index in the whole view: the chunks' loop (the
  compiled kernels') and the static chunks (interpret mode's) alike."""
  from jax.experimental import pallas as pl
  from fuseopt.kernels import interpret
  t = E.mosaic_tiling(shape, config, stream_bytes=6, ragged_edge=True)

  def kernel(o_ref):
    def chunk(view, index):
      view(o_ref)[...] = view(o_ref)[...] + index.astype(jnp.int32) + 1
    o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
    t.for_each_chunk(chunk, unrolled=unrolled)

  got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(t.view, jnp.int32), grid=t.grid,
                       out_specs=t.spec(), interpret=interpret.tpu_params())()
  want_index = jnp.arange(math.prod(t.view), dtype=jnp.int32).reshape(t.view) + 1
  harness.assert_bitwise_equal(got, want_index, str(shape))
