"""The engines' shared /metrics reader: the parser, the per-engine name tables and how label sets combine."""

from __future__ import annotations

from deepserve.engines import vllm_metrics as vllm
from deepserve.engines.metrics import (
    COMBINE,
    ENGINE_METRICS,
    SGLANG_METRICS,
    VLLM_METRICS,
    MetricNames,
    detect_engine,
    label_value,
    parse_sample,
    parse_samples,
    quantity_fields,
    read_metrics,
    sample_name,
    with_label,
)
from deepserve.engines.registry import ENGINES
from tests.helpers import present

TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_running_extra 99
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
vllm:num_preemptions_total{engine="0",model_name="m"} 1.0 1700000000000
vllm:num_preemptions_total{engine="1",model_name="m"} 4.0
"""


def test_a_sample_line_parses_with_labels_timestamps_and_odd_label_values():
    assert parse_sample('m{a="1"} 2.5') is not None
    sample = parse_sample('m{a="x } y",b="q\\"t"} 7 1700000000')
    assert sample is not None and (sample.name, sample.value) == ("m", 7.0)
    assert sample.labels == '{a="x } y",b="q\\"t"}'
    assert present(parse_sample("m 3")).value == 3.0
    assert parse_sample("m NaN") is not None and present(parse_sample("m +Inf")).value == float("inf")
    assert parse_sample('m{a="1" 2') is None and parse_sample("m") is None


def test_only_the_named_series_are_read_not_longer_names_nor_comments():
    samples = parse_samples(TEXT, [vllm.RUNNING])
    labels = ['{engine="0",model_name="m"}', '{engine="1",model_name="m"}']
    assert [(s.labels, s.value) for s in samples] == [(labels[0], 3.0), (labels[1], 2.0)]


def test_label_sets_combine_by_the_quantity_requests_add_up_the_cache_takes_the_fullest_counters_stay_apart():
    values = read_metrics(TEXT, VLLM_METRICS)
    assert values == {
        vllm.RUNNING: 5.0,
        vllm.KV_CACHE_USAGE: 0.75,
        vllm.PREEMPTIONS + '{engine="0",model_name="m"}': 1.0,
        vllm.PREEMPTIONS + '{engine="1",model_name="m"}': 4.0,
    }


def test_a_windowed_gauge_takes_the_mean_over_engines():
    text = 'sglang:spec_accept_length{dp_rank="0"} 2.0\nsglang:spec_accept_length{dp_rank="1"} 3.0\n'
    assert read_metrics(text, SGLANG_METRICS) == {"sglang:spec_accept_length": 2.5}


def test_labels_are_read_and_written_as_the_text_format_escapes_them():
    assert label_value('{engine="0",position="12"}', "position") == "12"
    assert label_value('{xposition="1",position="2"}', "position") == "2"  # not a label that ends in the key
    assert label_value('{a="q\\"t"}', "a") == 'q"t' and label_value("{}", "a") is None
    assert with_label('m{a="1"} 2', "replica", 'r"1') == 'm{replica="r\\"1",a="1"} 2'
    assert with_label("m 2", "replica", "r") == 'm{replica="r"} 2' and with_label("m{} 2", "r", "x") == 'm{r="x"} 2'
    assert sample_name('m{a="1"} 2') == "m" and sample_name("m 2") == "m"


def test_the_engine_is_the_one_whose_series_the_text_has():
    assert detect_engine(TEXT) is VLLM_METRICS
    assert detect_engine("sglang:num_running_reqs 3\n") is SGLANG_METRICS
    assert detect_engine("process_cpu_seconds_total 3\n# vllm:num_requests_running\n") is None


def test_every_engine_names_its_load_and_every_quantity_has_a_combine_rule():
    assert set(COMBINE) == set(quantity_fields())
    for name, engine in ENGINES.items():
        names = engine.metric_names
        assert names is ENGINE_METRICS[name] and names.engine == name
        assert names.waiting and names.running and names.kv_cache_usage
    assert VLLM_METRICS.of("spec_drafts") == (vllm.SPEC_DECODE_DRAFTS,)
    only = VLLM_METRICS.only("running")
    assert only.running == VLLM_METRICS.running and only.waiting == () and isinstance(only, MetricNames)
