"""Where and how an optimizer's kernels run: :class:`Execution`, one record
for every fuseopt transform (:func:`~fuseopt.optim.adam`,
:func:`~fuseopt.optim.adamw`, :func:`~fuseopt.optim.scale_by_adam`, the Muon
family and its directions).

It holds how the optimizer's kernels are run, not what the optimizer
computes: a forced backend, interpret mode, the placement of the parameters
on an Auto mesh, and for the Muon family how its Newton-Schulz iteration runs
(a :class:`~fuseopt.optim.NewtonSchulz` record: the iterates' dtype, Gram
iterations, the most elements a call, the matmul of the Pallas backends). It
holds no moment format: that is ``moment_dtype``. The record is frozen and
checked at construction; :func:`optax.inject_hyperparams` leaves it static,
and the builder reads it from YAML as a mapping
(``optimizer_kwargs: {execution: {implementation: xla, newton_schulz: {dtype: float32}}}``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Optional

from fuseopt.optim.muon_settings import NewtonSchulz

__all__ = ["Execution"]


@dataclasses.dataclass(frozen=True)
class Execution:
  """Where and how the kernels of an optimizer run.

  Attributes:
    implementation: force one backend of the kernels (``None``: picked by the
      platform and the shape; docs/kernels.md lists the names and the
      environment override).
    interpret: run the Pallas kernels in interpret mode (on the CPU).
    shardings: where the parameters live when the mesh axes are Auto: a tree
      of ``NamedSharding`` / ``PartitionSpec`` shaped like the params, a
      prefix, or one for all. The kernels then run shard-local
      (``shard_map``) with the counter hash on global indices: bitwise the
      unsharded result, no gather. ``None`` reads the placement from the
      arrays' types (Explicit axes); on an Auto mesh of several devices the
      plain-jnp reference runs instead (XLA partitions it) and a warning
      names this field. Sharded Muon leaves keep their momentum sharded; for
      the Newton-Schulz, same-shaped matrices are re-laid out with
      ``all_to_all`` so that each device orthogonalises about 1/N of them,
      whole, then laid back (docs/scaling.md).
    newton_schulz: the Muon family's :class:`~fuseopt.optim.NewtonSchulz`
      record (or a mapping of its fields; ``None``: its defaults): how each
      matrix's iteration runs. Adam runs no Newton-Schulz: ``adam``,
      ``adamw`` and ``scale_by_adam`` refuse a record that sets it.
  """
  implementation: Optional[str] = None
  interpret: bool = False
  shardings: Any = None
  newton_schulz: Any = None

  def __post_init__(self):
    ns = self.newton_schulz
    if isinstance(ns, Mapping):
      fields = {f.name for f in dataclasses.fields(NewtonSchulz)}
      unknown = sorted(set(ns) - fields)
      if unknown:
        raise ValueError(f"Execution: newton_schulz has unknown fields {unknown}; expected some "
                         f"of {sorted(fields)}")
      object.__setattr__(self, "newton_schulz", NewtonSchulz(**ns))
    elif ns is not None and not isinstance(ns, NewtonSchulz):
      raise TypeError(f"Execution: newton_schulz must be a fuseopt.optim.NewtonSchulz (or a "
                      f"mapping of its fields) or None, got {ns!r}")
    if self.implementation is not None and not isinstance(self.implementation, str):
      raise ValueError(f"Execution: implementation must be a backend name or None, got "
                       f"{self.implementation!r}")
    if not isinstance(self.interpret, bool):
      raise ValueError(f"Execution: interpret must be True or False, got {self.interpret!r}")
