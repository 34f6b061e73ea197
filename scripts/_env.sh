# Creates or reuses a venv and installs fuseopt with the extras asked for.
# Sourced by scripts/fuseopt and scripts/test; defines fuseopt_venv.
#
#   fuseopt_venv LEG EXTRAS     LEG: newest (.venv, Python 3.13, the newest
#                               supported jax) or floor (.venv-floor, Python
#                               3.11, jax 0.10.2 and optax 0.2.8, pinned by
#                               scripts/floor-constraints.txt); EXTRAS: a
#                               comma-separated list (test,bench,compile).
# Sets VENV and puts its bin/ first on PATH. The supported matrix:
# docs/compatibility.md.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

_fuseopt_python() {   # _fuseopt_python 3.13 -> a python3.13 executable
  local want="$1" cand
  for cand in "${PYTHON:-}" "python$want" \
      "$(command -v pyenv >/dev/null 2>&1 && pyenv prefix "$want" 2>/dev/null)/bin/python$want"; do
    [ -n "$cand" ] || continue
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c \
        "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$want'.split('.'))))" 2>/dev/null; then
      echo "$cand"; return 0
    fi
  done
  echo "fuseopt's $LEG venv needs Python $want (set PYTHON=/path/to/python$want)" >&2; return 1
}

fuseopt_venv() {
  LEG="$1"; local extras="$2" py constraints=()
  case "$LEG" in
    newest) VENV="$ROOT/.venv"; py=3.13 ;;
    floor) VENV="$ROOT/.venv-floor"; py=3.11
           constraints=(-c "$ROOT/scripts/floor-constraints.txt")
           extras="${extras//compile/compile-floor}" ;;
    *) echo "unknown leg '$LEG' (newest, floor)" >&2; return 2 ;;
  esac
  if [ ! -x "$VENV/bin/python" ]; then
    "$(_fuseopt_python "$py")" -m venv "$VENV"
  fi
  # The stamp holds the install's inputs and the extras installed with them:
  # nothing is reinstalled while both still cover what is asked.
  local stamp="$VENV/.fuseopt-installed" want have="" e missing=0
  want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/floor-constraints.txt" | sha256sum | cut -d' ' -f1)"
  if [ -f "$stamp" ] && [ "$(head -1 "$stamp")" = "$want" ]; then
    have="$(sed -n 2p "$stamp")"
  fi
  for e in ${extras//,/ }; do
    case ",$have," in *",$e,"*) ;; *) missing=1 ;; esac
  done
  if [ ! -f "$stamp" ] || [ "$(head -1 "$stamp")" != "$want" ] || [ "$missing" = 1 ]; then
    local all
    all="$(printf '%s\n' ${have//,/ } ${extras//,/ } | sort -u | paste -sd, -)"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    # compile / compile-floor: the real TPU and GPU compilers of the compile
    # tier (about 1.3 GB); nothing else needs them.
    "$VENV/bin/python" -m pip install --quiet ${constraints[@]+"${constraints[@]}"} -e "$ROOT${all:+[$all]}"
    printf '%s\n%s\n' "$want" "$all" > "$stamp"
  fi
  export PATH="$VENV/bin:$PATH"
}
cd "$ROOT"
