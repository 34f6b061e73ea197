"""Stochastic rounding's backends by name: this op's one dispatch table
(:func:`fuseopt.kernels.dispatch.select` chooses among them)."""

from fuseopt.kernels.stochastic_round import mosaic_gpu, mosaic_tpu, reference, triton

BACKENDS = {"xla": reference, "triton": triton, "mosaic_tpu": mosaic_tpu, "mosaic_gpu": mosaic_gpu}

# implementation=None's order where it is not dispatch.PLATFORM_ORDER's. On
# an H200 XLA's own fusion of the counter hash (the reference) streams faster
# than the Triton kernel and than XLA's round-to-nearest convert
# (docs/measurements.md, "Stochastic rounding"): the reference is the GPU's
# default; the kernel runs when named. The same on a TPU v5e, where XLA's
# fusion of the reference also outran the Mosaic kernel and the plain convert
# (docs/measurements.md, "TPU v5e").
ORDER = {"gpu": ("xla",), "cuda": ("xla",), "tpu": ("xla",)}

