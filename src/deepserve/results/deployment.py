"""What a run records about where it ran, so that a report can set its numbers against the hardware and a price.

A sweep writes these facts into its index's metadata (`deepserve.sweep.probe.server_facts`):

    "deployment": {
        "model_config": {...},                 # the served model's config.json (architecture: bytes per step)
        "accelerator": "h100-sxm" | "cpu",     # the catalog's name; "cpu" for a CPU-only host
        "device_name": "NVIDIA H100 80GB HBM3",
        "devices": 8,                          # GPUs on the server's host (1 for a CPU host)
        "devices_source": "nvidia-smi on the server's host",
        "host": {...},                         # CPU hosts: deepserve's own measurement (memory bandwidth, FLOP/s)
    }

Users add what the client cannot see with `--metadata` (`gpus=8 gpu_hour_usd=2.49 accelerator=h100` or
`hardware="8x H100 SXM5"`); those win over what was detected. Files written before any of this existed (and
`vllm bench serve` results) still load: what they lack stays unknown and the report says so.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepserve.errors import DeepserveError
from deepserve.hardware.catalog import Accelerator, get_accelerator, match_device_name
from deepserve.hardware.detect import LocalGpu
from deepserve.hardware.host import HostMeasurement
from deepserve.models.presets import canonical_preset_name, preset_config
from deepserve.models.spec import ModelSpec

DEPLOYMENT_KEY = "deployment"
CPU_ACCELERATOR = "cpu"
# Keys a user may give with --metadata (strings there), read here as the run's deployment.
USER_KEYS = ("gpus", "gpu_hour_usd", "accelerator", "hardware")

_COUNT_AND_NAME = re.compile(r"^\s*(\d+)\s*[x×]\s*(.+?)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class RecordedDeployment:
    """The deployment facts a result set carries, each with where it came from. None: not recorded."""

    model: str | None = None
    spec: ModelSpec | None = None
    accelerator: Accelerator | None = None
    accelerator_source: str = ""
    is_cpu_host: bool = False
    devices: int | None = None
    devices_source: str = ""
    host_bandwidth_gb_s: float | None = None  # a CPU host's memory bandwidth as deepserve measured it there
    host_words: str = ""  # that measurement in words: CPU, cores, date
    gpu_hour_usd: float | None = None
    price_source: str = ""


def read_deployment(metadata: dict[str, Any]) -> RecordedDeployment:
    """The deployment a set's metadata records: the user's --metadata keys first, then the hardware string
    ("8x NVIDIA H100 SXM5 80GB"), then what the sweep detected. Values that do not parse are treated as missing."""
    detected = metadata.get(DEPLOYMENT_KEY) if isinstance(metadata.get(DEPLOYMENT_KEY), dict) else {}
    assert isinstance(detected, dict)
    count_and_name = _parse_hardware(metadata.get("hardware"))
    devices, devices_source = _devices(metadata, count_and_name, detected)
    accelerator, accelerator_source = _accelerator(metadata, count_and_name, detected)
    is_cpu = detected.get("accelerator") == CPU_ACCELERATOR and accelerator is None
    host = detected.get("host") if is_cpu and isinstance(detected.get("host"), dict) else {}
    assert isinstance(host, dict)
    price = _positive_float(metadata.get("gpu_hour_usd"))
    model = _text(metadata.get("model")) or _text(metadata.get("model_id"))
    return RecordedDeployment(
        model=model,
        spec=_spec(detected.get("model_config"), model),
        accelerator=accelerator,
        accelerator_source=accelerator_source,
        is_cpu_host=is_cpu,
        devices=devices,
        devices_source=devices_source,
        host_bandwidth_gb_s=_positive_float(host.get("memory_bandwidth_gb_s")),
        host_words=_host_words(host),
        gpu_hour_usd=price,
        price_source="recorded (--metadata gpu_hour_usd)" if price is not None else "",
    )


def gpu_deployment(gpus: tuple[LocalGpu, ...]) -> dict[str, Any]:
    """The facts of a server on this machine with these GPUs (every GPU of the host is counted)."""
    accelerator = match_device_name(gpus[0].name)
    return {
        "accelerator": accelerator.name if accelerator else None,
        "device_name": gpus[0].name,
        "devices": len(gpus),
        "devices_source": "nvidia-smi on the server's host (all its GPUs)",
    }


def cpu_deployment(host: HostMeasurement) -> dict[str, Any]:
    """The facts of a server on this CPU-only machine: one device, the host, with deepserve's own measurement."""
    return {
        "accelerator": CPU_ACCELERATOR,
        "device_name": host.cpu_model,
        "devices": 1,
        "devices_source": "a CPU-only host counts as one device",
        "host": host.to_json(),
    }


