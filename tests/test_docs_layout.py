"""docs/layout.md describes the tree we have: every file and folder its map
lists exists, and every ``path.py`` the walk names (with the function or
class named right after it) is there."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = ROOT / "docs" / "layout.md"

_PY = re.compile(r"\b([\w]+\.py)\b")
_DIR = re.compile(r"(?<![\w/.<])([a-z_]+)/(?=[,\s)]|$)")
# "`optim/step.py` `step`": a path, then the name the walk follows in it
_PATH_NAME = re.compile(r"`((?:[\w]+/)*[\w]+\.py)`\s+`([A-Za-z_]\w*)`")
_PATH = re.compile(r"`((?:[\w]+/)+[\w]+\.py)`")


def _map_block() -> list[str]:
  text = LAYOUT.read_text()
  return text.split("```", 2)[1].splitlines()[1:]


def _listed() -> list[Path]:
  """Every path the map names: a top-level entry, an entry under it, and the
  files and folders listed in a folder entry's description."""
  paths, root, sub = [], None, None
  for line in _map_block():
    if not line.strip():
      continue
    indent = len(line) - len(line.lstrip())
    head, _, desc = line.strip().partition("  ")
    if indent == 0:
      head = line.split()[0]
      paths.append(ROOT / head)
      root, sub = (ROOT / head if head.endswith("/") else None), None
      continue
    if root is None:
      continue
    if indent == 2:
      names = [n.strip() for n in head.split(",")]
      sub = root / names[0] if len(names) == 1 and names[0].endswith("/") else None
      paths += [root / n for n in names]
      if sub is None:
        continue
    elif sub is None:
      continue
    desc = line.strip() if indent > 2 else desc
    paths += [sub / n for n in _PY.findall(desc)]
    paths += [sub / d for d in _DIR.findall(desc)]
  return paths


def test_the_map_lists_only_what_exists():
  listed = _listed()
  assert len(listed) > 40, f"the map's parser found only {len(listed)} paths"
  missing = [str(p.relative_to(ROOT)) for p in listed if not p.exists()]
  assert not missing, f"docs/layout.md lists paths the tree does not have: {missing}"


def _resolve(rel: str) -> Path | None:
  for base in (ROOT, ROOT / "fuseopt"):
    if (base / rel).exists():
      return base / rel
  return None


def test_the_walk_names_files_and_functions_that_exist():
  text = LAYOUT.read_text()
  paths = set(_PATH.findall(text))
  assert paths, "no paths found in the walk"
  missing = sorted(p for p in paths if _resolve(p) is None)
  assert not missing, f"docs/layout.md names files that do not exist: {missing}"
  gone = []
  for rel, name in _PATH_NAME.findall(text):
    path = _resolve(rel)
    if path is None:
      continue
    source = path.read_text()
    if not re.search(rf"^\s*(?:def|class)\s+{name}\b|^{name}\s*=", source, re.M):
      gone.append(f"{rel}: {name}")
  assert not gone, f"docs/layout.md names functions that do not exist: {gone}"


_NAMED_FILE = re.compile(r"`((?:fuseopt|tests|bench|examples|scripts)/[\w/.\-]+?\.(?:py|md|json|txtpb))"
                         r"(?:::[^`]*)?`")


def test_every_file_the_docs_name_exists():
  """A file the manual or the README names in backticks (``fuseopt/...py``,
  ``tests/...py::test``, ``bench/results/...json``) is in the tree: a page
  that cites a moved module sends its reader nowhere."""
  pages = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
  missing = [f"{page.name}: {m.group(1)}" for page in pages
             for m in _NAMED_FILE.finditer(page.read_text()) if not (ROOT / m.group(1)).exists()]
  assert not missing, f"the docs name files the tree does not have: {missing}"


def test_the_readme_is_a_front_page():
  """README.md stays a front page (at most 200 lines: the tables live in
  docs/, linked), keeping the install instructions and the test command CI
  runs (scripts/test), and every page it links exists."""
  text = (ROOT / "README.md").read_text()
  assert len(text.splitlines()) <= 200, f"README.md has {len(text.splitlines())} lines"
  assert "pip install -e ." in text and "scripts/test " in text
  links = re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)(?:#[\w-]*)?\)", text)
  assert links and not [l for l in links if not (ROOT / l).exists()]
