"""Parsing the vLLM series we report out of Prometheus text, and summarising the scrapes of a run."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepserve.bench.server_metrics import AUTO_MIN_INTERVAL_S, auto_interval_s, parse_metrics, summarize_samples

TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 2.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 4.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.5
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 250.0
vllm:num_preemptions_total{engine="0",model_name="tiny"} 1.0
vllm:time_to_first_token_seconds_bucket{le="0.001",model_name="tiny"} 7.0
vllm:num_requests_running_extra 99
other_metric 5
"""


def test_parse_sums_gauges_over_label_sets_keeps_counters_per_series_and_ignores_other_series():
    values = parse_metrics(TEXT)
    assert values == {
        "vllm:num_requests_running": 5.0,
        "vllm:num_requests_waiting": 4.0,
        "vllm:kv_cache_usage_perc": 0.5,
        'vllm:prefix_cache_queries_total{engine="0",model_name="tiny"}': 1000.0,
        'vllm:prefix_cache_hits_total{engine="0",model_name="tiny"}': 250.0,
        'vllm:num_preemptions_total{engine="0",model_name="tiny"}': 1.0,
    }


def test_kv_cache_usage_is_the_fullest_engine_not_a_sum_of_fractions():
    text = (
        'vllm:kv_cache_usage_perc{replica="http://a/v1",engine="0"} 0.25\n'
        'vllm:kv_cache_usage_perc{replica="http://b/v1",engine="0"} 0.5\n'
        'vllm:gpu_cache_usage_perc{engine="1"} 0.125\n'
        'vllm:gpu_cache_usage_perc{engine="2"} 0.0625\n'
        'vllm:num_requests_running{replica="http://a/v1"} 3\n'
        'vllm:num_requests_running{replica="http://b/v1"} 2\n'
        'vllm:num_preemptions_total{replica="http://a/v1"} 1\n'
        'vllm:num_preemptions_total{replica="http://b/v1"} 4\n'
    )
    values = parse_metrics(text)
    assert values["vllm:kv_cache_usage_perc"] == 0.5
    assert values["vllm:gpu_cache_usage_perc"] == 0.125
    assert values["vllm:num_requests_running"] == 5.0
    assert summarize_samples([{}, values]).preemptions == 0.0  # a counter first seen at the end grew by nothing


def test_summary_peaks_and_counter_growth_over_the_run():
    first = parse_metrics(TEXT)
    later = parse_metrics(
        TEXT.replace("} 3.0", "} 9.0")
        .replace("} 0.5", "} 0.75")
        .replace("} 1000.0", "} 1400.0")
        .replace("} 250.0", "} 350.0")
        .replace("} 1.0", "} 4.0")
    )
    summary = summarize_samples([first, later])
    assert summary.available and summary.scrapes == 2
    assert summary.peak_running == 11.0  # 9 + 2 engines
    assert summary.peak_waiting == 4.0
    assert summary.peak_kv_cache_usage_perc == 0.75
    assert summary.prefix_cache_queries == 400.0  # counters: last - first
    assert summary.prefix_cache_hits == 100.0
    assert summary.prefix_cache_hit_rate == pytest.approx(0.25)
    assert summary.preemptions == 3.0


def replicas(**counts: float) -> str:
    """/metrics/engines text: one prefix-cache query counter per replica (only the healthy ones are listed)."""
    return "".join(
        f'vllm:prefix_cache_queries_total{{replica="{name}",engine="0"}} {n}\n' for name, n in counts.items()
    )


def test_counters_grow_per_replica_when_one_drops_out_and_one_joins_late():
    scrapes = [
        replicas(a=1000, b=500),
        replicas(a=1100, b=520),
        replicas(a=1150, b=530, c=9000),  # c joins late with a long history: only its growth from here counts
        replicas(a=1200, c=9040),  # b is unhealthy and missing from the last scrape
    ]
    summary = summarize_samples([parse_metrics(text) for text in scrapes])
    assert summary.prefix_cache_queries == (1200 - 1000) + (530 - 500) + (9040 - 9000)


