"""Muon and NorMuon take a leaf's matrix axes in any order.

For every axis order (2-D and 3-D leaves: reduction and output axes in
either order, the batch axis anywhere), aspect ratio and Newton–Schulz dtype,
the update runs under ``jit`` (on the CPU too: a bf16 product XLA:CPU cannot
run used to crash PyTorch's (out, in) layout) and is the update of the leaf
transposed to the standard (batch, reduction, output) order, transposed back.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import fuseopt.optim as fo
from tests.properties.strategies import MEDIUM

MDN = fo.MuonDimensionNumbers
SIDES = (8, 16, 24)     # aspect ratios 1/3 to 3, compiled once per shape
ORDERS_2D = ((0, 1), (1, 0))
ORDERS_3D = tuple(p for p in itertools.permutations(range(3), 2))


@st.composite
def layouts(draw):
  """(shape, reduction axis, output axis) of a 2-D or 3-D leaf."""
  rows, cols = draw(st.sampled_from(SIDES)), draw(st.sampled_from(SIDES))
  if draw(st.booleans()):
    red, out = draw(st.sampled_from(ORDERS_2D))
    shape = [0, 0]
  else:
    red, out = draw(st.sampled_from(ORDERS_3D))
    shape = [2, 2, 2]
  shape[red], shape[out] = rows, cols
  return tuple(shape), red, out


def _update(make, leaf, grad, dims, ns_dtype):
  tx = make(0.02, muon_weight_dimension_numbers={"w": dims}, execution=fo.Execution(newton_schulz=fo.NewtonSchulz(dtype=ns_dtype)))
  u, _ = jax.jit(tx.update)({"w": grad}, tx.init({"w": leaf}), {"w": leaf})
  return np.asarray(u["w"])


@MEDIUM
@given(layout=layouts(), make=st.sampled_from([fo.muon, fo.normuon]),
       ns_dtype=st.sampled_from(["bfloat16", "float32"]), seed=st.integers(0, 2**31 - 1))
def test_any_axis_order_runs_under_jit_and_is_the_standard_update_transposed(
    layout, make, ns_dtype, seed):
  shape, red, out = layout
  k1, k2 = jax.random.split(jax.random.key(seed))
  leaf = jax.random.normal(k1, shape) * 0.1
  grad = jax.random.normal(k2, shape)
  got = _update(make, leaf, grad, MDN(red, out), ns_dtype)
  assert got.shape == shape and np.isfinite(got).all()

  batch = tuple(a for a in range(len(shape)) if a not in (red, out))
  perm = batch + (red, out)
  std_dims = MDN(len(batch), len(batch) + 1)
  want = _update(make, jnp.transpose(leaf, perm), jnp.transpose(grad, perm), std_dims, ns_dtype)
  want = np.transpose(want, np.argsort(perm))
  # bf16 iterates may round an element differently in the two layouts.
  tol = (0.02 if ns_dtype == "bfloat16" else 1e-4) * float(np.abs(want).max())
  np.testing.assert_allclose(got, want, rtol=0, atol=tol)
