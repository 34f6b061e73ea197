"""The dtypes fuseopt's kernels read and write, shared by Adam and Muon.

A leaf in one of :data:`KERNEL_DTYPES` goes through the kernels (the Adam
step, the Newton-Schulz iteration, Muon's fp32 momentum pass); a leaf of
another dtype (float16, float64 under x64, complex) runs optax's own
expressions in its own dtype. Both transforms read the set here, below them,
so that neither stands on the other for it.
"""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["KERNEL_DTYPES"]

KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))

