"""The compile tier at scale: models of 8.8 B to 80 B parameters, in the
layouts real codebases use, sharded over 8 to 1024 devices.

Each case is one hybrid Muon + AdamW step (fuseopt's fused ``step`` beside
``optax.contrib.muon``) on an Auto mesh, parameters, gradients and optimizer
state sharded alike, parameters and state donated, compiled by the target's
real compiler (shapes are abstract: nothing is allocated). A step that does
not fit the device (libtpu's ``RESOURCE_EXHAUSTED ... exceeds available HBM``)
is a recorded figure, not a failure of the sweep.

Models (:data:`MODELS`), Llama-shaped with full multi-head attention:

=============  =====  ======  ======  =======  ========  ============
model          d      ff      layers  vocab    experts   parameters
=============  =====  ======  ======  =======  ========  ============
``llama8.8b``  4096   14336   32      128256   -         8.84 B
``llama80b``   8192   28672   80      128256   -         79.9 B
``moe13.8b``   2048   1408    24      32000    64        13.8 B
=============  =====  ======  ======  =======  ========  ============

Layouts (:func:`tree`): ``leaves`` (one leaf per matrix and layer),
``scan`` (layers stacked: ``(L, in, out)``), ``packed`` (``qkv (d, 3d)`` and
``gate_up (d, 2ff)``, declared to Muon as :class:`MatrixViews`) and ``moe``
(layers stacked, experts ``(L, E, in, out)``).

Placements (:func:`specs`): ``fsdpN`` shards each matrix's rows (or, where
they do not divide, its columns) over N devices, stack axes whole; ``epN``
also puts the experts axis over the N devices (expert parallel);
``fsdpAxtpB`` is a 2-D mesh, rows over ``fsdp`` and columns over ``tp``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

F32 = jnp.dtype(jnp.float32)

MODELS = {
    "llama8.8b": dict(d=4096, ff=14336, layers=32, vocab=128256),
    "llama80b": dict(d=8192, ff=28672, layers=80, vocab=128256),
    "moe13.8b": dict(d=2048, ff=1408, layers=24, vocab=32000, experts=64),
}


def tree(model: str, layout: str = "leaves", dtype=F32) -> dict:
  """The parameter tree of ``model`` in ``layout``, as ``ShapeDtypeStruct``s."""
  m = MODELS[model]
  d, ff, L, vocab = m["d"], m["ff"], m["layers"], m["vocab"]
  if layout == "leaves":
    layer = {"attn": {"q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d)},
             "mlp": {"gate": (d, ff), "up": (d, ff), "down": (ff, d)},
             "attn_norm": (d,), "mlp_norm": (d,)}
    layers = [layer] * L
  elif layout == "packed":
    layer = {"attn": {"qkv": (d, 3 * d), "o": (d, d)},
             "mlp": {"gate_up": (d, 2 * ff), "down": (ff, d)},
             "attn_norm": (d,), "mlp_norm": (d,)}
    layers = [layer] * L
  elif layout == "scan":
    layers = {"attn": {k: (L, d, d) for k in "qkvo"},
              "mlp": {"gate": (L, d, ff), "up": (L, d, ff), "down": (L, ff, d)},
              "attn_norm": (L, d), "mlp_norm": (L, d)}
  elif layout == "moe":
    E = m["experts"]
    layers = {"attn": {k: (L, d, d) for k in "qkvo"},
              "router": (L, d, E),
              "experts": {"gate": (L, E, d, ff), "up": (L, E, d, ff), "down": (L, E, ff, d)},
              "attn_norm": (L, d), "mlp_norm": (L, d)}
  else:
    raise ValueError(f"unknown layout {layout!r}")
  shapes = {"embed": (vocab, d), "layers": layers, "final_norm": (d,), "lm_head": (d, vocab)}
  is_shape = lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x)
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dtype), shapes, is_leaf=is_shape)


def parameters(model: str, layout: str = "leaves") -> int:
  return sum(math.prod(x.shape) for x in jax.tree.leaves(tree(model, layout)))


def _is_muon(name: str, x) -> bool:
  # Embedding, LM head, router and norms go to AdamW, as in the hybrid recipe.
  return x.ndim >= 2 and not any(k in name for k in ("embed", "lm_head", "router", "norm"))


def muon_dims(model: str, layout: str):
  """Muon's dimension numbers for ``tree(model, layout)`` (``None``: AdamW):
  the last two axes are the matrix, leading axes (layers, experts) batch
  axes; packed leaves are :class:`MatrixViews` of their matrices."""
  from fuseopt.optim.matrix_views import MatrixViews, MuonDimensionNumbers
  m = MODELS[model]

  def pick(path, x):
    name = jax.tree_util.keystr(path)
    if not _is_muon(name, x):
      return None
    dims = MuonDimensionNumbers(x.ndim - 2, x.ndim - 1)
    if name.endswith("['qkv']"):
      return MatrixViews(dims, axis=x.ndim - 1, sizes=(m["d"],) * 3)
    if name.endswith("['gate_up']"):
      return MatrixViews(dims, axis=x.ndim - 1, sizes=(m["ff"], m["ff"]))
    return dims
  return lambda params: jax.tree_util.tree_map_with_path(pick, params)


@dataclasses.dataclass(frozen=True)
class Placement:
  """A mesh (axis sizes and names) and how leaves are laid out on it."""
  name: str
  shape: tuple[int, ...]
  axes: tuple[str, ...]

  @property
  def devices(self) -> int:
    return math.prod(self.shape)

  def spec(self, name: str, x) -> P:
    """The leaf's spec: on a 1-D mesh the first of its two matrix axes that
    divides by the mesh (stack axes stay whole, except an experts axis on an
    ``ep`` placement); on a 2-D mesh rows over the first axis and columns
    over the second, where they divide."""
    if x.ndim < 2:
      return P()
    entries = [None] * x.ndim
    if len(self.shape) == 2:
      for a, (size, axis) in zip((x.ndim - 2, x.ndim - 1), zip(self.shape, self.axes)):
        if x.shape[a] % size == 0:
          entries[a] = axis
      return P(*entries)
    (n,), (axis,) = self.shape, self.axes
    if self.name.startswith("ep") and "experts" in name and x.ndim == 4 and x.shape[1] % n == 0:
      entries[1] = axis
      return P(*entries)
    for a in (x.ndim - 2, x.ndim - 1):
      if x.shape[a] % n == 0:
        entries[a] = axis
        break
    return P(*entries)


def placement(name: str) -> Placement:
  """``"fsdp256"``, ``"ep64"``, ``"fsdp32xtp8"``."""
  if "x" in name:
    a, b = name.split("x")
    return Placement(name, (int(a[4:]), int(b[2:])), ("fsdp", "tp"))
  n = int(name.lstrip("fsdpe"))
  return Placement(name, (n,), ("fsdp",))


def shardings(tree_, mesh, where: Placement):
  return jax.tree_util.tree_map_with_path(
      lambda p, x: NamedSharding(mesh, where.spec(jax.tree_util.keystr(p), x)), tree_)


@dataclasses.dataclass(frozen=True)
class ScaleCase:
  """One model in one layout on one placement, on the listed targets
  (``ci``: those whose CI compiles its fuseopt step)."""
  model: str
  layout: str
  where: str
  targets: tuple[str, ...]
  ci: tuple[str, ...] = ()
  optax: bool = True       # optax.contrib.muon beside it (packed views: none, optax has no views)
  # Also fuseopt's step with the Pallas GEMM for NS's ``a·X + B·X``
  # (``NewtonSchulz(matmul="pallas")``): XLA's dot keeps fp32 products of the whole
  # matrix, the kernel writes the bf16 iterate only.
  pallas_gemm: bool = False

  @property
  def id(self) -> str:
    layout = "" if self.layout in ("leaves", "moe") else f"-{self.layout}"
    return f"{self.model}{layout}-{self.where}"


# The table of docs/scaling.md, "Measured at scale".
SCALE_CASES = (
    ScaleCase("llama8.8b", "leaves", "fsdp8", ("v5e", "h200")),
    ScaleCase("llama8.8b", "leaves", "fsdp64", ("v5e", "h200")),
    ScaleCase("llama8.8b", "leaves", "fsdp256", ("v5e", "h200"), ci=("v5e",), pallas_gemm=True),
    ScaleCase("llama8.8b", "scan", "fsdp256", ("v5e",)),
    ScaleCase("llama8.8b", "leaves", "fsdp32xtp8", ("v5e",)),
    ScaleCase("llama80b", "leaves", "fsdp256", ("v5e",), pallas_gemm=True),
    ScaleCase("llama80b", "leaves", "fsdp1024", ("v5p",), pallas_gemm=True),
    ScaleCase("moe13.8b", "moe", "ep64", ("v5e",)),
    ScaleCase("llama8.8b", "packed", "fsdp8", ("v5e", "v6e", "h200"), ci=("v6e", "h200"),
              optax=False),
    ScaleCase("llama8.8b", "packed", "fsdp256", ("v5e",), optax=False),
)


def step_args(t, sc: ScaleCase, variant: str, mesh):
  """``(step, args, donate)`` of ``sc``'s step on ``mesh`` (an Auto mesh of
  ``t``'s devices)."""
  from fuseopt.benchmarks import compile_steps
  params = tree(sc.model, sc.layout)
  placed = shardings(params, mesh, placement(sc.where))
  dims = muon_dims(sc.model, sc.layout)
  options = {"newton_schulz": {"matmul": "pallas"}} if variant == PALLAS_GEMM else {}
  tx = compile_steps.hybrid_tx(variant, placed if variant != "optax" else None, dims, **options)
  return compile_steps.sharded_step_args(t, tx, params, placed, fused=variant != "optax")


