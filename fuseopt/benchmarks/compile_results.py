"""The compile tier's committed figures: their JSON (schema, one file per
target and jax release), loading, writing, and the gate (:func:`compare`,
:func:`versions_match`).

Bytes, launches, collectives and spills are deterministic for pinned
compiler versions: any increase fails; times are reported only.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import jax

from fuseopt import targets as targets_lib
from fuseopt.benchmarks.compile_cases import cases

SCHEMA = "fuseopt-compiled/1"
RESULTS_DIR = Path("bench/results/compiled")


def results_path(target, root: Path | str = RESULTS_DIR, *, jax_version: str | None = None) -> Path:
  """Where the figures of ``target`` for a jax release live (default: the
  running one). Figures are exact for one set of compilers, and each jax
  release brings its own (libtpu, the CUDA plugin), so each release keeps its
  own file: ``<root>/jax-<release>/<target>.json``. ``<root>/<target>.json``
  is the file of the release it records (jax 0.11.2's, written before the
  releases were keyed): used for that release, and read, not enforced
  (:func:`versions_match`), by a release that has no file of its own."""
  name = targets_lib.get(target).name
  version = jax_version or jax.__version__
  keyed = Path(root) / f"jax-{version}" / f"{name}.json"
  legacy = Path(root) / f"{name}.json"
  return keyed if keyed.exists() or not legacy.exists() else legacy


def _recorded_jax(path: Path) -> str | None:
  try:
    return json.loads(path.read_text()).get("environment", {}).get("jax")
  except (OSError, ValueError):
    return None


def write_path(target, root: Path | str = RESULTS_DIR) -> Path:
  """Where ``--update`` writes the running release's figures: its own file,
  never another release's (:func:`results_path`)."""
  name = targets_lib.get(target).name
  legacy = Path(root) / f"{name}.json"
  if legacy.exists() and _recorded_jax(legacy) == jax.__version__:
    return legacy
  return Path(root) / f"jax-{jax.__version__}" / f"{name}.json"


def environment() -> dict[str, str]:
  from importlib import metadata
  env = {"jax": jax.__version__}
  # jax's CUDA wheels: CUDA 13's from jax 0.12.1, CUDA 12's on the floor.
  for dist in ("jaxlib", "libtpu", "jax-cuda13-plugin", "jax-cuda13-pjrt", "nvidia-cuda-nvcc",
               "nvidia-nvvm", "jax-cuda12-plugin", "jax-cuda12-pjrt", "nvidia-cuda-nvcc-cu12"):
    try:
      env[dist] = metadata.version(dist)
    except metadata.PackageNotFoundError:
      pass
  return env


def load(target, root: Path | str = RESULTS_DIR) -> dict[str, Any] | None:
  path = results_path(target, root)
  if not path.exists():
    return None
  return json.loads(path.read_text())


def write(target, figures: dict[str, dict], root: Path | str = RESULTS_DIR, *,
          merge: bool = True) -> Path:
  """Writes ``{case id: figures}`` for ``target`` (merged into what is there)."""
  t = targets_lib.get(target)
  path = write_path(t, root)
  old = json.loads(path.read_text()) if merge and path.exists() else None
  cases_ = dict(old["cases"]) if old else {}
  cases_.update(figures)
  # Cases that no longer exist (renamed or removed) leave the file.
  known = {c.id for c in cases(t, full=True, baselines=True)}
  cases_ = {k: v for k, v in cases_.items() if k in known}
  doc = {"schema": SCHEMA, "target": t.name, "device_kind": t.device_kind,
         "platform": t.platform, "implementation": t.implementation,
         "environment": environment(),
         "written": datetime.date.today().isoformat(),
         "cases": dict(sorted(cases_.items()))}
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
  return path


# Figures that fail when they grow; alias_bytes fails when it shrinks (less
# in place).
_GROWTH = ("temp_bytes", "argument_bytes", "output_bytes", "kernels")


def compare(fresh: dict[str, Any], base: dict[str, Any] | None) -> tuple[list[str], list[str]]:
  """(failures, notes) of one case's fresh figures against its baseline."""
  if base is None:
    return [], ["not in the baseline (new case)"]
  fails, notes = [], []
  for k in _GROWTH:
    a, b = fresh.get(k), base.get(k)
    if a is None or b is None:
      continue
    if a > b:
      fails.append(f"{k} grew: {b} -> {a}")
    elif a < b:
      notes.append(f"{k} shrank: {b} -> {a}")
  a, b = fresh.get("alias_bytes"), base.get("alias_bytes")
  if a is not None and b is not None:
    if a < b:
      fails.append(f"alias_bytes shrank (less in place): {b} -> {a}")
    elif a > b:
      notes.append(f"alias_bytes grew: {b} -> {a}")
  fc, bc = fresh.get("collectives", {}), base.get("collectives", {})
  for kind in sorted(set(fc) | set(bc)):
    for k in ("count", "bytes"):
      a, b = fc.get(kind, {}).get(k, 0), bc.get(kind, {}).get(k, 0)
      if a > b:
        fails.append(f"{kind} {k} grew: {b} -> {a}")
      elif a < b:
        notes.append(f"{kind} {k} shrank: {b} -> {a}")
  # Spills are not compared case by case: XLA compiles a kernel once per
  # process, so ptxas reports it for the first case that holds it. The tests
  # fail on any spill of a fuseopt kernel in a default config instead.
  new_spills = sorted(set(fresh.get("spills", [])) - set(base.get("spills", [])))
  if new_spills:
    notes.append(f"ptxas spills not in the baseline: {new_spills}")
  for k in ("lower_s", "compile_s"):
    if fresh.get(k) is not None and base.get(k):
      notes.append(f"{k} {fresh[k]:.1f} (baseline {base[k]:.1f})")
  return fails, notes


def versions_match(doc: dict[str, Any] | None) -> bool:
  """Figures depend on the compilers' versions: a baseline written with other
  versions is reported against, never enforced."""
  if not doc:
    return False
  here = environment()
  return all(here.get(k) == v for k, v in doc.get("environment", {}).items())
