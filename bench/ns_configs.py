"""Runs every Newton–Schulz kernel config once on the device: correct? how fast?

  python bench/ns_configs.py [OUT.json] [--m 2048 --n 8192 --batch 1] [--interpret]

docs/pallas_notes.md ("CUDA graphs"): some block configs lower fine and still fail on a GPU at run
time (a CUDA-graph error seen once for a large block), which interpret mode
cannot catch. This script runs each config of each search space
(``gram``/``update``/``fused`` modules, the backend of the default device)
inside ``jax.jit``, compares it with the kernel's reference (relative
Frobenius error), times it (median of ``--iters`` after warm-up) and writes
one JSON record per config, so the frozen defaults can be checked or
replaced from data. ``--interpret`` runs a tiny shape on the CPU (a dry run
of the script itself).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from fuseopt.benchmarks import core
from fuseopt.kernels import dispatch
from fuseopt.kernels.newton_schulz import api as ns
from fuseopt.kernels.newton_schulz import fused
from fuseopt.kernels.newton_schulz import gemm as update
from fuseopt.kernels.newton_schulz import sym as gram


def _rel(a, b):
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm((a - b).ravel()) / jnp.maximum(jnp.linalg.norm(b.ravel()), 1e-30))


def _run(label, cfg, fn, ref, args, iters):
  rec = {"kernel": label, "config": repr(cfg)}
  try:
    f = jax.jit(fn)
    out = core.block(f(*args))
    rec["rel_err"] = _rel(out, ref)
    rec["ok"] = bool(rec["rel_err"] < 2e-2)
    rec.update(core.time_fn(f, args, iters=iters))
  except Exception as e:  # noqa: BLE001 - a failing config is a result, not a crash
    rec["ok"] = False
    rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
  print(json.dumps(rec), flush=True)
  return rec


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("out", nargs="?", type=Path, default=None)
  ap.add_argument("--m", type=int, default=2048)
  ap.add_argument("--n", type=int, default=8192)
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--iters", type=int, default=10)
  ap.add_argument("--interpret", action="store_true", help="tiny CPU dry run (triton interpret)")
  args = ap.parse_args(argv)

  platform = jax.default_backend()
  if args.interpret:
    impl, interp, (b, m, n), iters = "triton", True, (1, 64, 128), 1
    spaces = {"sym": gram.triton.SEARCH_SPACE[:2], "update": update.triton.SEARCH_SPACE[:2],
              "fused": fused.triton.SEARCH_SPACE[:1]}
  else:
    impl = {"gpu": "triton", "tpu": "mosaic_tpu"}.get(platform)
    if impl is None:
      print("ns_configs: no GPU/TPU; use --interpret for a dry run", file=sys.stderr)
      return 2
    interp, (b, m, n), iters = False, (args.batch, args.m, args.n), args.iters
    backend = "triton" if impl == "triton" else "mosaic_tpu"
    spaces = {k: getattr(mod, backend).SEARCH_SPACE
              for k, mod in (("sym", gram), ("update", update), ("fused", fused))}
  interp = dispatch.interpret_arg(impl, interp)

  k1, k2 = jax.random.split(jax.random.key(0))
  x = (jax.random.normal(k1, (b, m, n), jnp.float32) / (m * n) ** 0.5).astype(jnp.bfloat16)
  a = gram.sym_reference(x)
  bmat = jax.random.normal(k2, (b, m, m), jnp.float32).astype(jnp.bfloat16) / m ** 0.5
  records = []
  t0 = time.perf_counter()
  ref = gram.sym_reference(a, alpha=2.0315, beta=-4.775)
  for cfg in spaces["sym"]:
    records.append(_run("poly", cfg, lambda v, c=cfg: gram.sym(
        v, alpha=2.0315, beta=-4.775, implementation=impl, interpret=interp, config=c), ref, (a,), iters))
  ref = gram.sym_reference(x)
  for cfg in spaces["sym"]:
    records.append(_run("gram", cfg, lambda v, c=cfg: gram.sym(
        v, implementation=impl, interpret=interp, config=c), ref, (x,), iters))
  ref = update.gemm_reference(bmat, x, a=3.4445)
  for cfg in spaces["update"]:
    records.append(_run("update", cfg, lambda p, v, c=cfg: update.matmul(
        p, v, a=3.4445, implementation=impl, interpret=interp, config=c), ref, (bmat, x), iters))
  if fused.fits(impl, min(m, n), max(m, n)):
    table = ns.coefficient_table("polar_express")[0]
    ref = fused.ns_fused_reference(x, table)
    for cfg in spaces["fused"]:
      records.append(_run("fused", cfg, lambda v, c=cfg: fused.newton_schulz_fused(
          v, table, implementation=impl, interpret=interp, config=c), ref, (x,), iters))
  summary = {"device_kind": core.device_kind(), "implementation": impl, "shape": [b, m, n],
             "wall_s": round(time.perf_counter() - t0, 1), "records": records,
             "failed": [r for r in records if not r["ok"]]}
  best = {}
  for r in records:
    if r["ok"] and "ms" in r and (r["kernel"] not in best or r["ms"] < best[r["kernel"]]["ms"]):
      best[r["kernel"]] = r
  summary["best"] = best
  print(json.dumps({"best": {k: (v["config"], v["ms"]) for k, v in best.items()},
                    "failed": len(summary["failed"])}), flush=True)
  if args.out:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
