"""The fused Adam update's backends by name: this op's one dispatch table
(:func:`fuseopt.kernels.dispatch.select` chooses among them)."""

from fuseopt.kernels.adam import mosaic_gpu, mosaic_tpu, reference, triton

BACKENDS = {"xla": reference, "triton": triton, "mosaic_tpu": mosaic_tpu, "mosaic_gpu": mosaic_gpu}
