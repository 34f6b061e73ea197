# Creates or reuses .venv (Python 3.12) and installs fuseopt with its extras
# (test, bench and compile: CI runs the compile tier).
# Sourced by scripts/fuseopt and scripts/test.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
find_python() {
  for cand in "${PYTHON:-}" python3.12 "$(command -v pyenv >/dev/null 2>&1 && pyenv prefix 3.12 2>/dev/null)/bin/python3.12" python3; do
    [ -n "$cand" ] || continue
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      echo "$cand"; return 0
    fi
  done
  echo "fuseopt needs Python 3.12 (set PYTHON=/path/to/python3.12)" >&2; return 1
}
if [ ! -x "$VENV/bin/python" ]; then
  "$(find_python)" -m venv "$VENV"
fi
STAMP="$VENV/.fuseopt-installed"
WANT="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  # compile: the real TPU and GPU compilers for the compile tier (about 1.3 GB).
  "$VENV/bin/python" -m pip install --quiet -e "$ROOT[test,bench,compile]"
  echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
