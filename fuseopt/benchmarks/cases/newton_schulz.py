"""Newton–Schulz, 5 steps, bf16 input: the per-shape table of docs/measurements.md.

Variants (Jordan's coefficients everywhere, so every output can be compared
with optax's; Polar Express costs the same FLOPs):

- ``optax_ns_bf16`` (baseline): ``optax.contrib``'s
  ``orthogonalize_via_newton_schulz`` on the bf16 input (it iterates in the
  input dtype), vmapped over a stack;
- ``fuseopt``: the default call, ``newton_schulz(x)`` (the platform's
  backend and iteration: on a GPU Gram NS on Triton for aspect ratio >= 2,
  else the standard iteration as XLA's matmuls);
- ``fuseopt[xla]``: the reference (plain jnp; bf16 iterates, fp32
  accumulation), standard iteration (every tagged row passes ``gram``);
- ``fuseopt[xla,gram]``: Gram NS (aspect ratio >= 2 only; CPU only, to keep
  the one-shot GPU suite inside its time budget);
- on a GPU / TPU: ``fuseopt[<impl>]`` (the default dispatch: fused kernel for
  small matrices, symmetric kernels + XLA dot otherwise),
  ``fuseopt[<impl>+pallas_update]`` (the update ``a·X + B X`` as the Pallas
  GEMM with fused epilogue instead of XLA's dot) and ``fuseopt[<impl>,gram]``;
  on an sm_90 GPU also ``fuseopt[mosaic_gpu]`` (the Mosaic GPU kernels: the
  single kernel for small matrices, else the symmetric products and the
  update GEMM; :mod:`fuseopt.kernels.newton_schulz.mosaic_gpu`).

``flops`` is the standard count 5·(4m²n + 2m³) per matrix (m <= n), so a
symmetric or Gram variant can exceed the matmul ceiling in effective
TFLOP/s. The ``check`` gives each fuseopt variant's relative Frobenius error
against the reference (passes below 3e-2; 5e-2 for Gram NS, whose bf16
error differs in kind) and against optax (a sanity bound of 0.15: optax
rounds the coefficients themselves to bf16, a slightly different polynomial;
about 4% apart at the CPU sizes).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from fuseopt.benchmarks import workloads
from fuseopt.benchmarks.core import Case

from fuseopt.kernels.newton_schulz import api as ns  # noqa: E402

STEPS = 5
COEFFS = "jordan"


def _impls(platform):
  return {"gpu": ("triton",), "tpu": ("mosaic_tpu",)}.get(platform, ())


def shapes(size: str, platform: str):
  if platform in ("gpu", "tpu"):
    return workloads.NS_SHAPES if size == "full" else workloads.NS_SHAPES_QUICK
  return workloads.NS_SHAPES_CPU if size == "full" else workloads.NS_SHAPES_CPU_QUICK


def flops(shape) -> float:
  *batch, m, n = shape
  return math.prod(batch) * ns.ns_flops(m, n, STEPS)


def optax_ns(x):
  """optax.contrib's NS on x (bf16 in, bf16 iterates), a stack vmapped: optax
  0.2.8's expressions as fuseopt.optim.muon_newton_schulz carries them (optax has no
  public function for the iteration alone)."""
  from fuseopt.optim import muon_newton_schulz
  table = jnp.tile(jnp.asarray(ns.JORDAN, x.dtype), (STEPS, 1))
  f = functools.partial(muon_newton_schulz.optax_newton_schulz, table=table,
                        preconditioning="frobenius", eps=1e-8)
  for _ in range(x.ndim - 2):
    f = jax.vmap(f)
  return f(x)


def _rel_err(a, b):
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm((a - b).ravel()) / jnp.linalg.norm(b.ravel()))


def check(outs):
  ref = outs.get("fuseopt[xla]")
  base = outs.get("optax_ns_bf16")
  figures = {}
  for label, out in outs.items():
    if not label.startswith("fuseopt"):
      continue
    tol = 5e-2 if "gram" in label else 3e-2
    if ref is not None and label != "fuseopt[xla]":
      e = _rel_err(out, ref)
      figures[f"rel_err_vs_reference[{label}]"] = e
      figures[f"ok[{label}]"] = bool(np.isfinite(e) and e < tol)
    if base is not None:
      e = _rel_err(out, base)
      figures[f"rel_err_vs_optax[{label}]"] = e
      # optax rounds the coefficients to bf16 (3.4445 → 3.4375, ...) and
      # its products to bf16, so it is a different polynomial: a sanity bound.
      figures[f"ok_vs_optax[{label}]"] = bool(np.isfinite(e) and e < 0.15)
  return figures


def variant_fns(shape, platform: str) -> dict:
  """label -> un-jitted function of the bf16 input, for one shape."""
  *batch, m, n = shape
  wide = max(m, n) >= ns.GRAM_AUTO_ASPECT * min(m, n)

  def fuse(impl, gram=False, **kw):
    # (tagged rows name their backend and their iteration: gram=False is the
    # standard one whatever the platform's default)
    return lambda x: ns.newton_schulz(x, coeffs=COEFFS, steps=STEPS, implementation=impl,
                                      gram=gram, **kw)

  fns = {"optax_ns_bf16": optax_ns,
         # the default call: backend and iteration as the platform's dispatch picks them
         "fuseopt": lambda x: ns.newton_schulz(x, coeffs=COEFFS, steps=STEPS),
         "fuseopt[xla]": fuse("xla")}
  if wide and not _impls(platform):  # on an accelerator the kernel Gram row stands for it
    fns["fuseopt[xla,gram]"] = fuse("xla", gram=True)
  for impl in _impls(platform):
    from fuseopt.kernels.newton_schulz import gemm
    fns[f"fuseopt[{impl}]"] = fuse(impl)
    config = ns.TiledConfig(matmul=gemm.heuristic(impl, math.prod(batch), min(m, n), max(m, n)))
    fns[f"fuseopt[{impl}+pallas_update]"] = fuse(impl, config=config)
    if wide:
      fns[f"fuseopt[{impl},gram]"] = fuse(impl, gram=True)
  if platform == "gpu" and _sm90():   # Mosaic GPU's kernels beside Triton's, where they compile
    fns["fuseopt[mosaic_gpu]"] = fuse("mosaic_gpu")
  return fns


def _sm90() -> bool:
  from fuseopt.kernels import dispatch
  try:
    dispatch.check_mosaic_gpu_target("newton_schulz", False)
  except ValueError:
    return False
  return True


def cases(size: str, platform: str):
  out = []
  for shape in shapes(size, platform):
    def make_x(shape=shape):
      return jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(jnp.bfloat16)

    def variant(fn, shape=shape):
      def build():
        return jax.jit(fn), (make_x(shape),)
      return build

    variants = {label: variant(fn) for label, fn in variant_fns(shape, platform).items()}
    out.append(Case(op="newton_schulz", name="x".join(map(str, shape)), variants=variants,
                    baseline="optax_ns_bf16", flops=flops(shape), params=math.prod(shape),
                    check=check, default="fuseopt"))
  return out
