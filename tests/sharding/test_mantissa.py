"""Mantissa-tracked bf16 parameters on a mesh: the companion is placed like
its parameter, and the sharded step is bitwise the unsharded one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import fuseopt.optim as fo

SHAPES = {"w": (64, 32), "stack": (2, 16, 24), "b": (32,)}
SPECS = {"w": P("fsdp", None), "stack": P(None, "fsdp", None), "b": P()}
DIMS = {"w": fo.MuonDimensionNumbers(0, 1), "stack": fo.MuonDimensionNumbers(1, 2), "b": None}
_STEPS = 3

FACTORIES = {
    "adamw": lambda shardings=None: fo.track_mantissa(fo.adamw(
        3e-3, weight_decay=0.1, execution=fo.Execution(shardings=shardings))),
    "muon": lambda shardings=None: fo.track_mantissa(fo.muon(
        2e-2, weight_decay=0.1, adam_weight_decay=0.1, muon_weight_dimension_numbers=DIMS,
        execution=fo.Execution(shardings=shardings)), owner="muon"),
}


def _tree(seed, dtype=jnp.bfloat16):
  k = jax.random.split(jax.random.key(seed), len(SHAPES))
  return {n: jax.random.normal(kk, s).astype(dtype) for kk, (n, s) in zip(k, sorted(SHAPES.items()))}


def _replay(tx, params, grads):
  """``jit(fo.step)`` over the gradients: every step's (params, state)."""
  run = jax.jit(lambda g, s, p: fo.step(tx, g, s, p))
  state, out = tx.init(params), []
  for g in grads:
    params, state = run(g, state, params)
    out.append((params, state))
  return out


def _spec(x):
  return x.sharding.spec if isinstance(x.sharding, NamedSharding) else None


@pytest.mark.parametrize("name", sorted(FACTORIES))
@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_companion_is_placed_like_its_param_and_the_step_is_bitwise(kind, name):
  grad_dtype = jnp.bfloat16   # what bf16 parameters give
  params = _tree(0)
  grads = [jax.tree.map(lambda x: x.astype(grad_dtype), _tree(t + 1)) for t in range(_STEPS)]
  want = _replay(FACTORIES[name](), params, grads)
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(kind,))
  sh = {n: NamedSharding(mesh, s) for n, s in SPECS.items()}
  put = lambda t: jax.tree.map(jax.device_put, t, sh)
  tx = FACTORIES[name](shardings=None if kind == AxisType.Explicit else sh)
  state = tx.init(put(params))
  for n, spec in SPECS.items():
    assert state.companion[n].sharding.is_equivalent_to(sh[n], len(SHAPES[n])), (n, _spec(
        state.companion[n]))
  got = _replay(tx, put(params), [put(g) for g in grads])
  for t, ((wp, ws), (gp, gs)) in enumerate(zip(want, got)):
    for n in SHAPES:
      assert gs.companion[n].sharding.is_equivalent_to(sh[n], len(SHAPES[n])), (t, n)
    wm, gm = fo.master_params(wp, ws), fo.master_params(gp, gs)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path((wp, wm, ws))[0],
                            jax.tree.leaves((gp, gm, gs))):
      what = f"step {t} {jax.tree_util.keystr(path)}"
      np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=what)
