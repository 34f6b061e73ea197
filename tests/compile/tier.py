"""The compile tier's shared test body and its parametrisation over the targets.

Each case of :func:`fuseopt.benchmarks.compile_cases.cases` is compiled for the
target by its real compiler (libtpu, or XLA + ptxas) and its figures are
held against the running jax release's figures (``bench/results/compiled/
jax-<release>/<target>.json``, :func:`fuseopt.benchmarks.compile_results.results_path`): a compile failure,
a figure that grows, or a ptxas spill in a default config fails. Where the
``compile`` extra is not installed the tier skips, naming the missing
package. ``FUSEOPT_COMPILED_UPDATE=1`` writes the fresh figures into the
JSON instead of comparing (after an intended change).
"""

from __future__ import annotations

import os

import pytest

from fuseopt import targets
from fuseopt.benchmarks import compile_cases, compile_harness, compile_results, compiled

UPDATE = os.environ.get("FUSEOPT_COMPILED_UPDATE") == "1"


def case_ids(target: str, kinds: tuple[str, ...]) -> list[str]:
  return [c.id for c in compile_cases.cases(target, kinds=kinds)]


def params(kind: str) -> list:
  """``(target, case_id)`` of every CI case of ``kind`` on every target of
  :data:`fuseopt.targets.TARGETS` (which cases CI compiles where is
  :func:`fuseopt.benchmarks.compile_cases.cases`'s to say). Each target's cases of
  a kind form one xdist group, so that ``--dist loadgroup`` spreads the
  groups over the workers and keeps one target's compiler in one process
  per group."""
  return [pytest.param(name, case_id, id=f"{name}/{case_id}",
                       marks=pytest.mark.xdist_group(f"compile-{name}-{kind}"))
          for name in targets.TARGETS for case_id in case_ids(name, (kind,))]


def check(target: str, case_id: str) -> None:
  why = targets.missing(target)
  if why:
    pytest.skip(why)
  case = {c.id: c for c in compile_cases.cases(target)}[case_id]
  recorded = ((compile_results.load(target) or {}).get("cases") or {}).get(case_id)
  if case.records_failure and recorded and "error" in recorded and not UPDATE:
    # A failure that is a figure (a layout that does not compile yet, a step
    # that does not fit): held to it; compiling now is progress to record.
    try:
      figures = compile_harness.compile_case(target, case)
    except compile_harness.CompileFailure as e:
      assert compiled.why_failed(str(e)) == compiled.why_failed(recorded["error"]), (
          f"{target}: {case_id} fails otherwise than recorded: {e}")
      pytest.xfail(f"{compiled.why_failed(str(e))} (recorded)")
    print(f"{target}: {case_id} compiles now (recorded: {compiled.why_failed(recorded['error'])}): "
          f"record it with `fuseopt compile-check --target {target} --all --match {case_id} --update`")
    return
  try:
    figures = compile_harness.compile_case(target, case)   # raises CompileFailure with the message
  except compile_harness.CompileFailure as e:
    if UPDATE and case.records_failure:
      compile_results.write(target, {case_id: {"error": str(e)}})
      return
    raise
  # fuseopt's kernels must not spill in default and heuristic configs (the
  # full sweep may, documented); XLA's own fusions are reported only.
  ours = compile_harness.fuseopt_spills(figures["spills"])
  assert not ours, f"{target}: {case_id}: ptxas spills registers: {ours}"
  if figures["spills"]:
    print(f"{target}: {case_id}: XLA's fusions spill: {figures['spills']}")
  if UPDATE:
    compile_results.write(target, {case_id: figures})
    return
  doc = compile_results.load(target)
  assert doc is not None, (f"{compile_results.results_path(target)} is missing: run "
                           f"`fuseopt compile-check --target {target} --update`")
  base = doc["cases"].get(case_id)
  assert base is not None, (f"{target}: {case_id} has no committed figures: run "
                            f"`fuseopt compile-check --target {target} --update`")
  fails, notes = compile_results.compare(figures, base)
  for n in notes:
    print(f"{target}: {case_id}: {n}")
  if not compile_results.versions_match(doc):
    # Another compiler set's figures (jax release, libtpu, CUDA plugin): compiled,
    # spills checked, figures reported, never compared as a gate.
    print(f"{target}: {case_id}: {compile_results.results_path(target)} records "
          f"{doc.get('environment')}, not the installed compilers: figures not enforced"
          + (f" ({'; '.join(fails)})" if fails else ""))
  else:
    assert not fails, f"{target}: {case_id}: " + "; ".join(fails) + (
        f" (if intended: fuseopt compile-check --target {target} --update)")
