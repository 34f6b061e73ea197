"""Every Pallas kernel declares its cost (``cost_estimate=``), so that XLA's
cost analysis (and a TPU's ``optimal_seconds``) count it."""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

from fuseopt import kernels
from fuseopt.kernels.adam import math as _backend

IMPLS = ("triton", "mosaic_tpu")


@pytest.fixture
def estimates(monkeypatch):
  seen = []
  real = pl.pallas_call

  def spy(*args, **kwargs):
    seen.append((kwargs.get("name"), kwargs.get("cost_estimate")))
    return real(*args, **kwargs)
  monkeypatch.setattr(pl, "pallas_call", spy)
  return seen


def _traced(fn, *args):
  jax.eval_shape(fn, *args)


@pytest.mark.parametrize("impl", IMPLS)
def test_elementwise_kernels_declare_flops_and_compulsory_bytes(estimates, impl):
  n = 4096
  p = g = jax.ShapeDtypeStruct((8, n // 8), jnp.float32)
  m = v = jax.ShapeDtypeStruct((8, n // 8), jnp.bfloat16)
  _traced(lambda x: kernels.stochastic_round_bf16(x, 7, implementation=impl, interpret=True), p)
  _traced(lambda p, g, m, v: kernels.adam_update(p, g, m, v, count=1, learning_rate=1e-3,
                                                 implementation=impl, interpret=True), p, g, m, v)
  (sr_name, sr), (adam_name, adam) = estimates
  assert sr_name == "fuseopt_stochastic_round" and adam_name == "fuseopt_adam_update"
  assert sr.bytes_accessed == n * (4 + 2) and sr.flops == 0
  # fp32 p, g and bf16 moments: 20 bytes per parameter, read and written once.
  assert adam.bytes_accessed == 20 * n
  assert adam.flops == n * _backend.ADAM_FLOPS_PER_ELEMENT and adam.transcendentals == n


def test_grouped_adam_kernel_counts_every_leaf(estimates):
  shapes = [(64, 32), (128,), (32, 8)]
  ps = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
  ms = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]
  _traced(lambda ps, gs, mus, nus: kernels.adam_update_tree(
      ps, gs, mus, nus, count=1, learning_rate=1e-3, implementation="triton", interpret=True,
      group=True), ps, ps, ms, ms)
  n = sum(a.size for a in ps)
  ((name, est),) = estimates
  assert name == "fuseopt_adam_update_group"
  assert est.bytes_accessed == 20 * n and est.flops == n * _backend.ADAM_FLOPS_PER_ELEMENT


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("path", ["fused", "tiled"])
def test_newton_schulz_kernels_declare_their_products(estimates, impl, path):
  b, m, n = 2, 512, 1024   # multiples of every default block: no padding
  x = jax.ShapeDtypeStruct((b, m, n), jnp.float32)
  if path == "fused":
    config = kernels.FusedTritonConfig() if impl == "triton" else kernels.FusedMosaicTPUConfig()
  else:
    update = kernels.GemmTritonConfig() if impl == "triton" else kernels.GemmMosaicTPUConfig()
    config = kernels.TiledConfig(matmul=update)
  _traced(lambda x: kernels.newton_schulz(x, coeffs="jordan", steps=5, implementation=impl,
                                          interpret=True, config=config), x)
  assert estimates and all(est is not None for _, est in estimates), estimates
  flops = sum(est.flops for _, est in estimates)
  # At least the symmetric count (3m²n + m³ a step), at most the dense one
  # (4m²n + 2m³) plus epilogues and the padding of the tiles.
  assert kernels.ns_flops(m, n, 5, symmetric=True) * b <= flops
  assert flops <= 1.2 * kernels.ns_flops(m, n, 5) * b
  assert all(est.bytes_accessed >= b * m * n * 2 for _, est in estimates)
