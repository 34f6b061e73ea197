"""The workload both the 2-process run and its single-process reference run."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import fuseopt.optim as fo

SHAPES = {"layers": (8, 32, 64), "head": (32, 64), "norm": (64,)}
SPECS = {"layers": P(None, "x", None), "head": P(None, "x"), "norm": P()}
DIMS = {"layers": fo.MuonDimensionNumbers(1, 2), "head": fo.MuonDimensionNumbers(0, 1),
        "norm": None}
STEPS = 3


def inputs():
  rng = np.random.default_rng(0)
  params = {n: (0.02 * rng.standard_normal(s)).astype(jnp.bfloat16) for n, s in SHAPES.items()}
  grads = [{n: rng.standard_normal(s).astype(jnp.bfloat16) for n, s in SHAPES.items()}
           for _ in range(STEPS)]
  return params, grads


def adamw_steps(params, grads):
  tx = fo.adamw(1e-2, weight_decay=0.1, seed=5, execution=fo.Execution(implementation="xla"))
  state = tx.init(params)
  update = jax.jit(lambda p, s, g: fo.step(tx, g, s, p))
  for g in grads:
    params, state = update(params, state, g)
  return params, state


def muon_steps(params, grads):
  tx = fo.muon(1e-2, muon_weight_dimension_numbers=DIMS, moment_dtype=jnp.bfloat16, execution=fo.Execution(implementation='xla'))
  state = tx.init(params)
  update = jax.jit(lambda p, s, g: fo.step(tx, g, s, p))
  for g in grads:
    params, state = update(params, state, g)
  return params
