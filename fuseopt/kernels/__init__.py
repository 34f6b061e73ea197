"""Device ops: each a plain-jnp reference plus Pallas backends (Triton for
GPU, Mosaic for TPU) behind one public function taking
``implementation=`` and ``interpret=``."""

from __future__ import annotations

import importlib

# public name -> module that defines it (imported on first use, so that one
# op's optional backend does not slow or break importing another's).
_EXPORTS = {
    "stochastic_round_bf16": "fuseopt.kernels.stochastic_round",
    "stochastic_round_reference": "fuseopt.kernels.stochastic_round",
    "derive_seed": "fuseopt.kernels.counter_hash",
    "adam_update": "fuseopt.kernels.adam",
    "adam_update_reference": "fuseopt.kernels.adam",
    "adam_update_tree": "fuseopt.kernels.adam",
    "newton_schulz": "fuseopt.kernels.ns.newton_schulz",
    "JORDAN": "fuseopt.kernels.ns.newton_schulz",
    "newton_schulz_reference": "fuseopt.kernels.ns.newton_schulz",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
  module = _EXPORTS.get(name)
  if module is None:
    raise AttributeError(f"module 'fuseopt.kernels' has no attribute {name!r}")
  value = getattr(importlib.import_module(module), name)
  globals()[name] = value
  return value


def __dir__():
  return sorted(set(globals()) | set(_EXPORTS))