def test_a_counter_that_drops_was_restarted_and_counts_again_from_zero():
    scrapes = [replicas(a=1000), replicas(a=1100), replicas(a=30), replicas(a=80)]  # a restarted after 1100
    summary = summarize_samples([parse_metrics(text) for text in scrapes])
    assert summary.prefix_cache_queries == 100 + 30 + 50


def test_hit_rate_over_the_run_only():
    before = {"vllm:prefix_cache_queries_total": 100.0, "vllm:prefix_cache_hits_total": 90.0}
    after = {"vllm:prefix_cache_queries_total": 300.0, "vllm:prefix_cache_hits_total": 140.0}
    summary = summarize_samples([before, after])
    assert summary.prefix_cache_hit_rate == pytest.approx(50 / 200)  # the 90 earlier hits are not ours


def test_a_server_without_vllm_series_is_noted():
    summary = summarize_samples([{}, {}])
    assert summary.available
    assert "none of the vLLM series" in summary.note
    assert summary.peak_running is None


FIXTURES = Path(__file__).parents[2] / "fixtures" / "metrics"


def test_speculative_decoding_over_the_run_from_vllms_counters():
    """Two scrapes written by vLLM's own SpecDecodingProm (tests/fixtures/metrics/make_vllm_spec_decode.py): 20
    drafts of 3 tokens, 36 accepted, 18/14/4 at positions 0/1/2, over two engines."""
    before = parse_metrics((FIXTURES / "vllm_spec_decode_before.prom").read_text())
    after = parse_metrics((FIXTURES / "vllm_spec_decode_after.prom").read_text())
    spec = summarize_samples([before, after]).spec_decode
    assert spec is not None and spec.source == "counters"
    assert (spec.drafts, spec.draft_tokens, spec.accepted_tokens) == (20.0, 60.0, 36.0)
    assert spec.acceptance_rate == pytest.approx(36 / 60)
    assert spec.mean_acceptance_length == pytest.approx(1 + 36 / 20)
    assert spec.acceptance_by_position == pytest.approx([18 / 20, 14 / 20, 4 / 20])


def test_no_speculative_decoding_when_the_engine_reports_none():
    assert summarize_samples([parse_metrics(TEXT), parse_metrics(TEXT)]).spec_decode is None


def test_sglang_series_are_read_with_sglangs_names():
    scrapes = [
        'sglang:num_running_reqs{dp_rank="0"} 5\nsglang:token_usage 0.2\nsglang:spec_accept_length 2.0\n'
        "sglang:spec_accept_rate 0.5\nsglang:prompt_tokens_total 100\nsglang:cached_tokens_total 10\n",
        'sglang:num_running_reqs{dp_rank="0"} 8\nsglang:token_usage 0.4\nsglang:spec_accept_length 3.0\n'
        "sglang:spec_accept_rate 0.7\nsglang:prompt_tokens_total 300\nsglang:cached_tokens_total 110\n",
    ]
    summary = summarize_samples([parse_metrics(text) for text in scrapes])
    assert summary.engine == "sglang" and summary.note == ""
    assert (summary.peak_running, summary.peak_kv_cache_usage_perc) == (8.0, 0.4)
    assert summary.prefix_cache_hit_rate == pytest.approx(100 / 200)
    spec = summary.spec_decode
    assert spec is not None and spec.source.startswith("gauges")
    assert spec.mean_acceptance_length == pytest.approx(2.5) and spec.acceptance_rate == pytest.approx(0.6)


def test_the_automatic_interval_grows_with_the_run():
    assert auto_interval_s(0.0) == AUTO_MIN_INTERVAL_S
    assert auto_interval_s(5.0) == pytest.approx(0.25)
    assert auto_interval_s(3600.0) == 1.0
