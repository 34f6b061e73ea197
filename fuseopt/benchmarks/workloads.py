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
* :func:`fitting_dims` — the Llama tree an accelerator's memory holds: the
  1.20 B tree where optax's fp32 AdamW step on it fits
  (:func:`adamw_step_bytes`), else the most layers of the same d and ff
  that do (6 layers, 533,751,808 params, on a 16 GiB TPU v5e);
  :func:`tree_info` says which one a run took.
* :class:`TreeData` — one case's params and grads, built on the device and
  freed with the case, so that one case's arrays never outlive it.
"""

from __future__ import annotations

import functools
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


# -- sizing the tree from the device's memory ---------------------------------
# One optax fp32 AdamW step, the largest of the suite's steps: params 4, grads
# 4, mu and nu 4 + 4 held, and the step's outputs (params', mu', nu': 12)
# counted beside them, as if nothing were donated.
ADAMW_FP32_STEP_BYTES_PER_PARAM = 4 + 4 + 8 + 12
# The share of the device's ``bytes_limit`` the model may take: XLA's
# temporaries, the suite's other buffers and fragmentation get the rest.
MEMORY_HEADROOM = 0.92


def llama_params(d: int = 2048, ff: int = 8192, layers: int = 16, vocab: int = 32000) -> int:
  """Parameters of :func:`llama_shapes` (without building it): per layer
  ``4 d^2 + 3 d ff + 2 d``, plus embedding, LM head and final norm."""
  return layers * (4 * d * d + 3 * d * ff + 2 * d) + 2 * vocab * d + d


def adamw_step_bytes(params: int) -> int:
  """Bytes optax's fp32 AdamW step on ``params`` parameters must hold:
  :data:`ADAMW_FP32_STEP_BYTES_PER_PARAM` per parameter."""
  return ADAMW_FP32_STEP_BYTES_PER_PARAM * int(params)


def fitting_dims(bytes_limit: int | None, *, base: dict | None = None,
                 headroom: float = MEMORY_HEADROOM) -> dict:
  """The Llama dims a device of ``bytes_limit`` bytes takes: ``base``
  (:data:`LLAMA_1B`) where :func:`adamw_step_bytes` of it fits in
  ``headroom * bytes_limit``, else the most layers of the same d, ff and
  vocab that fit (at least 1). ``None`` (the limit unknown): ``base``.

  A 16 GiB TPU v5e (``bytes_limit`` about 15.7 GiB) gets 6 layers, 533,751,808
  parameters (14.9 GB modelled); an H200 or a v5p the whole 1.2 B tree.
  """
  base = dict(base or LLAMA_1B)
  if not bytes_limit:
    return base
  for layers in range(base["layers"], 0, -1):
    dims = {**base, "layers": layers}
    if adamw_step_bytes(llama_params(**dims)) <= headroom * bytes_limit:
      return dims
  return {**base, "layers": 1}


def device_bytes_limit(device=None) -> int | None:
  """``memory_stats()["bytes_limit"]`` of ``device`` (default: the first),
  or None where the backend does not say (the CPU)."""
  try:
    device = device or jax.devices()[0]
    stats = device.memory_stats()
    return int(stats["bytes_limit"]) if stats and stats.get("bytes_limit") else None
  except Exception:  # noqa: BLE001 - not every backend has memory_stats
    return None


@functools.lru_cache(maxsize=None)
def _accelerator_dims(bytes_limit: int | None) -> tuple:
  return tuple(sorted(fitting_dims(bytes_limit).items()))


def accelerator_dims() -> dict:
  """:func:`fitting_dims` of the default device's memory (once a process)."""
  return dict(_accelerator_dims(device_bytes_limit()))


def _accel(platform: str) -> bool:
  return platform in ("gpu", "tpu", "cuda", "rocm")


def tree_dims(platform: str, size: str = "quick") -> dict:
  """The dims :func:`tree_for` builds: the largest Llama tree up to the
  1.20 B one that the accelerator's memory holds, the CPU tree on the CPU
  (``size`` "full" doubles its layers)."""
  if _accel(platform):
    return accelerator_dims()
  return {**LLAMA_CPU, **({"layers": 4} if size == "full" else {})}


def tree_name(dims: dict, platform: str) -> str:
  """A case name for the tree: ``llama1.2b`` (16 layers), ``llama0.53b``
  (6 layers) on an accelerator, ``llama_cpu_<params>`` on the CPU."""
  n = llama_params(**dims)
  return f"llama{n / 1e9:.2g}b" if _accel(platform) else f"llama_cpu_{n}"


def tree_info(platform: str, size: str = "quick") -> dict:
  """What the suite records of its tree (``meta["tree"]``): dims, params,
  case name, the device's ``bytes_limit``, the modelled bytes of optax's
  fp32 AdamW step and whether it is the full 1.2 B tree."""
  dims = tree_dims(platform, size)
  n = llama_params(**dims)
  limit = device_bytes_limit() if _accel(platform) else None
  return {**dims, "params": n, "name": tree_name(dims, platform), "bytes_limit": limit,
          "adamw_fp32_step_bytes": adamw_step_bytes(n),
          "bytes_per_param_modelled": ADAMW_FP32_STEP_BYTES_PER_PARAM,
          "headroom": MEMORY_HEADROOM, "full_tree": dims == LLAMA_1B if _accel(platform) else None}


