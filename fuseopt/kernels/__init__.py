"""Device ops: each a plain-jnp reference plus Pallas backends (Triton for
GPU, Mosaic for TPU; Mosaic GPU, sm_90 only, for the elementwise ops) behind
one public function taking ``implementation=`` and ``interpret=``.

Each op's block-size config types are exported with the op's name in front
(the modules themselves call them ``TritonConfig`` / ``MosaicConfig``), so
``config=`` can be built from this namespace alone. See docs/kernels.md.
"""

from __future__ import annotations

# Stochastic rounding fp32 -> bf16 and the counter hash.
from fuseopt.kernels.counter_hash import derive_seed
from fuseopt.kernels.counter_hash import STREAM_MU
from fuseopt.kernels.counter_hash import STREAM_NU
from fuseopt.kernels.counter_hash import STREAM_PARAM
from fuseopt.kernels.stochastic_round import stochastic_round_bf16
from fuseopt.kernels.stochastic_round import stochastic_round_reference

# Elementwise kernels' configs (stochastic rounding and the Adam update).
from fuseopt.kernels._elementwise import MosaicConfig as ElementwiseMosaicConfig
from fuseopt.kernels._elementwise import MosaicGPUConfig as ElementwiseMosaicGPUConfig
from fuseopt.kernels._elementwise import TritonConfig as ElementwiseTritonConfig

# The Adam update on bf16 moments.
from fuseopt.kernels.adam import adam_update
from fuseopt.kernels.adam import adam_update_reference
from fuseopt.kernels.adam import adam_update_tree
from fuseopt.kernels.adam import TritonGroupConfig as AdamTritonGroupConfig

# Running the kernels shard-local on a mesh (docs/scaling.md).
from fuseopt.kernels import sharding
from fuseopt.kernels.ns.distributed import orthogonalize_sharded

# Newton-Schulz.
from fuseopt.kernels.ns.newton_schulz import coefficient_table
from fuseopt.kernels.ns.newton_schulz import JORDAN
from fuseopt.kernels.ns.newton_schulz import newton_schulz
from fuseopt.kernels.ns.newton_schulz import newton_schulz_reference
from fuseopt.kernels.ns.newton_schulz import ns_flops
from fuseopt.kernels.ns.newton_schulz import POLAR_EXPRESS
from fuseopt.kernels.ns.newton_schulz import singular_value_band
from fuseopt.kernels.ns.newton_schulz import TiledConfig
from fuseopt.kernels.ns.fused import MosaicConfig as FusedMosaicConfig
from fuseopt.kernels.ns.fused import TritonConfig as FusedTritonConfig
from fuseopt.kernels.ns.gram import MosaicConfig as GramMosaicConfig
from fuseopt.kernels.ns.gram import TritonConfig as GramTritonConfig
from fuseopt.kernels.ns.update import MosaicConfig as UpdateMosaicConfig
from fuseopt.kernels.ns.update import TritonConfig as UpdateTritonConfig

__all__ = (
    "AdamTritonGroupConfig",
    "ElementwiseMosaicConfig",
    "ElementwiseMosaicGPUConfig",
    "ElementwiseTritonConfig",
    "FusedMosaicConfig",
    "FusedTritonConfig",
    "GramMosaicConfig",
    "GramTritonConfig",
    "JORDAN",
    "orthogonalize_sharded",
    "POLAR_EXPRESS",
    "STREAM_MU",
    "STREAM_NU",
    "STREAM_PARAM",
    "TiledConfig",
    "sharding",
    "UpdateMosaicConfig",
    "UpdateTritonConfig",
    "adam_update",
    "adam_update_reference",
    "adam_update_tree",
    "coefficient_table",
    "derive_seed",
    "newton_schulz",
    "newton_schulz_reference",
    "ns_flops",
    "singular_value_band",
    "stochastic_round_bf16",
    "stochastic_round_reference",
)