def model_config_for(names: list[str]) -> dict[str, Any] | None:
    """The config.json of the first of NAMES that is a preset or a local model directory, else None. (A served
    model is named by its path or its preset name; nothing is looked up on the network.)"""
    for name in names:
        if not name:
            continue
        path = Path(name).expanduser()
        if (path / "config.json").is_file():
            try:
                data = json.loads((path / "config.json").read_text())
            except (OSError, ValueError):
                continue
            return data if isinstance(data, dict) else None
        if canonical_preset_name(name) is not None:
            return preset_config(name)
    return None


def _parse_hardware(value: Any) -> tuple[int, str] | None:
    match = _COUNT_AND_NAME.match(value) if isinstance(value, str) else None
    return (int(match.group(1)), match.group(2)) if match else None


def _devices(
    metadata: dict[str, Any], count_and_name: tuple[int, str] | None, detected: dict[str, Any]
) -> tuple[int | None, str]:
    given = _positive_int(metadata.get("gpus"))
    if given is not None:
        return given, "recorded (--metadata gpus)"
    if count_and_name is not None and count_and_name[0] > 0:
        return count_and_name[0], f"recorded hardware: {metadata['hardware']}"
    found = _positive_int(detected.get("devices"))
    if found is not None:
        return found, str(detected.get("devices_source") or "recorded")
    return None, ""


def _accelerator(
    metadata: dict[str, Any], count_and_name: tuple[int, str] | None, detected: dict[str, Any]
) -> tuple[Accelerator | None, str]:
    for value, source in (
        (metadata.get("accelerator"), "recorded (--metadata accelerator)"),
        (count_and_name[1] if count_and_name else None, f"recorded hardware: {metadata.get('hardware')}"),
        (detected.get("device_name"), "detected on the server's host"),
        (detected.get("accelerator"), "detected on the server's host"),
    ):
        if not isinstance(value, str) or not value or value == CPU_ACCELERATOR:
            continue
        found = match_device_name(value) or _catalog(value)
        if found is not None:
            return found, source
    return None, ""


def _catalog(name: str) -> Accelerator | None:
    try:
        return get_accelerator(name)
    except DeepserveError:
        return None


def _spec(config: Any, model: str | None) -> ModelSpec | None:
    """The served model's architecture: the recorded config.json, else the preset its name names."""
    name = model or "model"
    try:
        if isinstance(config, dict):
            return ModelSpec.from_hf_config(config, name=name)
        if model is not None and canonical_preset_name(model) is not None:
            return ModelSpec.from_hf_config(preset_config(model), name=model)
    except (DeepserveError, TypeError, ValueError):
        return None
    return None


def _host_words(host: dict[str, Any]) -> str:
    parts = [str(host[key]) for key in ("cpu_model",) if host.get(key)]
    if host.get("cores"):
        parts.append(f"{host['cores']} cores")
    if host.get("measured_at"):
        parts.append(f"measured {host['measured_at']}")
    return ", ".join(parts)


def _positive_int(value: Any) -> int | None:
    try:
        number = int(str(value).strip()) if value is not None and not isinstance(value, bool) else None
    except ValueError:
        return None
    return number if number is not None and number > 0 else None


def _positive_float(value: Any) -> float | None:
    try:
        number = float(str(value).strip().lstrip("$")) if value is not None and not isinstance(value, bool) else None
    except ValueError:
        return None
    return number if number is not None and number > 0 and number != float("inf") else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None
