"""Newton–Schulz coefficient schedules, the Gram restarts, and the FLOP count.

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

One vocabulary: the Muon family's ``ns_coeffs`` (:func:`fuseopt.optim.muon`)
takes the same names and tables, and optax.contrib.muon's preset names too:
``"standard"`` is Jordan's triple and ``"dion"`` a 5-row table, mapped here,
once (:data:`OPTAX_PRESETS`, :func:`muon_coefficients`), to the tables optax
holds. The defaults differ by design: :func:`fuseopt.optim.muon` takes
optax's (Jordan's triple :data:`JORDAN` as a table, 5 steps: optax's
numbers); :func:`newton_schulz` takes ``"polar_express"`` (the better
orthogonaliser; docs/muon.md compares them).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

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

# optax.contrib.muon's ns_coeffs presets, as the tables optax holds.
DION = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)
OPTAX_PRESETS = {"standard": JORDAN, "dion": DION}
# The schedules named by fuseopt (coefficient_table's strings).
SCHEDULES = ("jordan", "polar_express")

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


def muon_coefficients(ns_coeffs: Any, ns_steps: int, owner: str = "muon"):
  """The Muon family's ``ns_coeffs``/``ns_steps`` as ``(coeffs, steps,
  state)``: what :func:`newton_schulz` gets, and the table the state keeps
  for inspection.

  - optax's preset names (:data:`OPTAX_PRESETS`) and tables of shape (3,)
    (repeated ``ns_steps`` times) or (k, 3) with k <= ``ns_steps`` (used as
    they are, as optax does): a static table; the state keeps
    ``ns_coeffs`` as optax does (the preset's table, or the table given);
  - fuseopt's schedule names (:data:`SCHEDULES`): the name and ``ns_steps``
    (so Gram Newton-Schulz restarts where that schedule wants); the state
    keeps the schedule's table as optax would hold it (``"jordan"``: the
    triple, repeated ``ns_steps`` times).
  """
  steps = int(ns_steps)
  if isinstance(ns_coeffs, str):
    if ns_coeffs in SCHEDULES:
      state = JORDAN if ns_coeffs == "jordan" else coefficient_table(ns_coeffs, steps)[0]
      return ns_coeffs, steps, state
    if ns_coeffs not in OPTAX_PRESETS:
      raise ValueError(f"{owner}: unknown ns_coeffs {ns_coeffs!r}; expected one of "
                       f"{sorted(SCHEDULES + tuple(OPTAX_PRESETS))} or a (3,) / (steps, 3) table")
    ns_coeffs = OPTAX_PRESETS[ns_coeffs]
  table = np.asarray(ns_coeffs, np.float64)
  if table.ndim not in (1, 2) or table.shape[-1] != 3:
    raise ValueError(f"{owner}: ns_coeffs must have shape (3,) or (steps, 3), got {table.shape}")
  if table.ndim == 1:
    table = np.tile(table, (steps, 1))
  elif table.shape[0] > steps:
    raise ValueError(f"{owner}: ns_coeffs has {table.shape[0]} rows, more than ns_steps={steps}")
  return tuple(tuple(float(c) for c in row) for row in table), None, ns_coeffs


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


def gram_restarts(gram, m, n, coeffs):
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
