"""Find the GPUs on this machine, without importing torch (which takes seconds and may not be installed)."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class LocalGpu:
    index: int
    name: str
    memory_mib: int


@lru_cache(maxsize=1)
def local_gpus() -> tuple[LocalGpu, ...]:
    """NVIDIA GPUs that nvidia-smi reports; empty when there is none (or no driver)."""
    lines = _query_nvidia_smi("index,name,memory.total")
    return tuple(_parse_smi_line(line) for line in lines)


def nvidia_driver_version() -> str | None:
    """The NVIDIA driver's version as nvidia-smi reports it (e.g. 570.124.06); None without a driver."""
    lines = _query_nvidia_smi("driver_version")
    return lines[0].strip() if lines else None


def _query_nvidia_smi(fields: str) -> list[str]:
    """One line per GPU of `nvidia-smi --query-gpu=FIELDS` (CSV, no header, no units); empty without nvidia-smi or
    when it fails."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run(
            [smi, f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line for line in out.splitlines() if line.strip()]


def _parse_smi_line(line: str) -> LocalGpu:
    index, name, memory = (part.strip() for part in line.split(","))
    return LocalGpu(index=int(index), name=name, memory_mib=int(float(memory)))


def has_gpu() -> bool:
    return bool(local_gpus())
