"""vLLM's metric names and formats; deterministic fault selection; runtime controls."""

from __future__ import annotations

import itertools

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deepserve.bench.server_metrics import parse_metrics
from deepserve.engines.vllm_metrics import one_two_five_buckets
from deepserve.errors import ConfigError
from deepserve.simulate.config import parse_metric_overrides
from deepserve.simulate.faults import Controls, Faults
from deepserve.simulate.metrics import CounterReading, EngineMetrics, GaugeReading, render

MODEL = "deepseek-ai/DeepSeek-V3"


def exposition(overrides: dict[str, float] | None = None) -> str:
    metrics = EngineMetrics(max_model_len=4096)
    metrics.ttft.observe(0.03)
    metrics.ttft.observe(0.3)
    metrics.itl.observe_many(0.02, 10)
    metrics.observe_finished("length", 0.0, 0.01, 0.3, 1.0, 100, 11)
    gauges = GaugeReading(running=3, waiting=2, kv_cache_usage=0.25)
    counters = CounterReading(
        prompt_tokens=100, generation_tokens=11, preemptions=1, prefix_queries=100, prefix_hits=64
    )
    return render(MODEL, metrics, gauges, counters, {"block_size": "64"}, overrides)


def test_the_benchmark_reads_the_series_it_reads_from_vllm() -> None:
    values = parse_metrics(exposition())
    labels = f'{{engine="0",model_name="{MODEL}"}}'
    assert values["vllm:num_requests_running"] == 3 and values["vllm:num_requests_waiting"] == 2
    assert values["vllm:kv_cache_usage_perc"] == 0.25
    assert values["vllm:prefix_cache_queries_total" + labels] == 100
    assert values["vllm:prefix_cache_hits_total" + labels] == 64
    assert values["vllm:num_preemptions_total" + labels] == 1


def test_the_exposition_parses_as_prometheus_text_with_cumulative_histograms() -> None:
    families = {family.name: family for family in text_string_to_metric_families(exposition())}
    ttft = families["vllm:time_to_first_token_seconds"]
    buckets = {s.labels["le"]: s.value for s in ttft.samples if s.name.endswith("_bucket")}
    assert buckets["0.01"] == 0 and buckets["0.04"] == 1 and buckets["0.5"] == 2 and buckets["+Inf"] == 2
    counts = {s.name: s.value for s in families["vllm:inter_token_latency_seconds"].samples}
    assert counts["vllm:inter_token_latency_seconds_count"] == 10
    assert counts["vllm:inter_token_latency_seconds_sum"] == pytest.approx(0.2)
    success = {s.labels["finished_reason"]: s.value for s in families["vllm:request_success"].samples}
    assert success == {"length": 1, "stop": 0, "abort": 0}
    expected = (
        "vllm:generation_tokens",
        "vllm:prompt_tokens",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:iteration_tokens_total",
        "vllm:cache_config_info",
    )
    assert set(expected) <= set(families)
    assert one_two_five_buckets(100) == (1, 2, 5, 10, 20, 50, 100)


def test_overrides_replace_a_series_value() -> None:
    values = parse_metrics(exposition({"vllm:num_requests_waiting": 40, "vllm:num_preemptions_total": 7}))
    assert values["vllm:num_requests_waiting"] == 40
    assert values[f'vllm:num_preemptions_total{{engine="0",model_name="{MODEL}"}}'] == 7


def test_a_fraction_picks_exactly_that_share_evenly_and_kinds_do_not_collide() -> None:
    faults = Faults(error_fraction=0.1, cut_fraction=0.1, hang_fraction=0.05)
    decisions = [faults.decide(i) for i in range(1000)]
    assert decisions.count("error") == 100 and decisions.count("cut") == 100 and decisions.count("hang") == 50
    errors = [i for i, d in enumerate(decisions) if d == "error"]
    assert all(b - a == 10 for a, b in itertools.pairwise(errors))
    assert Faults().decide(0) is None
    assert Faults(error_fraction=1.0).decide(7) == "error"
    picked = Faults(cut_indices=frozenset({2}), hang_indices=frozenset({3}))
    assert [picked.decide(i) for i in range(5)] == [None, None, "cut", "hang", None]


def test_controls_change_at_runtime_and_refuse_what_they_cannot_use() -> None:
    controls = Controls(unhealthy_after_requests=3)
    assert controls.is_healthy(0.0, 2) and not controls.is_healthy(0.0, 3)
    controls.apply({"healthy": True, "faults": {"error_fraction": 0.5, "hang_indices": [1]}})
    assert controls.is_healthy(0.0, 99) and controls.faults.decide(1) == "hang"
    controls.apply({"metric_overrides": {"vllm:kv_cache_usage_perc": 0.9}, "metrics_delay_s": 0.1})
    assert controls.metric_overrides == {"vllm:kv_cache_usage_perc": 0.9} and controls.metrics_delay_s == 0.1
    for bad, message in (
        ({"faults": {"error_fraction": 2}}, "between 0 and 1"),
        ({"faults": {"explode": True}}, "unknown fault"),
        ({"healthy": "yes"}, "healthy"),
        ({"volume": 11}, "unknown control"),
        ({"metric_overrides": {"x": "high"}}, "numbers"),
        ({"health_delay_s": -1}, "non-negative"),
    ):
        with pytest.raises(ValueError, match=message):
            controls.apply(bad)


def test_metric_flags_parse_to_numbers_and_refuse_what_is_not_name_equals_number() -> None:
    assert parse_metric_overrides(["vllm:num_requests_waiting=12", " vllm:kv_cache_usage_perc =0.5"]) == {
        "vllm:num_requests_waiting": 12.0,
        "vllm:kv_cache_usage_perc": 0.5,
    }
    for bad, message in (("foo", "KEY=VALUE"), ("=3", "KEY=VALUE"), ("vllm:x=high", "must be a number")):
        with pytest.raises(ConfigError, match=message):
            parse_metric_overrides([bad])
