"""Newton–Schulz orthogonalisation (Muon's polar factor).

The op's folder:

- :mod:`.api`: the public function :func:`newton_schulz` (the function is
  also this package's name, so it lives in a module of its own);
- :mod:`.reference`: the specification and the CPU path (``"xla"``);
- :mod:`.coefficients`: the coefficient schedules, Gram restarts, FLOPs;
- :mod:`.backends`: the op's dispatch table (``xla``, ``triton``,
  ``mosaic_tpu``, ``mosaic_gpu`` (opt-in, sm_90)), each Pallas backend a
  record that runs the fused kernel or the tiled kernels (:mod:`.paths`), and
  the platform defaults a measurement set (Gram iterations, the standard
  iteration's backend); :mod:`.mosaic_gpu_common`: the Mosaic GPU tile layout;
- the pieces, each a folder with its reference and one module per backend
  (kernel, config, heuristic, search space): :mod:`.sym` (the symmetric
  products ``alpha·X Xᵀ + beta·X + gamma·I``: the Gram matrix and the
  polynomial), :mod:`.gemm` (``a·X + B X``), :mod:`.fused` (the whole
  iteration in one kernel); :mod:`.tiled` runs the iteration on the first two;
- :mod:`.distributed`: Newton–Schulz over sharded matrices (all-to-all).
"""

from __future__ import annotations

from fuseopt.kernels.newton_schulz.api import newton_schulz
from fuseopt.kernels.newton_schulz.api import TiledConfig
from fuseopt.kernels.newton_schulz.coefficients import coefficient_table
from fuseopt.kernels.newton_schulz.coefficients import DEFAULT_STEPS
from fuseopt.kernels.newton_schulz.coefficients import GRAM_AUTO_ASPECT
from fuseopt.kernels.newton_schulz.coefficients import GRAM_RESTARTS
from fuseopt.kernels.newton_schulz.coefficients import JORDAN
from fuseopt.kernels.newton_schulz.coefficients import ns_flops
from fuseopt.kernels.newton_schulz.coefficients import POLAR_EXPRESS
from fuseopt.kernels.newton_schulz.coefficients import singular_value_band
from fuseopt.kernels.newton_schulz.reference import newton_schulz_reference

__all__ = ["DEFAULT_STEPS", "GRAM_AUTO_ASPECT", "GRAM_RESTARTS", "JORDAN", "POLAR_EXPRESS",
           "TiledConfig", "coefficient_table", "newton_schulz", "newton_schulz_reference",
           "ns_flops", "singular_value_band"]
