"""Each metric against values computed by hand (see the comments) from four records:

A: sent 0.00; chunks at 0.10 (1 token), 0.12 (1), 0.16 (2); ends 0.17; 4 output tokens; prompt 10
B: sent 1.00 (arrived 0.90); one chunk at 1.05 (1 token); ends 1.06; prompt 20 — TPOT undefined
C: failed (HTTP 500), sent 0.05, ended 0.20; prompt 30 — excluded everywhere except failures and concurrency
D: sent 2.00; chunks at 2.20 (3 tokens), 2.30 (1); ends 2.30; 4 output tokens; prompt 40
"""

from __future__ import annotations

import math

import pytest

from deepserve.bench import metrics as m
from deepserve.bench.types import RequestRecord

DURATION_S = 2.5


def record(index, sent, chunks, end, prompt_len, error=None, scheduled=None):
    times = [t for t, _ in chunks]
    tokens = [k for _, k in chunks]
    return RequestRecord(
        index=index,
        prompt_len=prompt_len,
        scheduled_s=sent if scheduled is None else scheduled,
        sent_s=sent,
        first_token_s=times[0] if times else None,
        end_s=end,
        output_len=sum(tokens),
        chunk_times_s=times,
        chunk_tokens=tokens,
        error=error,
    )


@pytest.fixture
def records():
    a = record(0, 0.0, [(0.10, 1), (0.12, 1), (0.16, 2)], 0.17, 10)
    b = record(1, 1.0, [(1.05, 1)], 1.06, 20, scheduled=0.9)
    c = record(2, 0.05, [], 0.20, 30, error="HTTP 500: boom")
    d = record(3, 2.0, [(2.20, 3), (2.30, 1)], 2.30, 40)
    return [a, b, c, d]


def test_ttft_e2el_tpot_per_request(records):
    a, b, c, d = records
    assert m.ttft_ms(a) == pytest.approx(100.0)
    assert m.e2el_ms(a) == pytest.approx(170.0)
    assert m.tpot_ms(a) == pytest.approx((170 - 100) / 3)  # 23.333: 3 tokens after the first
    assert m.ttft_ms(b) == pytest.approx(50.0)
    assert m.tpot_ms(b) is None  # one output token: TPOT undefined
    assert m.ttft_ms(c) is None  # failed before any token
    assert m.tpot_ms(d) == pytest.approx((300 - 200) / 3)


def test_itl_counts_every_token_of_multi_token_chunks(records):
    a, b, _, d = records
    # A: 20 ms gap with 1 token, then a 40 ms gap carrying 2 tokens -> two samples of 20 ms
    assert m.itl_ms(a) == pytest.approx([20.0, 20.0, 20.0])
    assert m.itl_ms(b) == []
    # D: the first chunk carries 3 tokens: 2 extra tokens arrived with the first (0 ms), then 100 ms for 1 token
    assert m.itl_ms(d) == pytest.approx([0.0, 0.0, 100.0])
    # one ITL sample per token after the first, so mean ITL equals (last chunk - first chunk) / (tokens - 1)
    assert len(m.itl_ms(a)) == a.output_len - 1


def test_throughputs_exclude_failed_requests(records):
    assert m.total_output_tokens(records) == 4 + 1 + 4
    assert m.total_input_tokens(records) == 10 + 20 + 40
    assert m.request_throughput(records, DURATION_S) == pytest.approx(3 / 2.5)
    assert m.output_throughput(records, DURATION_S) == pytest.approx(9 / 2.5)
    assert m.total_token_throughput(records, DURATION_S) == pytest.approx(79 / 2.5)
    assert m.request_throughput(records, 0.0) == 0.0


def test_peak_output_tokens_per_second_uses_one_second_buckets(records):
    # bucket 0: A's 4 tokens; bucket 1: B's 1; bucket 2: D's 3 + 1
    assert m.peak_output_tokens_per_s(records) == 4.0
    assert m.peak_output_tokens_per_s([records[1]]) == 1.0
    assert m.peak_output_tokens_per_s([]) == 0.0


def test_peak_concurrency_counts_overlaps_including_failures(records):
    assert m.peak_concurrent_requests(records) == 2  # A [0, 0.17] overlaps C [0.05, 0.20]
    back_to_back = [record(0, 0.0, [(0.1, 1)], 1.0, 1), record(1, 1.0, [(1.1, 1)], 2.0, 1)]
    assert m.peak_concurrent_requests(back_to_back) == 1  # one ends as the other starts


def test_goodput_under_slos(records):
    assert m.parse_goodput(["ttft:150", "tpot:25"]) == {"ttft": 150.0, "tpot": 25.0}
    assert m.parse_goodput(["ttft:150 e2el:1000"]) == {"ttft": 150.0, "e2el": 1000.0}
    # TTFT 100, 50, 200 -> A and B meet 150 ms
    assert m.goodput_req_s(records, {"ttft": 150}, DURATION_S) == pytest.approx(2 / 2.5)
    # TPOT 23.3, undefined (counts as 0), 33.3 -> A and B meet 25 ms; only B meets 20 ms
    assert m.goodput_req_s(records, {"ttft": 150, "tpot": 25}, DURATION_S) == pytest.approx(2 / 2.5)
    assert m.goodput_req_s(records, {"tpot": 20}, DURATION_S) == pytest.approx(1 / 2.5)
    assert m.goodput_req_s(records, {"e2el": 100}, DURATION_S) == pytest.approx(1 / 2.5)  # only B (60 ms)


