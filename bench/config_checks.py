"""Every block config of every Pallas kernel, run once on the device: correct? how fast?

A worker process for ``bench/device_run.py``, which starts it, feeds it one
config at a time and restarts it when a config kills it:

  python bench/config_checks.py [--dry-run] [--ew-layers 1] [--ns-shape 1 2048 8192] [--iters 10]

Lowering a kernel from the CPU and running it in interpret mode cannot
catch what only ptxas, the driver or XLA's CUDA-graph runtime reject
(docs/pallas_notes.md, "CUDA graphs": one per-leaf block size failed only
at run time on a GPU). So each config runs here on the device, inside
``jax.jit`` as a training step would run it, against its plain-jnp
reference.

Families (``implementation`` of the default device: ``triton`` on a GPU,
``mosaic_tpu`` on a TPU; on an sm_90 GPU also ``stochastic_round_mosaic_gpu``,
``adam_mosaic_gpu``, ``adam_group_mosaic_gpu``, ``ns_poly_mosaic_gpu``,
``ns_gram_mosaic_gpu``, ``ns_update_mosaic_gpu`` and ``ns_fused_mosaic_gpu``, the
same work through the Mosaic GPU kernels); each starts with ``<family>/heuristic`` (what
``config=None`` picks), then every config of the search space, the last
one first (the largest blocks, the likeliest to fail), ids
``<family>/<index in the search space>``:

- ``stochastic_round``: ``stochastic_round_bf16`` on every leaf of the
  Llama-shaped tree (``--ew-layers`` layers; 1 layer: 13 leaves, every leaf
  shape of the 1.2 B tree), one jit; must equal the reference bitwise.
- ``adam`` (one kernel per leaf) and, on a GPU, ``adam_group`` (grouped
  launches): ``adam_update_tree`` on that tree, fp32 params and grads, bf16
  moments, params and moments donated and fed back call after call as in
  training. Correct within ``ADAM_TOL`` of the XLA reference; bitwise
  equality with the reference and with the family's heuristic config (the
  determinism contract: same bits on any block size) recorded.
- ``adam_int8``: the same update with 8-bit moments (``QuantizedMoment``
  codes and scales) on the tree's leaves whose last axis divides the
  quantisation block, plus a (3, 1280) leaf that no block config divides;
  parameters within ``ADAM_TOL`` of the reference and at most 0.1 % of the
  codes and scales differing (``state_differing``), bitwise equality with
  the heuristic config recorded.
- ``adam_int8_group`` (GPU): the same 8-bit leaves in grouped Triton
  launches, ``triton.QUANTIZED_GROUP_SEARCH_SPACE``.
- ``adam_int4``: the same with 4-bit moments (packed codes, one fp32 scale
  per 128 elements) on the leaves that hold them, the same bound.
- ``ns_poly``, ``ns_gram`` (``gram.sym``), ``ns_update`` (``update.matmul``)
  at ``--ns-shape`` (2048×8192, an issue target), ``ns_fused`` at the
  largest shape its kernel takes; relative Frobenius error below
  ``NS_TOL`` (bf16 iterates).

Each record: ``ok``, ``rel_err``, ``ms`` (median of ``--iters`` calls after
warm-up), ``min_ms``, ``compile_s`` (first call), GB/s or TFLOP/s, or the
``error``; ``check`` says what ``ok`` compared (``bitwise`` against the
reference where docs/numerics.md promises the same bits: stochastic
rounding; a relative-error bound elsewhere). Each family's heuristic job
is the family's check on the chip (``bench/device_run.py`` runs them all
first). ``--dry-run`` runs tiny shapes in interpret mode on the CPU.

``--ew-layers`` (default: 1 on a GPU, every leaf shape of the 1.2 B tree;
0 on a TPU: the embedding, final norm and LM head, whose per-leaf Mosaic
compiles fit the per-config timeout) sets the elementwise families' tree.

Protocol (stdout lines that start with ``PREFIX``, JSON after it): first
``{"hello": {env, platform, device_kind, device_slug, jobs}}``; then, for
each job id read from stdin, ``{"start": id}`` and ``{"result": record}``.
A failed config is followed by a health check (a tiny jitted op): when the
device still answers ``{"health": true}``, else ``{"health": false}`` and
exit code 3, so that the parent starts a fresh process.
``FUSEOPT_CONFIG_FAULT="abort:ID,hang:ID,raise:ID"`` makes the listed jobs
abort the process, hang or raise (``abort:start``: the process dies before
its hello): tests of the parent's isolation.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
import traceback
from typing import Any, Callable

PREFIX = "@@fuseopt-config "
ADAM_TOL = 5e-3   # bf16 moments: a 1-ulp fp32 difference can move a stochastic rounding
NS_TOL = 2e-2     # bf16 iterates, fp32 accumulation (as bench/ns_configs.py)
SCALE_RTOL = 4 * 2.0 ** -23   # blockwise scales: a few fp32 ulps (tests/kernels/test_adam_int4_tpu.py)
FAULT_ENV = "FUSEOPT_CONFIG_FAULT"
EXIT_POISONED = 3


@dataclasses.dataclass
class Settings:
  implementation: str
  interpret: bool
  ew_dims: dict            # llama_tree dims of the elementwise families' tree
  ragged: tuple            # leaf shapes added to it
  ns_shape: tuple          # (batch, m, n), m <= n
  fused_shape: tuple       # (batch, m, n) the single-kernel NS takes
  iters: int
  per_family: int | None   # keep the first N jobs of each family (dry run)
  # Also time the Mosaic GPU elementwise kernels beside Triton's (an sm_90 GPU).
  mosaic_gpu: bool = False


@dataclasses.dataclass
class Family:
  name: str
  kernel: str                       # module.function the configs belong to
  space: tuple                      # the search space
  setup: Callable[[], dict]         # inputs, reference outputs (once per process)
  run: Callable[[dict, Any], Callable[[], Any]]  # (state, config) -> call (one step, returns outputs; _call)
  compare: Callable[[dict, Any], dict]  # (state, outputs) -> rel_err, bitwise, ok
  work: dict                        # {"bytes": B} or {"flops": F} per call
  # Each config's outputs compared with the heuristic config's (recorded;
  # the elementwise families, whose rounding must not depend on the block).
  same_bits_as_heuristic: bool = False


def settings_for(platform: str, args) -> Settings:
  if args.dry_run:  # the embedding, final norm and head of a tiny Llama, 2 ragged leaves
    return Settings("triton", True, dict(d=32, ff=64, layers=0, vocab=64), RAGGED_LEAVES_DRY,
                    (1, 64, 128), (2, 32, 64), 1, args.per_family or 2)
  impl = {"gpu": "triton", "cuda": "triton", "tpu": "mosaic_tpu"}.get(platform)
  if impl is None:
    raise SystemExit(f"config_checks: no GPU or TPU (platform {platform!r}); use --dry-run")
  from fuseopt.benchmarks import workloads
  from fuseopt.kernels.newton_schulz import fused
  fm = 128 if impl == "triton" else 512
  while not fused.fits(impl, fm, fm):
    fm //= 2
  layers = args.ew_layers if args.ew_layers is not None else (0 if impl == "mosaic_tpu" else 1)
  return Settings(impl, False, {**workloads.LLAMA_1B, "layers": layers}, RAGGED_LEAVES,
                  tuple(args.ns_shape), (32, fm, fm), args.iters, args.per_family,
                  mosaic_gpu=impl == "triton" and _sm90())


def _sm90() -> bool:
  """Whether the default GPU can compile Mosaic GPU kernels (fuseopt refuses
  the others before lowering)."""
  from fuseopt.kernels import dispatch
  try:
    dispatch.check_mosaic_gpu_target("config_checks", False)
  except ValueError:
    return False
  return True


# ------------------------------------------------------------------ helpers --
def _block(x):
  import jax
  return jax.block_until_ready(x)


def _stats(outs, refs):
  """Per array pair: sum of squared differences, sum of squared reference
  values (fp32), elements whose bits differ. One jitted program: eager ops
  would compile once per leaf shape."""
  import jax
  import jax.numpy as jnp

  def bits(a):
    return jax.lax.bitcast_convert_type(a, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32,
                                            8: jnp.uint64}[a.dtype.itemsize])

  def one(a, b):
    a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
    return (jnp.sum(jnp.square(a32 - b32)), jnp.sum(jnp.square(b32)),
            jnp.sum(bits(a) != bits(b), dtype=jnp.int32))
  return [one(a, b) for a, b in zip(outs, refs)]


_STATS = None


def compare_arrays(outs, refs) -> dict:
  """``rel_err`` (relative Frobenius error over all arrays), ``differing``
  ([elements whose bits differ, elements]) and ``bitwise``."""
  import jax
  global _STATS
  if _STATS is None:
    _STATS = jax.jit(_stats)
  outs, refs = list(outs), list(refs)
  n = sum(int(b.size) for b in refs)
  if len(outs) != len(refs) or any(a.shape != b.shape or a.dtype != b.dtype for a, b in zip(outs, refs)):
    return {"rel_err": float("inf"), "differing": [n, n], "bitwise": False}
  stats = jax.device_get(_STATS(outs, refs))
  num = sum(float(s[0]) for s in stats)
  den = sum(float(s[1]) for s in stats)
  diff = sum(int(s[2]) for s in stats)
  return {"rel_err": math.sqrt(num) / max(math.sqrt(den), 1e-30), "differing": [diff, n],
          "bitwise": diff == 0}


# Leaves added to the Llama tree's: every Llama leaf is a multiple of 2048
# elements, so without these no block would be ragged (masked) on hardware.
RAGGED_LEAVES = ((1001, 999), (7,))
RAGGED_LEAVES_DRY = ((13, 7), (7,))
# The 8-bit family's extra leaf: 3 rows of 5 quantisation blocks, so that
# no block config divides it (a masked last program).
INT8_EXTRA_LEAVES = ((3, 1280),)


def int8_shapes(st: Settings, fmt: str = "int8") -> list[tuple[int, ...]]:
  """The elementwise tree's leaves whose last axis divides the 8-bit (or
  4-bit: ``fmt="int4"``) moments' quantisation block, and
  :data:`INT8_EXTRA_LEAVES`."""
  from fuseopt.kernels.adam import int4, quantized
  fits = int4.fits if fmt == "int4" else quantized.fits
  return [s for s in ew_shapes(st) if fits(s)] + [s for s in INT8_EXTRA_LEAVES if fits(s)]


def ew_shapes(st: Settings) -> list[tuple[int, ...]]:
  """Leaf shapes of the elementwise families' tree: the Llama-shaped
  tree's, then the ragged ones."""
  import jax
  from fuseopt.benchmarks import workloads
  llama = jax.tree.leaves(workloads.llama_tree(abstract=True, **st.ew_dims))
  return [s.shape for s in llama] + list(st.ragged)


