from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepserve.errors import ConfigError
from deepserve.hardware.catalog import get_accelerator
from deepserve.plan.calibration import CALIBRATION_FORMAT, apply_calibration, load_calibration
from deepserve.plan.kernels import WORK_KINDS, kernel_rates
from tests.helpers import load_benchmark_script


def _load_script(monkeypatch: pytest.MonkeyPatch):
    return load_benchmark_script("calibrate_gpu", monkeypatch)


def test_smoke_run_on_cpu_writes_every_kind_and_is_refused_by_the_planner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "calibration.json"
    assert _load_script(monkeypatch).main(["--device", "cpu", "--smoke", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["smoke"] is True and data["format"] == CALIBRATION_FORMAT
    assert {m["family"] for m in data["measurements"]} == set(WORK_KINDS)
    for m in data["measurements"]:
        assert m["seconds"] > 0 and m["roofline_s"] > 0 and m["bytes_moved"] > 0
    cases = {(m["family"], m["case"]) for m in data["measurements"]}
    assert any(family == "moe_gemm" and case.startswith("ep32 ") for family, case in cases)  # expert parallelism
    assert any(case.endswith("context 512") for _, case in cases)  # long contexts (shrunk for the smoke run)
    assert any(case.startswith("chunk ") for _, case in cases)  # a prompt chunk over a long cached context
    assert not any(m["dtype"] == "fp4" for m in data["measurements"])  # no FP4 units on a CPU: skipped, said so
    kinds = data["planner"]["kinds"]
    assert kinds and set(kinds) <= set(WORK_KINDS)  # a kind no case could measure is left to the table
    for by_family in kinds.values():
        for figures in by_family.values():
            efficiencies = figures.keys() & {"memory_efficiency", "compute_efficiency"}
            assert "floor_us" in figures and efficiencies
            assert all(0 <= figures[key] <= 1 for key in efficiencies)  # a smoke run measures nothing real
    with pytest.raises(ConfigError, match="smoke"):
        load_calibration(out)


def _write(path: Path, kinds: object, **extra: object) -> Path:
    path.write_text(
        json.dumps(
            {"format": CALIBRATION_FORMAT, "device": "NVIDIA H100 80GB HBM3", "planner": {"kinds": kinds}, **extra}
        )
    )
    return path


def test_calibration_replaces_the_measured_kinds_only(tmp_path: Path) -> None:
    table = kernel_rates(get_accelerator("h100"), "fp8")
    path = _write(
        tmp_path / "cal.json",
        {"moe_gemm": {"fp8": {"memory_efficiency": 0.55, "compute_efficiency": 0.4, "floor_us": 12}}},
        hardware_class="hopper",
    )
    rates = apply_calibration(table, path)
    assert rates.rate("moe_gemm").memory_efficiency == 0.55 and rates.rate("moe_gemm").floor_us == 12
    assert rates.rate("dense_gemm") == table.rate("dense_gemm")
    assert "measured on NVIDIA H100" in rates.provenance


def test_a_figure_the_script_could_not_measure_keeps_the_tables(tmp_path: Path) -> None:
    table = kernel_rates(get_accelerator("h100"), "bf16")
    path = _write(
        tmp_path / "cal.json", {"mla_prefill": {"any": {"compute_efficiency": 0.41}}}, hardware_class="hopper"
    )
    attention = apply_calibration(table, path).rate("mla_prefill")
    assert attention.compute_efficiency == 0.41 and attention.measured
    assert attention.memory_efficiency == table.rate("mla_prefill").memory_efficiency


@pytest.mark.parametrize(
    ("kinds", "extra", "message"),
    [
        ({"moe_gemm": {"fp8": {"floor_us": 3}}}, {}, "neither efficiency"),
        ({"moe_gemm": {"fp8": {"memory_efficiency": 1.5, "compute_efficiency": 0.5}}}, {}, "must be in"),
        ({"warp_drive": {"any": {"memory_efficiency": 0.5, "compute_efficiency": 0.5}}}, {}, "unknown kind"),
        ({}, {}, "lacks planner.kinds"),
        (
            {"moe_gemm": {"fp8": {"memory_efficiency": 0.5, "compute_efficiency": 0.5}}},
            {"hardware_class": "ampere"},
            "measured on ampere",
        ),
    ],
)
def test_bad_calibration_files_are_clear_errors(tmp_path: Path, kinds: object, extra: dict, message: str) -> None:
    path = _write(tmp_path / "cal.json", kinds, **extra)
    with pytest.raises(ConfigError, match=message):
        apply_calibration(kernel_rates(get_accelerator("h100"), "fp8"), path)


def test_files_of_the_earlier_format_and_missing_files_are_refused(tmp_path: Path) -> None:
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"device": "x", "planner": {"memory_efficiency": 0.8, "compute_efficiency": 0.5}}))
    with pytest.raises(ConfigError, match="per-kind"):
        load_calibration(old)
    with pytest.raises(ConfigError, match="does not exist"):
        load_calibration(tmp_path / "missing.json")


