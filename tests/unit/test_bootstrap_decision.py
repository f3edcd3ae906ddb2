"""scripts/engine-build.sh, the decision scripts/bootstrap.sh makes before installing anything: which vLLM build a
machine needs (CUDA's, ROCm's, the CPU one) and, on AMD GPUs, how to get ROCm's. Run with stand-in nvidia-smi,
amd-smi, rocm-smi and Pythons on an otherwise empty PATH (only the shell's own tools are linked in)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "engine-build.sh"
AMD_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "amd"
TOOLS = ("grep", "cat", "head")  # what the script calls besides the stand-ins


def stand_in(directory: Path, name: str, body: str) -> None:
    path = directory / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


def python_stand_in(directory: Path, name: str, version: str, rocm_vllm: bool) -> None:
    """A Python that answers the two questions the script asks: its version, and whether it has vLLM's ROCm
    build."""
    stand_in(
        directory,
        name,
        'case "$2" in\n'
        f"  *torch.version.hip*) exit {0 if rocm_vllm else 1} ;;\n"
        f"  *version_info*) echo {version} ;;\n"
        "  *) exit 3 ;;\n"
        "esac\n",
    )


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "bin"
    directory.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found, tool
        (directory / tool).symlink_to(found)
    return directory


def run(bin_dir: Path, action: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["/bin/bash", str(SCRIPT), action],
        env={"PATH": str(bin_dir), **env},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_no_gpu_tool_means_the_cpu_build(bin_dir: Path) -> None:
    assert run(bin_dir, "build").stdout.strip() == "cpu"


def test_nvidia_smi_listing_gpus_means_the_cuda_build(bin_dir: Path) -> None:
    stand_in(bin_dir, "nvidia-smi", 'echo "GPU 0: NVIDIA H200 (UUID: GPU-1)"\n')
    stand_in(bin_dir, "amd-smi", "exit 1\n")
    assert run(bin_dir, "build").stdout.strip() == "gpu"


def test_a_failing_nvidia_smi_is_no_gpu(bin_dir: Path) -> None:
    stand_in(bin_dir, "nvidia-smi", "echo 'NVIDIA-SMI has failed' ; exit 9\n")
    assert run(bin_dir, "build").stdout.strip() == "cpu"


def test_amd_smi_listing_gpus_means_the_rocm_build(bin_dir: Path) -> None:
    stand_in(bin_dir, "amd-smi", '[ "$1" = list ] && echo \'[{"gpu": 0, "gpu_bdf": "0000:05:00.0"}]\'\n')
    assert run(bin_dir, "build").stdout.strip() == "rocm"
    assert run(bin_dir, "vendor").stdout.strip() == "amd"


def test_amd_smi_with_no_gpu_is_no_gpu(bin_dir: Path) -> None:
    stand_in(bin_dir, "amd-smi", f"cat {AMD_FIXTURES / 'amd_smi_static_none.json'}\n")
    assert run(bin_dir, "build").stdout.strip() == "cpu"


def test_rocm_smi_when_amd_smi_is_missing(bin_dir: Path) -> None:
    stand_in(bin_dir, "rocm-smi", f"cat {AMD_FIXTURES / 'rocm_smi_mi300x.json'}\n")
    assert run(bin_dir, "build").stdout.strip() == "rocm"


def test_the_override_wins_and_a_wrong_one_is_refused(bin_dir: Path) -> None:
    stand_in(bin_dir, "nvidia-smi", 'echo "GPU 0: NVIDIA H200"\n')
    assert run(bin_dir, "build", DEEPSERVE_ENGINE_BUILD="rocm").stdout.strip() == "rocm"
    wrong = run(bin_dir, "build", DEEPSERVE_ENGINE_BUILD="tpu")
    assert wrong.returncode != 0 and "use cpu, gpu or rocm" in wrong.stderr


def test_rocm_uses_a_python_that_already_has_vllms_rocm_build(bin_dir: Path) -> None:
    python_stand_in(bin_dir, "python3", "3.12", rocm_vllm=True)  # inside vllm/vllm-openai-rocm
    done = run(bin_dir, "rocm-plan")
    assert done.returncode == 0 and done.stdout.strip() == "system python3"


def test_rocm_installs_the_wheel_into_python_3_12(bin_dir: Path) -> None:
    python_stand_in(bin_dir, "python3", "3.11", rocm_vllm=False)
    python_stand_in(bin_dir, "python3.12", "3.12", rocm_vllm=False)
    done = run(bin_dir, "rocm-plan")
    assert done.returncode == 0 and done.stdout.strip() == "wheel python3.12"


def test_rocm_without_python_3_12_says_exactly_how_and_never_falls_back_to_cpu(bin_dir: Path) -> None:
    python_stand_in(bin_dir, "python3", "3.11", rocm_vllm=False)
    done = run(bin_dir, "rocm-plan")
    assert done.returncode == 1 and done.stdout == ""
    assert "wheels exist for Python 3.12 only" in " ".join(done.stderr.split())
    assert "https://wheels.vllm.ai/rocm/" in done.stderr
    assert "vllm/vllm-openai-rocm:v0.32.0" in done.stderr and "--device /dev/kfd" in done.stderr
    assert "does not install vLLM's CPU build" in done.stderr


def test_bootstrap_sources_the_decision_and_stops_on_amd_without_a_way(bin_dir: Path, tmp_path: Path) -> None:
    """bootstrap.sh itself, up to the decision: on an AMD host with no Python 3.12 it exits 1 before creating any
    virtualenv (a copy of the scripts in a scratch checkout, so nothing of the real one is touched)."""
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    for name in ("bootstrap.sh", "engine-build.sh"):
        shutil.copy(SCRIPT.parent / name, checkout / "scripts" / name)
    (checkout / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    for tool in ("dirname", "sha256sum", "cut"):
        found = shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(found)
    stand_in(bin_dir, "amd-smi", "echo '[{\"gpu\": 0}]'\n")
    python_stand_in(bin_dir, "python3", "3.11", rocm_vllm=False)
    done = subprocess.run(
        ["/bin/bash", str(checkout / "scripts" / "bootstrap.sh")],
        env={"PATH": str(bin_dir), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    assert "does not install vLLM's CPU build" in done.stderr
    assert not (checkout / ".venv").exists()
    assert set(os.listdir(checkout)) == {"scripts", "pyproject.toml"}
