from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from deepserve.errors import ConfigError
from deepserve.plan.factors import FACTORS_PATH, ProfileKey, load_fitted, select_factors
from deepserve.plan.fit import fit_profiles
from deepserve.plan.published import FIGURES_PATH, load_rows
from deepserve.plan.validate import validate

SHARED_CSV = Path(__file__).resolve().parents[4] / "shared" / "published" / "serving_figures.csv"


def test_packaged_figures_are_the_shared_csv() -> None:
    if not SHARED_CSV.is_file():
        pytest.skip("the shared calibration CSV is not next to this checkout")
    with SHARED_CSV.open() as handle:
        assert json.loads(FIGURES_PATH.read_text())["rows"] == list(csv.DictReader(handle))


def test_stored_factors_are_what_the_fit_produces() -> None:
    """No hand-tuned numbers: refitting from the published rows reproduces the stored factors."""
    stored = load_fitted()
    fits = {fit.key: fit for fit in fit_profiles()}
    assert set(fits) == set(stored)
    for key, fit in fits.items():
        for name in ("layer_overhead_us", "memory_efficiency", "compute_efficiency"):
            assert getattr(fit.factors, name) == pytest.approx(getattr(stored[key], name), rel=0.02)


def test_few_factors() -> None:
    data = json.loads(FACTORS_PATH.read_text())
    assert len(data["profiles"]) <= 4
    for profile in data["profiles"]:
        assert set(profile["factors"]) == {"layer_overhead_us", "memory_efficiency", "compute_efficiency"}
        assert len(profile["fitted_on_rows"]) >= 6  # at least two rows per factor
        assert profile["inputs"]["rows"] and profile["inputs"]["catalog"]


def test_validation_meets_the_target_on_fitted_profiles() -> None:
    result = validate()
    fitted = [r for r in result.results if r.provenance == "fitted"]
    assert len(fitted) >= 25
    assert result.mape_pct_of(True) <= 25
    assert all(0.5 <= r.ratio <= 2 for r in fitted)


def test_every_row_is_either_predicted_or_explained() -> None:
    result = validate()
    numbers = sorted([r.row.number for r in result.results] + [s.row.number for s in result.skipped])
    assert numbers == [row.number for row in load_rows()]
    reasons = {s.row.number: s.reason for s in result.skipped}
    by_number = {row.number: row for row in load_rows()}
    for number, reason in reasons.items():
        assert reason
        if by_number[number].engine == "trtllm":
            assert "no efficiency factors for engine trtllm" in reason
        if by_number[number].input_len is None:
            assert "not given" in reason


def test_rows_on_another_vendor_are_explained_not_counted() -> None:
    """No AMD row is fitted: NVIDIA's factors must not silently stand in for ROCm's kernels in the MAPE."""
    result = validate()
    assert not [r for r in result.results if r.row.hardware.startswith("MI300X")]
    mi300x = [s for s in result.skipped if s.row.hardware.startswith("MI300X")]
    assert mi300x
    for skipped in mi300x:
        assert "no efficiency factors for vllm on amd hardware" in skipped.reason
        assert skipped.transferred is not None and skipped.transferred.provenance.startswith("transferred from nvidia")
    entry = next(e for e in result.to_json()["unpredictable"] if e["row"] == mi300x[0].row.number)
    assert entry["transferred_prediction"]["ratio"] == pytest.approx(mi300x[0].transferred.ratio, abs=1e-3)


def test_factor_selection_prefers_exact_then_transfers() -> None:
    fitted = load_fitted()
    exact = next(iter(fitted))
    assert select_factors(exact, fitted).provenance == "fitted"
    same_vendor = ProfileKey("ampere", exact.engine, exact.weights)
    assert select_factors(same_vendor, fitted, across_vendors=False).provenance == (
        f"transferred (nothing fitted for {same_vendor.describe()})"
    )
    other_vendor = ProfileKey("cdna3", exact.engine, exact.weights)
    assert "transferred from nvidia to amd" in select_factors(other_vendor, fitted).provenance
    assert select_factors(other_vendor, fitted, across_vendors=False) is None
    assert select_factors(ProfileKey("hopper", "trtllm", "fp8"), fitted, across_engines=False) is None
    with pytest.raises(ConfigError, match="plan fit"):
        select_factors(exact, {})


def _write(path: Path, payload: object) -> Path:
    path.write_text(json.dumps(payload))
    return path


def test_calibration_file_replaces_kernel_efficiencies(tmp_path: Path) -> None:
    fitted = load_fitted()
    key = next(iter(fitted))
    good = _write(
        tmp_path / "cal.json",
        {"device": "NVIDIA H100 80GB HBM3", "planner": {"memory_efficiency": 0.81, "compute_efficiency": 0.55}},
    )
    selected = select_factors(key, fitted, calibration=good)
    assert selected.factors.memory_efficiency == 0.81
    assert selected.factors.compute_efficiency == 0.55
    assert selected.factors.layer_overhead_us == fitted[key].layer_overhead_us
    assert "measured on NVIDIA H100" in selected.provenance


@pytest.mark.parametrize(
    "payload",
    [{"planner": {"memory_efficiency": 0.8}}, {"planner": {"memory_efficiency": 1.5, "compute_efficiency": 0.5}}, []],
)
def test_bad_calibration_files_are_clear_errors(tmp_path: Path, payload: object) -> None:
    path = _write(tmp_path / "cal.json", payload)
    with pytest.raises(ConfigError, match="calibration file"):
        select_factors(next(iter(load_fitted())), load_fitted(), calibration=path)
    with pytest.raises(ConfigError, match="does not exist"):
        select_factors(next(iter(load_fitted())), load_fitted(), calibration=tmp_path / "missing.json")
