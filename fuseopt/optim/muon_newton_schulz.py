"""The Newton-Schulz stage of Muon's step: a plan's calls run, and the
iteration on one ``(batch, rows, cols)`` stack.

:func:`run_call` runs one call of a :class:`~fuseopt.optim.muon_plan.MuonPlan`
where the plan placed it: a batched call joins its ranges of same-shaped
matrices along the batch (the one batching loop) and cuts the result back;
an all-to-all call hands its leaves to the plan's distributed placement.
:func:`newton_schulz_stack` is the iteration itself: the kernel, and optax's
iteration for what the kernel does not cover (the coefficients come
resolved from :func:`fuseopt.kernels.newton_schulz.coefficients.muon_coefficients`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fuseopt import kernels
from fuseopt.kernels import sharding as kernel_sharding
from fuseopt.optim import _checks
from fuseopt.optim.dtypes import KERNEL_DTYPES


__all__ = ["NS_STEPS", "PRECONDITIONINGS", "concat", "newton_schulz_stack", "optax_newton_schulz",
           "replicated", "run_call"]

# optax's preconditionings of the iteration; the kernels take "frobenius".
PRECONDITIONINGS = ("frobenius", "spectral", "aol", "schatten")
# The default of ns_steps (5, optax's): not an int, so that
# optax.inject_hyperparams leaves it static (see _checks.StaticDefault).
NS_STEPS = _checks.StaticDefault(5)


def optax_newton_schulz(x, table, preconditioning, eps):
  """optax.contrib's Newton-Schulz iteration on one ``(rows, cols)`` matrix,
  in ``x``'s dtype (Jordan 2024; AOL preconditioning: Boissin et al. 2025,
  arXiv 2512.04632; Schatten-4 rescaling: Grishina et al. 2025, arXiv
  2506.10935): the same expressions in the same order as optax 0.2.8's
  ``orthogonalize_via_newton_schulz``, for what the kernel does not cover."""
  def base(x, c):
    a = x @ x.T.conj()
    b = c[1] * a + c[2] * a @ a
    return c[0] * x + b @ x

  def aol_first(x, c):
    a = x @ x.T.conj()
    s = jnp.expand_dims(jax.lax.rsqrt(jnp.clip(jnp.abs(a).sum(axis=-1), min=1e-8)), -1)
    x, a = x * s, a * s * s.transpose(-1, -2)
    b = c[1] * a + c[2] * a @ a
    return c[0] * x + b @ x

  def schatten_first(x, c):
    a = x @ x.T
    s = jnp.expand_dims(jax.lax.rsqrt(jnp.clip(jnp.linalg.norm(a, ord="fro", axis=(-2, -1)),
                                               min=1e-8)), (0, -1))
    x, a = x * s, a * s ** 2
    b = c[1] * a + c[2] * a @ a
    return c[0] * x + b @ x

  transposed = x.shape[0] > x.shape[1]
  if transposed:
    x = x.T
  if preconditioning == "frobenius":
    x /= jnp.linalg.norm(x, ord="fro") + eps
  elif preconditioning == "spectral":
    # The SVD behind ord=2 takes no bf16/f16 (jnp.linalg raises): the norm is
    # taken in fp32, the division stays in the iteration's dtype.
    wide = jnp.promote_types(x.dtype, jnp.float32)
    x /= (jnp.linalg.norm(x.astype(wide), ord=2) + eps).astype(x.dtype)
  first = {"aol": aol_first, "schatten": schatten_first}.get(preconditioning, base)
  table = table.astype(x.dtype)
  for i in range(table.shape[0]):
    x = (first if i == 0 else base)(x, table[i])
  return x.T if transposed else x


def newton_schulz_stack(x, *, coeffs, steps, ns_dtype, eps, preconditioning, gram, implementation, interpret,
                        ns_matmul="xla"):
  """Newton-Schulz on a ``(batch, rows, cols)`` array."""
  if preconditioning == "frobenius" and jnp.dtype(x.dtype) in KERNEL_DTYPES:
    config = None if ns_matmul == "xla" else kernels.TiledConfig(matmul=ns_matmul)
    return kernels.newton_schulz(x, coeffs=coeffs, steps=steps, ns_dtype=ns_dtype, eps=eps,
                                 gram=gram, implementation=implementation, interpret=interpret,
                                 config=config)
  # What the kernel does not cover runs optax's iteration: optax's other
  # preconditionings (in ns_dtype), and float16, float64 or complex matrices
  # (in their own dtype, as optax).
  if isinstance(coeffs, str):
    raise ValueError(f"muon: preconditioning={preconditioning!r} and {x.dtype} matrices need a "
                     f"numeric coefficient table, got coeffs={coeffs!r}")
  if jnp.dtype(x.dtype) in KERNEL_DTYPES:
    x = x.astype(ns_dtype)
  table = jnp.asarray(coeffs)
  return jax.vmap(lambda m: optax_newton_schulz(m, table, preconditioning, eps))(x)


def run_call(plan, call, ns, ns_input):
  """One Newton-Schulz call of ``plan`` (a :class:`~fuseopt.optim.muon_plan.MuonPlan`),
  run where the plan placed it; returns ``[((leaf, piece), result)]``.

  ``ns`` orthogonalises a ``(batch, rows, cols)`` stack (a batched call
  passes it through :func:`replicated`); ``ns_input(leaf, piece)`` is that
  piece's matrices for a batched call, the leaf's whole Newton-Schulz input
  for an all-to-all call (whose results are in the leaf's layout, ``piece``
  0). A result is what ``ns`` returns: an array, or a tuple of arrays with
  the batch first (NorMuon's column sums beside it).
  """
  if call.across_mesh:
    ys = plan.all_to_all.run([ns_input(i, 0) for i in call.leaves], ns, call.slots)
    return [((i, 0), y) for i, y in zip(call.leaves, ys)]
  xs = []
  for k, a, b in call.ranges:
    i, j, batch = call.family[k]
    x = ns_input(i, j)
    xs.append(x if (a, b) == (0, batch) else jax.lax.slice_in_dim(x, a, b))
  y = ns(xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=0))
  out, offset = [], 0
  for k, a, b in call.ranges:
    i, j, _ = call.family[k]
    out.append(((i, j), y if len(call.ranges) == 1 else _slice(y, offset, offset + b - a)))
    offset += b - a
  return out


def _slice(y, a, b):
  """Batch rows ``[a, b)`` of a call's result (or of each array of it)."""
  return jax.tree.map(lambda t: jax.lax.slice_in_dim(t, a, b), y)


def concat(parts):
  """A piece's results from several calls joined along the batch."""
  if len(parts) == 1:
    return parts[0]
  return jax.tree.map(lambda *t: jnp.concatenate(t, axis=0), *parts)


def replicated(ns):
  """``ns`` for a stack that may live on a multi-device mesh: gathered, then
  run whole on every device (a batched call of leaves the all-to-all does not
  take; a Pallas kernel must never see a sharded operand)."""
  def run(x):
    where = kernel_sharding.placement_of(x)
    if not isinstance(where, kernel_sharding.Placement):
      return ns(x)
    whole = kernel_sharding.Placement(where.mesh, jax.sharding.PartitionSpec(*[None] * x.ndim))
    out_specs = jax.tree.map(lambda t: jax.sharding.PartitionSpec(*[None] * t.ndim),
                             jax.eval_shape(ns, x))
    return kernel_sharding.shard_local(ns, where.mesh, whole.spec, out_specs)(
        kernel_sharding.to_spec(x, whole))
  return run