def tree_for(platform: str, size: str = "quick", dtype=jnp.float32, *, seed: int | None = None,
             abstract: bool | None = None) -> Any:
  """The Llama tree that suits a backend (:func:`tree_dims`): the 1.20 B
  tree on an accelerator that holds optax's fp32 AdamW step on it, else the
  most layers that fit; the CPU tree on the CPU."""
  return llama_tree(dtype, seed=seed, abstract=abstract, **tree_dims(platform, size))


def tree_params(tree) -> int:
  """Number of parameters (elements) in a tree of arrays or structs."""
  return int(sum(math.prod(x.shape) for x in jax.tree.leaves(tree)))


def tree_bytes(tree) -> int:
  return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


# Above this many elements, on an accelerator, :func:`materialize` draws on
# the device: numpy takes seconds per 100 M values and then copies them over.
DEVICE_RNG_MIN_ELEMENTS = 1 << 22


@functools.lru_cache(maxsize=None)
def _device_normal(shape, dtype):
  def draw(seed, i, scale):
    key = jax.random.fold_in(jax.random.key(seed), i)
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)
  return jax.jit(draw)


def materialize(tree, *, seed: int = 0, scale: float = 0.02, on_device: bool | None = None):
  """Arrays for a tree of ``ShapeDtypeStruct`` (normal × ``scale``, drawn
  in fp32 and cast to the leaf's dtype). Leaf ``i`` from
  ``numpy.random.default_rng([seed, i])``, or, drawn on the device
  (``on_device``; by default on an accelerator for trees past
  :data:`DEVICE_RNG_MIN_ELEMENTS`), from ``fold_in(key(seed), i)``: one
  small compile per leaf shape. Either way a tree is reproducible leaf by
  leaf, and a bf16 tree is the cast of the fp32 one of the same seed."""
  leaves, treedef = jax.tree.flatten(tree)
  if on_device is None:
    on_device = (jax.default_backend() != "cpu"
                 and sum(math.prod(s.shape) for s in leaves) > DEVICE_RNG_MIN_ELEMENTS)
  if not on_device:
    return jax.tree.unflatten(treedef, [_normal(seed, i, s.shape, s.dtype, scale)
                                        for i, s in enumerate(leaves)])
  return jax.tree.unflatten(treedef, [
      _device_normal(tuple(s.shape), jnp.dtype(s.dtype))(seed, i, np.float32(scale))
      for i, s in enumerate(leaves)])


def sample(tree, elements: int = 1 << 16):
  """The first ``elements`` of every array leaf, flattened (scalars and
  smaller leaves whole), in buffers of their own (the tree may be donated
  next): what a case's check keeps of a variant's outputs, so that checking
  many variants never holds a second copy of the model."""
  def cut(x):
    if not isinstance(x, jax.Array):
      return x
    if x.ndim and x.size > elements:
      return x.reshape(-1)[:elements]
    return jnp.copy(x)
  return jax.tree.map(cut, tree)


class TreeData:
  """The params and grads of one case, on the device.

  Params are drawn afresh for each variant (:meth:`params`: every variant
  donates its own); grads are kept, in one dtype at a time (:meth:`grads`:
  asking for another dtype frees the first before drawing). A failed draw
  leaves nothing half set, so a later case or variant starts clean (an
  out-of-memory error in one case cannot leave another a missing entry).
  :meth:`start` is :func:`sample` of the params a variant starts from (for
  the checks); :meth:`release` frees everything (the suite calls it when
  the case is done).
  """

  def __init__(self, struct, *, params_seed: int = 0, grads_seed: int = 1, grads_scale: float = 0.02,
               params_scale: float = 0.02):
    self.struct = struct
    self.seeds = (params_seed, grads_seed)
    self.scales = (params_scale, grads_scale)
    self._grads: tuple | None = None        # (dtype, tree)
    self._start: dict = {}

  def _tree(self, dtype):
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype or s.dtype), self.struct)

  def params(self, dtype=None):
    return materialize(self._tree(dtype), seed=self.seeds[0], scale=self.scales[0])

  def grads(self, dtype=None):
    key = jnp.dtype(dtype) if dtype is not None else None
    if self._grads is None or self._grads[0] != key:
      self._grads = None   # free the other dtype's grads first
      tree = materialize(self._tree(dtype), seed=self.seeds[1], scale=self.scales[1])
      self._grads = (key, tree)
    return self._grads[1]

  def start(self, dtype=None):
    key = jnp.dtype(dtype) if dtype is not None else None
    if key not in self._start:
      self._start[key] = jax.block_until_ready(sample(self.params(dtype)))
    return self._start[key]

  def release(self):
    self._grads = None
    self._start.clear()


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
