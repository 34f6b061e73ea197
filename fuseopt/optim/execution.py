"""Where and how an optimizer's kernels run: :class:`Execution`, one record
for every fuseopt transform (:func:`~fuseopt.optim.adam`,
:func:`~fuseopt.optim.adamw`, :func:`~fuseopt.optim.scale_by_adam`, the Muon
family and its directions).

It holds what does not change the mathematics: a forced backend, interpret
mode, and the placement of the parameters on an Auto mesh. The record is
frozen and checked at construction; :func:`optax.inject_hyperparams` leaves
it static, and the builder reads it from YAML as a mapping
(``optimizer_kwargs: {execution: {implementation: xla}}``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

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
  """
  implementation: Optional[str] = None
  interpret: bool = False
  shardings: Any = None

  def __post_init__(self):
    if self.implementation is not None and not isinstance(self.implementation, str):
      raise ValueError(f"Execution: implementation must be a backend name or None, got "
                       f"{self.implementation!r}")
    if not isinstance(self.interpret, bool):
      raise ValueError(f"Execution: interpret must be True or False, got {self.interpret!r}")