def test_validation_uses_a_calibration_for_the_rows_of_its_gpu_class_only(tmp_path: Path) -> None:
    from deepserve.plan.published import load_rows, row_deployment, unpredictable_reason

    path = _write(
        tmp_path / "cal.json",
        {"moe_gemm": {"16bit": {"memory_efficiency": 0.5, "compute_efficiency": 0.5, "floor_us": 7}}},
        hardware_class="hopper",
    )
    rows = [row for row in load_rows() if unpredictable_reason(row) is None]
    by_class: dict[str, list[bool]] = {}
    for row in rows:
        deployment = row_deployment(row, path)
        by_class.setdefault(deployment.accelerator.hardware_class, []).append(deployment.calibration == path)
    assert all(by_class["hopper"]) and by_class.keys() - {"hopper"}
    assert not any(flag for cls, flags in by_class.items() if cls != "hopper" for flag in flags)


def test_fp4_weights_have_kernel_figures_on_every_gpu_class() -> None:
    """FP4 formats (the models colleague's NVFP4/MXFP4) get Blackwell's FP4 path and, on GPUs without FP4 units,
    the dequantizing 4-bit path; every figure is marked as carried over until calibrate_gpu.py measures it."""
    from deepserve.plan.kernels import weight_family

    assert weight_family("nvfp4") == "fp4" and weight_family("mxfp4-moe") == "fp4"
    for gpu in ("b200", "h200", "a100", "mi300x"):
        rates = kernel_rates(get_accelerator(gpu), "nvfp4")
        assert rates.family == "fp4" and not rates.rate("moe_gemm").measured


def test_the_engines_kernel_sets_the_fp8_figures_where_several_were_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Block-scaled GEMMs (DeepSeek's FP8 checkpoints) and the grouped MoE GEMM (one kernel over every local expert,
    as the engines' fused MoE) set the planner's FP8 figures; the faster per-tensor and per-expert cases only stay
    in the file."""
    torch = pytest.importorskip("torch")
    script = _load_script(monkeypatch)
    acc = get_accelerator("h100")
    calibration = script.Calibration(acc, torch.device("cpu"), script.Timer(torch.device("cpu"), 0, 1), 1)
    bandwidth = acc.memory_bandwidth_gb_s * 1e9
    for family, case, scaling, fraction in (
        ("dense_gemm", "o_proj m=1", "tensor", 0.8),
        ("dense_gemm", "lm_head m=1", "tensor", 0.8),
        ("dense_gemm", "o_proj m=1", "block", 0.4),
        ("dense_gemm", "lm_head m=1", "block", 0.4),
        ("moe_gemm", "ep8 batch 256 (32 tokens/rank, 32/32 experts)", "block per expert", 0.3),
        ("moe_gemm", "ep16 batch 256 (32 tokens/rank, 16/16 experts)", "block per expert", 0.3),
        ("moe_gemm", "ep8 batch 256 (32 tokens/rank, 32/32 experts)", "rowwise grouped", 0.6),
        ("moe_gemm", "ep16 batch 256 (32 tokens/rank, 16/16 experts)", "rowwise grouped", 0.6),
    ):
        nbytes = 1e9 if case.startswith(("lm_head", "ep8")) else 2.5e8
        calibration.record(family, case, "fp8", nbytes / (fraction * bandwidth), nbytes, 1e6, scaling)
    kinds = calibration.planner_block()["kinds"]
    assert kinds["dense_gemm"]["fp8"]["memory_efficiency"] == pytest.approx(0.4, rel=1e-3)
    assert kinds["moe_gemm"]["fp8"]["memory_efficiency"] == pytest.approx(0.6, rel=1e-3)
    assert kinds["moe_gemm"]["fp8"]["floor_us"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_the_recorded_gpu_calibrations_hold_the_kernels_the_searched_layouts_need(gpu: str) -> None:
    path = Path(__file__).parents[3] / "benchmarks" / "results" / f"calibration_{gpu}.json"
    data = json.loads(path.read_text())
    assert data["catalog_entry"].startswith(gpu) and not data["smoke"] and data["device"].startswith("NVIDIA H")
    cases = [(m["family"], m["case"], m["scaling"]) for m in data["measurements"]]
    assert any(f == "moe_gemm" and c.startswith("ep64 ") and s == "rowwise grouped" for f, c, s in cases)
    assert any(f == "dense_gemm" and s == "block" for f, _, s in cases)
    assert any(f == "mla_decode" and c.endswith("context 131072") for f, c, _ in cases)
    assert any(f == "mla_prefill" and c.startswith("chunk 8192 over 131072") for f, c, _ in cases)
    assert load_calibration(path)["kinds"].keys() >= {"dense_gemm", "moe_gemm", "mla_decode", "mla_prefill"}
