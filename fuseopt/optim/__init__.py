"""Optax transforms around fuseopt's kernels, schedules, parameter groups
and the config builder. Nothing here imports Pallas: kernels come from
:mod:`fuseopt.kernels`."""

from __future__ import annotations

from fuseopt.optim import schedules

# Stochastically rounded apply_updates.
from fuseopt.optim.updates import apply_updates

# Adam/AdamW on bf16 moments, and the fused step.
from fuseopt.optim.adam_transforms import adam
from fuseopt.optim.adam_transforms import adamw
from fuseopt.optim.adam_transforms import bf16_moments
from fuseopt.optim.adam_transforms import scale_by_adam
from fuseopt.optim.convert import convert_moments
from fuseopt.optim.step import step

# Muon, its matrix views and its split from logical axes; QK-Clip.
from fuseopt.optim.muon_transforms import muon
from fuseopt.optim.muon_transforms import MuonDimensionNumbers
from fuseopt.optim.muon_transforms import scale_by_muon
from fuseopt.optim.execution import Execution
from fuseopt.optim.muon_settings import NewtonSchulz
from fuseopt.optim.normuon_transforms import normuon
from fuseopt.optim.normuon_transforms import NorMuonState
from fuseopt.optim.normuon_transforms import scale_by_normuon

# Cautious weight decay (a decay rate's piece); exact bf16 parameters (a
# mantissa companion); stacked experts (a spec's piece).
from fuseopt.optim.weight_decay import add_cautious_decayed_weights
from fuseopt.optim.weight_decay import cautious
from fuseopt.optim.weight_decay import CautiousDecay
from fuseopt.optim.mantissa import master_params
from fuseopt.optim.mantissa import MantissaState
from fuseopt.optim.mantissa import track_mantissa
from fuseopt.optim.matrix_views import Experts
from fuseopt.optim.matrix_views import MatrixViews
from fuseopt.optim.matrix_views import mla_kv_b_proj_views
from fuseopt.optim.muon_axes import BATCH_AXES
from fuseopt.optim.muon_axes import HEAD_AXES
from fuseopt.optim.muon_axes import LAYER_AXES
from fuseopt.optim.muon_axes import logical_axes
from fuseopt.optim.muon_axes import muon_weight_dimension_numbers
from fuseopt.optim.muon_axes import SELECTION_AXES
from fuseopt.optim.qk_clip import MLAHeadDims
from fuseopt.optim.qk_clip import muonclip
from fuseopt.optim.qk_clip import PROJECTION_ROLES
from fuseopt.optim.qk_clip import QK_PROJECTIONS
from fuseopt.optim.qk_clip import scale_by_qk_clip

# Parameter groups, the config record, its schedules, and the builder.
from fuseopt.optim.builder import build_optimizer
from fuseopt.optim.builder import learning_rate_schedule
from fuseopt.optim.config import OptimConfig
from fuseopt.optim.groups import mup_param_groups
from fuseopt.optim.groups import NO_DECAY_PATTERNS
from fuseopt.optim.groups import param_labels
from fuseopt.optim.groups import ParamGroup
from fuseopt.optim.safeguards import freeze
from fuseopt.optim.safeguards import global_norm_of
from fuseopt.optim.safeguards import skip_nonfinite
from fuseopt.optim.schedules import Constant
from fuseopt.optim.schedules import Cosine
from fuseopt.optim.schedules import Linear
from fuseopt.optim.schedules import Power
from fuseopt.optim.schedules import PowerTail
from fuseopt.optim.schedules import WSD

__all__ = (
    "BATCH_AXES",
    "CautiousDecay",
    "Constant",
    "Cosine",
    "Execution",
    "Experts",
    "HEAD_AXES",
    "LAYER_AXES",
    "Linear",
    "MLAHeadDims",
    "MatrixViews",
    "MantissaState",
    "MuonDimensionNumbers",
    "NewtonSchulz",
    "NorMuonState",
    "NO_DECAY_PATTERNS",
    "OptimConfig",
    "PROJECTION_ROLES",
    "ParamGroup",
    "Power",
    "PowerTail",
    "QK_PROJECTIONS",
    "SELECTION_AXES",
    "WSD",
    "adam",
    "adamw",
    "add_cautious_decayed_weights",
    "apply_updates",
    "bf16_moments",
    "convert_moments",
    "build_optimizer",
    "cautious",
    "freeze",
    "global_norm_of",
    "learning_rate_schedule",
    "logical_axes",
    "master_params",
    "mla_kv_b_proj_views",
    "muon",
    "muon_weight_dimension_numbers",
    "muonclip",
    "mup_param_groups",
    "normuon",
    "param_labels",
    "scale_by_adam",
    "scale_by_muon",
    "scale_by_normuon",
    "scale_by_qk_clip",
    "schedules",
    "skip_nonfinite",
    "step",
    "track_mantissa",
)
