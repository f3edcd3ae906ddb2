"""Find the GPUs on this machine, without importing torch (which takes seconds and may not be installed).

NVIDIA GPUs come from nvidia-smi. AMD Instinct GPUs come from amd-smi (ROCm's current tool), or from rocm-smi where
amd-smi is missing or fails (rocm-smi is deprecated in its favour but still ships with older ROCm releases). Both
print JSON; their shapes vary between releases, so the readers below accept each shape seen in the wild
(tests/fixtures/amd/README.md lists them with their sources)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

NVIDIA = "nvidia"
AMD = "amd"
SMI_TIMEOUT_S = 20
ROCM_VERSION_FILE = Path("/opt/rocm/.info/version")  # written by every ROCm install (e.g. "6.4.1-120")
MIB = 1024**2


@dataclass(frozen=True)
class LocalGpu:
    index: int
    name: str
    memory_mib: int
    vendor: str = NVIDIA
    arch: str = ""  # AMD's graphics target (gfx942 for MI300X/MI325X, gfx950 for MI355X); empty for NVIDIA


@lru_cache(maxsize=1)
def local_gpus() -> tuple[LocalGpu, ...]:
    """The GPUs of this machine: NVIDIA's (nvidia-smi), else AMD's (amd-smi, else rocm-smi); empty when none."""
    nvidia = tuple(_parse_smi_line(line) for line in _query_nvidia_smi("index,name,memory.total"))
    return nvidia or amd_gpus()


def has_gpu() -> bool:
    return bool(local_gpus())


def gpu_vendor() -> str | None:
    """nvidia, amd, or None on a machine without a GPU."""
    gpus = local_gpus()
    return gpus[0].vendor if gpus else None


# ---- NVIDIA --------------------------------------------------------------------------------------------------------


def nvidia_driver_version() -> str | None:
    """The NVIDIA driver's version as nvidia-smi reports it (e.g. 570.124.06); None without a driver."""
    lines = _query_nvidia_smi("driver_version")
    return lines[0].strip() if lines else None


def _query_nvidia_smi(fields: str) -> list[str]:
    """One line per GPU of `nvidia-smi --query-gpu=FIELDS` (CSV, no header, no units); empty without nvidia-smi or
    when it fails."""
    out = _run_tool("nvidia-smi", [f"--query-gpu={fields}", "--format=csv,noheader,nounits"])
    return [line for line in (out or "").splitlines() if line.strip()]


def _parse_smi_line(line: str) -> LocalGpu:
    index, name, memory = (part.strip() for part in line.split(","))
    return LocalGpu(index=int(index), name=name, memory_mib=int(float(memory)))


# ---- AMD -----------------------------------------------------------------------------------------------------------


def amd_gpus() -> tuple[LocalGpu, ...]:
    """AMD GPUs as amd-smi reports them, else as rocm-smi does; empty when neither lists one."""
    out = _run_tool("amd-smi", ["static", "--asic", "--vram", "--json"], json_despite_failure=True)
    gpus = parse_amd_smi_static(out) if out else ()
    if gpus:
        return gpus
    out = _run_tool("rocm-smi", ["--showproductname", "--showmeminfo", "vram", "--json"], json_despite_failure=True)
    return parse_rocm_smi(out) if out else ()


def rocm_version() -> str | None:
    """ROCm's version on this machine (e.g. 7.0.2): from `amd-smi version --json`, else /opt/rocm/.info/version."""
    out = _run_tool("amd-smi", ["version", "--json"], json_despite_failure=True)
    version = parse_amd_smi_version(out) if out else None
    if version:
        return version
    try:
        return ROCM_VERSION_FILE.read_text().strip().split("-")[0] or None
    except OSError:
        return None