def _normal_tree(st: Settings, seed, dtype=None, scale=0.02, shapes=None):
  """The elementwise tree's leaves as device arrays: drawn on the device
  (host-side numpy would take seconds per 100 M values), or with numpy for a
  tiny tree (compiling a generator per shape costs more there)."""
  import jax
  import jax.numpy as jnp
  from fuseopt.benchmarks import workloads
  structs = [jax.ShapeDtypeStruct(s, jnp.float32) for s in (shapes or ew_shapes(st))]
  if sum(math.prod(s.shape) for s in structs) < (1 << 20):
    tree = workloads.materialize(structs, seed=seed, scale=scale)
    return [x.astype(dtype or jnp.float32) for x in tree]
  keys = jax.random.split(jax.random.key(seed), len(structs))
  gen = {}
  out = []
  for k, s in zip(keys, structs):
    if s.shape not in gen:
      gen[s.shape] = jax.jit(lambda k, shape=s.shape: jax.random.normal(k, shape, jnp.float32) * scale)
    out.append(gen[s.shape](k).astype(dtype or jnp.float32))
  return out


# ---------------------------------------------------------------- families --
def families(st: Settings) -> list[Family]:
  import jax
  import jax.numpy as jnp
  from fuseopt.kernels import adam, dispatch, stochastic_round
  from fuseopt.kernels.newton_schulz import api as ns
  from fuseopt.kernels.newton_schulz import fused
  from fuseopt.kernels.newton_schulz import gemm as update
  from fuseopt.kernels.newton_schulz import sym as gram

  impl = st.implementation
  mosaic = impl == "mosaic_tpu"
  interp_pallas = dispatch.interpret_arg(impl, st.interpret)
  out: list[Family] = []

  # -- elementwise: one jit over every leaf of the tree ---------------------
  def sr_setup():
    xs = _normal_tree(st, 0)
    ref = jax.jit(lambda xs: [stochastic_round.stochastic_round_reference(x, i + 17)
                              for i, x in enumerate(xs)])(xs)
    return {"args": xs, "ref": _block(ref)}

  def sr_runner(impl):
    def run(state, cfg):
      f = jax.jit(lambda xs: [stochastic_round.stochastic_round_bf16(
          x, i + 17, implementation=impl, interpret=st.interpret, config=cfg)
          for i, x in enumerate(xs)])
      return _call(lambda: f(state["args"]), f, (state["args"],))
    return run

  def sr_compare(state, outs):
    c = compare_arrays(outs, state["ref"])
    return {"rel_err": c["rel_err"], "bitwise_ref": c["bitwise"], "ok": c["bitwise"],
            "check": "bitwise against stochastic_round_reference (docs/numerics.md)"}

  n_ew = sum(math.prod(s) for s in ew_shapes(st))
  out.append(Family("stochastic_round", "fuseopt.kernels.stochastic_round.stochastic_round_bf16",
                    stochastic_round.mosaic_tpu.SEARCH_SPACE if mosaic else stochastic_round.triton.SEARCH_SPACE,
                    sr_setup, sr_runner(impl), sr_compare, {"bytes": 6 * n_ew},
                    same_bits_as_heuristic=True))

  hyper = dict(count=3, learning_rate=1e-3, weight_decay=0.1, seed=5)

  def adam_setup(param_dtype=jnp.float32):
    p, g = ([x.astype(param_dtype) for x in _normal_tree(st, k)] for k in (1, 2))
    mu = [x.astype(jnp.bfloat16) for x in _normal_tree(st, 3, scale=1e-3)]
    nu = [jnp.square(x).astype(jnp.bfloat16) for x in _normal_tree(st, 4, scale=1e-3)]
    ref = jax.jit(lambda p, g, mu, nu: adam.adam_update_tree(
        p, g, mu, nu, implementation="xla", **hyper))(p, g, mu, nu)
    return {"args": (p, g, mu, nu), "ref": _flat(_block(ref))}

  def adam_runner(group, impl=impl):
    def run(state, cfg):
      f = jax.jit(lambda p, g, mu, nu: adam.adam_update_tree(
          p, g, mu, nu, implementation=impl, interpret=st.interpret, config=cfg, group=group, **hyper),
                  donate_argnums=(0, 2, 3))
      p, g, mu, nu = state["args"]
      copy = lambda xs: [x.copy() for x in xs]
      live = {"p": copy(p), "mu": copy(mu), "nu": copy(nu)}

      def call():
        # Training's pattern: the step's outputs are the next step's
        # (donated) inputs. The first call sees the pristine inputs.
        np_, nmu, nnu = f(live["p"], g, live["mu"], live["nu"])
        live.update(p=np_, mu=nmu, nu=nnu)
        return np_ + nmu + nnu
      return _call(call, f, (p, g, mu, nu))
    return run

  def adam_compare(state, outs):
    c = compare_arrays(outs, state["ref"])
    return {"rel_err": c["rel_err"], "bitwise_ref": c["bitwise"], "ok": c["rel_err"] < ADAM_TOL,
            "check": f"params and bf16 moments within {ADAM_TOL:g} relative of the xla reference "
                     "(an fp32 ulp may move a stochastic rounding: docs/numerics.md); bits recorded"}

  def adam_bf16_setup():
    # bf16 params and grads (14 B/param): on the H200 the suite's 1.2 B step of
    # this kind ran at 1.0 TB/s where the fp32-param step reaches 2.0 (docs/
    # measurements.md); every block config, to find whether the block is why.
    return adam_setup(jnp.bfloat16)

  adam_work = {"bytes": 20 * n_ew}  # fp32 params r/w, fp32 grads, bf16 mu and nu r/w
  out.append(Family("adam", "fuseopt.kernels.adam.adam_update_tree(group=False)",
                    adam.mosaic_tpu.SEARCH_SPACE if mosaic else adam.triton.SEARCH_SPACE,
                    adam_setup, adam_runner(False), adam_compare, adam_work,
                    same_bits_as_heuristic=True))
  out.append(Family("adam_bf16", "fuseopt.kernels.adam.adam_update_tree(bf16 params and grads)",
                    adam.mosaic_tpu.SEARCH_SPACE if mosaic else adam.triton.SEARCH_SPACE,
                    adam_bf16_setup, adam_runner(False), adam_compare, {"bytes": 14 * n_ew},
                    same_bits_as_heuristic=True))
  if not mosaic:  # Mosaic TPU stays per leaf (docs/pallas_notes.md)
    out.append(Family("adam_group", "fuseopt.kernels.adam.adam_update_tree(group=True)",
                      adam.triton.GROUP_SEARCH_SPACE, adam_setup, adam_runner(True), adam_compare,
                      adam_work, same_bits_as_heuristic=True))
  # 8-bit moments (kernels/adam/quantized.py): the leaves whose last axis
  # divides the quantisation block, moments from one reference step from
  # zero so that codes and scales are those of a running optimizer.
  from fuseopt.kernels.adam import quantized

  from fuseopt.kernels.adam import int4 as int4_format
  from fuseopt.kernels.adam import triton_blockwise

  def int8_setup(fmt="int8"):
    shapes = int8_shapes(st, fmt)
    p, g, g0 = (_normal_tree(st, k, shapes=shapes) for k in (1, 2, 3))
    if fmt == "int4":
      zeros = lambda signed: [int4_format.zeros(x.shape) for x in p]
    else:
      zeros = lambda signed: [quantized.zeros(x.shape, signed=signed) for x in p]
    _, mu, nu = jax.jit(lambda p, g, mu, nu: adam.adam_update_tree(
        p, g, mu, nu, implementation="xla", **{**hyper, "count": 1}))(p, g0, zeros(True), zeros(False))
    ref = jax.jit(lambda p, g, mu, nu: adam.adam_update_tree(
        p, g, mu, nu, implementation="xla", **hyper))(p, g, mu, nu)
    return {"args": (p, g, list(mu), list(nu)), "ref": _block(_int8_flat(ref))}

  def int8_runner(impl=impl, group=False):
    def run(state, cfg):
      f = jax.jit(lambda p, g, mu, nu: adam.adam_update_tree(
          p, g, mu, nu, implementation=impl, interpret=st.interpret, config=cfg, group=group,
          **hyper), donate_argnums=(0, 2, 3))
      p, g, mu, nu = state["args"]
      copy = lambda xs: jax.tree.map(lambda x: x.copy(), xs)
      live = {"p": copy(p), "mu": copy(mu), "nu": copy(nu)}

      def call():
        np_, nmu, nnu = f(live["p"], g, live["mu"], live["nu"])
        live.update(p=np_, mu=nmu, nu=nnu)
        return _int8_flat((np_, nmu, nnu))
      return _call(call, f, (p, g, mu, nu))
    return run

  def int8_compare(state, outs):
    # The parameters within ADAM_TOL of the reference; the codes may differ
    # where a 1-ulp fp32 difference moves a stochastic rounding (at most
    # 0.1% of them), the scales by a few fp32 ulps (FMA contraction:
    # tests/kernels/test_adam_int4_tpu.py); the bits recorded.
    import numpy as np
    n = len(state["args"][0])
    c = compare_arrays(outs[:n], state["ref"][:n])
    codes = compare_arrays(outs[n::2], state["ref"][n::2])
    scales = compare_arrays(outs[n + 1::2], state["ref"][n + 1::2])
    worst = max((float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
                              / np.maximum(np.abs(np.asarray(b, np.float64)), 1e-30), initial=0.0))
                 for a, b in zip(outs[n + 1::2], state["ref"][n + 1::2])), default=0.0)
    return {"rel_err": c["rel_err"], "bitwise_ref": c["bitwise"] and codes["bitwise"] and scales["bitwise"],
            "state_differing": [codes["differing"][0] + scales["differing"][0],
                                codes["differing"][1] + scales["differing"][1]],
            "codes_differing": codes["differing"], "scales_max_rel_diff": worst,
            "state_rel_err": compare_arrays(outs[n:], state["ref"][n:])["rel_err"],
            "ok": (c["rel_err"] < ADAM_TOL and codes["differing"][0] <= 1e-3 * codes["differing"][1]
                   and worst <= SCALE_RTOL),
            "check": f"params within {ADAM_TOL:g} relative of the xla reference, at most 0.1% of "
                     f"codes differing, scales within {SCALE_RTOL:.1e} relative (bitwise with FMA "
                     "off: tests/kernels); bits recorded"}

  n_int8 = sum(math.prod(s) for s in int8_shapes(st))
  int8_work = {"bytes": (16 + 16 / quantized.BLOCK) * n_int8}
  out.append(Family("adam_int8", "fuseopt.kernels.adam.adam_update_tree(int8 moments)",
                    adam.mosaic_tpu.SEARCH_SPACE if mosaic else adam.triton.SEARCH_SPACE,
                    int8_setup, int8_runner(), int8_compare, int8_work,
                    same_bits_as_heuristic=True))
  def int4_setup():
    return int8_setup("int4")

  n_int4 = sum(math.prod(s) for s in int8_shapes(st, "int4"))
  out.append(Family("adam_int4", "fuseopt.kernels.adam.adam_update_tree(int4 moments)",
                    adam.mosaic_tpu.SEARCH_SPACE if mosaic else triton_blockwise.INT4_SEARCH_SPACE,
                    int4_setup, int8_runner(), int8_compare,
                    {"bytes": (14 + 16 / int4_format.BLOCK) * n_int4}, same_bits_as_heuristic=True))
  if not mosaic:  # (what fo.step runs on a GPU by default)
    out.append(Family("adam_int8_group", "fuseopt.kernels.adam.triton.update_quantized_group",
                      adam.triton.QUANTIZED_GROUP_SEARCH_SPACE, int8_setup,
                      int8_runner(group=True), int8_compare, int8_work,
                      same_bits_as_heuristic=True))

  if st.mosaic_gpu:
    # The same trees through the Mosaic GPU kernels: Triton stays the GPU
    # default until these two families have been timed beside the two above.
    from fuseopt.kernels.adam import mosaic_gpu as adam_mosaic_gpu
    from fuseopt.kernels.stochastic_round import mosaic_gpu as stochastic_round_mosaic_gpu
    out.append(Family("stochastic_round_mosaic_gpu",
                      "fuseopt.kernels.stochastic_round.mosaic_gpu.round_flat",
                      stochastic_round_mosaic_gpu.SEARCH_SPACE, sr_setup, sr_runner("mosaic_gpu"),
                      sr_compare, {"bytes": 6 * n_ew}))
    out.append(Family("adam_mosaic_gpu", "fuseopt.kernels.adam.mosaic_gpu.update_flat",
                      adam_mosaic_gpu.SEARCH_SPACE, adam_setup, adam_runner(False, "mosaic_gpu"),
                      adam_compare, adam_work))
    out.append(Family("adam_group_mosaic_gpu", "fuseopt.kernels.adam.mosaic_gpu.update_group",
                      adam_mosaic_gpu.GROUP_SEARCH_SPACE, adam_setup,
                      adam_runner(True, "mosaic_gpu"), adam_compare, adam_work))
    out.append(Family("adam_int8_mosaic_gpu", "fuseopt.kernels.adam.mosaic_gpu.update_quantized",
                      adam_mosaic_gpu.SEARCH_SPACE, int8_setup, int8_runner("mosaic_gpu"),
                      int8_compare, int8_work))

  # -- Newton–Schulz kernels ------------------------------------------------
  b, m, n = st.ns_shape
  space = lambda mod: mod.mosaic_tpu.SEARCH_SPACE if mosaic else mod.triton.SEARCH_SPACE
  poly = dict(alpha=2.0315, beta=-4.775)

  def ns_setup():
    k1, k2 = jax.random.split(jax.random.key(0))
    x = (jax.random.normal(k1, (b, m, n), jnp.float32) / (m * n) ** 0.5).astype(jnp.bfloat16)
    a = gram.sym_reference(x)
    bmat = (jax.random.normal(k2, (b, m, m), jnp.float32) / m ** 0.5).astype(jnp.bfloat16)
    refs = {"poly": gram.sym_reference(a, **poly), "gram": gram.sym_reference(x),
            "update": update.gemm_reference(bmat, x, a=3.4445)}
    return {"x": x, "a": a, "b": bmat, "refs": _block(refs)}

  def ns_family(fn, args_of, ref_key):
    def run(state, cfg):
      f = jax.jit(lambda *a: fn(*a, cfg))
      args = args_of(state)
      return _call(lambda: [f(*args)], f, args)

    def compare(state, outs):
      ref = state["refs"][ref_key] if ref_key else state["ref"]
      rel = compare_arrays(outs, [ref])["rel_err"]
      return {"rel_err": rel, "ok": rel < NS_TOL,
              "check": f"within {NS_TOL:g} relative (Frobenius) of the reference (bf16 iterates)"}
    return run, compare

  kw = dict(implementation=impl, interpret=interp_pallas)
  for name, fn, args_of, flops in (
      ("poly", lambda a, cfg: gram.sym(a, **poly, config=cfg, **kw), lambda s: (s["a"],), 2 * b * m ** 3),
      ("gram", lambda x, cfg: gram.sym(x, config=cfg, **kw), lambda s: (s["x"],), 2 * b * m * m * n),
      ("update", lambda bm_, x, cfg: update.matmul(bm_, x, a=3.4445, config=cfg, **kw),
       lambda s: (s["b"], s["x"]), 2 * b * m * m * n)):
    mod = update if name == "update" else gram
    run, compare = ns_family(fn, args_of, name)
    out.append(Family(f"ns_{name}", f"{mod.__name__}.{'gemm' if name == 'update' else 'sym'}"
                      + ("(alpha, beta: the polynomial)" if name == "poly" else ""),
                      space(mod), ns_setup, run, compare, {"flops": flops}))
    if st.mosaic_gpu:
      # The same products through the Mosaic GPU kernels, timed beside Triton's.
      kw_mgpu = dict(implementation="mosaic_gpu",
                     interpret=dispatch.interpret_arg("mosaic_gpu", st.interpret))
      fn_mgpu = {
          "poly": lambda a, cfg: gram.sym(a, **poly, config=cfg, **kw_mgpu),
          "gram": lambda x, cfg: gram.sym(x, config=cfg, **kw_mgpu),
          "update": lambda bm_, x, cfg: update.gemm(bm_, x, a=3.4445, config=cfg, **kw_mgpu),
      }[name]
      run, compare = ns_family(fn_mgpu, args_of, name)
      out.append(Family(f"ns_{name}_mosaic_gpu", f"{mod.__name__}.mosaic_gpu."
                        f"{'gemm' if name == 'update' else 'sym'} (via {mod.__name__})",
                        mod.BACKENDS["mosaic_gpu"].SEARCH_SPACE,
                        ns_setup, run, compare, {"flops": flops}))

  fb, fm, fn_ = st.fused_shape
  table = ns.coefficient_table("polar_express")[0]

  def fused_setup():
    x = (jax.random.normal(jax.random.key(1), (fb, fm, fn_), jnp.float32)
         / (fm * fn_) ** 0.5).astype(jnp.bfloat16)
    return {"x": x, "ref": _block(fused.ns_fused_reference(x, table))}

  run, compare = ns_family(lambda x, cfg: fused.newton_schulz_fused(x, table, config=cfg, **kw),
                           lambda s: (s["x"],), None)
  out.append(Family("ns_fused", "fuseopt.kernels.newton_schulz.fused.newton_schulz_fused", space(fused),
                    fused_setup, run, compare,
                    {"flops": fb * len(table) * (4 * fm * fm * fn_ + 2 * fm ** 3)}))
  if st.mosaic_gpu:   # the same batch through the Mosaic GPU single kernel
    run, compare = ns_family(
        lambda x, cfg: fused.newton_schulz_fused(x, table, config=cfg, implementation="mosaic_gpu",
                                                 interpret=dispatch.interpret_arg(
                                                     "mosaic_gpu", st.interpret)),
        lambda s: (s["x"],), None)
    out.append(Family("ns_fused_mosaic_gpu",
                      "fuseopt.kernels.newton_schulz.fused.mosaic_gpu.run (via newton_schulz_fused)",
                      fused.BACKENDS["mosaic_gpu"].SEARCH_SPACE, fused_setup, run, compare,
                      {"flops": fb * len(table) * (4 * fm * fm * fn_ + 2 * fm ** 3)}))
  return out


