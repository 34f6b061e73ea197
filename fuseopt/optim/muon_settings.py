"""How each Muon matrix's Newton-Schulz iteration runs: :class:`NewtonSchulz`.

:func:`~fuseopt.optim.muon`, :func:`~fuseopt.optim.normuon`,
:func:`~fuseopt.optim.muonclip` and their ``scale_by_`` directions take
optax's arguments one by one (the numeric ones are what
:func:`optax.inject_hyperparams` injects) and fuseopt's settings as a frozen
record, which inject_hyperparams leaves static: :class:`~fuseopt.optim.Execution`
(where the kernels run, shared with Adam), whose ``newton_schulz`` field is
this one. Both are checked at construction; the builder reads them from YAML
as mappings (``optimizer_kwargs: {execution: {newton_schulz: {dtype: float32}}}``).

What the iteration computes -- the coefficients and the step count -- keeps
optax's names, ``ns_coeffs`` and ``ns_steps``, on the transforms
(:mod:`fuseopt.kernels.newton_schulz.coefficients` has the vocabulary).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax.numpy as jnp
import numpy as np


__all__ = ["NewtonSchulz"]

_MATMULS = ("xla", "pallas")


@dataclasses.dataclass(frozen=True)
class NewtonSchulz:
  """How each Muon matrix's Newton-Schulz iteration runs.

  Attributes:
    dtype: dtype of the iteration (fp32 accumulation): ``"bfloat16"``
      (default) or ``"float32"`` (optax's numerics); a dtype, its name or its
      scalar type. Stored as a ``jnp.dtype``.
    gram: Gram Newton-Schulz (iterate on the small Gram matrix, restarted):
      ``False``, ``True``, ``"auto"`` (for matrices of aspect ratio >= 2), or
      ``None`` (default): the platform's fastest measured
      (:func:`fuseopt.kernels.newton_schulz`): ``"auto"`` on a GPU, ``False``
      (optax's iteration) on a TPU and the CPU.
    max_elements: the most matrix elements one NS call takes (``None``: the
      platform's default, :func:`~fuseopt.optim.muon_plan.default_ns_max_elements`:
      2^23 = 16 MiB of bf16 input on a GPU or a TPU, 2^25 on the CPU).
      Same-shaped matrices beyond it go into several calls, each still
      batched (never one lone matrix of a larger family); in
      :func:`fuseopt.optim.step` the calls run one after the other, so the
      step's temporary memory is one call's working set.
    matmul: how the Pallas backends compute ``X' = a·X + B·X``: ``"xla"``
      (default: XLA's GEMM with a fused add) or ``"pallas"`` (the update
      kernel, ``a·X`` in its epilogue, bf16 out only). On a GPU ``"pallas"``
      needs less temporary memory, on a TPU more (the compiled figures:
      docs/scaling.md). It accumulates in its own order, so
      results on hardware differ from the default's by bf16 rounding. No
      effect on the CPU.
  """
  dtype: Any = "bfloat16"
  gram: bool | str | None = None
  max_elements: Optional[int] = None
  matmul: str = "xla"

  def __post_init__(self):
    try:
      if self.dtype is None:
        raise TypeError
      dtype = jnp.dtype(self.dtype)
    except TypeError as e:
      raise ValueError(f"NewtonSchulz: dtype must be a dtype or its name, got {self.dtype!r}") from e
    object.__setattr__(self, "dtype", dtype)
    if not (self.gram is None or isinstance(self.gram, bool) or self.gram == "auto"):
      raise ValueError(f"NewtonSchulz: gram must be None, False, True or 'auto', "
                       f"got {self.gram!r}")
    m = self.max_elements
    if m is not None and (isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1):
      raise ValueError(f"NewtonSchulz: max_elements must be an int >= 1 or None, got {m!r}")
    if self.matmul not in _MATMULS:
      raise ValueError(f"NewtonSchulz: matmul must be one of {_MATMULS}, got {self.matmul!r}")
