"""Newton–Schulz on the Mosaic TPU kernels: the fused whole-NS kernel for a
matrix that fits on chip, else the tiled symmetric-product and GEMM kernels
(:mod:`.paths`). The kernels, configs, heuristics and search spaces live in
the pieces' ``mosaic_tpu`` modules (:mod:`.sym.mosaic_tpu`, :mod:`.gemm.mosaic_tpu`,
:mod:`.fused.mosaic_tpu`)."""

from __future__ import annotations

import functools

from fuseopt.kernels import dispatch
from fuseopt.kernels.newton_schulz import paths

# Every floating batch of matrices (the public function checks them).
supports = dispatch.supports_every_call
# orthogonalize(y, *, table, restarts, ns_dtype, interpret, config): the
# iteration on a normalised batch ``y`` (B, m, n), m <= n.
orthogonalize = functools.partial(paths.orthogonalize, "mosaic_tpu")
