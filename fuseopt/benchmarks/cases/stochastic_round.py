"""Stochastic rounding fp32 → bf16: 6 bytes per element (read 4, write 2).

Rows: ``fuseopt`` is the default call, ``stochastic_round_bf16(x, seed)``,
whichever backend the dispatcher picks for it; ``fuseopt[<backend>]`` passes
``implementation=<backend>`` (``triton`` on a GPU, ``mosaic_tpu`` on a TPU,
and ``xla``, the reference, everywhere: every case's check). One of them is
the default's own program, recorded as ``same_program_as`` and not timed
twice. The baseline ``xla_convert`` is XLA's round-to-nearest
``x.astype(bf16)``, the peer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fuseopt.benchmarks.core import Case
from fuseopt.kernels import stochastic_round as sr

SIZES = {"quick": (1 << 20,), "full": (1 << 24, 1 << 28)}
CPU_SIZES = {"quick": (1 << 18,), "full": (1 << 22,)}
SEED = 7
DEFAULT = "fuseopt"


def _impls(platform):
  return {"gpu": ("triton",), "tpu": ("mosaic_tpu",)}.get(platform, ())


def variant_fns(platform: str) -> dict:
  """label -> function of ``x``: the default call, the explicit backends,
  XLA's convert."""
  fns = {DEFAULT: lambda x: sr.stochastic_round_bf16(x, SEED)}
  for impl in (*_impls(platform), "xla"):
    fns[f"fuseopt[{impl}]"] = lambda x, impl=impl: sr.stochastic_round_bf16(x, SEED, implementation=impl)
  fns["xla_convert"] = lambda x: x.astype(jnp.bfloat16)
  return fns


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

    fns = variant_fns(platform)
    meta = {label: {"moved_bytes_per_param": 6,
                    "calls": ("x.astype(bf16)" if label == "xla_convert" else
                              "stochastic_round_bf16(x, seed)" if label == DEFAULT else
                              f"stochastic_round_bf16(x, seed, implementation={label[8:-1]!r})")}
            for label in fns}

    def check(outs):
      ref = outs["fuseopt[xla]"]
      return {k: bool((v.view(jnp.uint16) == ref.view(jnp.uint16)).all()) for k, v in outs.items()
              if k.startswith("fuseopt")}
    out.append(Case(op="stochastic_round", name=f"{n}",
                    variants={k: variant(fn) for k, fn in fns.items()},
                    baseline="xla_convert", default=DEFAULT, bytes=6 * n, params=n, meta=meta,
                    check=check))
  return out
