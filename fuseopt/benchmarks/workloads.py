"""Named workloads shared by benchmarks, the GPU suite and tests.

Every op's bench cases (``fuseopt/benchmarks/cases``) and tests can import
these so that one shape means the same thing everywhere:

* :data:`NS_SHAPES` — the per-shape Newton–Schulz table of docs/measurements.md
  (``(m, n)`` or ``(batch, m, n)``), with :data:`NS_SHAPES_CPU` scaled down.
* :func:`llama_tree` — the 1.20 B-parameter Llama-shaped parameter tree of
  docs/measurements.md (d=2048, ff=8192, 16 layers, vocab 32000: 147 leaves), as
  ``jax.ShapeDtypeStruct`` leaves or as arrays; :func:`llama_tree_cpu` the
  same structure at CPU size.
* :data:`SR_SIZES` — stochastic-rounding element counts.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Newton–Schulz shapes of docs/measurements.md, in its row order. A 3-tuple is a stack.
NS_SHAPES: tuple[tuple[int, ...], ...] = (
    (1024, 1024),
    (2048, 2048),
    (4096, 4096),
    (2048, 8192),
    (8192, 2048),
    (4096, 14336),
    (16, 2048, 2048),
)
# docs/measurements.md's optax.contrib NS times (ms, bf16 input, 5 steps, H200): the
# reference the GPU report quotes next to the measured rows.
NS_OPTAX_H200_MS = {
    (1024, 1024): 0.359, (2048, 2048): 0.658, (4096, 4096): 3.353,
    (2048, 8192): 1.382, (8192, 2048): 1.454, (4096, 14336): 8.710,
    (16, 2048, 2048): 7.434,
}
# The same aspect ratios (square, 1:4, 4:1, 2:7, stacked) at CPU size.
NS_SHAPES_CPU: tuple[tuple[int, ...], ...] = (
    (128, 128),
    (128, 512),
    (512, 128),
    (128, 448),
    (4, 128, 128),
)
# Quick subsets (``size="quick"``): a square, a wide and a stacked shape.
NS_SHAPES_QUICK = ((2048, 2048), (2048, 8192), (16, 2048, 2048))
NS_SHAPES_CPU_QUICK = ((128, 128), (128, 512), (4, 128, 128))

# Stochastic rounding: element counts.
SR_SIZES = {"quick": (1 << 20,), "full": (1 << 24, 1 << 28)}
SR_SIZES_CPU = {"quick": (1 << 18,), "full": (1 << 22,)}

# The Llama-shaped model of docs/measurements.md and its CPU stand-in.
LLAMA_1B = dict(d=2048, ff=8192, layers=16, vocab=32000)
LLAMA_CPU = dict(d=64, ff=256, layers=2, vocab=512)


def ns_flops(shape: tuple[int, ...], steps: int = 5) -> float:
  """Standard Newton–Schulz FLOPs: ``steps * (4 m^2 n + 2 m^3)`` per matrix
  with ``m <= n`` (the count of docs/measurements.md), times the stack size."""
  *batch, a, b = shape
  m, n = min(a, b), max(a, b)
  return float(math.prod(batch) * steps * (4 * m * m * n + 2 * m ** 3))


def shape_name(shape: tuple[int, ...]) -> str:
  """``(2048, 8192)`` → ``"2048x8192"``; ``(16, 2048, 2048)`` → ``"16x2048x2048"``."""
  return "x".join(str(s) for s in shape)


def llama_shapes(d: int = 2048, ff: int = 8192, layers: int = 16,
                 vocab: int = 32000) -> dict[str, Any]:
  """Shapes of a Llama-style decoder's parameters as a nested dict of tuples.

  Per layer: attention q/k/v/o (d×d), MLP gate/up (d×ff) and down (ff×d),
  two RMSNorm scales (d); plus the embedding and an untied LM head
  (vocab×d, d×vocab) and the final norm. With the defaults this is
  1,204,881,408 parameters in 147 leaves (the 1.20 B tree of docs/measurements.md).
  """
  layer = {
      "attn": {"q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d)},
      "mlp": {"gate": (d, ff), "up": (d, ff), "down": (ff, d)},
      "attn_norm": (d,),
      "mlp_norm": (d,),
  }
  return {
      "embed": (vocab, d),
      "layers": [layer for _ in range(layers)],
      "final_norm": (d,),
      "lm_head": (d, vocab),
  }


def _is_shape(x):
  return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


def _normal(seed: int, i: int, shape, dtype, scale: float):
  # numpy, not jax.random: one XLA compile per leaf shape costs seconds on
  # the CPU, and a workload only needs reproducible values.
  x = np.random.default_rng([seed, i]).standard_normal(shape, dtype=np.float32) * np.float32(scale)
  return jnp.asarray(x.astype(np.dtype(dtype)))


def llama_tree(dtype=jnp.float32, *, seed: int | None = None, abstract: bool | None = None,
               scale: float = 0.02, **dims) -> Any:
  """The Llama-shaped parameter tree.

  ``abstract=True`` (the default when ``seed`` is None) gives
  ``jax.ShapeDtypeStruct`` leaves — free to build at 1.2 B parameters, for
  lowering and ``memory_analysis``. With a ``seed`` the leaves are
  ``scale * normal`` arrays of ``dtype`` on the default device, leaf ``i``
  drawn from ``numpy.random.default_rng([seed, i])``, so a tree is
  reproducible leaf by leaf. ``dims`` override ``d``, ``ff``,
  ``layers``, ``vocab``.
  """
  shapes = llama_shapes(**{**LLAMA_1B, **dims})
  if abstract is None:
    abstract = seed is None
  structs = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dtype), shapes, is_leaf=_is_shape)
  if abstract:
    return structs
  return materialize(structs, seed=seed or 0, scale=scale)


def llama_tree_cpu(dtype=jnp.float32, *, seed: int | None = None, abstract: bool | None = None,
                   **dims) -> Any:
  """:func:`llama_tree` at CPU size (d=64, ff=256, 2 layers, vocab 512:
  196,928 parameters in 21 leaves): same structure, leaf kinds and aspect
  ratios, small enough for interpret mode and CI."""
  return llama_tree(dtype, seed=seed, abstract=abstract, **{**LLAMA_CPU, **dims})


def tree_for(platform: str, size: str = "quick", dtype=jnp.float32, *, seed: int | None = None,
             abstract: bool | None = None) -> Any:
  """The Llama tree that suits a backend: the full 1.20 B tree on an
  accelerator, the CPU tree on the CPU (``size`` "full" doubles its layers)."""
  if platform in ("gpu", "tpu", "cuda", "rocm"):
    return llama_tree(dtype, seed=seed, abstract=abstract)
  extra = {"layers": 4} if size == "full" else {}
  return llama_tree_cpu(dtype, seed=seed, abstract=abstract, **extra)


def tree_params(tree) -> int:
  """Number of parameters (elements) in a tree of arrays or structs."""
  return int(sum(math.prod(x.shape) for x in jax.tree.leaves(tree)))


def tree_bytes(tree) -> int:
  return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def materialize(tree, *, seed: int = 0, scale: float = 0.02):
  """Arrays for a tree of ``ShapeDtypeStruct`` (normal × ``scale``; leaf
  ``i`` from ``numpy.random.default_rng([seed, i])``)."""
  leaves, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(treedef, [_normal(seed, i, s.shape, s.dtype, scale) for i, s in enumerate(leaves)])


def matrices(tree) -> list:
  """The 2-D leaves of a tree (what Muon orthogonalises) — excluding the
  embedding and LM head, which hybrid Muon gives to AdamW."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  out = []
  for path, leaf in flat:
    name = jax.tree_util.keystr(path)
    if len(leaf.shape) == 2 and "embed" not in name and "lm_head" not in name:
      out.append(leaf)
  return out
