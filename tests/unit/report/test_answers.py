from __future__ import annotations

import math
from pathlib import Path

import pytest

from deepserve.errors import ConfigError
from deepserve.report.answers import saturation_answers, slo_answers
from deepserve.results.points import PointParams, ResultPoint, ResultSet
from deepserve.results.slo import Slo, parse_slo, parse_slos
from deepserve.results.sweepdir import load_result_set

FIXTURES = Path(__file__).parents[2] / "fixtures" / "results"


def test_slo_answer_on_the_b200_table():
    # Seed 002's measured P99 ITL: 9.46, 12.90, 15.47, 22.32 ms up to concurrency 32, then 143.82 ms at 64.
    sets = [load_result_set(FIXTURES / "b200_vllm_loose", label="B200")]
    [answer] = slo_answers(sets, [Slo("p99_itl_ms", 50)])
    assert answer.concurrency == 32
    assert answer.output_throughput == pytest.approx(1382, rel=0.01)
    assert "highest concurrency that meets P99 ITL ≤ 50 ms is 32" in answer.text
    assert "1,382 output tokens/s" in answer.text


def test_slo_must_hold_at_every_lower_concurrency():
    def point(concurrency: int, p99_itl_ms: float) -> ResultPoint:
        result = {"completed": 1, "duration": 1, "p99_itl_ms": p99_itl_ms, "output_throughput": 10.0 * concurrency}
        return ResultPoint(f"c{concurrency}", PointParams(max_concurrency=concurrency), result)

    noisy = ResultSet("noisy", [point(1, 20), point(2, 60), point(4, 40)])  # a lucky pass at 4 after failing at 2
    [answer] = slo_answers([noisy], [Slo("p99_itl_ms", 50)])
    assert answer.concurrency == 1
    [none] = slo_answers([noisy], [Slo("p99_itl_ms", 10)])
    assert none.concurrency is None and "no measured concurrency meets" in none.text
    [all_pass] = slo_answers([ResultSet("easy", [point(1, 5), point(2, 6)])], [Slo("p99_itl_ms", 50)])
    assert all_pass.concurrency == 2 and "the highest measured" in all_pass.text


def test_several_slos_must_all_hold():
    sets = [load_result_set(FIXTURES / "b200_vllm_loose", label="B200")]
    # Median TTFT: 92 ms at 1, 1,311 ms at 8: a 1 s TTFT SLO stops at concurrency 1.
    [answer] = slo_answers(sets, [Slo("p99_itl_ms", 50), Slo("median_ttft_ms", 1000)])
    assert answer.concurrency == 1
    assert "P99 ITL ≤ 50 ms and median TTFT ≤ 1000 ms" in answer.text


def test_rate_saturation_matches_the_seed():
    sets = [load_result_set(FIXTURES / "h100_v3_rate"), load_result_set(FIXTURES / "h100_r1_rate")]
    answers = [answer for answer in saturation_answers(sets) if answer.offered_rate is not None]
    v3, r1 = answers
    assert v3.saturated and v3.completed_rate == pytest.approx(2.75, abs=0.01)
    assert v3.offered_rate == 4  # 3/s offered still completes 2.54/s, below the plateau; 4/s completes 2.70/s
    assert "saturates at about 2.75 requests/s" in v3.text
    assert r1.completed_rate == pytest.approx(2.55, abs=0.01)


def test_a_server_that_keeps_up_is_not_called_saturated():
    points = [
        ResultPoint(
            f"r{rate}", PointParams(request_rate=rate), {"completed": 1, "duration": 1, "request_throughput": rate}
        )
        for rate in (1.0, 2.0, 4.0)
    ]
    [answer] = saturation_answers([ResultSet("fast", points)])
    assert not answer.saturated
    assert "did not saturate up to an offered 4 requests/s" in answer.text


def test_concurrency_plateau():
    sets = [load_result_set(FIXTURES / "b200_vllm_loose", label="B200")]
    [answer] = saturation_answers(sets)
    assert answer.saturated
    assert "levels off from concurrency 512" in answer.text  # 4,321 is within 5% of the peak 4,370


@pytest.mark.parametrize(
    ("text", "metric", "limit"),
    [
        ("p99_itl_ms=50", "p99_itl_ms", 50.0),
        ("median_ttft:2000", "median_ttft_ms", 2000.0),
        ("p90_e2el=1.5", "p90_e2el_ms", 1.5),
    ],
)
def test_parse_slo(text, metric, limit):
    slo = parse_slo(text)
    assert (slo.metric, slo.max_ms) == (metric, limit)


@pytest.mark.parametrize("text", ["p99_itl_ms", "p99_foo_ms=5", "p99_itl_ms=abc", "p99_itl_ms=-1", "=5"])
def test_bad_slos_are_config_errors(text):
    with pytest.raises(ConfigError):
        parse_slo(text)


def test_default_slo_is_the_seeds_50_ms_itl():
    assert parse_slos(None) == [Slo("p99_itl_ms", 50.0)]
    assert math.isclose(parse_slos(["p99_itl_ms=200"])[0].max_ms, 200)


def test_points_without_per_token_gaps_are_left_out_not_passed_nor_failed():
    """The e2e suite on a busy machine: at concurrency 1 and 2 every response arrived in one write, so their ITL is
    null (deepserve now) or 0 (older files, and other tools): neither counts as meeting an ITL SLO."""

    def point(concurrency: int, p99_itl_ms: float | None) -> ResultPoint:
        result = {"completed": 4, "duration": 1, "p99_itl_ms": p99_itl_ms, "output_throughput": 10.0 * concurrency}
        return ResultPoint(f"c{concurrency}", PointParams(max_concurrency=concurrency), result)

    line = ResultSet("busy", [point(1, 0.0), point(2, None), point(4, 20), point(8, 60)])
    assert line.points[0].metric("p99_itl_ms") is None and line.points[0].metric("output_throughput") == 10.0
    [answer] = slo_answers([line], [Slo("p99_itl_ms", 50)])
    assert answer.concurrency == 4
    [none] = slo_answers([ResultSet("all", [point(1, 0.0), point(2, None)])], [Slo("p99_itl_ms", 50)])
    assert none.concurrency is None and "arrived in one write" in none.text
