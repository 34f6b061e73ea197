"""fuseopt: fused optimizer kernels for JAX, as drop-in optax transforms.

``import fuseopt`` is cheap: the subpackages (and with them jax, optax and
Pallas) load on first use, e.g. ``import fuseopt.optim as fo`` or
``fuseopt.optim.adamw``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what static tools see; at run time see __getattr__.
  from fuseopt import kernels
  from fuseopt import nnx
  from fuseopt import optim

__version__ = "0.1.0"
__all__ = ["kernels", "nnx", "optim", "__version__"]

_SUBPACKAGES = ("kernels", "nnx", "optim")


def __getattr__(name):
  if name in _SUBPACKAGES:
    return importlib.import_module(f"fuseopt.{name}")
  raise AttributeError(f"module 'fuseopt' has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(_SUBPACKAGES))
