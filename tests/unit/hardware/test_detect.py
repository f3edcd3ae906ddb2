"""GPUs and the driver as nvidia-smi reports them, read with a stand-in nvidia-smi on PATH (this machine has none)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from deepserve.hardware.detect import LocalGpu, local_gpus, nvidia_driver_version

FAKE_SMI = """#!/bin/sh
case "$1" in
  --query-gpu=index,name,memory.total) printf '0, NVIDIA H100 80GB HBM3, 81559\\n1, NVIDIA H100 80GB HBM3, 81559\\n' ;;
  --query-gpu=driver_version) printf '570.124.06\\n570.124.06\\n' ;;
  *) exit 2 ;;
esac
"""


@pytest.fixture
def on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("PATH", str(tmp_path))
    local_gpus.cache_clear()
    yield tmp_path
    local_gpus.cache_clear()


def test_gpus_and_driver_from_nvidia_smi(on_path: Path) -> None:
    smi = on_path / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    assert local_gpus() == (LocalGpu(0, "NVIDIA H100 80GB HBM3", 81559), LocalGpu(1, "NVIDIA H100 80GB HBM3", 81559))
    assert nvidia_driver_version() == "570.124.06"


def test_no_nvidia_smi_means_no_gpu_and_no_driver(on_path: Path) -> None:
    assert local_gpus() == ()
    assert nvidia_driver_version() is None


def test_a_failing_nvidia_smi_means_no_gpu(on_path: Path) -> None:
    smi = on_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the driver' >&2\nexit 9\n"
    )
    smi.chmod(0o755)
    assert local_gpus() == ()
    assert nvidia_driver_version() is None