PALLAS_GEMM = "fuseopt_step_pallas_gemm"


def variants(sc: ScaleCase) -> tuple[str, ...]:
  return (("fuseopt_step",) + ((PALLAS_GEMM,) if sc.pallas_gemm else ())
          + (("optax",) if sc.optax else ()))


def mesh_of(t, sc: ScaleCase):
  from fuseopt import targets
  where = placement(sc.where)
  return targets.mesh(t, where.shape, where.axes, axis_types=(AxisType.Auto,) * len(where.shape))


def cases() -> list:
  """The scale cases as compile-tier :class:`~fuseopt.benchmarks.compile_harness.Case`s
  (kind ``"scale"``): ``scale/hybrid/<variant>/<model>[-<layout>]-<placement>``."""
  from fuseopt.benchmarks import compile_harness
  out = []
  for sc in SCALE_CASES:
    for variant in variants(sc):
      build = lambda t, sc=sc, variant=variant: step_args(t, sc, variant, mesh_of(t, sc))
      out.append(compile_harness.Case(
          f"scale/hybrid/{variant}/{sc.id}", build, kind="scale",
          devices=placement(sc.where).devices, implementations=("triton", "mosaic_tpu"),
          expect_kernels=variant != "optax", baseline=variant == "optax",
          ci_targets=sc.ci if variant == "fuseopt_step" else (), on_targets=sc.targets,
          mesh=lambda t, sc=sc: mesh_of(t, sc), records_failure=True))
  return out