def _call(call, jitted, args):
  """``call`` (one step) carrying its jitted function and arguments, so that
  a test can lower the very same step for a device from the CPU."""
  call.jitted = jitted
  call.args = args
  return call


def _flat(tree_outs):
  """adam_update_tree's three lists as one list (params, mu, nu)."""
  p, mu, nu = tree_outs
  return list(p) + list(mu) + list(nu)


def _int8_flat(tree_outs):
  """adam_update_tree's outputs with 8-bit (or 4-bit) moments as one list:
  params, then each moment's codes and scales."""
  p, mu, nu = tree_outs
  return list(p) + [a for m in list(mu) + list(nu) for a in (m.codes, m.scales)]


def jobs_of(fams: list[Family], per_family: int | None = None) -> list[dict]:
  """The job list: per family the heuristic, then the space's configs last first."""
  out = []
  for fam in fams:
    entries = [("heuristic", None)] + [(str(i), fam.space[i]) for i in reversed(range(len(fam.space)))]
    if per_family:
      entries = entries[:per_family]
    for key, cfg in entries:
      out.append({"id": f"{fam.name}/{key}", "family": fam.name, "kernel": fam.kernel,
                  "config": "heuristic (config=None)" if cfg is None else repr(cfg),
                  "space_index": None if cfg is None else int(key)})
  return out


