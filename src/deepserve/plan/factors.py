"""Efficiency factors: the few numbers the performance model does not derive from datasheets.

Three per profile (hardware class x engine x weight family), fitted to the published serving figures by
`deepserve plan fit` and stored with the fit's inputs in data/efficiency_factors.json. A GPU calibration file
written by benchmarks/calibrate_gpu.py can replace the two kernel efficiencies with measured ones.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from deepserve.errors import ConfigError
from deepserve.hardware.catalog import class_vendor

FACTORS_PATH = Path(__file__).with_name("data") / "efficiency_factors.json"


@dataclass(frozen=True)
class EfficiencyFactors:
    layer_overhead_us: float  # fixed time per layer per step: launches, syncs, small kernels the roofline misses
    memory_efficiency: float  # fraction of datasheet memory bandwidth the weight and KV reads achieve
    compute_efficiency: float  # fraction of datasheet dense FLOP/s the matmuls achieve (prefill, large batches)

    def to_json(self) -> dict[str, float]:
        return {key: round(value, 6) for key, value in asdict(self).items()}


@dataclass(frozen=True)
class ProfileKey:
    hardware_class: str
    engine: str
    weights: str  # weight family: fp8, int4, 16bit

    @property
    def vendor(self) -> str:
        return class_vendor(self.hardware_class)

    def describe(self) -> str:
        return f"{self.hardware_class}/{self.engine}/{self.weights}"


@dataclass(frozen=True)
class SelectedFactors:
    factors: EfficiencyFactors
    profile: str  # the fitted profile the factors come from
    provenance: str  # "fitted", "transferred from ...", "measured (calibration file ...)"


def weight_family(format_name: str) -> str:
    if format_name.startswith("fp8"):
        return "fp8"
    if "int4" in format_name:
        return "int4"
    return "16bit"


def load_fitted(path: Path = FACTORS_PATH) -> dict[ProfileKey, EfficiencyFactors]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    fitted = {}
    for entry in data["profiles"]:
        fitted[ProfileKey(**entry["key"])] = EfficiencyFactors(**entry["factors"])
    return fitted


def select_factors(
    key: ProfileKey,
    fitted: dict[ProfileKey, EfficiencyFactors] | None = None,
    calibration: Path | None = None,
    across_engines: bool = True,
    across_vendors: bool = True,
) -> SelectedFactors | None:
    """The fitted profile for KEY; else one for the same engine and weights on other hardware, else (when
    ACROSS_ENGINES) the same engine, else any. Without ACROSS_VENDORS only the same vendor's hardware is a donor:
    a kernel stack (CUDA against ROCm) differs far more than two generations of one vendor's GPUs do. The
    provenance says which, so a transferred prediction is never mistaken for a fitted one. None when nothing may
    be transferred."""
    fitted = load_fitted() if fitted is None else fitted
    if not fitted:
        raise ConfigError(f"no efficiency factors at {FACTORS_PATH}; run `deepserve plan fit --write`")
    candidates = [
        lambda k: k == key,
        lambda k: k.engine == key.engine and k.weights == key.weights,
        lambda k: k.engine == key.engine,
        lambda k: across_engines,
    ]
    donors = [k for k in fitted if across_vendors or k.vendor == key.vendor]
    for rank, matches in enumerate(candidates):
        found = sorted((k for k in donors if matches(k)), key=lambda k: k.describe())
        if found:
            chosen = found[0]
            provenance = "fitted" if rank == 0 else _transfer_note(key, chosen)
            selected = SelectedFactors(fitted[chosen], chosen.describe(), provenance)
            return apply_calibration(selected, calibration) if calibration else selected
    return None


def _transfer_note(key: ProfileKey, donor: ProfileKey) -> str:
    if donor.vendor == key.vendor:
        return f"transferred (nothing fitted for {key.describe()})"
    return (
        f"transferred from {donor.vendor} to {key.vendor} hardware (nothing fitted for {key.describe()}; "
        "another vendor's kernel stack: a rough estimate only)"
    )


def apply_calibration(selected: SelectedFactors, path: Path) -> SelectedFactors:
    """Kernel efficiencies measured on a real GPU replace the fitted ones; the per-layer overhead (an engine
    property that kernel microbenchmarks do not see) stays fitted."""
    measured = load_calibration(path)
    factors = EfficiencyFactors(
        layer_overhead_us=selected.factors.layer_overhead_us,
        memory_efficiency=measured["memory_efficiency"],
        compute_efficiency=measured["compute_efficiency"],
    )
    device = measured.get("device", "unknown device")
    return SelectedFactors(factors, selected.profile, f"measured on {device} ({path}); layer overhead fitted")


def load_calibration(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"calibration file {path} does not exist; write one with benchmarks/calibrate_gpu.py")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"calibration file {path} is not JSON: {exc}") from exc
    if isinstance(data, dict) and data.get("smoke"):
        raise ConfigError(f"calibration file {path} comes from a --smoke run, which measures nothing; run it on a GPU")
    planner = data.get("planner") if isinstance(data, dict) else None
    if not isinstance(planner, dict) or not {"memory_efficiency", "compute_efficiency"} <= planner.keys():
        raise ConfigError(
            f"calibration file {path} lacks planner.memory_efficiency and planner.compute_efficiency; "
            "it must come from benchmarks/calibrate_gpu.py"
        )
    for key in ("memory_efficiency", "compute_efficiency"):
        value = planner[key]
        if not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ConfigError(f"calibration file {path}: planner.{key} must be in (0, 1], got {value!r}")
    return {**planner, "device": data.get("device", "unknown device")}
