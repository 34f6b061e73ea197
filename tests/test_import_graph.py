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


# -- fuseopt.optim's floors ----------------------------------------------------
OPTIM = "fuseopt.optim"
MAX_OPTIM_FLOORS = 6


def _optim_graph(graph):
  """The imports among fuseopt.optim's modules (the package's __init__, which
  only re-exports, left out)."""
  mods = {m for m in graph if m.startswith(OPTIM + ".")}
  return {m: {t for t in graph[m] if t in mods} for m in mods}


def _floors(graph) -> dict[str, int]:
  """Each module's floor: 1 for a module importing none of the others, else
  one above the highest floor it imports (the longest import chain below it)."""
  floor = {}

  def visit(m):
    if m not in floor:
      floor[m] = 1 + max((visit(t) for t in graph[m]), default=0)
    return floor[m]

  for m in graph:
    visit(m)
  return floor


def _chain(graph, floor, top) -> list[str]:
  chain = [top]
  while graph[chain[-1]]:
    chain.append(max(graph[chain[-1]], key=floor.get))
  return chain


def test_the_floor_count_sees_a_chain():
  floor = _floors({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"c"}})
  assert floor == {"a": 3, "b": 2, "c": 1, "d": 2}


def test_optim_is_at_most_six_floors_deep():
  """Muon's stages stand on shared pieces (dtypes, matrix views, the
  store), not on one another or on Adam: the longest chain of imports inside
  fuseopt.optim, function-local ones counted, is six modules."""
  graph = _optim_graph(_graph())
  floor = _floors(graph)
  top = max(floor, key=floor.get)
  assert floor[top] <= MAX_OPTIM_FLOORS, (
      f"fuseopt.optim is {floor[top]} floors deep: {' <- '.join(_chain(graph, floor, top))}")


def test_adam_and_muon_stand_side_by_side_on_the_shared_constants():
  """The Muon step and Adam's transforms are neighbours on one floor, the
  dtype constants below both; no Muon stage imports Adam."""
  graph = _optim_graph(_graph())
  floor = _floors(graph)
  assert floor[f"{OPTIM}.dtypes"] == 1
  assert floor[f"{OPTIM}.adam_transforms"] == floor[f"{OPTIM}.muon_pipeline"]
  leaning = sorted(m for m in graph if m.rpartition(".")[2].startswith("muon_")
                   and m != f"{OPTIM}.muon_transforms" and f"{OPTIM}.adam_transforms" in graph[m])
  assert not leaning, f"Muon modules importing adam_transforms: {leaning}"


# -- private names -------------------------------------------------------------
def _private_uses(modules: dict[str, Path]) -> list[tuple[str, str, str]]:
  """``(importer, module, name)`` for every private (underscore) name of a
  fuseopt.optim module that another fuseopt module uses: ``from .x import _y``
  or ``x._y`` with ``x`` an imported module."""
  found = []
  for name, path in modules.items():
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    aliases = {}
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          up = package.split(".")[:len(package.split(".")) - node.level + 1]
          base = ".".join(up + ([base] if base else []))
        for a in node.names:
          full = f"{base}.{a.name}"
          if full in modules:
            aliases[a.asname or a.name] = full
          elif a.name.startswith("_") and base in modules and base != name:
            found.append((name, base, a.name))
      elif isinstance(node, ast.Import):
        for a in node.names:
          if a.name in modules and a.asname:
            aliases[a.asname] = a.name
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
          and node.value.id in aliases and aliases[node.value.id] != name
          and node.attr.startswith("_") and not node.attr.startswith("__")):
        found.append((name, aliases[node.value.id], node.attr))
  return sorted({f for f in found if f[1].startswith(OPTIM + ".")})


def test_the_private_name_finder_finds_both_forms(tmp_path):
  pkg = tmp_path / "fuseopt"
  (pkg / "optim").mkdir(parents=True)
  (pkg / "optim" / "a.py").write_text("_x = 1\ndef _f(): pass\n")
  (pkg / "optim" / "b.py").write_text("from fuseopt.optim.a import _x\nfrom fuseopt.optim import a\n"
                                      "y = a._f()\n")
  modules = {"fuseopt.optim.a": pkg / "optim" / "a.py", "fuseopt.optim.b": pkg / "optim" / "b.py"}
  assert _private_uses(modules) == [("fuseopt.optim.b", "fuseopt.optim.a", "_f"),
                                    ("fuseopt.optim.b", "fuseopt.optim.a", "_x")]


def test_no_private_name_of_optim_crosses_a_module():
  """Muon's stages (and every other module of fuseopt.optim) talk through
  public values: no module uses another's underscore name."""
  crossing = _private_uses(_modules())
  assert not crossing, f"private names used across modules: {crossing}"
