"""Newton–Schulz orthogonalisation (Muon's polar factor): reference and dispatch.

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

Coefficient schedules (``coeffs=``):

- ``"jordan"``: Keller Jordan's (3.4445, −4.7750, 2.0315) every step (5 by
  default), s = 1. The singular values land in about [0.5, 1.5] rather than
  at 1 (the polynomial trades accuracy for slope at zero);
- ``"polar_express"``: the degree-5 schedule of Amsel, Persson, Musco & Gower,
  "The Polar Express: Optimal Matrix Sign Methods and Their Application to the
  Muon Algorithm" (arXiv:2505.16932, Algorithm 1), optimal for singular values
  in [1e-3, 1]; every polynomial but the last of their 8-row table is divided
  by the safety factor 1.01 (a/1.01, b/1.01³, c/1.01⁵) and the input norm is
  inflated by 1.01, as in the paper. Steps beyond 8 repeat the last row;
- a user table: shape (3,) (repeated ``steps`` times, 5 by default) or
  (steps, 3), s = 1.

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
standard iteration's band and error. FLOPs: see :func:`ns_flops`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fuseopt.kernels import _backend
from fuseopt.kernels import _validate

OP_NAME = "newton_schulz"

# ------------------------------------------------------------ coefficients --
JORDAN = (3.4445, -4.7750, 2.0315)

# arXiv:2505.16932, Algorithm 1 (degree 5, designed for l = 1e-3, u = 1).
_POLAR_EXPRESS_RAW = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
POLAR_EXPRESS_SAFETY = 1.01
POLAR_EXPRESS = tuple(
    (a / POLAR_EXPRESS_SAFETY, b / POLAR_EXPRESS_SAFETY**3, c / POLAR_EXPRESS_SAFETY**5)
    for a, b, c in _POLAR_EXPRESS_RAW[:-1]) + (_POLAR_EXPRESS_RAW[-1],)

DEFAULT_STEPS = 5
# Gram NS restarts (rebuilds X and R from the original X_0) before these steps.
GRAM_RESTARTS = {"jordan": (2, 4), "polar_express": (2, 3, 4)}
GRAM_RESTARTS_TABLE = (2, 3, 4)   # a user table: the conservative choice
# gram="auto" switches Gram NS on from this aspect ratio (long / short side).
GRAM_AUTO_ASPECT = 2.0


def coefficient_table(coeffs: Any = "polar_express", steps: int | None = None
                      ) -> tuple[tuple[tuple[float, float, float], ...], float]:
  """The per-step (a, b, c) table and the norm inflation factor ``s``.

  Returns a tuple of ``steps`` python-float triples (static, so kernels bake
  them in) and ``s`` (1.01 for Polar Express, else 1).
  """
  if steps is not None and (not isinstance(steps, (int, np.integer)) or steps < 1):
    raise ValueError(f"newton_schulz: steps must be a positive int or None, got {steps!r}")
  if isinstance(coeffs, str):
    if coeffs == "jordan":
      return (JORDAN,) * (steps or DEFAULT_STEPS), 1.0
    if coeffs == "polar_express":
      n = steps or DEFAULT_STEPS
      rows = POLAR_EXPRESS[:n] + (POLAR_EXPRESS[-1],) * max(0, n - len(POLAR_EXPRESS))
      return rows, POLAR_EXPRESS_SAFETY
    raise ValueError(f"newton_schulz: coeffs must be 'polar_express', 'jordan' or a "
                     f"table of shape (3,) or (steps, 3), got {coeffs!r}")
  if isinstance(coeffs, jax.core.Tracer):
    raise TypeError("newton_schulz: coeffs must be concrete (a tuple or numpy/jax array "
                    "outside jit): the kernels bake the coefficients in")
  table = np.asarray(coeffs, dtype=np.float64)
  if table.ndim == 1 and table.shape == (3,):
    table = np.tile(table, (steps or DEFAULT_STEPS, 1))
  elif table.ndim != 2 or table.shape[1] != 3 or table.shape[0] < 1:
    raise ValueError(f"newton_schulz: a coefficient table must have shape (3,) or "
                     f"(steps, 3), got {table.shape}")
  elif steps is not None and steps != table.shape[0]:
    raise ValueError(f"newton_schulz: steps={steps} disagrees with the coefficient "
                     f"table's {table.shape[0]} rows")
  if not np.all(np.isfinite(table)):
    raise ValueError("newton_schulz: the coefficient table has non-finite entries")
  return tuple(tuple(float(v) for v in row) for row in table), 1.0


def singular_value_band(coeffs: Any = "polar_express", steps: int | None = None,
                        lo: float = 1e-3, num: int = 20001) -> tuple[float, float]:
  """Exact-arithmetic range of the composed polynomial over σ in [lo, 1].

  This is the band the coefficients promise for the singular values of the
  result, for inputs whose normalised singular values are >= ``lo`` (the
  normalised spectrum is always <= 1). bf16 rounding widens it slightly.
  """
  table, _ = coefficient_table(coeffs, steps)
  s = np.geomspace(lo, 1.0, num)
  for a, b, c in table:
    s = a * s + b * s**3 + c * s**5
  return float(s.min()), float(s.max())


def ns_flops(m: int, n: int, steps: int = DEFAULT_STEPS, *, gram: bool = False,
             symmetric: bool = False, restarts: Sequence[int] = (2, 4)) -> float:
  """FLOPs of one NS on an m × n matrix (m, n in any order).

  Standard: per step 4m²n + 2m³ (Gram 2m²n, A·A 2m³, B·X 2m²n) for m <= n;
  ``symmetric=True`` counts what the symmetric kernels execute (half of the
  two symmetric products: 3m²n + m³).
  Gram NS (``gram=True``): 2m²n for each Gram X Xᵀ (one per restart segment)
  and 2m²n for each X = Q X_0 (one per segment), plus per step on the m × m
  side R² (2m³), Q ← Z Q (2m³, skipped at a segment's first step) and
  R ← Z R Z (4m³, skipped at a segment's last step). ``restarts``: Jordan's
  default (2, 4); Polar Express's is (2, 3, 4).
  """
  m, n = min(m, n), max(m, n)
  if not gram:
    per = (3 * m * m * n + m**3) if symmetric else (4 * m * m * n + 2 * m**3)
    return float(steps * per)
  bounds = [0] + [r for r in restarts if 0 < r < steps] + [steps]
  total = 0.0
  for s0, s1 in zip(bounds[:-1], bounds[1:]):
    total += 2 * 2 * m * m * n  # R = X Xᵀ and X = Q X_0
    for t in range(s0, s1):
      total += 2 * m**3
      if t > s0:
        total += 2 * m**3
      if t < s1 - 1:
        total += 4 * m**3
  return float(total)


# --------------------------------------------------------------- reference --
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


class _ReferenceOps:
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


def _normalise(x32, scale, eps, dtype):
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
  # the stack is made (on an H200 that copy was 512 MiB of a 128 Mi-element
  # call).
  amax = jnp.max(jnp.abs(x32), axis=(-2, -1), keepdims=True).astype(jnp.float32)
  x32 = x32.astype(jnp.float32)
  c = 1.0 / jnp.clip(amax, 2.0**-126, 2.0**126)
  norm = jnp.sqrt(jnp.sum(jnp.square(x32 * c), axis=(-2, -1), keepdims=True))
  den = norm * scale + eps * c
  k = c / jnp.where(den > 0, den, 1.0)  # zero matrix with eps = 0: 0·c, not 0/0
  k = jnp.where(k >= jnp.finfo(jnp.float32).tiny, k, jnp.nan)
  return (x32 * k).astype(dtype)


def _iterate_standard(x, table, ops):
  for a, b, c in table:
    gram = ops.sym(x)                               # A = X Xᵀ
    poly = ops.sym(gram, alpha=c, beta=b)           # B = b·A + c·A A (A = Aᵀ)
    x = ops.matmul(poly, x, a=a)                    # X' = a·X + B X
  return x


def _iterate_gram(x, table, ops, restarts):
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


def _as_batched(x):
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


def _gram_restarts(gram, m, n, coeffs):
  """None (standard NS) or the restart steps of Gram NS."""
  default = GRAM_RESTARTS.get(coeffs, GRAM_RESTARTS_TABLE) if isinstance(coeffs, str) else GRAM_RESTARTS_TABLE
  if gram == "auto":
    return default if max(m, n) >= GRAM_AUTO_ASPECT * min(m, n) else None
  if gram is True:
    return default
  if gram is False or gram is None:
    return None
  if isinstance(gram, (tuple, list)) and all(isinstance(r, (int, np.integer)) and r > 0 for r in gram):
    return tuple(sorted(int(r) for r in gram))
  raise ValueError(f"newton_schulz: gram must be True, False, 'auto' or a tuple of restart "
                   f"steps, got {gram!r}")


def _iterate(table, restarts, ops):
  if restarts is None:
    return lambda y: _iterate_standard(y, table, ops)
  return lambda y: _iterate_gram(y, table, ops, restarts)


def _check_dtype(x, ns_dtype):
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
  ns_dtype = _check_dtype(x, ns_dtype)
  _validate.check_real("newton_schulz", "eps", eps, lo=0.0)
  table, scale = coefficient_table(coeffs, steps)
  xb, restore = _as_batched(x)
  if xb.size == 0:
    return x
  restarts = _gram_restarts(gram, *xb.shape[-2:], coeffs)
  y = _normalise(xb, scale, eps, ns_dtype)
  y = _iterate(table, restarts, _ReferenceOps(ns_dtype))(y)
  return restore(y.astype(x.dtype))


# ------------------------------------------------------------------ public --
@dataclasses.dataclass(frozen=True)
class TiledConfig:
  """Block configs for the multi-kernel path (``None`` → the shape heuristic).

  ``sym``: :mod:`fuseopt.kernels.ns.gram` config for the symmetric products;
  ``matmul``: :mod:`fuseopt.kernels.ns.update` config, the string ``"xla"``
  (the default) to run ``a·X + B X`` as an XLA dot with a fused add, or
  ``"pallas"`` for the update kernel with its shape heuristic. The Pallas
  kernel adds ``a·X`` in its epilogue and writes only the rounded result:
  XLA's dot keeps fp32 products and an fp32 copy of X (excess precision) per
  call, 3-4 fp32 buffers the size of the call on an H200 and a TPU.

  Any TiledConfig forces the tiled path, except ``TiledConfig(matmul="pallas")``,
  which leaves the choice (single fused kernel or tiled) to the shape.
  """
  sym: Any = None
  matmul: Any = None


def _pick_path(impl, m, n, batch, config, use_gram):
  """'fused' or 'tiled' for a Pallas backend (see docs/kernels.md, "What implementation=None runs")."""
  from fuseopt.kernels.ns import fused
  forced = os.environ.get("FUSEOPT_NS_PATH")
  if isinstance(config, TiledConfig) and (config.sym is not None or config.matmul != "pallas"):
    return "tiled"
  if isinstance(config, (fused.TritonConfig, fused.MosaicConfig)):
    return "fused"
  if forced in ("fused", "tiled"):
    return forced
  if use_gram:
    return "tiled"
  return "fused" if fused.fits(impl, m, n) else "tiled"


def newton_schulz(x, *, coeffs="polar_express", steps=None, ns_dtype=jnp.bfloat16,
                  eps=1e-7, gram=False, implementation=None, interpret=False,
                  config=None) -> jax.Array:
  """Orthogonalises ``x`` (its polar factor U Vᵀ, approximately) by Newton–Schulz.

  Args:
    x: (m, n) or (..., m, n) floating array; leading axes are a batch of
      independent matrices (one normalisation per matrix).
    coeffs: ``"polar_express"`` (default), ``"jordan"``, or a table of shape
      (3,) or (steps, 3) of (a, b, c) per step (concrete values).
    steps: number of steps (default 5, or the table's length).
    ns_dtype: dtype of the iterates (bf16 default; fp32 for a precise run);
      products always accumulate in fp32.
    eps: added to the (inflated) Frobenius norm before dividing; a finite
      number >= 0. The norm is taken after scaling by the largest magnitude,
      so it neither overflows nor underflows (exact for norms up to 2^126;
      beyond, a NaN result rather than a silent zero), and a zero matrix
      gives zeros.
    gram: Gram Newton–Schulz (iterate on the m × m Gram matrix, restarted
      before the steps in ``GRAM_RESTARTS[coeffs]``); ``"auto"`` enables it from
      aspect ratio 2; a tuple of step indices sets the restarts (``(2,)``:
      one restart, fewer FLOPs, less accurate on ill-conditioned inputs).
    implementation: ``None`` (by platform and shape), ``"xla"``,
      ``"triton"`` or ``"mosaic_tpu"``.
    interpret: run a Pallas backend in interpret mode (CPU debugging).
    config: :class:`TiledConfig`, or a :mod:`fuseopt.kernels.ns.fused` config
      to force the single-kernel path.

  Returns:
    An array of ``x``'s shape and dtype. Its derivative is the reference's
    (:func:`newton_schulz_reference`), whatever the implementation.
  """
  x = jnp.asarray(x)
  ns_dtype = _check_dtype(x, ns_dtype)
  _validate.check_real("newton_schulz", "eps", eps, lo=0.0)
  table, scale = coefficient_table(coeffs, steps)
  impl = _backend.resolve_implementation(OP_NAME, implementation, (x,))
  xb, restore = _as_batched(x)
  if impl == "xla" or xb.size == 0:
    return newton_schulz_reference(x, coeffs=coeffs, steps=steps, ns_dtype=ns_dtype,
                                   eps=eps, gram=gram)
  batch, m, n = xb.shape
  restarts = _gram_restarts(gram, m, n, coeffs)
  reference = functools.partial(newton_schulz_reference, coeffs=coeffs, steps=steps,
                                ns_dtype=ns_dtype, eps=eps, gram=gram)
  kernel = functools.partial(_newton_schulz_kernels, impl=impl, interpret=interpret,
                             config=config, table=table, scale=scale, eps=eps,
                             ns_dtype=ns_dtype, restarts=restarts)
  return _reference_derivative(kernel, reference, x)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _reference_derivative(kernel, reference, x):
  return kernel(x)


@_reference_derivative.defjvp
def _reference_derivative_jvp(kernel, reference, primals, tangents):
  # Pallas calls have no usable derivative (jax fails with "Linearization
  # failed to produce known values"); the kernels compute the reference's
  # function, so they take the reference's derivative (computed by XLA).
  (x,), (t,) = primals, tangents
  _, dy = jax.jvp(reference, (x,), (t,))
  return kernel(x), dy


def _newton_schulz_kernels(x, *, impl, interpret, config, table, scale, eps, ns_dtype, restarts):
  xb, restore = _as_batched(x)
  batch, m, n = xb.shape
  y = _normalise(xb, scale, eps, ns_dtype)
  path = _pick_path(impl, m, n, batch, config, restarts is not None)
  interp = _backend.interpret_arg(impl, interpret)
  if path == "fused":
    from fuseopt.kernels.ns import fused
    y = fused.newton_schulz_fused(y, table, implementation=impl, interpret=interp,
                                  config=config if not isinstance(config, TiledConfig) else None)
  else:
    from fuseopt.kernels.ns import ops as ns_ops
    cfg = config if isinstance(config, TiledConfig) else TiledConfig()
    kops = ns_ops.KernelOps(ns_dtype, impl, interp, cfg)
    y = kops.run(y, _iterate(table, restarts, kops))
  return restore(y.astype(x.dtype))
