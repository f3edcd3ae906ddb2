#!/usr/bin/env bash
# The unit and integration tiers again under Python 3.10, the oldest Python deepserve supports (Ubuntu 22.04's), in
# a lighter virtualenv .venv310/: deepserve[dev] without vLLM or torch (tests that need them skip, saying why).
# Creates the virtualenv on first use and reinstalls only when pyproject.toml or this script changed.
# Without a working Python 3.10 on this machine it says so and exits 0: the stage is skipped, not failed.
#   scripts/py310-tests.sh [PYTEST ARGS]   # the arguments ./run-tests got; the e2e tier is always left out
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv310"
stamp="$venv/.deepserve-installed"
export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# A python3.10 that runs (a pyenv shim on PATH may exist and refuse to), from PATH or pyenv's versions.
find_python310() {
  local candidate
  for candidate in python3.10 /usr/bin/python3.10 /usr/local/bin/python3.10 \
    "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.10*/bin/python3.10; do
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys, venv; sys.exit(0 if sys.version_info[:2] == (3, 10) else 1)' >/dev/null 2>&1; then
      command -v "$candidate"
      return 0
    fi
  done
  return 1
}

# The user's pytest arguments, with the e2e tier (real vLLM, which this virtualenv does not have) always left out:
# a -m EXPR of theirs becomes -m "(EXPR) and not e2e".
pytest_args() {
  local marked=0 args=()
  while [ $# -gt 0 ]; do
    if [ "$1" = "-m" ] && [ $# -gt 1 ]; then
      args+=(-m "($2) and not e2e")
      marked=1
      shift 2
      continue
    fi
    args+=("$1")
    shift
  done
  [ "$marked" = 1 ] || args=(-m "not e2e" ${args[@]+"${args[@]}"})
  printf '%s\0' "${args[@]}"
}

if ! python310="$(find_python310)"; then
  echo "py310-tests: no working python3.10 on PATH or in ${PYENV_ROOT:-$HOME/.pyenv}/versions; skipping the" \
    "Python 3.10 stage (install python3.10 and python3.10-venv to run it)" >&2
  exit 0
fi

want="$(cat "$root/pyproject.toml" "$root/scripts/py310-tests.sh" | sha256sum | cut -c1-16)"
if ! { [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; }; then
  if [ ! -x "$venv/bin/python" ]; then
    echo "py310-tests: creating $venv with $python310" >&2
    "$python310" -m venv "$venv"
  fi
  echo "py310-tests: installing deepserve[dev] (no vLLM) into $venv" >&2
  "$venv/bin/python" -m pip install --quiet --upgrade pip >&2
  "$venv/bin/python" -m pip install --quiet -e "$root[dev]" >&2
  echo "$want" > "$stamp"
fi

mapfile -d '' args < <(pytest_args "$@")
cd "$root"
echo "py310-tests: $("$venv/bin/python" --version) pytest ${args[*]}" >&2
exec "$venv/bin/python" -m pytest -p no:cacheprovider "${args[@]}"
