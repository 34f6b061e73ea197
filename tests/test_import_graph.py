"""fuseopt's modules import each other without a cycle, function-local imports
counted, and the library (kernels, optim, the shim, nnx) never imports the
tooling (fuseopt.benchmarks, the CLI)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fuseopt"
TOOLING = ("fuseopt.benchmarks", "fuseopt.cli")


def _modules() -> dict[str, Path]:
  out = {}
  for path in PACKAGE.rglob("*.py"):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    out[name] = path
  return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
  """The fuseopt modules ``name`` imports anywhere in its body."""
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    targets = []
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        up = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(up + ([base] if base else []))
      targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                 for a in node.names]
    for t in targets:
      while t not in modules and "." in t:
        t = t.rpartition(".")[0]
      if t in modules and t != name and t.startswith("fuseopt"):
        found.add(t)
  return found


def _graph():
  modules = _modules()
  return {m: _imports(m, p, modules) for m, p in modules.items()}


def _cycles(graph) -> list[list[str]]:
  """Strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in graph:
    if v not in index:
      visit(v)
  return out


def test_no_import_cycle():
  graph = _graph()
  assert len(graph) > 50 and any(graph.values())
  assert not _cycles(graph), f"import cycles (function-local imports counted): {_cycles(graph)}"


def test_the_cycle_finder_finds_one():
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_library_never_imports_the_tooling():
  graph = _graph()
  library = [m for m in graph if not m.startswith(TOOLING)]
  up = {m: sorted(t for t in graph[m] if t.startswith(TOOLING)) for m in library}
  up = {m: ts for m, ts in up.items() if ts}
  assert not up, f"library modules importing fuseopt.benchmarks / the CLI: {up}"
