"""Device ops: each a plain-jnp reference plus Pallas backends (Triton for
GPU, Mosaic for TPU; Mosaic GPU, sm_90 only, for the elementwise ops and
Newton–Schulz) behind
one public function taking ``implementation=`` and ``interpret=``.

One folder per op (:mod:`.stochastic_round`, :mod:`.adam`,
:mod:`.newton_schulz`), one module per backend in it; one dispatch for all
(:mod:`.dispatch`). Each op's block-size config types are exported here with
the op's name in front and the backend's name behind (``AdamTritonGroupConfig``,
``ElementwiseMosaicTPUConfig``), so ``config=`` can be built from this
namespace alone; each class has that one name. See docs/kernels.md,
"Anatomy of an op".

``fuseopt.kernels.newton_schulz`` is the function; its package's modules are
imported by their full names (``from fuseopt.kernels.newton_schulz import sym``).
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
from fuseopt.kernels.elementwise_tiling import MosaicGPUConfig as ElementwiseMosaicGPUConfig
from fuseopt.kernels.elementwise_tiling import MosaicTPUConfig as ElementwiseMosaicTPUConfig
from fuseopt.kernels.elementwise_tiling import TritonConfig as ElementwiseTritonConfig

# The Adam update on bf16 moments.
from fuseopt.kernels.adam import adam_update
from fuseopt.kernels.adam import adam_update_reference
from fuseopt.kernels.adam import adam_update_tree
from fuseopt.kernels.adam.mosaic_gpu import MosaicGPUGroupConfig as AdamMosaicGPUGroupConfig
from fuseopt.kernels.adam.triton import TritonGroupConfig as AdamTritonGroupConfig

# The platform a computation on given arrays runs on (what implementation=None reads).
from fuseopt.kernels.dispatch import current_platform

# Running the kernels shard-local on a mesh (docs/scaling.md).
from fuseopt.kernels import sharding
from fuseopt.kernels.newton_schulz.distributed import orthogonalize_sharded

# Newton-Schulz and its pieces' configs.
from fuseopt.kernels.newton_schulz import coefficient_table
from fuseopt.kernels.newton_schulz import JORDAN
from fuseopt.kernels.newton_schulz import newton_schulz
from fuseopt.kernels.newton_schulz import newton_schulz_reference
from fuseopt.kernels.newton_schulz import ns_flops
from fuseopt.kernels.newton_schulz import POLAR_EXPRESS
from fuseopt.kernels.newton_schulz import singular_value_band
from fuseopt.kernels.newton_schulz import TiledConfig
from fuseopt.kernels.newton_schulz.fused import MosaicGPUConfig as FusedMosaicGPUConfig
from fuseopt.kernels.newton_schulz.fused import MosaicTPUConfig as FusedMosaicTPUConfig
from fuseopt.kernels.newton_schulz.fused import TritonConfig as FusedTritonConfig
from fuseopt.kernels.newton_schulz.gemm import MosaicGPUConfig as GemmMosaicGPUConfig
from fuseopt.kernels.newton_schulz.gemm import MosaicTPUConfig as GemmMosaicTPUConfig
from fuseopt.kernels.newton_schulz.gemm import TritonConfig as GemmTritonConfig
from fuseopt.kernels.newton_schulz.sym import MosaicGPUConfig as SymMosaicGPUConfig
from fuseopt.kernels.newton_schulz.sym import MosaicTPUConfig as SymMosaicTPUConfig
from fuseopt.kernels.newton_schulz.sym import TritonConfig as SymTritonConfig

__all__ = (
    "AdamMosaicGPUGroupConfig",
    "AdamTritonGroupConfig",
    "ElementwiseMosaicGPUConfig",
    "ElementwiseMosaicTPUConfig",
    "ElementwiseTritonConfig",
    "FusedMosaicGPUConfig",
    "FusedMosaicTPUConfig",
    "FusedTritonConfig",
    "GemmMosaicGPUConfig",
    "GemmMosaicTPUConfig",
    "GemmTritonConfig",
    "JORDAN",
    "orthogonalize_sharded",
    "POLAR_EXPRESS",
    "STREAM_MU",
    "STREAM_NU",
    "STREAM_PARAM",
    "SymMosaicGPUConfig",
    "SymMosaicTPUConfig",
    "SymTritonConfig",
    "TiledConfig",
    "sharding",
    "adam_update",
    "adam_update_reference",
    "adam_update_tree",
    "coefficient_table",
    "current_platform",
    "derive_seed",
    "newton_schulz",
    "newton_schulz_reference",
    "ns_flops",
    "singular_value_band",
    "stochastic_round_bf16",
    "stochastic_round_reference",
)