# ------------------------------------------------------------------ worker --
def _emit(msg: dict) -> None:
  sys.stdout.write(PREFIX + json.dumps(msg, default=repr) + "\n")
  sys.stdout.flush()


def _faults() -> dict[str, str]:
  out = {}
  for item in filter(None, os.environ.get(FAULT_ENV, "").split(",")):
    kind, _, job = item.partition(":")
    out[job.strip()] = kind.strip()
  return out


def _healthy() -> bool:
  import jax
  import jax.numpy as jnp
  try:
    return float(jax.jit(lambda v: (v * 2).sum())(jnp.ones((8,), jnp.float32))) == 16.0
  except Exception:  # noqa: BLE001 - any error here means the device is gone
    return False


def run_job(fam: Family, cfg, state: dict, iters: int, heuristic_outs: dict) -> dict:
  rec: dict[str, Any] = {}
  if cfg is not None and fam.same_bits_as_heuristic and fam.name not in heuristic_outs:
    # The heuristic ran in a process that has since crashed: its first
    # call's outputs again, for the bits of this config.
    import jax
    t = time.perf_counter()
    heuristic_outs[fam.name] = jax.device_get(list(_block(fam.run(state, None)())))
    rec["heuristic_rerun_s"] = round(time.perf_counter() - t, 3)
  t0 = time.perf_counter()
  call = fam.run(state, cfg)
  outs = _block(call())
  rec["compile_s"] = round(time.perf_counter() - t0, 3)
  rec.update(fam.compare(state, outs))
  if fam.same_bits_as_heuristic:
    if cfg is None:
      # On the host (the parent runs every family's heuristic before the
      # other configs, so it outlives the family's inputs on the device);
      # and a copy: the Adam families donate their outputs to the next call.
      import jax
      heuristic_outs[fam.name] = jax.device_get(list(outs))
    elif fam.name in heuristic_outs:
      # Determinism: every block config gives the heuristic's bits (the
      # rounding exactly; Adam's fp32 outputs up to an FMA contraction,
      # tests/kernels/test_adam_group.py).
      c = compare_arrays(outs, heuristic_outs[fam.name])
      rec["bitwise_vs_heuristic"] = c["bitwise"]
      rec["differing_vs_heuristic"] = c["differing"]
      if fam.name == "stochastic_round":
        rec["ok"] = rec["ok"] and rec["bitwise_vs_heuristic"]
  del outs
  for _ in range(2):
    _block(call())
  times = []
  for _ in range(iters):
    t = time.perf_counter()
    _block(call())
    times.append((time.perf_counter() - t) * 1e3)
  times.sort()
  rec["ms"] = times[len(times) // 2]
  rec["min_ms"] = times[0]
  rec["runs"] = len(times)
  if fam.work.get("bytes"):
    rec["gbps"] = fam.work["bytes"] / (rec["ms"] * 1e-3) / 1e9
  if fam.work.get("flops"):
    rec["tflops"] = fam.work["flops"] / (rec["ms"] * 1e-3) / 1e12
  return rec


def worker(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--dry-run", action="store_true", help="tiny shapes, interpret mode, on the CPU")
  ap.add_argument("--ew-layers", type=int, default=None,
                  help="layers of the Llama tree the elementwise configs run on (default 1 on a GPU: "
                       "13 leaves; 0 on a TPU; 16: the whole 1.2 B tree, 147 leaves)")
  ap.add_argument("--ns-shape", type=int, nargs=3, default=(1, 2048, 8192), metavar=("B", "M", "N"))
  ap.add_argument("--iters", type=int, default=10)
  ap.add_argument("--per-family", type=int, default=None, help="only the first N jobs of each family")
  args = ap.parse_args(argv)

  import warnings
  warnings.filterwarnings("ignore", message=".*[Dd]onat.*")
  warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
  import jax
  from fuseopt.benchmarks import core, environment

  if _faults().get("start") == "abort":  # (a process that dies before its hello)
    os.abort()
  platform = jax.default_backend()
  st = settings_for(platform, args)
  fams = {f.name: f for f in families(st)}
  jobs = jobs_of(list(fams.values()), st.per_family)
  configs = {}
  for j in jobs:
    space = fams[j["family"]].space
    configs[j["id"]] = None if j["space_index"] is None else space[j["space_index"]]
  _emit({"hello": {"platform": platform, "device_kind": core.device_kind(),
                   "xla_flags": os.environ.get("XLA_FLAGS"),
                   "device_slug": core.device_slug(), "env": environment.collect(),
                   "settings": dataclasses.asdict(st), "jobs": jobs}})
  faults = _faults()
  states: dict[str, Any] = {}
  heuristic_outs: dict[str, Any] = {}
  by_id = {j["id"]: j for j in jobs}
  for line in sys.stdin:
    job_id = line.strip()
    if not job_id:
      continue
    if job_id == "exit":
      break
    job = by_id.get(job_id)
    if job is None:
      _emit({"result": {"id": job_id, "ok": False, "status": "error", "error": "unknown job id"}})
      continue
    fam = fams[job["family"]]
    _emit({"start": job_id})
    rec: dict[str, Any] = {"id": job_id}
    try:
      fault = faults.get(job_id)
      if fault == "abort":
        os.abort()
      if fault == "hang":
        time.sleep(3600)
      if fault == "raise":
        raise RuntimeError("injected fault")
      if fam.setup not in states:
        # One set of inputs at a time on a device (adam and adam_group share
        # theirs): free the previous ones first (the heuristics' outputs
        # stay, on the host). The dry run's tiny inputs all stay: its second
        # pass over the families builds none again.
        if not st.interpret:
          states.clear()
        t = time.perf_counter()
        states[fam.setup] = fam.setup()
        rec["setup_s"] = round(time.perf_counter() - t, 3)
      rec.update(run_job(fam, configs[job_id], states[fam.setup], st.iters, heuristic_outs))
      rec["status"] = "ok" if rec["ok"] else "wrong"
    except Exception as e:  # noqa: BLE001 - a failing config is a result
      rec.update(ok=False, status="error", error=f"{type(e).__name__}: {str(e)[:1500]}",
                 traceback=traceback.format_exc()[-1500:])
    _emit({"result": rec})
    if rec["status"] == "error":
      healthy = _healthy()
      _emit({"health": healthy})
      if not healthy:
        return EXIT_POISONED
  return 0


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  sys.exit(worker())
