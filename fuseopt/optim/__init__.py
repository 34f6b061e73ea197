"""Optax transforms around fuseopt's kernels, schedules, parameter groups
and the config builder. Nothing here imports Pallas: kernels come from
:mod:`fuseopt.kernels`."""

from __future__ import annotations

import importlib

# public name -> module that defines it (imported on first use).
_EXPORTS = {
    # updates.py
    "apply_updates": "fuseopt.optim.updates",
    # adam.py / step.py (fused Adam, bf16 moments)
    "scale_by_adam": "fuseopt.optim.fused_adam",
    "adam": "fuseopt.optim.fused_adam",
    "adamw": "fuseopt.optim.fused_adam",
    "bf16_moments": "fuseopt.optim.fused_adam",
    "step": "fuseopt.optim.step",
    # muon.py (Newton-Schulz Muon)
    "muon": "fuseopt.optim.fused_muon",
    "scale_by_muon": "fuseopt.optim.fused_muon",
    "MuonDimensionNumbers": "fuseopt.optim.fused_muon",
    "MatrixViews": "fuseopt.optim.matrix_views",
    "mla_kv_b_proj_views": "fuseopt.optim.matrix_views",
    # muon_axes.py, matrix views, qk_clip.py
    "muon_weight_dimension_numbers": "fuseopt.optim.muon_axes",
    "SELECTION_AXES": "fuseopt.optim.muon_axes",
    "BATCH_AXES": "fuseopt.optim.muon_axes",
    "HEAD_AXES": "fuseopt.optim.muon_axes",
    "scale_by_qk_clip": "fuseopt.optim.qk_clip",
    "QK_PROJECTIONS": "fuseopt.optim.qk_clip",
    "muonclip": "fuseopt.optim.qk_clip",
    "MLAHeadDims": "fuseopt.optim.qk_clip",
    "PROJECTION_ROLES": "fuseopt.optim.qk_clip",
    "LAYER_AXES": "fuseopt.optim.muon_axes",
    "logical_axes": "fuseopt.optim.muon_axes",
    # groups.py, config.py, builder.py
    "ParamGroup": "fuseopt.optim.groups",
    "NO_DECAY_PATTERNS": "fuseopt.optim.groups",
    "mup_param_groups": "fuseopt.optim.groups",
    "param_labels": "fuseopt.optim.groups",
    "OptimConfig": "fuseopt.optim.config",
    "build_optimizer": "fuseopt.optim.builder",
    "learning_rate_schedule": "fuseopt.optim.builder",
    "skip_nonfinite": "fuseopt.optim.safeguards",
    "global_norm_of": "fuseopt.optim.safeguards",
    "freeze": "fuseopt.optim.safeguards",
}

__all__ = sorted(_EXPORTS) + ["schedules"]


def __getattr__(name):
  if name == "schedules":
    return importlib.import_module("fuseopt.optim.schedules")
  module = _EXPORTS.get(name)
  if module is None:
    raise AttributeError(f"module 'fuseopt.optim' has no attribute {name!r}")
  value = getattr(importlib.import_module(module), name)
  globals()[name] = value
  return value


def __dir__():
  return sorted(set(globals()) | set(_EXPORTS) | {"schedules"})
