"""--num-runs: Student's t confidence intervals over runs, against published t values and hand-computed intervals,
and the combined result (means, intervals, every run's values) in the JSON and the console."""

from __future__ import annotations

import math
from typing import Any

import pytest

from deepserve.bench.output import BenchResult, console_block
from deepserve.bench.repeats import combine_runs, confidence_interval, interval_words, student_t_quantile
from tests.unit.bench.test_output import make_result


@pytest.mark.parametrize(
    ("df", "t"),
    [(1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (9, 2.262), (19, 2.093), (30, 2.042), (120, 1.980)],
)  # two-sided 95% critical values of Student's t (any statistics table)
def test_student_t_quantile_matches_the_table(df, t):
    assert student_t_quantile(0.975, df) == pytest.approx(t, abs=5e-4)


def test_confidence_interval_by_hand():
    # 10, 12, 11, 13, 9: mean 11, s = sqrt(10 / 4) = 1.5811, half-width 2.776 * 1.5811 / sqrt(5) = 1.9632
    interval = confidence_interval([10, 12, 11, 13, 9])
    assert (interval.mean, interval.n) == (11.0, 5)
    assert interval.std == pytest.approx(math.sqrt(2.5))
    assert interval.half_width == pytest.approx(1.9632, abs=1e-4)
    assert (interval.low, interval.high) == (pytest.approx(9.0368, abs=1e-4), pytest.approx(12.9632, abs=1e-4))
    single = confidence_interval([7.0])
    assert (single.mean, single.half_width, single.low) == (7.0, None, None)


def test_a_skewed_latency_interval_stops_at_zero():
    # one slow run in five: mean 52, s = 77.6, half-width 96.4, so t's interval would start at -44.4 ms
    skewed = confidence_interval([10.0, 12.0, 11.0, 9.0, 218.0])
    assert skewed.mean - (skewed.half_width or 0) < 0
    assert skewed.low == 0.0 and skewed.high == pytest.approx(skewed.mean + (skewed.half_width or 0))
    assert interval_words(skewed.to_json()) == f" (95% CI 0.00 to {skewed.high:,.2f})"
    assert interval_words(confidence_interval([10, 12, 11, 13, 9]).to_json()) == " ± 1.96"
    # a metric that can be negative (a difference) keeps t's symmetric interval
    signed = confidence_interval([-1.0, 1.0, 0.5])
    assert signed.low == pytest.approx(signed.mean - (signed.half_width or 0))


def test_runs_combine_measurements_only():
    runs: list[dict[str, Any]] = [
        {"completed": 10, "output_throughput": 100.0, "median_ttft_ms": 20.0, "max_concurrency": 4, "errors": {}},
        {"completed": 10, "output_throughput": 120.0, "median_ttft_ms": None, "max_concurrency": 4, "errors": {}},
    ]
    combined, intervals = combine_runs(runs)
    assert combined["output_throughput"] == 110.0 and combined["max_concurrency"] == 4  # a setting, not averaged
    assert set(intervals) == {"completed", "output_throughput"}  # a metric missing from a run is not averaged
    assert combined["median_ttft_ms"] == 20.0  # the first run's value stands where no mean exists


def test_a_repeated_result_reports_means_intervals_and_every_run():
    first, second = make_result(metrics={"num_runs": 2}), make_result(metrics={"num_runs": 2})
    for record in second.records:  # the second run: every latency 20% longer
        record.first_token_s = None if record.first_token_s is None else record.first_token_s * 1.2
        record.end_s = None if record.end_s is None else record.end_s * 1.2
    result = BenchResult.of_runs(first.config, [first, second])
    data = result.to_json()
    assert data["num_runs"] == 2 and len(data["runs"]) == 2 and data["completed"] == 2
    one, two = (run["mean_ttft_ms"] for run in data["runs"])
    assert (one, two) == (pytest.approx(150.0), pytest.approx(180.0))
    assert data["mean_ttft_ms"] == pytest.approx(165.0)
    interval = data["confidence_intervals"]["mean_ttft_ms"]
    assert interval["ci95_half_width"] == pytest.approx(12.706 * 15 * math.sqrt(2) / math.sqrt(2), rel=1e-3)
    assert len(result.records) == 6
    text = console_block(result)
    assert " 2 Runs: Mean ± 95% CI " in text and "Median TTFT (ms)" in text
