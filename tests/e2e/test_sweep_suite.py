"""Suites end to end on the tiny model: real vLLM, the real benchmark runner, at a small time budget."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from deepserve.cli.main import main
from deepserve.results.store import ResultsStore


def engine_url(served) -> str:
    """The engine itself: the workload counts prompt tokens with its /tokenize, which the gateway does not serve."""
    return getattr(served, "engine_url", "") or served.base_url


def test_concurrency_suite_runs_resumes_records_and_reports(served_tiny, tmp_path: Path, capsys):
    out = tmp_path / "sweep"
    command = [
        "sweep",
        "--base-url",
        engine_url(served_tiny),
        "--suite",
        "concurrency",
        "--time-budget-s",
        "60",
        "--result-dir",
        str(out),
        "--label",
        "tiny",
    ]
    started = time.monotonic()
    assert main(command) == 0
    elapsed_s = time.monotonic() - started
    assert elapsed_s < 150, f"a 60 s budget took {elapsed_s:.0f} s"

    index = json.loads((out / "index.json").read_text())
    assert index["suite"] == "concurrency" and index["label"] == "tiny"
    assert index["metadata"]["engine"] == "vllm" and index["metadata"]["max_model_len"]
    assert index["metadata"]["scale"]["length_factor"] < 1  # scaled down to the budget
    done = [p for p in index["points"] if p["status"] == "done"]
    assert len(done) >= 3
    assert [p["params"]["max_concurrency"] for p in done] == sorted(p["params"]["max_concurrency"] for p in done)
    for point in done:
        result = json.loads((out / point["result_file"]).read_text())
        assert result["completed"] > 0 and result["failed"] == 0
        assert result["max_concurrency"] == point["params"]["max_concurrency"]
        assert result["output_throughput"] > 0
        # a starved vLLM CPU API server may send whole answers in one write: then no ITL (null), never 0
        assert result["p99_itl_ms"] is None or result["p99_itl_ms"] > 0
        assert result["p99_itl_ms"] is not None or result["one_write_requests"] == result["completed"]
    # Points not run were skipped for a stated reason: saturation or the budget.
    for point in index["points"]:
        assert point["status"] in ("done", "skipped")
        if point["status"] == "skipped":
            assert "saturated" in point["note"] or "time budget" in point["note"]

    html = (out / "report" / "report.html").read_text()
    assert len(re.findall(r'<img src="data:image/png;base64,', html)) >= 3
    # The deployment: the tiny model's config and this CPU host's measured bandwidth, hence the hardware limit.
    deployment = index["metadata"]["deployment"]
    assert deployment["accelerator"] == "cpu" and deployment["host"]["memory_bandwidth_gb_s"] > 0
    assert deployment["model_config"]["model_type"] == "deepseek_v3"
    # Per-token figures come only from points with gaps between tokens (on a busy machine vLLM's CPU API server may
    # send whole answers in one write, mostly at low concurrency); the limit line and the chart need one and two.
    timed = [p for p in done if json.loads((out / p["result_file"]).read_text())["mean_tpot_ms"] is not None]
    if timed:
        assert "of the hardware&#x27;s memory-bandwidth limit" in html
    if len(timed) >= 2:
        assert 'id="decode_vs_hardware_limit"' in html and 'id="pareto"' in html
    answers = ("the highest concurrency that meets P99 ITL", "no measured concurrency meets", "arrived in one write")
    assert any(answer in html for answer in answers)
    runs = ResultsStore().list_runs(suite="concurrency")
    assert {run.point_id for run in runs} == {p["point_id"] for p in done}

    # The same command again: every finished point kept, no probe. Points the budget cut off (a busy machine) run
    # now under a fresh budget, as the docs promise; without such points nothing runs at all.
    cut_off = [p for p in index["points"] if p["status"] == "skipped" and "time budget" in p["note"]]
    capsys.readouterr()
    started = time.monotonic()
    assert main(command) == 0
    printed = capsys.readouterr().err
    assert "Resuming the planned suite" in printed
    counts = re.search(r"(\d+) ran, (\d+) kept from before", printed)
    assert counts, printed
    ran, kept = int(counts[1]), int(counts[2])
    assert kept == len(done) and ran <= len(cut_off)
    if not cut_off:
        assert ran == 0 and time.monotonic() - started < 30
    assert len(ResultsStore().list_runs(suite="concurrency")) == len(done) + ran


def test_prefix_suite_compares_sharing_on_and_off(served_tiny, tmp_path: Path):
    out = tmp_path / "prefix"
    command = [
        "sweep",
        "--base-url",
        engine_url(served_tiny),
        "--suite",
        "prefix-cache",
        "--time-budget-s",
        "40",
        "--result-dir",
        str(out),
    ]
    assert main(command) == 0
    index = json.loads((out / "index.json").read_text())
    variants = {p["params"]["variant"]: p for p in index["points"]}
    assert set(variants) == {"no sharing", "shared prefix"}
    assert all(p["status"] == "done" for p in variants.values())
    shared = variants["shared prefix"]["overrides"]
    assert 0 < shared["shared_prefix_len"] < shared["random_input_len"]
    assert (out / "report" / "prefix_sharing.png").is_file()
