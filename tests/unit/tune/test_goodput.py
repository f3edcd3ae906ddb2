"""Goodput and SLO checks of a point, against hand-computed values."""

from __future__ import annotations

import pytest

from deepserve.results.slo import parse_slo
from deepserve.tune.goodput import MissingDetails, attainment, check_slos, output_goodput_tok_s, slos_hold
from tests.unit.tune.fake_points import result_from_requests

# Three requests over 2 s: TTFTs 100, 300 and 900 ms; 5, 3 and 4 output tokens; one failure with no tokens.
RESULT = result_from_requests(
    ttfts_ms=[100.0, 300.0, 900.0, 50.0],
    itls_ms=[[10.0, 10.0, 10.0, 50.0], [20.0, 20.0], [10.0, 10.0, 10.0], []],
    output_lens=[5, 3, 4, 0],
    duration_s=2.0,
    errors=["", "", "", "HTTP 500"],
)


def test_goodput_counts_the_output_tokens_of_requests_meeting_every_slo():
    assert output_goodput_tok_s(RESULT, []) == pytest.approx((5 + 3 + 4) / 2.0)
    # TTFT within 500 ms: the first two requests, 5 + 3 tokens over 2 s.
    assert output_goodput_tok_s(RESULT, [parse_slo("p99_ttft_ms=500")]) == pytest.approx(4.0)
    # TPOT per request: (100+80-100)/4... = 20, 20, 10 ms; within 15 ms only the third.
    assert output_goodput_tok_s(RESULT, [parse_slo("mean_tpot_ms=15")]) == pytest.approx(2.0)
    # Both at once: no request.
    assert output_goodput_tok_s(RESULT, [parse_slo("p99_ttft_ms=500"), parse_slo("mean_tpot_ms=15")]) == 0.0


def test_itl_is_judged_per_request_by_the_same_statistic_over_its_own_gaps():
    # Own median gaps: 10, 20, 10 ms; own P99 gaps: 48.8, 20, 10 ms.
    assert output_goodput_tok_s(RESULT, [parse_slo("median_itl_ms=15")]) == pytest.approx((5 + 4) / 2.0)
    assert output_goodput_tok_s(RESULT, [parse_slo("p99_itl_ms=30")]) == pytest.approx((3 + 4) / 2.0)


def test_slos_hold_on_the_statistic_over_the_whole_point():
    # Completed TTFTs 100, 300, 900: median 300 ms.
    (median,) = check_slos(RESULT, [parse_slo("median_ttft_ms=300")])
    assert median.value_ms == pytest.approx(300.0) and median.holds
    assert not slos_hold(RESULT, [parse_slo("median_ttft_ms=299")])
    # Every gap pooled: 10,10,10,50,20,20,10,10,10: the max 50, P50 10.
    (p100,) = check_slos(RESULT, [parse_slo("p100_itl_ms=50")])
    assert p100.value_ms == pytest.approx(50.0)
    assert slos_hold(RESULT, [parse_slo("p50_itl_ms=10")])


def test_a_key_the_benchmark_wrote_is_used_as_written():
    assert check_slos({**RESULT, "p99_ttft_ms": 123.0}, [parse_slo("p99_ttft_ms=200")])[0].value_ms == 123.0


def test_a_run_with_no_completed_request_meets_nothing():
    failed = result_from_requests([0.0], [[]], [0], 1.0, errors=["refused"])
    failed["p99_itl_ms"] = 0.0  # the benchmark writes zeros for empty samples
    (check,) = check_slos(failed, [parse_slo("p99_itl_ms=50")])
    assert check.value_ms is None and not check.holds
    assert output_goodput_tok_s(failed, [parse_slo("p99_itl_ms=50")]) == 0.0


def test_attainment_counts_failed_requests_against_it():
    assert attainment(RESULT, [parse_slo("p99_ttft_ms=500")]) == pytest.approx(2 / 4)


def test_a_result_without_per_request_lists_says_so():
    with pytest.raises(MissingDetails, match="--save-detailed"):
        output_goodput_tok_s({"completed": 1, "duration": 1.0}, [])
