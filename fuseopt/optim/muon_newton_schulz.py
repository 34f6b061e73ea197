"""How Muon orthogonalises one ``(batch, rows, cols)`` stack: the platform's
default call size, the kernel, and optax's iteration for what the kernel
does not cover (the coefficients come resolved from
:func:`fuseopt.kernels.newton_schulz.coefficients.muon_coefficients`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fuseopt import kernels
from fuseopt.optim import _checks
from fuseopt.optim.dtypes import KERNEL_DTYPES


# Most matrix elements per Newton-Schulz call (see scale_by_muon), by the
# platform the step runs on. The fused step holds one call's working set.
# GPU and TPU: 2^23 (8 Mi elements, 16 MiB of bf16 input: two 2048 x 2048
# matrices a call; a 2048 x 8192 matrix, larger, runs alone, one a device a
# round when sharded). Temporaries of the 1.2 B tree's hybrid step
# (docs/fused_step.md): H200 0.16 GiB, 8 x H200 0.13 GiB a device; v6e
# 0.07 GiB, 8 x v5e 0.06 GiB a device. A TPU at 2^25 held 0.97 GiB on a
# v6e and 0.71 GiB a device on 8 x v5e (two 2048 x 8192 matrices a device:
# four fp32 products of the NS live at once); smaller calls on a TPU need
# the new parameter's layout pinned (_MuonStep.in_leaf_layout).
# Elsewhere (the CPU) 2^25.
DEFAULT_NS_MAX_ELEMENTS = {"gpu": 1 << 23, "cuda": 1 << 23, "rocm": 1 << 23, "tpu": 1 << 23}
DEFAULT_NS_MAX_ELEMENTS_ELSEWHERE = 1 << 25


def default_ns_max_elements(platform: str) -> int:
  """The default ``ns_max_elements`` for a step running on ``platform``."""
  return DEFAULT_NS_MAX_ELEMENTS.get(platform, DEFAULT_NS_MAX_ELEMENTS_ELSEWHERE)


_PRECONDITIONINGS = ("frobenius", "spectral", "aol", "schatten")
# The default of ns_steps (5, optax's): not an int, so that
# optax.inject_hyperparams leaves it static (see _checks.StaticDefault).
_NS_STEPS = _checks.StaticDefault(5)


def _optax_newton_schulz(x, table, preconditioning, eps):
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
  return jax.vmap(lambda m: _optax_newton_schulz(m, table, preconditioning, eps))(x)
