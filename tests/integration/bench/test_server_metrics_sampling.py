"""Server metrics sampled often enough for the run: the engine's peaks as the simulator reports them, for runs far
shorter than a one-second scrape interval, with the default (automatic, event-driven) sampling."""

from __future__ import annotations

import pytest

from deepserve.bench.config import BenchConfig
from deepserve.bench.output import console_block
from deepserve.bench.runner import run_benchmark
from tests.helpers import simulator_thread

pytestmark = pytest.mark.timeout(120)


def bench(root_url: str, **load) -> dict:
    config = BenchConfig.model_validate(
        {
            "target": {"base_url": root_url},
            "workload": {"num_prompts": 8, "random_input_len": 32, "random_output_len": 30},
            "load": {"max_concurrency": 8, **load},
        }
    )
    result = run_benchmark(config, display=False)
    assert "Peak running requests:" in console_block(result)
    return result.to_json()


def test_a_five_second_run_of_eight_concurrent_requests_reports_peak_running_eight():
    with simulator_thread(ttft_ms=20, itl_ms=10) as server:  # each request about 0.3 s: 15 waves
        data = bench(server.root_url, duration_s=5)
    metrics = data["server_metrics"]
    assert metrics["peak_running"] == 8
    assert metrics["scrapes"] >= 30  # every 50 ms at first, then elapsed / 20
    assert "new high" in metrics["sampling"]


def test_a_run_shorter_than_a_second_still_sees_its_peak():
    """Eight requests of about 0.3 s all at once: a 1 s interval saw only the idle scrapes before and after."""
    with simulator_thread(ttft_ms=20, itl_ms=10) as server:
        data = bench(server.root_url)
    assert data["duration"] < 1.0
    assert data["server_metrics"]["peak_running"] == 8
