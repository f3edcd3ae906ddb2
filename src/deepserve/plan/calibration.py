"""Measured kernel figures from benchmarks/calibrate_gpu.py, in place of the table's (`plan --calibration FILE`).

The script times each kind of work the step model uses (dense GEMMs per weight family, grouped MoE GEMMs, MLA
decode and prefill attention) on a real GPU and writes, under `planner.kinds`, the same fields data/kernels.json
has: memory_efficiency, compute_efficiency and floor_us per kind and weight family. A figure the script could not
measure (a compute efficiency where no case was compute-bound, a memory efficiency where none streamed) is left
out, and the table's stays. The engine profile's overheads stay as they are: kernel microbenchmarks do not see the
engine.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from deepserve.errors import ConfigError
from deepserve.plan.kernels import WORK_KINDS, KernelRates, KindRate

CALIBRATION_FORMAT = "deepserve-calibration/3"


def load_calibration(path: Path) -> dict[str, Any]:
    """The file's `planner` block, checked, with the device it was measured on (read once per version of the file:
    a fit asks for it on every step)."""
    if not path.is_file():
        raise ConfigError(f"calibration file {path} does not exist; write one with benchmarks/calibrate_gpu.py")
    return _load_checked(path, path.stat().st_mtime_ns)


@lru_cache(maxsize=8)
def _load_checked(path: Path, _version: int) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"calibration file {path} is not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"calibration file {path} must hold a JSON object from benchmarks/calibrate_gpu.py")
    if data.get("smoke"):
        raise ConfigError(f"calibration file {path} comes from a --smoke run, which measures nothing; run it on a GPU")
    if data.get("format") != CALIBRATION_FORMAT:
        raise ConfigError(
            f"calibration file {path} is not in format {CALIBRATION_FORMAT} (per-kind figures of kernels timed as "
            "CUDA graph replays); rerun benchmarks/calibrate_gpu.py from this version"
        )
    planner = data.get("planner")
    kinds = planner.get("kinds") if isinstance(planner, dict) else None
    if not isinstance(kinds, dict) or not kinds:
        raise ConfigError(f"calibration file {path} lacks planner.kinds; it must come from benchmarks/calibrate_gpu.py")
    for kind, by_family in kinds.items():
        if kind not in WORK_KINDS or not isinstance(by_family, dict):
            raise ConfigError(f"calibration file {path}: unknown kind {kind!r}; valid: {', '.join(WORK_KINDS)}")
        for family, figures in by_family.items():
            _check_figures(path, f"{kind}.{family}", figures)
    return {"kinds": kinds, "device": data.get("device", "unknown device"), "class": data.get("hardware_class")}


def _check_figures(path: Path, where: str, figures: Any) -> None:
    if not isinstance(figures, dict):
        raise ConfigError(f"calibration file {path}: planner.kinds.{where} must be an object")
    efficiencies = [key for key in ("memory_efficiency", "compute_efficiency") if key in figures]
    if not efficiencies:
        raise ConfigError(f"calibration file {path}: planner.kinds.{where} has neither efficiency")
    for key in efficiencies:
        value = figures[key]
        if not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ConfigError(f"calibration file {path}: planner.kinds.{where}.{key} must be in (0, 1], got {value!r}")
    floor = figures.get("floor_us", 0.0)
    if not isinstance(floor, (int, float)) or floor < 0:
        raise ConfigError(f"calibration file {path}: planner.kinds.{where}.floor_us must be >= 0, got {floor!r}")


def apply_calibration(rates: KernelRates, path: Path) -> KernelRates:
    """RATES with every kind the file measured (for their weight family, or for any) replaced."""
    calibration = load_calibration(path)
    measured_class = calibration["class"]
    if measured_class and measured_class != rates.hardware_class:
        raise ConfigError(
            f"calibration file {path} was measured on {measured_class} hardware; this plan is for "
            f"{rates.hardware_class}: calibrate on the GPU you plan for"
        )
    device = calibration["device"]
    overrides = {}
    for kind, by_family in calibration["kinds"].items():
        figures = by_family.get(rates.family) or by_family.get("any")
        if figures is None:
            continue
        table = rates.rate(kind)
        overrides[kind] = KindRate(
            memory_efficiency=float(figures.get("memory_efficiency", table.memory_efficiency)),
            compute_efficiency=float(figures.get("compute_efficiency", table.compute_efficiency)),
            floor_us=float(figures.get("floor_us", table.floor_us)),
            measured=True,
            source=f"measured on {device} ({path})",
        )
    if not overrides:
        raise ConfigError(f"calibration file {path} has no figures for {rates.family} weights or for any weights")
    return rates.with_overrides(overrides, f"measured on {device} ({path}) for {', '.join(sorted(overrides))}")


def calibrated_class(path: Path) -> str | None:
    """The GPU class the calibration file was measured on (checked as `load_calibration` checks it)."""
    measured = load_calibration(path)["class"]
    return str(measured) if measured else None