@pytest.mark.parametrize("bad", ["ttft", "latency:10", "ttft:-1"])
def test_bad_goodput_specs_are_rejected(bad):
    with pytest.raises(ValueError):
        m.parse_goodput([bad])


def test_client_queue_time(records):
    assert m.client_queue_time_ms(records[1]) == pytest.approx(100.0)
    assert m.metric_samples(records, "client_queue_time") == pytest.approx([0.0, 100.0, 0.0])


def test_distribution_matches_numpy_linear_percentiles(records):
    stats = m.distribution(m.metric_samples(records, "ttft"), (25.0, 75.0, 99.0))
    # TTFT samples 100, 50, 200
    assert stats.mean == pytest.approx(350 / 3)
    assert stats.median == pytest.approx(100.0)
    assert stats.std == pytest.approx(
        math.sqrt(((100 - 350 / 3) ** 2 + (50 - 350 / 3) ** 2 + (200 - 350 / 3) ** 2) / 3)
    )
    assert stats.percentiles[25.0] == pytest.approx(75.0)  # halfway between 50 and 100
    assert stats.percentiles[75.0] == pytest.approx(150.0)
    assert stats.percentiles[99.0] == pytest.approx(198.0)  # 100 + 0.98 * 100
    empty = m.distribution([], (99.0,))
    assert (empty.mean, empty.percentiles[99.0], empty.count) == (0.0, 0.0, 0)


def test_failures_grouped_by_message(records):
    more = [*records, record(4, 0.0, [], 0.1, 1, error="HTTP 500: boom"), record(5, 0.0, [], 0.1, 1, error="timeout")]
    assert m.failures_by_error(more) == {"HTTP 500: boom": 2, "timeout": 1}
    assert next(iter(m.failures_by_error(more))) == "HTTP 500: boom"  # most frequent first


def test_summarize_uses_vllm_keys(records):
    summary = m.summarize(records, DURATION_S, ("ttft", "tpot", "itl", "e2el"), (50.0, 99.9), {"ttft": 150})
    assert summary["completed"] == 3
    assert summary["failed"] == 1
    assert summary["total_output_tokens"] == 9
    assert summary["request_goodput"] == pytest.approx(0.8)
    assert summary["median_itl_ms"] == pytest.approx(20.0)  # ITL samples 20, 20, 20, 0, 0, 100
    assert summary["mean_itl_ms"] == pytest.approx(160 / 6)
    assert summary["mean_tpot_ms"] == pytest.approx(((70 / 3) + (100 / 3)) / 2)  # B has no TPOT
    for key in (
        "p25_ttft_ms",
        "p75_ttft_ms",
        "p90_ttft_ms",
        "p95_ttft_ms",
        "p99_ttft_ms",
        "p50_e2el_ms",
        "p99.9_itl_ms",
    ):
        assert key in summary
    assert summary["errors_by_message"] == {"HTTP 500: boom": 1}
    assert m.summarize(records, DURATION_S)["request_goodput"] is None


def test_percentile_words_follow_vllm():
    assert m.percentile_word(99.0) == "99"
    assert m.percentile_word(99.9) == "99.9"
    assert m.parse_percentiles("25,50,99.9") == (25.0, 50.0, 99.9)
    with pytest.raises(ValueError):
        m.parse_percentiles("101")


def test_a_response_that_arrived_in_one_write_has_no_tpot_nor_itl_not_zeros():
    # E: sent 3.00; 5 chunks of one token all in one read at 3.40 (a starved server flushed the whole answer)
    # F: sent 4.00; one chunk of 4 tokens at 4.30
    e = record(4, 3.0, [(3.40, 1)] * 5, 3.41, 10)
    f = record(5, 4.0, [(4.30, 4)], 4.31, 10)
    b = record(1, 1.0, [(1.05, 1)], 1.06, 20)  # one token: no per-token figure anyway, not "one write"
    assert m.arrived_in_one_write(e) and m.arrived_in_one_write(f) and not m.arrived_in_one_write(b)
    assert (m.tpot_ms(e), m.itl_ms(e), m.tpot_ms(f), m.itl_ms(f)) == (None, [], None, [])
    assert m.ttft_ms(e) == pytest.approx(400.0) and m.e2el_ms(e) == pytest.approx(410.0)
    summary = m.summarize([e, f, b], 5.0)
    assert summary["one_write_requests"] == 2
    assert summary["median_itl_ms"] is None and summary["p99_tpot_ms"] is None  # undefined, not vLLM's zeros
    assert summary["median_ttft_ms"] == pytest.approx(300.0)


def test_one_write_requests_leave_the_others_per_token_figures_alone(records):
    e = record(4, 3.0, [(3.40, 1)] * 5, 3.41, 10)
    summary = m.summarize([*records, e], DURATION_S)
    assert summary["one_write_requests"] == 1
    assert summary["median_itl_ms"] == pytest.approx(20.0)  # A's and D's samples only, as without E
    assert summary["mean_tpot_ms"] == pytest.approx(((70 / 3) + (100 / 3)) / 2)


def test_tokens_per_chunk_where_the_server_listed_each_chunks_tokens(records):
    a, _, _, d = records  # A: 4 tokens in 3 chunks; B: 1 in 1; D: 4 in 2 (all exact: the lists add up)
    assert m.tokens_per_chunk(a) == pytest.approx(4 / 3) and m.tokens_per_chunk(d) == 2.0
    assert m.mean_tokens_per_chunk(records) == pytest.approx((4 / 3 + 1 + 2) / 3)
    d.token_attribution = "estimated"
    assert m.tokens_per_chunk(d) is None  # spread by text: not what the server sent per step
