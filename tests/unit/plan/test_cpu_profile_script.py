"""benchmarks/cpu_profile.py's steady part of a closed-loop run: what the planner's formula is scored against."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.helpers import load_benchmark_script


@pytest.fixture
def script(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_benchmark_script("cpu_profile", monkeypatch)


def _run(requests: list[tuple[float, float, float, int]]) -> dict[str, list[float]]:
    """--save-detailed lists from (start s, ttft s, latency s, output tokens) per request."""
    return {
        "start_times": [r[0] for r in requests],
        "ttfts": [r[1] for r in requests],
        "latencies": [r[2] for r in requests],
        "output_lens": [r[3] for r in requests],
    }


def test_first_wave_and_drain_are_left_out(script: ModuleType) -> None:
    # Two streams, A and B. The first wave (t=0) waits 1 s for its prompts, the steady requests 0.1 s. A's fourth
    # request is the last one sent (t=7.2); B's third, sent at 5.6, is still running then (it ends at 7.7).
    stream_a = [(0.0, 1.0, 3.0, 21), (3.0, 0.1, 2.1, 21), (5.1, 0.1, 2.1, 21), (7.2, 0.1, 1.1, 11)]
    stream_b = [(0.0, 1.0, 3.5, 21), (3.5, 0.1, 2.1, 21), (5.6, 0.1, 2.1, 31)]
    result = script.steady_state(_run(stream_b + stream_a), concurrency=2)
    assert result["requests"] == 3
    assert result["ttft_ms"] == pytest.approx(100.0)
    assert result["tpot_ms"] == pytest.approx(100.0)  # (2.1 - 0.1) s over 20 intervals
    assert result["output_tok_s"] == pytest.approx(2 * 21 / 2.1)  # Little's law: two streams, 2.1 s a request


def test_too_short_a_run_has_no_steady_part(script: ModuleType) -> None:
    assert script.steady_state(_run([(0.0, 0.1, 1.0, 10), (1.0, 0.1, 1.0, 10)]), concurrency=1) is None


def test_a_point_without_a_steady_part_is_scored_on_the_whole_run(script: ModuleType) -> None:
    point = script.Point(128, 4, 200.0, 15.0, 230.0, 16, {}, None)
    assert point.in_steady_state() is point
    measured = script.Point(
        128, 4, 200.0, 15.0, 230.0, 16, {}, {"ttft_ms": 90.0, "tpot_ms": 16.0, "output_tok_s": 220.0}
    )
    assert (measured.in_steady_state().ttft_ms, measured.in_steady_state().output_tok_s) == (90.0, 220.0)