def parse_amd_smi_static(text: str) -> tuple[LocalGpu, ...]:
    """`amd-smi static --asic --vram --json`: a list of per-GPU objects (amd-smi 24.x, ROCm 6.2) or the same list
    under "gpu_data" (later releases), each with "gpu", "asic" {market_name, target_graphics_version} and "vram"
    {size: {value, unit}}. Unreadable text gives no GPUs."""
    data = _json(text)
    if isinstance(data, dict):
        data = data.get("gpu_data", [data] if "gpu" in data else [])
    if not isinstance(data, list):
        return ()
    gpus = []
    for position, entry in enumerate(item for item in data if isinstance(item, dict)):
        asic = _section(entry, "asic")
        vram = _section(entry, "vram")
        arch = _known(asic.get("target_graphics_version"))
        name = _known(asic.get("market_name")) or (f"AMD {arch}" if arch else "AMD GPU")
        index = entry.get("gpu", position)
        gpus.append(
            LocalGpu(
                index=int(index) if str(index).isdigit() else position,
                name=name,
                memory_mib=_mib(vram.get("size")),
                vendor=AMD,
                arch=arch,
            )
        )
    return tuple(gpus)


def parse_rocm_smi(text: str) -> tuple[LocalGpu, ...]:
    """`rocm-smi --showproductname --showmeminfo vram --json`: {"card0": {"Card Series": …, "GFX Version": …,
    "VRAM Total Memory (B)": "…"}, …}; key capitalisation varies between releases, and some put the cards under
    "system"."""
    data = _json(text)
    if isinstance(data, dict) and isinstance(data.get("system"), dict) and not any(_is_card(k) for k in data):
        data = data["system"]
    if not isinstance(data, dict):
        return ()
    cards = sorted((int(key[4:]), value) for key, value in data.items() if _is_card(key) and isinstance(value, dict))
    gpus = []
    for index, card in cards:
        fields = {key.lower(): value for key, value in card.items()}
        arch = _known(fields.get("gfx version"))
        name = _known(fields.get("card series")) or _known(fields.get("card model")) or f"AMD {arch or 'GPU'}"
        memory_bytes = _number(fields.get("vram total memory (b)"))
        gpus.append(LocalGpu(index, name, int(memory_bytes // MIB), AMD, arch))
    return tuple(gpus)


def parse_amd_smi_version(text: str) -> str | None:
    """The ROCm version in `amd-smi version --json` (a "rocm_version" member, at whatever depth the release puts
    it)."""
    return _known(_find_key(_json(text), "rocm_version")) or None


def _section(entry: dict[str, Any], name: str) -> dict[str, Any]:
    value = entry.get(name)
    return value if isinstance(value, dict) else {}


def _is_card(key: str) -> bool:
    return key.startswith("card") and key[4:].isdigit()


def _mib(size: Any) -> int:
    """A size as amd-smi writes it: {"value": 196592, "unit": "MB"} (amd-smi's MB are MiB: 192 GiB is 196,608),
    or the same as a string "196592 MB"."""
    if isinstance(size, dict):
        value, unit = _number(size.get("value")), str(size.get("unit", "MB"))
    else:
        match = re.match(r"\s*([\d.]+)\s*([A-Za-z]*)", str(size or ""))
        if not match:
            return 0
        value, unit = float(match.group(1)), match.group(2) or "MB"
    scale = {"B": 1 / MIB, "KB": 1 / 1024, "MB": 1, "MIB": 1, "GB": 1024, "GIB": 1024}.get(unit.upper(), 1)
    return int(value * scale)


def _number(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def _known(value: Any) -> str:
    """VALUE as text, or empty for the tools' placeholders for a field they could not read."""
    text = str(value).strip() if value is not None else ""
    return "" if text.upper() in ("", "N/A", "NA", "UNKNOWN") else text


def _find_key(data: Any, key: str) -> Any:
    if isinstance(data, dict):
        if key in data:
            return data[key]
        data = list(data.values())
    if isinstance(data, list):
        for item in data:
            found = _find_key(item, key)
            if found is not None:
                return found
    return None


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return None


# ---- running the tools ---------------------------------------------------------------------------------------------


def _run_tool(tool: str, args: list[str], json_despite_failure: bool = False) -> str | None:
    """TOOL's standard output, or None when it is not installed, fails or hangs. JSON_DESPITE_FAILURE: keep the
    output of a failed run (amd-smi exits non-zero when one section of one GPU cannot be read, after printing the
    JSON of everything else); the parsers reject anything that is not JSON."""
    path = shutil.which(tool)
    if path is None:
        return None
    try:
        done = subprocess.run([path, *args], capture_output=True, text=True, timeout=SMI_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0 and not (json_despite_failure and done.stdout.strip()):
        return None
    return done.stdout
