"""NorMuon: Muon with a per-neuron second moment on the orthogonalised update.

Li et al. 2025, "NorMuon: Making Muon more efficient and scalable", arXiv
2510.05491. Muon's orthogonalised update has equal singular values but very
unequal rows: some output neurons get far larger updates than others.
NorMuon keeps an Adam-style second moment per output neuron of each matrix
and divides it out after Newton-Schulz, then rescales the update to Muon's
RMS (:mod:`fuseopt.optim.neuron_norm` has the math and the layouts).

Everything else is :func:`~fuseopt.optim.muon`'s: the same arguments, the
same batched and sharded Newton-Schulz, the same AdamW side, the same fused
:func:`fuseopt.optim.step` (the per-neuron statistic comes out of the
Newton-Schulz call, where each matrix is whole; the factor is folded into the
pass that writes the parameter).
"""

# No `from __future__ import annotations`: optax reads `learning_rate`'s
# annotation as the object optax.ScalarOrSchedule.
from typing import Any, Optional

import jax.numpy as jnp
import optax

from fuseopt.optim import _checks
from fuseopt.optim import muon_newton_schulz
from fuseopt.optim import muon_transforms
from fuseopt.optim.muon_transforms import JORDAN_COEFFS, NorMuonState

__all__ = ["NorMuonState", "normuon", "scale_by_normuon"]

_NS_STEPS = muon_newton_schulz._NS_STEPS


def _normuon_args(owner, b2, normuon_eps, nu_dtype):
  """NorMuon's (b2, eps, v dtype), checked: a bool ``b2=True`` would be 1
  (NorMuon silently off), a string would fail at the first update."""
  _checks.check_decay(owner, "b2", b2)
  _checks.check_nonnegative(owner, "normuon_eps", normuon_eps)
  nu_dtype = _checks.check_dtype(owner, "nu_dtype", nu_dtype, (jnp.float32, jnp.bfloat16))
  return (b2, normuon_eps, nu_dtype)


def scale_by_normuon(
    ns_coeffs=JORDAN_COEFFS,
    ns_steps: int = _NS_STEPS,
    beta: float = 0.95,
    eps: float = 1e-8,
    mu_dtype: Optional[Any] = None,
    *,
    b2: float = 0.95,
    normuon_eps: float = 1e-8,
    nu_dtype: Optional[Any] = None,
    nesterov: bool = True,
    weight_dimension_numbers=None,
    coeffs=None,
    ns_dtype="bfloat16",
    shape_scaling: bool = False,
    consistent_rms: Optional[float] = None,
    skip_inactive: bool = False,
    gram: bool | str = False,
    ns_max_elements: Optional[int] = None,
    ns_matmul: str = "xla",
    implementation: Optional[str] = None,
    interpret: bool = False,
    shardings: Any = None,
) -> optax.GradientTransformation:
  r"""NorMuon's direction: Muon's, normalised per output neuron.

  With :math:`O = \mathrm{NS}(\hat m)` of :func:`~fuseopt.optim.scale_by_muon`
  on a ``(rows = fan-in, cols = fan-out)`` matrix:

  .. math::
    v_j \leftarrow \beta_2 v_j + (1-\beta_2)\,\overline{O_{:j}^2},\qquad
    \hat O_{:j} = \frac{O_{:j}}{\sqrt{v_j} + \varepsilon},\qquad
    u = \frac{\sqrt{\min(\text{rows}, \text{cols})}}{\|\hat O\|_F}\,\hat O

  (Li et al. 2025, arXiv 2510.05491: the mean is over the neuron's inputs,
  one :math:`v_j` per output unit -- the paper's rows of :math:`W` in
  :math:`y = Wx`), then Muon's width scaling when ``shape_scaling``.
  ``b2 = 0`` makes every neuron's update the same RMS. No bias correction of
  :math:`v` (the rescale to a fixed norm makes it moot).

  Args:
    b2: decay of the per-neuron second moment, in [0, 1).
    normuon_eps: added to :math:`\sqrt{v_j}`, >= 0 (the NS ``eps`` is separate).
    nu_dtype: dtype of ``nu``: float32 (default, ``None``) or bfloat16
      (stochastically rounded, seed stream ``STREAM_NU``).
    Everything else: as :func:`~fuseopt.optim.scale_by_muon` (without
    ``adaptive`` and ``preconditioning``, which NorMuon replaces). Matrices
    are declared with :class:`~fuseopt.optim.MuonDimensionNumbers` or
    :class:`~fuseopt.optim.MatrixViews`; each view has its own second
    moment per output neuron (a view axis on the reduction side stays in
    ``nu``, one entry per view).

  Returns:
    A transformation whose state is :class:`NorMuonState` ``(count, mu, nu,
    ns_coeffs)``.
  """
  normuon = _normuon_args("scale_by_normuon", b2, normuon_eps, nu_dtype)
  return muon_transforms._scale_by_muon(
      ns_coeffs=ns_coeffs, ns_steps=ns_steps, beta=beta, eps=eps, mu_dtype=mu_dtype,
      nesterov=nesterov, weight_dimension_numbers=weight_dimension_numbers, coeffs=coeffs,
      ns_dtype=ns_dtype, shape_scaling=shape_scaling, consistent_rms=consistent_rms,
      skip_inactive=skip_inactive, gram=gram, ns_max_elements=ns_max_elements,
      ns_matmul=ns_matmul, implementation=implementation, interpret=interpret,
      shardings=shardings, normuon=normuon)


