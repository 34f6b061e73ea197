"""Stochastic rounding fp32 → bf16: 6 bytes per element (read 4, write 2)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fuseopt.benchmarks.core import Case
from fuseopt.kernels import stochastic_round as sr

SIZES = {"quick": (1 << 20,), "full": (1 << 24, 1 << 28)}
CPU_SIZES = {"quick": (1 << 18,), "full": (1 << 22,)}


def _impls(platform):
  return {"gpu": ("triton",), "tpu": ("mosaic_tpu",)}.get(platform, ())


def cases(size: str, platform: str):
  sizes = (SIZES if platform in ("gpu", "tpu") else CPU_SIZES)[size]
  out = []
  for n in sizes:
    def make_x(n=n):
      return jax.random.normal(jax.random.key(0), (n,), jnp.float32)

    def variant(fn, n=n):
      def build():
        return jax.jit(fn), (make_x(n),)
      return build

    variants = {}
    for impl in _impls(platform):
      variants[f"fuseopt[{impl}]"] = variant(
          functools.partial(lambda x, impl: sr.stochastic_round_bf16(x, 7, implementation=impl), impl=impl))
    variants["fuseopt[xla]"] = variant(lambda x: sr.stochastic_round_bf16(x, 7, implementation="xla"))
    variants["xla_convert"] = variant(lambda x: x.astype(jnp.bfloat16))

    def check(outs):
      ref = outs["fuseopt[xla]"]
      return {k: bool((v.view(jnp.uint16) == ref.view(jnp.uint16)).all()) for k, v in outs.items()
              if k.startswith("fuseopt")}
    out.append(Case(op="stochastic_round", name=f"{n}", variants=variants,
                    baseline="xla_convert", bytes=6 * n, params=n, check=check))
  return out
