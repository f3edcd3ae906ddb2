"""`deepserve sweep` with the real benchmark runner against the simulator with fixed timings on loopback: a grid and
a suite run, resume, land in the store and produce a report, in seconds and without vLLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepserve.cli.main import main
from deepserve.hardware import host
from deepserve.hardware.host import HostMeasurement
from deepserve.report import derived as dv
from deepserve.report.build import build_report, load_sets
from deepserve.results.store import ResultsStore
from deepserve.sweep import probe
from tests.helpers import present, simulator_thread

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def fake():
    with simulator_thread(ttft_ms=20, itl_ms=2) as server:
        yield server


def test_grid_sweep_runs_resumes_records_and_reports(fake, tmp_path: Path, capsys):
    out = tmp_path / "grid"
    command = [
        "sweep",
        "--base-url",
        fake.root_url,
        "--max-concurrency",
        "1,2,4",
        "--random-input-len",
        "16",
        "--random-output-len",
        "8",
        "--num-prompts",
        "8",
        "--ignore-eos",
        "--result-dir",
        str(out),
        "--label",
        "fake",
        "--no-stop-at-saturation",
        "--metadata",
        "hardware=loopback fake",
    ]
    assert main(command) == 0
    index = json.loads((out / "index.json").read_text())
    assert [p["status"] for p in index["points"]] == ["done", "done", "done"]
    assert index["metadata"]["hardware"] == "loopback fake"  # --metadata wins over detection
    for point, concurrency in zip(index["points"], (1, 2, 4), strict=True):
        result = json.loads((out / point["result_file"]).read_text())
        assert result["max_concurrency"] == concurrency
        assert result["completed"] == 8 and result["failed"] == 0
        assert result["total_output_tokens"] == 64
        assert result["median_ttft_ms"] >= 20  # the simulator's TTFT
    runs = ResultsStore().list_runs(label="fake")
    assert sorted(present(run.params.max_concurrency) for run in runs) == [1, 2, 4]
    html = (out / "report" / "report.html").read_text()
    assert "Throughput vs concurrency" in html and "loopback fake" in html

    requests_before = fake.app.stats.requests
    capsys.readouterr()
    assert main(command) == 0
    assert "0 ran, 3 kept from before" in capsys.readouterr().err
    assert fake.app.stats.requests - requests_before < 3  # at most the metadata look-ups, no benchmark requests
    assert len(ResultsStore().list_runs(label="fake")) == 3


def test_suite_probes_plans_and_runs(fake, tmp_path: Path, capsys):
    out = tmp_path / "long"
    assert (
        main(
            [
                "sweep",
                "--base-url",
                fake.root_url,
                "--suite",
                "long-prompt",
                "--time-budget-s",
                "30",
                "--result-dir",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().err
    assert "Speed probe: prefill" in printed
    index = json.loads((out / "index.json").read_text())
    assert index["suite"] == "long-prompt"
    assert index["metadata"]["scale"]["probe"]["prefill_tok_s"] > 0
    lengths = [p["overrides"]["long_prompt_len"] for p in index["points"]]
    assert lengths == [10240, 16384]  # a fast server keeps the seed's lengths
    for point in index["points"]:
        result = json.loads((out / point["result_file"]).read_text())
        assert result["completed"] == 1
        assert result["total_input_tokens"] == pytest.approx(point["overrides"]["long_prompt_len"], rel=0.01)
    assert (out / "report" / "latency_vs_input_len.png").is_file()


def test_a_sweep_on_this_host_records_its_deployment_and_the_report_sets_it_against_the_limit(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
):
    """A served model whose architecture is known (a preset name here) on a CPU-only host: the sweep records the
    model's config.json and the host's measured bandwidth (stubbed: the real measurement copies a gigabyte), the
    report draws the Pareto, cost and hardware-limit charts from them, and a later report reads them back."""
    measured: list[int] = []

    def measure() -> HostMeasurement:
        measured.append(1)
        return HostMeasurement("box", "Test CPU", 2, 5.0, 50.0, None, "2026-11-22T00:00:00Z")

    monkeypatch.setattr(host, "measure_host", measure)
    monkeypatch.setattr(probe, "local_gpus", lambda: ())
    out = tmp_path / "tiny"
    command = ["sweep", "--random-input-len", "16", "--random-output-len", "8", "--num-prompts", "8"]
    command += ["--max-concurrency", "1,2,4", "--ignore-eos", "--result-dir", str(out), "--no-stop-at-saturation"]
    command += ["--metadata", "gpu_hour_usd=0.5", "--label", "tiny"]
    with simulator_thread(ttft_ms=20, itl_ms=4, model="deepserve/tiny-deepseek-v3") as server:
        assert main([*command, "--base-url", server.root_url]) == 0
    assert measured == [1]
    deployment = json.loads((out / "index.json").read_text())["metadata"]["deployment"]
    assert deployment["accelerator"] == "cpu" and deployment["devices"] == 1
    assert deployment["host"]["memory_bandwidth_gb_s"] == 5.0
    assert deployment["model_config"]["model_type"] == "deepseek_v3"
    printed = capsys.readouterr().err
    assert "tiny: decode runs at" in printed and "the CPU host (5 GB/s, measured by deepserve: Test CPU" in printed
    assert "tiny: the cheapest point costs $" in printed and "1 x $0.50 per hour" in printed
    for name in ("pareto", "cost_per_million_tokens", "decode_vs_hardware_limit"):
        assert (out / "report" / f"{name}.png").is_file()

    # Read back by a later report: every point has its limit, consistent with the planner's own numbers.
    sets = load_sets([out])
    report = build_report(sets, tmp_path / "again", [])
    limit = report.deployments[0].limit
    assert limit is not None and limit.bandwidth_gb_s == 5.0
    for point in sets[0].points:
        batch, context = present(point.metric(dv.DECODE_BATCH)), present(dv.mean_context_len(point))
        assert context == pytest.approx(16 + 8 / 2)
        assert point.metric(dv.LIMIT_TOK_S) == pytest.approx(limit.tokens_per_s(batch, context))
        assert 0 < (point.metric(dv.LIMIT_FRACTION) or 0) < 1
