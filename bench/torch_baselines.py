"""PyTorch baselines for the Adam and Muon rows (optional; needs torch with CUDA).

  python bench/torch_baselines.py OUT.json [--iters 20]

Times one optimizer step of torch's AdamW (``fused=True`` and
``foreach=True``, fp32 params, grads and moments: 28 B/param), of the fused
AdamW with bf16 moments (``torch_adamw_fused[bf16_moments]``: fp32 params
and grads, ``exp_avg`` and ``exp_avg_sq`` created in bf16 by a step pre-hook
before the optimizer's lazy initialisation, so that the fused kernel takes
its mixed-precision path, fp32 arithmetic and bf16 moments rounded to
nearest: 20 B/param, the head-to-head of fuseopt's default format) and of
the hybrid ``torch.optim.Muon`` (the layers' 2-D matrices; lr 0.02, 5 NS
steps) + fused AdamW (the rest) on the 1.20 B Llama-shaped tree of
:func:`fuseopt.benchmarks.workloads.llama_shapes`, with lr 1e-3 / weight
decay 0.1 as in ``fuseopt.benchmarks.cases.adam``/``muon``. Medians of CUDA
event timings after warm-up; ``torch.cuda.max_memory_allocated`` beyond the
params, grads and state is reported as temp memory. Each row says what it
stores (``stores``, ``stored_bytes_per_param``: params + state) and the
bytes a step of that format must move (``moved_bytes_per_param``); its
``check`` holds the dtypes the optimizer state has after the first step.

It runs in its own process, before JAX takes the GPU: JAX preallocates most
of the device memory, so the two frameworks cannot share one process.
``bench/gpu_suite.py`` calls it and merges its rows into the op's case, next
to the optax baseline measured in the same run. Nothing here is imported by
the fuseopt package: torch stays out of its dependencies.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

LR_ADAM, LR_MUON, WD = 1e-3, 0.02, 0.1


def _leaves(shapes, prefix=""):
  if isinstance(shapes, tuple):
    yield prefix, shapes
  elif isinstance(shapes, dict):
    for k, v in shapes.items():
      yield from _leaves(v, f"{prefix}/{k}")
  else:
    for i, v in enumerate(shapes):
      yield from _leaves(v, f"{prefix}/{i}")


def _is_muon_matrix(path, shape):
  # The rule of fuseopt.benchmarks.cases.muon.muon_dims.
  return len(shape) == 2 and "embed" not in path and "lm_head" not in path


def _time_step(torch, step, iters):
  for _ in range(3):
    step()
  torch.cuda.synchronize()
  times = []
  for _ in range(iters):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    torch.cuda.synchronize()
    times.append(start.elapsed_time(end))
  return statistics.median(times), min(times)


def run(iters: int = 20) -> dict:
  import torch
  from fuseopt.benchmarks.workloads import llama_shapes

  if not torch.cuda.is_available():
    raise RuntimeError("torch has no CUDA device")
  leaves = list(_leaves(llama_shapes()))
  n = sum(int(torch.Size(s).numel()) for _, s in leaves)
  gen = torch.Generator(device="cuda").manual_seed(0)

  def tree(paths):
    ps = []
    for _, shape in paths:
      p = torch.empty(shape, device="cuda").normal_(0, 0.02, generator=gen)
      p.grad = torch.empty(shape, device="cuda").normal_(0, 0.02, generator=gen)
      ps.append(p)
    return ps

  rows = []

  def measure(op, case, variant, make, meta):
    torch.cuda.empty_cache()
    row = {"op": op, "case": case, "variant": variant, "is_baseline": False, "params": n, **meta}
    try:
      params, step, opts = make()
      base = torch.cuda.memory_allocated()
      torch.cuda.reset_peak_memory_stats()
      step()  # creates the optimizer state
      torch.cuda.synchronize()
      state = torch.cuda.memory_allocated() - base
      check = state_check(params, opts, meta.get("state_dtype"))
      torch.cuda.reset_peak_memory_stats()
      ms, min_ms = _time_step(torch, step, iters)
      temp = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
      row.update({"ms": ms, "min_ms": min_ms, "runs": iters, "temp_bytes": int(temp),
                  "state_bytes_per_param": state / n, "check": check})
      if row.get("stored_bytes_per_param") is None:  # params fp32 + the state measured
        row["stored_bytes_per_param"] = 4 + state / n
      del params, step, opts
    except Exception as e:  # noqa: BLE001 - one failing baseline must not hide the others
      row["error"] = f"{type(e).__name__}: {e}"[:500]
    rows.append(row)

  def state_check(params, opts, want):
    """The dtypes of the optimizer state after the first step, and whether
    the params stayed finite fp32 and the moments in ``want`` (a name)."""
    dtypes = sorted({str(v.dtype) for o in opts for st in o.state.values() for k, v in st.items()
                     if k in ("exp_avg", "exp_avg_sq", "momentum_buffer")})
    figures = {"state_dtypes": ", ".join(dtypes),
               "ok[params fp32, finite]": all(p.dtype == torch.float32 and bool(torch.isfinite(p).all())
                                              for p in params)}
    if want is not None:
      figures[f"ok[moments {want}]"] = dtypes == [f"torch.{want}"]
    return figures

  def moments_in(dtype):
    """A step pre-hook creating Adam's moments in ``dtype`` (and its step
    count as the fused kernel wants it, an fp32 scalar on the device) before
    the optimizer's lazy initialisation, which then keeps them."""
    def hook(optimizer, args, kwargs):
      for group in optimizer.param_groups:
        for p in group["params"]:
          if p.grad is not None and not optimizer.state[p]:
            optimizer.state[p]["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            optimizer.state[p]["exp_avg"] = torch.zeros_like(p, dtype=dtype)
            optimizer.state[p]["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype)
    return hook

  def adamw(kind, moments=None):
    def make():
      params = tree(leaves)
      opt = torch.optim.AdamW(params, lr=LR_ADAM, weight_decay=WD, **{kind: True})
      if moments is not None:
        opt.register_step_pre_hook(moments_in(moments))
      return params, opt.step, [opt]
    return make

  def hybrid():
    mats = [(p, s) for p, s in leaves if _is_muon_matrix(p, s)]
    rest = [(p, s) for p, s in leaves if not _is_muon_matrix(p, s)]
    m_params, a_params = tree(mats), tree(rest)
    muon = torch.optim.Muon(m_params, lr=LR_MUON, weight_decay=WD)
    adam = torch.optim.AdamW(a_params, lr=LR_ADAM, weight_decay=WD, fused=True)

    def step():
      muon.step()
      adam.step()
    return m_params + a_params, step, [muon, adam]

  with torch.no_grad():
    for variant, make in (("torch_adamw_fused", adamw("fused")),
                          ("torch_adamw_foreach", adamw("foreach")),
                          ("torch_adamw_fused[bf16_moments]", adamw("fused", torch.bfloat16))):
      measure("adam", "llama1.2b", variant, make, ROWS[variant])
    if hasattr(torch.optim, "Muon"):
      measure("muon", "llama1.2b", "torch_muon+adamw_fused", hybrid, ROWS["torch_muon+adamw_fused"])
  return {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "rows": rows}


# What each row keeps and moves per parameter (the table's "stores" and
# "moves" columns): params + state in bytes, and the bytes one step of that
# format must read and write (p, g, moments read; p, moments written).
ROWS = {
    "torch_adamw_fused": {
        "stores": "p, exp_avg and exp_avg_sq fp32", "stored_bytes_per_param": 12,
        "moved_bytes_per_param": 28, "state_dtype": "float32",
        "calls": "torch.optim.AdamW(params, lr, weight_decay=wd, fused=True).step()"},
    "torch_adamw_foreach": {
        "stores": "p, exp_avg and exp_avg_sq fp32", "stored_bytes_per_param": 12,
        "moved_bytes_per_param": 28, "state_dtype": "float32",
        "calls": "torch.optim.AdamW(params, lr, weight_decay=wd, foreach=True).step()"},
    "torch_adamw_fused[bf16_moments]": {
        "stores": "p fp32, exp_avg and exp_avg_sq bf16", "stored_bytes_per_param": 8,
        "moved_bytes_per_param": 20, "state_dtype": "bfloat16",
        "calls": "torch.optim.AdamW(params, lr, weight_decay=wd, fused=True).step(), "
                 "moments created in bf16 by a step pre-hook"},
    "torch_muon+adamw_fused": {
        "stores": "p fp32, state fp32 (Muon momentum; AdamW moments)", "stored_bytes_per_param": None,
        "calls": "torch.optim.Muon(matrices, lr, weight_decay=wd).step() + "
                 "torch.optim.AdamW(rest, lr, weight_decay=wd, fused=True).step()"},
}


def merge_rows(rows: list[dict], torch_rows: list[dict]) -> list[dict]:
  """Adds torch's rows to the cases they belong to, with the ratio to the
  case's baseline and the roofline fraction measured in the JAX run."""
  out = list(rows)
  for t in torch_rows:
    base = next((r for r in rows if r["op"] == t["op"] and r["case"] == t["case"]
                 and r.get("is_baseline") and "ms" in r), None)
    if base is None:
      continue  # the case did not run (another size or budget): nothing to compare with
    t = dict(t)
    for key in ("flops", "bytes", "floor_ms"):
      if base.get(key) is not None:
        t[key] = base[key]
    if "ms" in t:
      t["baseline_ms"] = base["ms"]
      t["ratio_to_baseline"] = t["ms"] / base["ms"]
      if t.get("bytes"):
        t["gbps"] = t["bytes"] / (t["ms"] * 1e-3) / 1e9
      if t.get("floor_ms"):
        t["fraction_of_floor"] = t["floor_ms"] / t["ms"]
    last = max(i for i, r in enumerate(out) if r["op"] == t["op"] and r["case"] == t["case"])
    out.insert(last + 1, t)
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("out", type=Path)
  ap.add_argument("--iters", type=int, default=20)
  args = ap.parse_args(argv)
  result = run(args.iters)
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps(result, indent=1) + "\n")
  for r in result["rows"]:
    print(f"torch_baselines: {r['op']}/{r['case']} {r['variant']}: "
          f"{r.get('error') or format(r['ms'], '.3f') + ' ms'}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
