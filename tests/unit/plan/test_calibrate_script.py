from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from deepserve.errors import ConfigError
from deepserve.plan.factors import load_calibration

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "calibrate_gpu.py"


def _load_script(monkeypatch: pytest.MonkeyPatch):
    spec = importlib.util.spec_from_file_location("calibrate_gpu", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "calibrate_gpu", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_smoke_run_on_cpu_writes_every_family_and_is_refused_by_the_planner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "calibration.json"
    assert _load_script(monkeypatch).main(["--device", "cpu", "--smoke", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["smoke"] is True
    families = {m["family"] for m in data["measurements"]}
    assert families == {"mla_decode", "moe_experts", "dense_gemm"}
    for m in data["measurements"]:
        assert m["seconds"] > 0 and m["roofline_s"] > 0 and m["bytes_moved"] > 0
    assert {"memory_efficiency", "compute_efficiency"} <= data["planner"].keys()
    with pytest.raises(ConfigError, match="smoke"):
        load_calibration(out)
