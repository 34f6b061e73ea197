"""Triton kernels never touch memory past a ragged leaf's end.

jax 0.11.2's Triton lowering emits unmasked loads and stores for a block that
runs past its array (0.12 masks them): on an H200 the last program of a
ragged leaf wrote into the buffers XLA placed after it (NaN parameters,
stochastic rounding off its reference on the device). Interpret mode cannot
show it, so these tests read the Triton IR that Pallas lowers for the H200
(``pallas_call(debug=True)`` prints it) and require a mask on every load and
store of a block, on whichever jax is installed (both ends of the supported
range run this module).
"""

import contextlib
import io
import re

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from fuseopt import targets
from fuseopt.kernels import adam, stochastic_round
from fuseopt.kernels.adam import quantized
from fuseopt.kernels.adam.triton import TritonGroupConfig
from fuseopt.kernels.elementwise_tiling import TritonConfig

# A block access: ``tt.load %ptr[, %mask[, %other]] : tensor<...>`` or
# ``tt.store %ptr, %value[, %mask] : tensor<...>``; scalar accesses (the
# seeds and step scalars, always in range) are ``!tt.ptr`` without a tensor.
_LOAD = re.compile(r"tt\.load ((?:%[\w#]+(?:, )?)+) : tensor<")
_STORE = re.compile(r"tt\.store ((?:%[\w#]+(?:, )?)+) : tensor<")


def _triton_ir(fn, *structs) -> str:
  """The Triton IR of every kernel in ``jax.jit(fn)`` lowered for the H200."""
  original = pl.pallas_call
  buf = io.StringIO()
  try:
    pl.pallas_call = lambda *a, **k: original(*a, **{**k, "debug": True})
    with contextlib.redirect_stdout(buf), targets.lowering_for("h200"):
      jax.jit(fn).trace(*structs).lower(lowering_platforms=("cuda",))
  finally:
    pl.pallas_call = original
  return buf.getvalue()


def _accesses(ir: str):
  loads = [len(m.group(1).split(", ")) for m in _LOAD.finditer(ir)]
  stores = [len(m.group(1).split(", ")) for m in _STORE.finditer(ir)]
  return loads, stores


def _assert_masked(ir: str):
  loads, stores = _accesses(ir)
  assert stores, "no block store found in the Triton IR"
  assert all(n >= 2 for n in loads), f"unmasked block load: operand counts {loads}"
  assert all(n == 3 for n in stores), f"unmasked block store: operand counts {stores}"


f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
bf16 = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
HYPER = dict(count=3, learning_rate=1e-3, weight_decay=0.1, seed=5, implementation="triton")


def test_stochastic_round_ragged_is_masked():
  ir = _triton_ir(lambda x: stochastic_round.stochastic_round_bf16(
      x, 3, implementation="triton", config=TritonConfig(1024, 8)), f32(1000))
  _assert_masked(ir)


def test_stochastic_round_dividing_stays_plain():
  """A leaf the blocks divide keeps unmasked accesses on jax 0.11.2 (nothing
  to mask; the kernel's code unchanged). jax 0.12 masks every block itself."""
  if jax.__version_info__ >= (0, 12):
    pytest.skip("jax >= 0.12 masks every Triton block access itself")
  ir = _triton_ir(lambda x: stochastic_round.stochastic_round_bf16(
      x, 3, implementation="triton", config=TritonConfig(1024, 8)), f32(4096))
  loads, stores = _accesses(ir)
  assert stores and all(n == 2 for n in stores), stores


@pytest.mark.parametrize("apply", [True, False], ids=["apply", "direction"])
def test_adam_per_leaf_ragged_is_masked(apply):
  def fn(p, g, mu, nu):
    return adam.adam_update(p if apply else None, g, mu, nu, apply=apply,
                            config=TritonConfig(1024, 8), **HYPER)
  _assert_masked(_triton_ir(fn, f32(1001, 3), f32(1001, 3), bf16(1001, 3), bf16(1001, 3)))


def test_adam_group_ragged_is_masked():
  shapes = [(999, 7), (1025,), (13,)]   # every leaf ragged under block 1024

  def fn(ps, gs, mus, nus):
    return adam.adam_update_tree(ps, gs, mus, nus, group=True,
                                 config=TritonGroupConfig(1024, 8, 16), **HYPER)
  ir = _triton_ir(fn, [f32(*s) for s in shapes], [f32(*s) for s in shapes],
                  [bf16(*s) for s in shapes], [bf16(*s) for s in shapes])
  _assert_masked(ir)


def test_adam_int8_ragged_rows_are_masked():
  shape = (3, 5 * quantized.BLOCK)   # 15 quantisation rows, 4 a program
  codes = lambda dt: jax.ShapeDtypeStruct(shape, dt)
  scales = jax.ShapeDtypeStruct(quantized.scales_shape(shape), jnp.float32)

  def fn(p, g, muc, mus, nuc, nus):
    return adam.adam_update(p, g, quantized.QuantizedMoment(muc, mus),
                            quantized.QuantizedMoment(nuc, nus),
                            config=TritonConfig(1024, 8), **HYPER)
  ir = _triton_ir(fn, f32(*shape), f32(*shape), codes(jnp.int8), scales, codes(jnp.uint8), scales)
  _assert_masked(ir)
