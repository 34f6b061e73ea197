"""Muon on a mesh of devices: where the Newton–Schulz runs and what it moves.

One Muon step (``tx.update`` + ``apply_updates``; params and state donated)
of a family of 16 same-shaped matrices stored stacked, plus one single matrix
of another shape, on a 1-D FSDP mesh over every local device (8 emulated CPU
devices in the tests and ``fuseopt bench`` on the CPU; the case is skipped on
one device):

- ``optax_muon[gspmd]`` (baseline): ``optax.contrib.muon`` on FSDP-sharded
  params (rows of each matrix over the mesh): XLA partitions the
  iteration, with collectives inside every NS step;
- ``optax_muon[replicated]``: the same with replicated params: every device
  orthogonalises every matrix;
- ``fuseopt_muon[all_to_all]``: :func:`fuseopt.optim.muon` on the same FSDP
  params (``shardings=``): each device orthogonalises 1/N of the matrices,
  whole, after one all-to-all, and sends them back with another.

Besides time, the figures that tell the three apart come from the compiled
per-device program: ``collectives`` and ``collective_bytes``
(:func:`fuseopt.benchmarks.core.collective_stats`) and ``cost_flops``.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from fuseopt.benchmarks import core
from fuseopt.benchmarks.core import Case
from fuseopt.kernels.newton_schulz.coefficients import JORDAN
from fuseopt.optim import muon_transforms as fmuon

LR = 0.02
FAMILY = 16


def _shapes(size: str, platform: str) -> dict:
  if platform in ("gpu", "tpu"):
    m = 2048
  else:
    m = 256 if size == "full" else 128
  return {"layers": (FAMILY, m, m), "head": (m, 2 * m)}


DIMS = {"layers": fmuon.MuonDimensionNumbers(1, 2), "head": fmuon.MuonDimensionNumbers(0, 1)}
FSDP = {"layers": P(None, "fsdp", None), "head": P("fsdp", None)}
REPLICATED = {"layers": P(), "head": P()}


def _step(tx):
  def step(params, grads, state):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return jax.jit(step, donate_argnums=(0, 2))


def cases(size: str, platform: str):
  n = len(jax.devices())
  if n < 2:
    return []
  mesh = jax.make_mesh((n,), ("fsdp",), axis_types=(AxisType.Auto,))
  shapes = _shapes(size, platform)
  fsdp = {k: NamedSharding(mesh, s) for k, s in FSDP.items()}
  replicated = {k: NamedSharding(mesh, s) for k, s in REPLICATED.items()}
  optax_tx = optax.contrib.muon(learning_rate=LR, ns_coeffs=JORDAN,
                                muon_weight_dimension_numbers=DIMS)
  variants_spec = {
      "optax_muon[gspmd]": (optax_tx, fsdp),
      "optax_muon[replicated]": (optax_tx, replicated),
      "fuseopt_muon[all_to_all]": (fmuon.muon(LR, ns_coeffs="jordan", muon_weight_dimension_numbers=DIMS, execution=fmuon.Execution(shardings=fsdp)), fsdp),
  }
  cache = {}

  def data():
    if not cache:
      rng = np.random.default_rng(0)
      cache["params"] = {k: (0.02 * rng.standard_normal(s)).astype(np.float32)
                         for k, s in shapes.items()}
      cache["grads"] = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    return cache["params"], cache["grads"]

  def variant(label):
    def build():
      tx, where = variants_spec[label]
      params, grads = data()
      put = lambda t: {k: jax.device_put(v, where[k]) for k, v in t.items()}
      g = put(grads)

      def refresh():
        p = put(params)
        return p, g, tx.init(p)
      return _step(tx), refresh(), refresh
    return build

  def check(outs):
    params, _ = data()
    delta = {k: jax.tree.map(lambda a, b: a - b, v[0], params) for k, v in outs.items()}
    # fuseopt iterates in bf16, optax in fp32 here: a few percent.
    return core.checks_against(delta, "optax_muon[replicated]", tol=0.1)

  params = int(sum(np.prod(s) for s in shapes.values()))
  m = shapes["layers"][1]
  return [Case(op="sharded_muon", name=f"{n}dev_{FAMILY}x{m}x{m}+{m}x{2 * m}",
               variants={k: variant(k) for k in variants_spec}, baseline="optax_muon[gspmd]",
               params=params, check=check)]
