"""fuseopt: fused optimizer kernels for JAX, as drop-in optax transforms."""

from fuseopt import kernels
from fuseopt import optim

__version__ = "0.1.0"
__all__ = ["kernels", "optim", "__version__"]
