"""The CI regression gate against the simulator: a baseline measured on a fast simulated engine and a candidate on a
slower one fail `deepserve runs compare --fail-on`; two runs of the same engine pass. Both with --num-runs, so the
verdict rests on the runs' confidence intervals, for single results and for sweeps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepserve.cli.main import main
from tests.helpers import simulator_thread

pytestmark = pytest.mark.timeout(180)
WORKLOAD = ["--num-prompts", "6", "--random-input-len", "16", "--random-output-len", "20", "--ignore-eos"]
GATE = ["--fail-on", "median_tpot_ms=+10%", "--fail-on", "output_throughput=-10%"]


def bench(url: str, out: Path, *flags: str) -> Path:
    command = ["bench", "--base-url", url, *WORKLOAD, "--max-concurrency", "3", "--num-runs", "3"]
    assert (
        main([*command, "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name, *flags]) == 0
    )
    return out


def test_a_slower_engine_fails_the_gate_and_the_same_engine_passes(tmp_path: Path, capsys):
    with simulator_thread(ttft_ms=10, itl_ms=4) as fast:
        baseline = bench(fast.root_url, tmp_path / "baseline.json")
        again = bench(fast.root_url, tmp_path / "again.json")
    with simulator_thread(ttft_ms=10, itl_ms=8) as slow:
        slower = bench(slow.root_url, tmp_path / "slower.json")
    data = json.loads(baseline.read_text())
    assert data["num_runs"] == 3 and len(data["runs"]) == 3
    assert data["confidence_intervals"]["median_tpot_ms"]["ci95_half_width"] is not None
    capsys.readouterr()
    assert main(["runs", "compare", str(baseline), str(again), *GATE]) == 0
    assert "PASS" in capsys.readouterr().out
    assert main(["runs", "compare", str(baseline), str(slower), *GATE]) == 1
    out = capsys.readouterr().out
    assert "REGRESSION: median_tpot_ms" in out and "beyond the runs' 95% confidence intervals" in out
    assert "FAIL" in out


def test_the_sweep_form_compares_point_by_point(tmp_path: Path, capsys):
    def sweep(url: str, out: Path) -> Path:
        command = ["sweep", "--base-url", url, *WORKLOAD, "--max-concurrency", "1,3", "--num-runs", "2"]
        assert main([*command, "--result-dir", str(out), "--no-report", "--no-record", "--no-stop-at-saturation"]) == 0
        return out

    with simulator_thread(ttft_ms=10, itl_ms=4) as fast:
        baseline = sweep(fast.root_url, tmp_path / "base")
    with simulator_thread(ttft_ms=10, itl_ms=8) as slow:
        slower = sweep(slow.root_url, tmp_path / "slow")
    capsys.readouterr()
    assert main(["runs", "compare", str(baseline), str(slower), *GATE]) == 1
    out = capsys.readouterr().out
    # TPOT doubled at both points: beyond the threshold and the intervals. Throughput halved too, but two runs a
    # point give 95% intervals 12.7 standard errors wide (Student's t, one degree of freedom): on a busy machine they
    # may overlap, and then the gate rightly does not call it a regression
    assert "c=1 rate=inf" in out and "c=3 rate=inf" in out
    assert out.count("REGRESSION: median_tpot_ms") == 2, out
    assert "FAIL: " in out and "checks regressed" in out
    assert main(["runs", "compare", str(baseline), str(baseline), *GATE]) == 0
