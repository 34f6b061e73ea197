"""Block sizes and paths of fuseopt's TPU kernels, timed on one chip.

  PYTHONPATH=$PWD python bench/tpu_sweep.py OUT.json [--parts adam tree sr ns muon] [--dry-run]

The measurements behind the TPU defaults (docs/measurements.md, "TPU v5e"):
the elementwise kernels at several block budgets beside XLA's own fusion of
the same math and a Pallas copy (the streaming rate a block size can reach),
the optimizer steps a user runs on a Llama tree that fits the chip, every
Newton–Schulz path per shape, and the Muon step. Each case is compiled and
timed in this one process (median of 10 runs after 2 warm-ups, donated
inputs refreshed outside the timing), its compile time recorded; a case that
fails is recorded with its error and the next one runs. The JSON is
rewritten after every case, so a run cut short keeps what it finished.
``--dry-run``: the same cases at CPU sizes in interpret mode (CI's smoke).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

HBM_GBS = 819.0   # TPU v5e's HBM bandwidth (spec)


def _block(x):
  return jax.tree.map(lambda a: a.block_until_ready() if hasattr(a, "block_until_ready") else a, x)


def timed(fn, make_args, *, iters=10, donate=(), feed=None):
  """(compile_s, median ms, min ms) of ``jax.jit(fn)`` over ``iters`` calls
  after 2 warm-ups. ``make_args()`` builds the arguments once; a step that
  donates them gets the next call's from its own outputs (``feed(out, args)``,
  as a training loop does), so one copy of the state is alive."""
  jf = jax.jit(fn, donate_argnums=donate)
  args = make_args()
  t0 = time.perf_counter()
  compiled = jf.lower(*args).compile()
  compile_s = time.perf_counter() - t0
  times = []
  for i in range(iters + 2):
    _block(args)
    t0 = time.perf_counter()
    out = compiled(*args)
    _block(out)
    if i >= 2:
      times.append((time.perf_counter() - t0) * 1e3)
    if donate:
      args = feed(out, args)
    del out
  return compile_s, statistics.median(times), min(times)


class Recorder:
  def __init__(self, path, meta):
    self.path, self.doc = path, {"meta": meta, "rows": []}

  def run(self, part, name, fn, make_args, *, bytes_moved=None, flops=None, donate=(), feed=None,
          **extra):
    row = {"part": part, "name": name, **extra}
    try:
      compile_s, ms, min_ms = timed(fn, make_args, donate=donate, feed=feed)
      row.update(status="ok", compile_s=round(compile_s, 2), ms=round(ms, 4), min_ms=round(min_ms, 4))
      if bytes_moved:
        row["bytes"] = int(bytes_moved)
        row["gbs"] = round(bytes_moved / ms / 1e6, 1)
        row["pct_floor"] = round(100 * bytes_moved / ms / 1e6 / HBM_GBS, 1)
      if flops:
        row["tflops"] = round(flops / ms / 1e9, 1)
    except Exception as e:  # noqa: BLE001 (a failed case is a record)
      row.update(status="error", error=f"{type(e).__name__}: {str(e)[:600]}")
      traceback.print_exc()
    self.doc["rows"].append(row)
    print(json.dumps(row), flush=True)
    with open(self.path, "w") as f:
      json.dump(self.doc, f, indent=1)
    return row


def _normal(shape, dtype, seed=0, scale=0.02):
  return (jax.random.normal(jax.random.key(seed), shape, jnp.float32) * scale).astype(dtype)


def _feed_leaf(out, args):
  p, mu, nu = out
  return p, args[1], mu, nu


def part_adam(rec, dry, interpret):
  from fuseopt.kernels import adam
  from fuseopt.kernels.elementwise_tiling import MosaicTPUConfig
  shape = (256, 1024) if dry else (8192, 8192)
  n = shape[0] * shape[1]

  def leaf(p_dtype, m_dtype):
    return lambda: (_normal(shape, p_dtype), _normal(shape, jnp.float32, 1),
                    jnp.zeros(shape, m_dtype), jnp.zeros(shape, m_dtype))

  def step(impl, config):
    def f(p, g, mu, nu):
      return adam.adam_update(p, g, mu, nu, count=jnp.int32(1), learning_rate=1e-3,
                              weight_decay=0.1, implementation=impl, config=config,
                              interpret=interpret)
    return f

  rows = (16, 64) if dry else (512, 1024, 2048, 4096, 8192)
  for p_dtype, m_dtype in ((jnp.float32, jnp.bfloat16), (jnp.float32, jnp.float32),
                           (jnp.bfloat16, jnp.bfloat16)):
    b = n * (2 * jnp.dtype(p_dtype).itemsize + 4 + 4 * jnp.dtype(m_dtype).itemsize)
    tag = f"p={jnp.dtype(p_dtype).name},m={jnp.dtype(m_dtype).name}"
    for r in rows:
      rec.run("adam_leaf", f"mosaic_tpu rows={r} {tag}", step("mosaic_tpu", MosaicTPUConfig(r)),
              leaf(p_dtype, m_dtype), bytes_moved=b, donate=(0, 2, 3), block_rows=r,
              feed=_feed_leaf)
    rec.run("adam_leaf", f"xla {tag}", step("xla", None), leaf(p_dtype, m_dtype), bytes_moved=b,
            donate=(0, 2, 3), feed=_feed_leaf)

  # A Pallas copy at each block size: what streaming can reach here.
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import tpu as pltpu

  def copy(rows_):
    def kernel(x_ref, o_ref):
      o_ref[...] = x_ref[...] + 1.0
    def f(x):
      spec = pl.BlockSpec((rows_, shape[1]), lambda i: (i, 0))
      return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(shape, jnp.float32),
                            grid=(shape[0] // rows_,), in_specs=[spec], out_specs=spec,
                            input_output_aliases={0: 0}, interpret=interpret,
                            compiler_params=None if interpret else pltpu.CompilerParams(
                                dimension_semantics=("parallel",), vmem_limit_bytes=64 << 20))(x)
    return f

  for r in ((8, 32) if dry else (8, 32, 64, 128, 256, 512)):
    rec.run("copy", f"pallas copy rows={r}x{shape[1]}", copy(r),
            lambda: (_normal(shape, jnp.float32),), bytes_moved=8 * n, donate=(0,), block_rows=r,
            feed=lambda out, a: (out,))
  rec.run("copy", "xla x+1", lambda x: x + 1.0, lambda: (_normal(shape, jnp.float32),),
          bytes_moved=8 * n, donate=(0,), feed=lambda out, a: (out,))
  rec.run("copy", "xla p - lr*g (3 streams)", lambda p, g: p - 1e-3 * g,
          lambda: (_normal(shape, jnp.float32), _normal(shape, jnp.float32, 1)),
          bytes_moved=12 * n, donate=(0,), feed=lambda out, a: (out, a[1]))


def _step_args(tx, structs):
  """``make_args`` of a step on ``structs``: fresh params made on the device,
  their state, and the gradients (made once)."""
  init, gen, grads = jax.jit(tx.init), _maker(structs), _materialize(structs, 7)

  def make():
    p = gen()
    return p, init(p), grads
  return make


def _feed_step(out, args):
  """A step's (params, state) outputs as the next step's inputs, same grads."""
  return out[0], out[1], args[2]


def _tree(dry, dtype=jnp.float32):
  from fuseopt.benchmarks import workloads
  dims = dict(d=64, ff=256, layers=2, vocab=512) if dry else dict(d=2048, ff=8192, layers=6,
                                                                  vocab=32000)
  return workloads.llama_tree(dtype, abstract=True, **dims)


def _maker(structs, seed=0):
  """A jitted function making fresh arrays for ``structs`` on the device (no
  host copy, no second copy kept alive)."""
  leaves, treedef = jax.tree.flatten(structs)
  return jax.jit(lambda: jax.tree.unflatten(
      treedef, [_normal(s.shape, s.dtype, seed + i) for i, s in enumerate(leaves)]))


def _materialize(structs, seed=0):
  return _maker(structs, seed)()


def part_tree(rec, dry, interpret, block_rows):
  import optax
  import fuseopt.optim as fo
  from fuseopt.benchmarks import user_step
  from fuseopt.kernels.adam import mosaic_tpu as adam_tpu
  from fuseopt.kernels.elementwise_tiling import MosaicTPUConfig

  def case(name, tx, p_dtype, fused, b_per_param, **extra):
    structs = _tree(dry, p_dtype)
    n = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(structs))
    rec.run("tree", name, user_step.step_fn(tx, fused), _step_args(tx, structs),
            bytes_moved=b_per_param * n, donate=(0, 1), params=n, feed=_feed_step, **extra)

  ex = lambda impl: fo.Execution(implementation=impl)
  adamw = lambda **kw: fo.adamw(1e-3, weight_decay=0.1, **kw)
  case("optax_adamw", optax.adamw(1e-3, weight_decay=0.1), jnp.float32, False, 28)
  case("optax_adamw_mu_bf16", optax.adamw(1e-3, weight_decay=0.1, mu_dtype=jnp.bfloat16),
       jnp.float32, False, 24)
  case("optax_adamw_bf16_params", optax.adamw(1e-3, weight_decay=0.1), jnp.bfloat16, False, 14)
  case("fo_step", adamw(), jnp.float32, True, 20)
  case("fo_dropin", adamw(), jnp.float32, False, 28)
  case("fo_step_bf16_params", adamw(), jnp.bfloat16, True, 14)
  # 8-bit: p, g 4 + 4, codes 1 + 1 in; p 4, codes 1 + 1 out; fp32 scales per 256 (in and out)
  case("fo_step_int8", adamw(moment_dtype="int8"), jnp.float32, True, 16 + 16 / 256)
  # 4-bit: p, g 4 + 4, codes 1/2 + 1/2 in; p 4, codes 1/2 + 1/2 out; fp32 scales per 128
  case("fo_step_int4", adamw(moment_dtype="int4"), jnp.float32, True, 14 + 16 / 128)
  for r in block_rows:
    default = adam_tpu.heuristic
    adam_tpu.heuristic = lambda size, r=r: MosaicTPUConfig(block_rows=r)
    try:
      case(f"fo_step rows={r}", adamw(), jnp.float32, True, 20, block_rows=r)
      case(f"fo_step_int8 rows={r}", adamw(moment_dtype="int8"), jnp.float32, True,
           16 + 16 / 256, block_rows=r)
    finally:
      adam_tpu.heuristic = default
  case("fo_step[xla]", adamw(execution=ex("xla")), jnp.float32, True, 20)


def part_sr(rec, dry, interpret):
  from fuseopt.kernels import stochastic_round as sr
  from fuseopt.kernels.elementwise_tiling import MosaicTPUConfig
  shape = (256, 1024) if dry else (16384, 16384)
  n = shape[0] * shape[1]
  make = lambda: (_normal(shape, jnp.float32),)
  for r in ((16,) if dry else (1024, 4096)):
    rec.run("sr", f"mosaic_tpu rows={r}", lambda x, r=r: sr.stochastic_round_bf16(
        x, 0, implementation="mosaic_tpu", config=MosaicTPUConfig(r), interpret=interpret),
            make, bytes_moved=6 * n, block_rows=r)
  rec.run("sr", "default", lambda x: sr.stochastic_round_bf16(x, 0, interpret=interpret), make,
          bytes_moved=6 * n)
  rec.run("sr", "xla", lambda x: sr.stochastic_round_bf16(x, 0, implementation="xla"), make,
          bytes_moved=6 * n)
  rec.run("sr", "xla convert", lambda x: x.astype(jnp.bfloat16), make, bytes_moved=6 * n)


def part_ns(rec, dry, interpret):
  from fuseopt.benchmarks.cases import newton_schulz as ns_case
  from fuseopt.kernels.newton_schulz import api as ns
  shapes = ([(128, 128), (128, 512)] if dry else
            [(12, 2048, 8192), (6, 8192, 2048), (24, 2048, 2048), (4096, 14336)])
  for shape in shapes:
    make = lambda shape=shape: (_normal(shape, jnp.bfloat16, scale=1.0),)
    fl = ns_case.flops(shape)
    wide = max(shape[-2:]) >= 2 * min(shape[-2:])
    variants = {"optax_ns_bf16": ns_case.optax_ns,
                "default": lambda x: ns.newton_schulz(x, coeffs="jordan", steps=5,
                                                      interpret=interpret)}
    for impl in ("xla", "mosaic_tpu"):
      for gram in ((False, True) if wide else (False,)):
        variants[f"{impl}{',gram' if gram else ''}"] = (
            lambda x, impl=impl, gram=gram: ns.newton_schulz(
                x, coeffs="jordan", steps=5, implementation=impl, gram=gram,
                interpret=interpret))
    for label, fn in variants.items():
      rec.run("ns", f"{'x'.join(map(str, shape))} {label}", fn, make, flops=fl,
              shape=list(shape), variant=label)


def part_muon(rec, dry, interpret):
  import optax
  import fuseopt.optim as fo
  from fuseopt.benchmarks import user_step
  structs = _tree(dry, jnp.float32)
  n = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(structs))

  def case(name, tx, fused, donate=(0, 1)):
    rec.run("muon", name, user_step.step_fn(tx, fused), _step_args(tx, structs),
            donate=donate, params=n, feed=_feed_step)

  def is_matrix(p):
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x.ndim == 2 and "embed" not in jax.tree_util.keystr(path)
        and "lm_head" not in jax.tree_util.keystr(path), p)

  dims = lambda p: jax.tree.map(lambda m: optax.contrib.MuonDimensionNumbers() if m else None,
                                is_matrix(p))
  case("optax_contrib_muon", optax.contrib.muon(1e-3, muon_weight_dimension_numbers=dims), False)
  fdims = lambda p: jax.tree.map(lambda m: fo.MuonDimensionNumbers() if m else None,
                                 is_matrix(p))
  for label, kw in (("", {}), ("[xla]", dict(execution=fo.Execution(implementation="xla")))):
    tx = fo.muon(1e-3, muon_weight_dimension_numbers=fdims, **kw)
    case(f"fo_muon_step{label}", tx, True)
    if not label:
      case(f"fo_muon_dropin{label}", tx, False)


def part_check(rec, dry, interpret):
  """Each Mosaic TPU Adam kernel's output on the chip against the reference
  (``implementation="xla"``) after two steps: codes and scales of the
  blockwise formats (equal codes, scales to the ulp), bf16 moments and the
  parameters (relative error)."""
  from fuseopt.kernels import adam
  from fuseopt.kernels.adam import int4 as q4, quantized as q8

  shapes = ([(128, 512), (8, 2304)] if dry else
            [(2048, 8192), (8192, 2048), (2048, 32000), (4096,), (16, 2048, 128)])
  for fmt in ("bfloat16", "int8", "int4"):
    for shape in shapes:
      for p_dtype in (jnp.float32, jnp.bfloat16):
        row = {"part": "check", "name": f"{fmt} {shape} p={jnp.dtype(p_dtype).name}"}
        try:
          p = _normal(shape, p_dtype, 1, 1.0)
          if fmt == "int8":
            mu, nu = q8.zeros(shape, signed=True), q8.zeros(shape, signed=False)
          elif fmt == "int4":
            mu, nu = q4.zeros(shape), q4.zeros(shape)
          else:
            mu = nu = jnp.zeros(shape, jnp.bfloat16)

          def two(impl, p=p, mu=mu, nu=nu):
            f = jax.jit(lambda p, g, mu, nu, c: adam.adam_update(
                p, g, mu, nu, count=c, learning_rate=1e-2, weight_decay=0.1, seed=3,
                implementation=impl, interpret=interpret if impl != "xla" else False))
            for c in (1, 2):
              p, mu, nu = f(p, _normal(shape, jnp.float32, 10 + c, 1.0), mu, nu, jnp.int32(c))
            return p, mu, nu
          got, want = two("mosaic_tpu"), two("xla")
          p32 = lambda x: np.asarray(x, np.float32)
          row["param_max_rel"] = float(np.max(np.abs(p32(got[0]) - p32(want[0])))
                                       / np.max(np.abs(p32(want[0]))))
          if fmt == "bfloat16":
            row["moments_equal"] = float(np.mean(p32(got[1]) == p32(want[1])))
            ok = row["moments_equal"] > 0.999
          else:
            codes = [np.mean(np.asarray(a.codes) == np.asarray(b.codes))
                     for a, b in ((got[1], want[1]), (got[2], want[2]))]
            scales = [float(np.max(np.abs(p32(a.scales) - p32(b.scales))
                                   / np.maximum(np.abs(p32(b.scales)), 1e-30)))
                      for a, b in ((got[1], want[1]), (got[2], want[2]))]
            row.update(codes_equal=[float(c) for c in codes], scales_max_rel=scales)
            ok = min(codes) > 0.999 and max(scales) < 1e-5
          ok = ok and row["param_max_rel"] < (1e-2 if p_dtype == jnp.bfloat16 else 1e-5)
          row["status"] = "ok" if ok else "wrong"
        except Exception as e:  # noqa: BLE001
          row.update(status="error", error=f"{type(e).__name__}: {str(e)[:600]}")
        rec.doc["rows"].append(row)
        print(json.dumps(row), flush=True)
  with open(rec.path, "w") as f:
    json.dump(rec.doc, f, indent=1)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("out")
  ap.add_argument("--parts", nargs="+", default=["tree", "muon", "sr", "check", "ns"])
  ap.add_argument("--tree-block-rows", nargs="*", type=int, default=[])
  ap.add_argument("--dry-run", action="store_true")
  a = ap.parse_args(argv)
  interpret = False
  if a.dry_run:
    from jax.experimental.pallas import tpu as pltpu
    interpret = pltpu.InterpretParams()
  dev = jax.devices()[0]
  meta = {"device_kind": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
          "python": sys.version.split()[0], "dry_run": a.dry_run}
  rec = Recorder(a.out, meta)
  parts = {"adam": part_adam, "sr": part_sr, "ns": part_ns, "muon": part_muon, "check": part_check,
           "tree": functools.partial(part_tree, block_rows=a.tree_block_rows)}
  for p in a.parts:
    t0 = time.perf_counter()
    try:
      parts[p](rec, a.dry_run, interpret)
    except Exception:  # noqa: BLE001
      traceback.print_exc()
    print(f"== part {p}: {time.perf_counter() - t0:.1f} s", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
