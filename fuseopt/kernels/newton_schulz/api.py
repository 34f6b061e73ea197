"""Newton–Schulz orthogonalisation (Muon's polar factor): the public function.

What it computes: :mod:`.reference` (the specification and the CPU path).
Backends (:mod:`.backends`' table), chosen by :mod:`fuseopt.kernels.dispatch`:
``xla`` (:mod:`.reference`), ``triton``, ``mosaic_tpu`` and ``mosaic_gpu``
(opt-in, sm_90); a Pallas backend runs the fused whole-NS kernel or the tiled
kernels (:mod:`.paths`; the pieces' modules per backend in :mod:`.sym`,
:mod:`.gemm`, :mod:`.fused`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fuseopt.kernels import _validate
from fuseopt.kernels import dispatch
from fuseopt.kernels.newton_schulz.backends import BACKENDS, DEFAULT_GRAM, GRAM_ORDER, STANDARD_ORDER
from fuseopt.kernels.newton_schulz.coefficients import coefficient_table
from fuseopt.kernels.newton_schulz.coefficients import DEFAULT_STEPS
from fuseopt.kernels.newton_schulz.coefficients import GRAM_AUTO_ASPECT
from fuseopt.kernels.newton_schulz.coefficients import gram_restarts
from fuseopt.kernels.newton_schulz.coefficients import JORDAN
from fuseopt.kernels.newton_schulz.coefficients import ns_flops
from fuseopt.kernels.newton_schulz.coefficients import POLAR_EXPRESS
from fuseopt.kernels.newton_schulz.coefficients import singular_value_band
from fuseopt.kernels.newton_schulz.paths import pick_path as _pick_path
from fuseopt.kernels.newton_schulz.reference import as_batched
from fuseopt.kernels.newton_schulz.reference import check_dtype
from fuseopt.kernels.newton_schulz.reference import newton_schulz_reference
from fuseopt.kernels.newton_schulz.reference import normalise
from fuseopt.kernels.newton_schulz.tiled import TiledConfig

OP_NAME = "newton_schulz"

__all__ = ["DEFAULT_STEPS", "GRAM_AUTO_ASPECT", "JORDAN", "POLAR_EXPRESS", "TiledConfig",
           "coefficient_table", "newton_schulz", "newton_schulz_reference", "ns_flops",
           "singular_value_band"]


def newton_schulz(x, *, coeffs="polar_express", steps=None, ns_dtype=jnp.bfloat16,
                  eps=1e-7, gram=None, implementation=None, interpret=False,
                  config=None) -> jax.Array:
  """Orthogonalises ``x`` (its polar factor U Vᵀ, approximately) by Newton–Schulz.

  Args:
    x: (m, n) or (..., m, n) floating array; leading axes are a batch of
      independent matrices (one normalisation per matrix).
    coeffs: ``"polar_express"`` (default), ``"jordan"``, or a table of shape
      (3,) or (steps, 3) of (a, b, c) per step (concrete values).
    steps: number of steps (default 5, or the table's length).
    ns_dtype: dtype of the iterates (bf16 default; fp32 for a precise run);
      products always accumulate in fp32.
    eps: added to the (inflated) Frobenius norm before dividing; a finite
      number >= 0. The norm is taken after scaling by the largest magnitude,
      so it neither overflows nor underflows (exact for norms up to 2^126;
      beyond, a NaN result rather than a silent zero), and a zero matrix
      gives zeros.
    gram: Gram Newton–Schulz (iterate on the m × m Gram matrix, restarted
      before the steps in ``GRAM_RESTARTS[coeffs]``): ``True``, ``False``,
      ``"auto"`` (from aspect ratio 2), a tuple of step indices setting the
      restarts (``(2,)``: one restart, fewer FLOPs, less accurate on
      ill-conditioned inputs), or ``None`` (default): the platform's fastest
      measured (``backends.DEFAULT_GRAM``): ``"auto"`` on a GPU and a TPU,
      ``False`` (optax's iteration) elsewhere.
    implementation: ``None`` (chosen by :mod:`fuseopt.kernels.dispatch`;
      without ``config``, the standard iteration runs as XLA's matmuls on a
      GPU and a TPU, and the Gram iteration on Triton on a GPU and as XLA's
      matmuls on a TPU, each the faster measured there:
      ``backends.STANDARD_ORDER``, ``GRAM_ORDER``), ``"xla"``, ``"triton"``, ``"mosaic_tpu"``
      or ``"mosaic_gpu"`` (sm_90 GPUs only, bf16/f16 iterates:
      :mod:`.mosaic_gpu`; never chosen by ``None``).
    interpret: run a Pallas backend in interpret mode (CPU debugging).
    config: :class:`TiledConfig`, or a :mod:`fuseopt.kernels.newton_schulz.fused`
      config (``mosaic_gpu``: :class:`.fused.mosaic_gpu.MosaicGPUConfig`) to force
      the single-kernel path.

  Returns:
    An array of ``x``'s shape and dtype. Its derivative is the reference's
    (:func:`newton_schulz_reference`), whatever the implementation.
  """
  x = jnp.asarray(x)
  ns_dtype = check_dtype(x, ns_dtype)
  _validate.check_real("newton_schulz", "eps", eps, lo=0.0)
  table, scale = coefficient_table(coeffs, steps)
  overrides = dispatch.environment_overrides()
  platform = dispatch.current_platform((x,))
  if gram is None:
    gram = DEFAULT_GRAM.get(platform, False)
  xb, _ = as_batched(x)
  batch, m, n = xb.shape
  restarts = gram_restarts(gram, m, n, coeffs)
  # (a config asks for a Pallas path: the common order)
  order = None if config is not None else STANDARD_ORDER if restarts is None else GRAM_ORDER
  impl = dispatch.select(OP_NAME, BACKENDS, implementation, (x,), interpret=interpret,
                         overrides=overrides, order=order, shape=x.shape, dtype=x.dtype,
                         ns_dtype=ns_dtype)
  if impl == "xla" or xb.size == 0:
    return newton_schulz_reference(x, coeffs=coeffs, steps=steps, ns_dtype=ns_dtype,
                                   eps=eps, gram=gram)
  reference = functools.partial(newton_schulz_reference, coeffs=coeffs, steps=steps,
                                ns_dtype=ns_dtype, eps=eps, gram=gram)
  kernel = functools.partial(_run_backend, impl=impl, interpret=interpret,
                             config=config, table=table, scale=scale, eps=eps,
                             ns_dtype=ns_dtype, restarts=restarts, ns_path=overrides.ns_path)
  return _reference_derivative(kernel, reference, x)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _reference_derivative(kernel, reference, x):
  return kernel(x)


@_reference_derivative.defjvp
def _reference_derivative_jvp(kernel, reference, primals, tangents):
  # Pallas calls have no usable derivative (jax fails with "Linearization
  # failed to produce known values"); the kernels compute the reference's
  # function, so they take the reference's derivative (computed by XLA).
  (x,), (t,) = primals, tangents
  _, dy = jax.jvp(reference, (x,), (t,))
  return kernel(x), dy


def _run_backend(x, *, impl, interpret, config, table, scale, eps, ns_dtype, restarts, ns_path):
  """Normalises ``x`` and runs backend ``impl``'s iteration on it."""
  xb, restore = as_batched(x)
  y = normalise(xb, scale, eps, ns_dtype)
  y = BACKENDS[impl].iterate(
      y, table=table, restarts=restarts, ns_dtype=ns_dtype, config=config,
      interpret=dispatch.interpret_arg(impl, interpret), ns_path=ns_path)
  return restore(y.astype(x.dtype))
