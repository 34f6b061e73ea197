"""Newton–Schulz orthogonalisation: the reference (the specification and the CPU path).

For a matrix ``G`` (m, n) the iteration approximates ``polar(G) = U Vᵀ`` (with
``G = U Σ Vᵀ``) by applying an odd quintic to the singular values, one
polynomial per step::

  X_0     = G / (s·‖G‖_F + eps)                     (fp32, per matrix)
  A       = X_t X_tᵀ                                  (m × m, symmetric)
  B       = b_t A + c_t A A                           (m × m, symmetric)
  X_{t+1} = a_t X_t + B X_t  = p_t(X_t),  p_t(σ) = a_t σ + b_t σ³ + c_t σ⁵

The matrix is oriented so that ``m <= n`` (transposed in and out), so the
Gram matrix is on the short side. Normalisation runs in fp32; the iteration
in ``ns_dtype`` (bf16 by default) with fp32 accumulation: every product is
accumulated in fp32, its epilogue (the ``b·A`` and ``a·X`` terms) is applied
in fp32, and the result is rounded once to ``ns_dtype``.

Gram Newton–Schulz (``gram=True``, or ``"auto"`` for aspect ratio >= 2):
because every p_t(X) = q_t(X Xᵀ) X with q_t(R) = a_t I + b_t R + c_t R², the
whole iteration is X_T = Q X_0 with Q a polynomial in R_0 = X_0 X_0ᵀ. We
iterate on the small m × m matrices (Z_t = q_t(R_t), Q ← Z_t Q,
R_{t+1} = Z_t R_t Z_t) and touch the wide n-side only to form R and to apply
Q. In bf16 rounding errors compound through R ← Z R Z, so the Gram
iteration is *restarted* (X rebuilt as Q X_0, R recomputed from it) before
the steps in ``GRAM_RESTARTS[coeffs]``: Jordan before steps 2 and 4; Polar
Express before 2, 3 and 4 (its steps 1–3 have steep polynomials, and one
Gram segment across steps 2–3 let σ_max reach 1.22 on well-conditioned
inputs). Measured (docs/kernels.md, "Gram Newton–Schulz"): with one restart before step 2,
ill-conditioned inputs (normalised σ down to 1e-3) reach σ_max 1.29–1.44
(standard bf16 NS: 1.12–1.20); with these defaults the result stays in the
standard iteration's band and error. FLOPs: see
:func:`~fuseopt.kernels.newton_schulz.coefficients.ns_flops`.

The iteration (:func:`iterate`) is written once, on three primitives
(``sym``, ``matmul``); :class:`ReferenceOps` gives them in plain ``jnp``, and
:class:`fuseopt.kernels.newton_schulz.tiled.KernelOps` on the tiled kernels.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from fuseopt.kernels import _validate
from fuseopt.kernels import dispatch
from fuseopt.kernels.newton_schulz.coefficients import coefficient_table, gram_restarts

# The reference runs every call.
supports = dispatch.supports_every_call



def iterate(y, *, table, restarts, ns_dtype, interpret, config, ns_path=None):
  """The iteration on a normalised batch ``(B, m, n)``, ``m <= n``."""
  del interpret, config, ns_path
  return iterate(table, restarts, ReferenceOps(ns_dtype))(y)


def _dot32(a, b, ns_dtype):
  """a @ b with fp32 accumulation; batched over the leading axis."""
  precision = jax.lax.Precision.HIGHEST if jnp.dtype(ns_dtype) == jnp.float32 else None
  return jnp.einsum("bij,bjk->bik", a, b, preferred_element_type=jnp.float32,
                    precision=precision)


def _dot_t32(a, b, ns_dtype):
  """a @ bᵀ with fp32 accumulation; batched over the leading axis."""
  precision = jax.lax.Precision.HIGHEST if jnp.dtype(ns_dtype) == jnp.float32 else None
  return jnp.einsum("bik,bjk->bij", a, b, preferred_element_type=jnp.float32,
                    precision=precision)


class ReferenceOps:
  """The three NS primitives in plain jnp, batched (B, ·, ·).

  Each accumulates in fp32, applies its epilogue in fp32 and rounds once to
  ``dtype``: the contract every kernel backend implements.
  """

  def __init__(self, dtype):
    self.dtype = jnp.dtype(dtype)

  def sym(self, x, *, alpha=1.0, beta=0.0, gamma=0.0):
    """alpha·X Xᵀ + beta·X + gamma·I (X square when beta or gamma != 0)."""
    acc = alpha * _dot_t32(x, x, self.dtype)
    if beta:
      acc = acc + beta * x.astype(jnp.float32)
    if gamma:
      acc = acc + gamma * jnp.eye(x.shape[-2], dtype=jnp.float32)
    return acc.astype(self.dtype)

  def matmul(self, b, x, *, a=0.0):
    """a·X + B X (B: (m, m), X: (m, n))."""
    acc = _dot32(b, x, self.dtype)
    if a:
      acc = acc + a * x.astype(jnp.float32)
    return acc.astype(self.dtype)


def normalise(x32, scale, eps, dtype):
  """X_0 = G / (s·‖G‖_F + eps), without the overflow of ‖G‖².

  ‖G‖² overflows fp32 once entries reach about 1.8e19 (the result was
  G / inf = 0: a zero update no non-finite check can see) and underflows for
  entries below about 1e-23. So the norm is taken of G·c, with c = 1 / (G's
  largest magnitude, clipped to the normal range [2^-126, 2^126]), which
  neither overflows nor underflows; then X_0 = G·k with one per-matrix factor
  k = c / (s·‖G·c‖_F + eps·c). That is exact for any s·‖G‖_F + eps up to
  2^126 ≈ 8.5e37 (entries up to about 8.5e37 / sqrt(rows·cols)). Beyond it
  k would be subnormal, which XLA flushes to zero (it turns a division by a
  broadcast scalar into a multiplication by its reciprocal, on every
  backend), so k is NaN there instead: a visible non-finite result, never a
  silent zero. Scaling in two steps would cover that last range too, but on
  the CPU it made XLA keep a bf16 copy of every Muon matrix (temp memory of
  the test tree's Muon step: 0.92 → 1.18 MB). A zero matrix gives zeros
  (also with eps = 0); a NaN or Inf entry gives NaN.
  """
  # The input may be the bf16 NS input: the largest magnitude is exact in its
  # own dtype, and every fp32 use widens it on the fly, so no fp32 copy of
  # the stack is made (a call's whole stack in fp32 more).
  amax = jnp.max(jnp.abs(x32), axis=(-2, -1), keepdims=True).astype(jnp.float32)
  x32 = x32.astype(jnp.float32)
  c = 1.0 / jnp.clip(amax, 2.0**-126, 2.0**126)
  norm = jnp.sqrt(jnp.sum(jnp.square(x32 * c), axis=(-2, -1), keepdims=True))
  den = norm * scale + eps * c
  k = c / jnp.where(den > 0, den, 1.0)  # zero matrix with eps = 0: 0·c, not 0/0
  k = jnp.where(k >= jnp.finfo(jnp.float32).tiny, k, jnp.nan)
  return (x32 * k).astype(dtype)


def settle_layout(y):
  """``y``, written out in its own row-major layout before the bf16 products
  on the CPU (an ``optimization_barrier``); unchanged elsewhere.

  When the matrix is a transposed view of a leaf (a 2-D leaf in PyTorch's
  (out, in) layout: its reduction axis last), XLA:CPU folds the transpose
  into the first Gram product X Xᵀ after it has decided how to run that
  product, and is left with a bf16 x bf16 -> f32 dot it has no kernel for
  ("Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32",
  under ``jit`` only). Behind the barrier every product reads ``y`` as
  written by the normalisation, in the form XLA:CPU runs. ``y`` is written
  out anyway (several products read it), so nothing is added, and where the
  unguarded bf16 iteration runs the results are bitwise the same. fp32 and
  fp16 iterations, which have CPU kernels in every form, and other
  platforms are left as they are.
  """
  if y.dtype != jnp.bfloat16 or dispatch.current_platform((y,)) != "cpu":
    return y
  return jax.lax.optimization_barrier(y)


def iterate_standard(x, table, ops):
  for a, b, c in table:
    gram = ops.sym(x)                               # A = X Xᵀ
    poly = ops.sym(gram, alpha=c, beta=b)           # B = b·A + c·A A (A = Aᵀ)
    x = ops.matmul(poly, x, a=a)                    # X' = a·X + B X
  return x


def iterate_gram(x, table, ops, restarts):
  steps = len(table)
  bounds = [0] + [r for r in restarts if 0 < r < steps] + [steps]
  for s0, s1 in zip(bounds[:-1], bounds[1:]):
    r = ops.sym(x)                                  # R = X Xᵀ
    q = None
    for t in range(s0, s1):
      a, b, c = table[t]
      z = ops.sym(r, alpha=c, beta=b, gamma=a)      # Z = a I + b R + c R²
      q = z if q is None else ops.matmul(z, q)      # Q ← Z Q
      if t < s1 - 1:
        r = ops.matmul(z, ops.matmul(r, z))         # R ← Z R Z
    x = ops.matmul(q, x)                            # X ← Q X (restart)
  return x


def as_batched(x):
  """(..., m, n) → (B, m', n') with m' <= n'; and the inverse."""
  if x.ndim < 2:
    raise ValueError(f"newton_schulz: x must have rank >= 2 (a matrix or a batch of "
                     f"matrices (..., m, n)), got shape {x.shape}")
  lead, (m, n) = x.shape[:-2], x.shape[-2:]
  xb = x.reshape((math.prod(lead), m, n))
  transposed = m > n
  if transposed:
    xb = jnp.swapaxes(xb, -1, -2)

  def restore(y):
    if transposed:
      y = jnp.swapaxes(y, -1, -2)
    return y.reshape(x.shape)
  return xb, restore


def iterate(table, restarts, ops):
  if restarts is None:
    return lambda y: iterate_standard(y, table, ops)
  return lambda y: iterate_gram(y, table, ops, restarts)


def check_dtype(x, ns_dtype):
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"newton_schulz: x must be a floating array, got {x.dtype}")
  ns_dtype = jnp.dtype(ns_dtype)
  if ns_dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.float16)):
    raise ValueError(f"newton_schulz: ns_dtype must be bfloat16, float16 or float32, got {ns_dtype}")
  return ns_dtype


def newton_schulz_reference(x, *, coeffs="polar_express", steps=None,
                            ns_dtype=jnp.bfloat16, eps=1e-7, gram=False) -> jax.Array:
  """The specification of :func:`newton_schulz` in plain jnp (also the CPU path)."""
  x = jnp.asarray(x)
  ns_dtype = check_dtype(x, ns_dtype)
  _validate.check_real("newton_schulz", "eps", eps, lo=0.0)
  table, scale = coefficient_table(coeffs, steps)
  xb, restore = as_batched(x)
  if xb.size == 0:
    return x
  restarts = gram_restarts(gram, *xb.shape[-2:], coeffs)
  y = settle_layout(normalise(xb, scale, eps, ns_dtype))
  y = iterate(table, restarts, ReferenceOps(ns_dtype))(y)
  return restore(y.astype(x.dtype))