def normuon(
    learning_rate: optax.ScalarOrSchedule,
    ns_coeffs=JORDAN_COEFFS,
    ns_steps: int = _NS_STEPS,
    beta: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    weight_decay_mask: Optional[Any] = None,
    mu_dtype: Optional[Any] = None,
    *,
    b2: float = 0.95,
    normuon_eps: float = 1e-8,
    nu_dtype: Optional[Any] = None,
    nesterov: bool = True,
    adam_b1: float = 0.9,
    adam_b2: float = 0.999,
    adam_eps_root: float = 0.0,
    adam_weight_decay: float = 0.0,
    adam_learning_rate: Optional[optax.ScalarOrSchedule] = None,
    muon_weight_dimension_numbers=None,
    consistent_rms: Optional[float] = None,
    coeffs=None,
    ns_dtype="bfloat16",
    adam_moment_dtype: Optional[Any] = None,
    skip_inactive: bool = False,
    gram: bool | str = False,
    ns_max_elements: Optional[int] = None,
    ns_matmul: str = "xla",
    implementation: Optional[str] = None,
    interpret: bool = False,
    shardings: Any = None,
    cautious_weight_decay: bool = False,
    bf16_params: str = "stochastic",
) -> optax.GradientTransformation:
  r"""NorMuon for the matrices, AdamW for everything else.

  :func:`~fuseopt.optim.muon` with :func:`scale_by_normuon`'s direction:

  .. math::
    W \leftarrow W - \eta\,(s\,u + \lambda W)

  with :math:`u` NorMuon's normalised update and :math:`s` Muon's width
  factor (``consistent_rms=0.2`` gives the paper's
  :math:`0.2\sqrt{mn}/\|\hat O\|_F`). Arguments: :func:`~fuseopt.optim.muon`'s
  (without ``adaptive`` and ``preconditioning``) and ``b2``,
  ``normuon_eps``, ``nu_dtype`` of :func:`scale_by_normuon`. The state has
  :func:`~fuseopt.optim.muon`'s structure with a :class:`NorMuonState` in
  place of the Muon state. :func:`fuseopt.optim.step` fuses it as it fuses
  Muon.
  """
  normuon_args = _normuon_args("normuon", b2, normuon_eps, nu_dtype)
  return muon_transforms._muon(
      learning_rate, ns_coeffs, ns_steps, beta, eps, weight_decay, weight_decay_mask, mu_dtype,
      nesterov=nesterov, adam_b1=adam_b1, adam_b2=adam_b2, adam_eps_root=adam_eps_root,
      adam_weight_decay=adam_weight_decay, adam_learning_rate=adam_learning_rate,
      muon_weight_dimension_numbers=muon_weight_dimension_numbers,
      consistent_rms=consistent_rms, coeffs=coeffs, ns_dtype=ns_dtype,
      adam_moment_dtype=adam_moment_dtype, skip_inactive=skip_inactive, gram=gram,
      ns_max_elements=ns_max_elements, ns_matmul=ns_matmul, implementation=implementation,
      interpret=interpret, shardings=shardings, cautious_weight_decay=cautious_weight_decay,
      bf16_params=bf16_params, normuon=normuon_args, owner="normuon")
