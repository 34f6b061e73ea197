"""The house rule on sizes: no module of ``fuseopt/`` over 600 lines, no
function over 120 lines (its docstring not counted), so that each concept
stays in a room a reader can take in."""

from __future__ import annotations

import ast
import pathlib

import fuseopt

MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 120
ROOT = pathlib.Path(fuseopt.__file__).parent


def _sources():
  return sorted(ROOT.rglob("*.py"))


def _function_lines(node) -> int:
  """Lines of ``node`` from its ``def`` to its last line, less its docstring."""
  lines = node.end_lineno - node.lineno + 1
  body = node.body
  if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
      and isinstance(body[0].value.value, str):
    lines -= body[0].end_lineno - body[0].lineno + 1
  return lines


def test_the_count_sees_a_long_function_and_skips_its_docstring():
  doc = '  """' + "\n" * 200 + '  """\n'
  short = ast.parse("def f():\n" + doc + "  return 1\n").body[0]
  long = ast.parse("def f():\n" + "  x = 1\n" * 130).body[0]
  assert _function_lines(short) == 2
  assert _function_lines(long) > MAX_FUNCTION_LINES


def test_no_module_over_600_lines():
  big = {str(p.relative_to(ROOT)): n for p in _sources()
         if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
  assert not big, f"modules over {MAX_MODULE_LINES} lines: {big}"


def test_no_function_over_120_lines():
  long = {}
  for p in _sources():
    for node in ast.walk(ast.parse(p.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        n = _function_lines(node)
        if n > MAX_FUNCTION_LINES:
          long[f"{p.relative_to(ROOT)}:{node.lineno} {node.name}"] = n
  assert not long, f"functions over {MAX_FUNCTION_LINES} lines (docstrings excluded): {long}"
