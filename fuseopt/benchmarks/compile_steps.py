"""The steps the compile tier compiles: the hybrid Muon + AdamW recipe of the sharded and scale
cases, and a sharded step's arguments placed as a user places them (the
optimizer state like the parameters, :func:`shard_like_params`). Shared by
:mod:`.compile_cases` and :mod:`.scale`, below both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fuseopt import targets as targets_lib
from fuseopt.benchmarks.user_step import step_fn

BF16 = jnp.dtype(jnp.bfloat16)


FSDP_AXIS = "fsdp"


def fsdp_spec(x):
  """FSDP over 8: rows sharded where they divide by 8, else replicated."""
  P = jax.sharding.PartitionSpec
  if len(x.shape) >= 2 and x.shape[0] % 8 == 0:
    return P(FSDP_AXIS, *([None] * (len(x.shape) - 1)))
  return P()


def hybrid_tx(variant: str, shardings=None, dims=None, newton_schulz=None, **options):
  """The hybrid Muon + AdamW recipe of the sharded cases: fuseopt's (bf16
  AdamW moments, Jordan's coefficients; ``shardings`` on an Auto mesh;
  ``newton_schulz`` the :class:`~fuseopt.optim.NewtonSchulz` settings of its
  ``Execution``, ``options`` of :func:`fuseopt.optim.muon`) or optax's ``contrib.muon`` on
  the same split (``dims``: the Muon dimension numbers, the 1.2 B tree's by
  default)."""
  import optax

  import fuseopt.optim as fo
  from fuseopt.benchmarks.cases import muon as muon_cases
  dims = dims or muon_cases.muon_dims
  if variant == "optax":
    return optax.contrib.muon(0.02, ns_coeffs=muon_cases.COEFFS, weight_decay=0.1,
                              adam_weight_decay=0.1, muon_weight_dimension_numbers=dims)
  return fo.muon(0.02, ns_coeffs="jordan", weight_decay=0.1, adam_weight_decay=0.1,
                 muon_weight_dimension_numbers=dims,
                 execution=fo.Execution(shardings=shardings, newton_schulz=newton_schulz),
                 **options)


def sharded_step_args(t, tx, tree, shardings, *, fused: bool):
  """``(step, (params, state, grads), donate)`` of one sharded step: params
  and grads placed by ``shardings``, the state placed like the params
  (:func:`shard_like_params`), params and state donated: the program a user
  runs."""
  placed = targets_lib.avals(t, tree, shardings)
  state = jax.eval_shape(tx.init, placed)
  mesh = jax.tree.leaves(shardings)[0].mesh
  return step_fn(tx, fused), (placed, shard_like_params(state, placed, mesh), placed), (0, 1)


def shard_like_params(state, params, mesh):
  """``state`` (``jax.eval_shape(tx.init, params)``) placed as a user places
  it: like the parameters.

  On an Explicit mesh ``eval_shape`` already gives every state leaf its
  sharding; on Auto axes it gives none, and placing those structs replicated
  would compile a step whose optimizer state arrives whole on every device
  (and cannot be donated into the sharded output). A state leaf found under a
  parameter's key path (Adam's moments, Muon's momentum, a mantissa
  companion, inside any ``optax.chain``/``partition`` wrapper) takes that
  parameter's spec, keeping only the entries whose dimension is the
  parameter's (a per-neuron moment's reduced axis is replicated); anything
  else (counts, coefficient tables) is replicated.
  """
  P, NamedSharding = jax.sharding.PartitionSpec, jax.sharding.NamedSharding
  rep = NamedSharding(mesh, P())
  by_path = {}
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    spec = x.sharding.spec if isinstance(getattr(x, "sharding", None), NamedSharding) else P()
    by_path[tuple(str(k) for k in path)] = (tuple(x.shape), spec)

  def spec_for(path, x):
    keys = tuple(str(k) for k in path)
    keys = keys[:-1] if keys[-1:] in ((".codes",), (".scales",)) else keys  # 8-bit moments
    for j in range(len(keys)):
      if keys[j:] in by_path:
        shape, spec = by_path[keys[j:]]
        if len(shape) != len(x.shape):
          return P()
        spec = tuple(spec) + (None,) * (len(shape) - len(spec))
        return P(*[e if a == b else None for e, a, b in zip(spec, x.shape, shape)])
    return P()

  def one(path, x):
    if not isinstance(x, jax.ShapeDtypeStruct):
      return x
    s = x.sharding
    if not isinstance(s, NamedSharding) or not any(s.spec):
      s = NamedSharding(mesh, spec_for(path, x)) if x.shape else rep
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
  return jax.tree_util.tree_map_with_path(one, state)
