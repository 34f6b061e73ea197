"""docs/scaling.md's "Measured at scale" table, from the committed compile
figures of the scale cases (:mod:`.scale`) and the 1.2 B tree's sharded
steps: each row from the newest jax release that recorded it."""

from __future__ import annotations

import json
from pathlib import Path

from fuseopt.benchmarks import compile_results, compiled, scale

SCALE_START = "<!-- scale-table:start -->"
SCALE_END = "<!-- scale-table:end -->"

_LAYOUTS = {
    "leaves": "one leaf per matrix",
    "scan": "scan-stacked `(L, in, out)`",
    "packed": "packed `qkv`, `gate_up` (`MatrixViews`)",
    "moe": "experts stacked `(L, E, in, out)`",
}
_MODEL_NAMES = {"llama1.2b": "1.2 B", "llama8.8b": "8.8 B", "llama80b": "80 B", "moe13.8b": "13.8 B MoE"}


def _where_name(where: str) -> str:
  p = scale.placement(where)
  if len(p.shape) == 2:
    return f"FSDP {p.shape[0]} × TP {p.shape[1]}"
  return "experts over the mesh (EP), the rest FSDP" if where.startswith("ep") else "FSDP"


def _coll_bytes(fig) -> str:
  c = fig.get("collectives") or {}
  return ", ".join(f"{v['count']} {k} ({compiled.gb(v['bytes'])})" for k, v in c.items()) or "none"


def _cells(fig) -> tuple[str, str, str, str, str]:
  """temp, arguments, collectives, launches, seconds of one case's figures."""
  if not fig:
    return ("not recorded",) + ("-",) * 4
  if "error" in fig:
    return (compiled.why_failed(fig["error"]),) + ("-",) * 4
  secs = f"{fig['lower_s'] + fig['compile_s']:.0f}" if "lower_s" in fig else "-"
  return (compiled.gb(fig["temp_bytes"]), compiled.gb(fig["argument_bytes"]), _coll_bytes(fig),
          str(fig["kernels"]), secs)


def rows():
  """``(model, layout, placement, devices, target, fuseopt case id, optax case id or None)``
  of the table: the 1.2 B tree's Auto-mesh FSDP step on 8 devices, then every scale case."""
  out = [("llama1.2b", "leaves", "fsdp8", 8, t, "sharded/hybrid/fuseopt_step/llama1.2b-fsdp8-auto",
          "sharded/hybrid/optax/llama1.2b-fsdp8-auto") for t in ("v5e", "v6e", "h200")]
  for sc in scale.SCALE_CASES:
    for t in sc.targets:
      for variant in scale.variants(sc)[:1 + sc.pallas_gemm]:
        out.append((sc.model, sc.layout, sc.where, scale.placement(sc.where).devices, t,
                    f"scale/hybrid/{variant}/{sc.id}",
                    f"scale/hybrid/optax/{sc.id}" if sc.optax else None))
  return out


def records(target: str, root) -> list[tuple[str, dict]]:
  """``(jax release, {case id: figures})`` of ``target``'s committed records,
  the newest release first: ``<root>/jax-<release>/<target>.json`` (the CI
  cases, and the scale sweep where it was run with that release), then
  ``<root>/<target>.json`` (jax 0.11.2's full sweep)."""
  def version(path):
    return tuple(int(v) for v in path.parent.name.removeprefix("jax-").split(".") if v.isdigit())
  keyed = sorted(Path(root).glob(f"jax-*/{target}.json"), key=version, reverse=True)
  out = [(p.parent.name.removeprefix("jax-"), json.loads(p.read_text())["cases"]) for p in keyed]
  legacy = compiled.sweep_record(target, root)
  if legacy:
    out.append((legacy.get("environment", {}).get("jax", "0.11.2"), legacy["cases"]))
  return out


def _figures(recs, case_id):
  """The newest release's figures of ``case_id`` and that release (``(None, None)``: none)."""
  for release, cases_ in recs:
    if case_id in cases_:
      return cases_[case_id], release
  return None, None


def markdown(root=None) -> str:
  """docs/scaling.md's "Measured at scale" table, from the committed figures:
  each row from the newest jax release that recorded it (named in its own
  column)."""
  root = compile_results.RESULTS_DIR if root is None else root
  docs = {}
  out = ["| model, layout | devices | fuseopt temp | fuseopt arguments | fuseopt collectives (bytes) "
         "| fuseopt launches | optax temp | optax arguments | optax collectives (bytes) "
         "| lower + compile s (fuseopt / optax) | jax (fuseopt / optax) |",
         "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | --- | ---: | --- |"]
  for model, layout, where, n, t, ours, theirs in rows():
    if t not in docs:
      docs[t] = records(t, root)
    fig_a, rel_a = _figures(docs[t], ours)
    fig_b, rel_b = _figures(docs[t], theirs) if theirs else (None, None)
    a = _cells(fig_a)
    b = _cells(fig_b) if theirs else ("no views",) + ("-",) * 4
    gemm = ', Pallas GEMM (`NewtonSchulz(matmul="pallas")`)' if f"/{scale.PALLAS_GEMM}/" in ours else ""
    out.append(f"| {_MODEL_NAMES[model]}, {_LAYOUTS[layout]}, {_where_name(where)}{gemm} "
               f"| {n} × {t} | {a[0]} | {a[1]} | {a[2]} | {a[3]} | {b[0]} | {b[1]} | {b[2]} "
               f"| {a[4]} / {b[4]} | {rel_a or '-'} / {rel_b or '-'} |")
  return "\n".join(out) + "\n"


def render(path="docs/scaling.md", root=None) -> bool | None:
  """Rewrites the table between the scale-table markers of ``path``."""
  return compiled.render_between(path, SCALE_START, SCALE_END, markdown(root))
