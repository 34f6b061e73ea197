"""NorMuon on a multi-device mesh: its per-neuron statistics are computed
where each matrix is whole, so the sharded step is the unsharded step's."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import fuseopt.optim as fo
from tests.sharding.test_muon import FAMILY_SHAPES, _replay, _tree

_STEPS = 4


@pytest.fixture(scope="module")
def normuon_run():
  params = _tree(0, FAMILY_SHAPES)
  grads = [_tree(10 + t, FAMILY_SHAPES) for t in range(_STEPS)]
  return params, grads, _replay(fo.normuon(1e-2, weight_decay=0.1), params, grads)


@pytest.mark.parametrize("axis", [0, 1], ids=["rows", "cols"])
@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_sharded_normuon_step_is_bitwise_the_unsharded_step(normuon_run, kind, axis):
  """FSDP on the reduction axis (rows: the column sums cross devices) or on
  the output axis (cols: the neurons do): params, momentum and the per-neuron
  second moments equal the one-device step's bit for bit, every step."""
  params, grads, want = normuon_run
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(kind,))
  matrix = P("fsdp", None) if axis == 0 else P(None, "fsdp")
  sh = {n: NamedSharding(mesh, matrix if len(s) == 2 else P()) for n, s in FAMILY_SHAPES.items()}
  put = lambda t: jax.tree.map(jax.device_put, t, sh)
  tx = fo.normuon(1e-2, weight_decay=0.1, execution=fo.Execution(shardings=None if kind == AxisType.Explicit else sh))
  got = _replay(tx, put(params), [put(g) for g in grads])
  for t, (w, g) in enumerate(zip(want, got)):
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(w)[0], jax.tree.leaves(g)):
      np.testing.assert_array_equal(np.asarray(b), np.asarray(a),
                                    err_msg=f"step {t} {jax.tree_util.keystr(path)}")
