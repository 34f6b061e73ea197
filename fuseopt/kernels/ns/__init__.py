"""Newton–Schulz building blocks (see :mod:`fuseopt.kernels.ns.newton_schulz`).

- :mod:`.gram`: symmetric ``alpha·X Xᵀ + beta·X + gamma·I`` over the upper
  triangle of tiles, mirror written by the same program;
- :mod:`.poly`: ``B = b·A + c·A·A`` (the symmetric kernel on a square A);
- :mod:`.update`: ``X' = a·X + B X`` as a GEMM with a fused epilogue;
- :mod:`.fused`: the whole iteration in one kernel for matrices that fit on
  chip;
- :mod:`.ops`: glue that pads once and runs an iteration on these kernels.
"""
