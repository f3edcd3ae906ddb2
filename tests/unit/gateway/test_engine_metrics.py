"""Merging the replicas' Prometheus texts for the gateway's /metrics/engines: every sample labelled with its
replica, one HELP/TYPE header per family, each family's samples together."""

from __future__ import annotations

from deepserve.engines.metrics import read_left_out
from deepserve.gateway.engine_metrics import label_sample, merge_exposition

A = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{le="0.3",model_name="tiny"} 1.0
vllm:e2e_request_latency_seconds_count{model_name="tiny"} 1.0
"""
B = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
# TYPE process_open_fds gauge
process_open_fds 17.0
"""


def test_label_sample_puts_the_replica_first_in_any_sample_form():
    assert label_sample('m{a="1"} 2', "r") == 'm{replica="r",a="1"} 2'
    assert label_sample("m 2", "r") == 'm{replica="r"} 2'
    assert label_sample("m{} 2", "r") == 'm{replica="r"} 2'
    assert label_sample('m{a="x y"} 2 1700000000', 'r"1') == 'm{replica="r\\"1",a="x y"} 2 1700000000'


def test_merge_groups_families_across_replicas_with_one_header_each():
    merged = merge_exposition({"http://a:1/v1": A, "http://b:2/v1": B}, {"http://c:3/v1": "HTTP 500"})
    lines = merged.splitlines()
    assert lines[0] == "# replica http://c:3/v1 left out: HTTP 500"
    assert lines[1:5] == [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{replica="http://a:1/v1",engine="0",model_name="tiny"} 3.0',
        'vllm:num_requests_running{replica="http://b:2/v1",engine="0",model_name="tiny"} 2.0',
    ]
    assert 'vllm:e2e_request_latency_seconds_count{replica="http://a:1/v1",model_name="tiny"} 1.0' in lines
    assert lines[-2:] == ["# TYPE process_open_fds gauge", 'process_open_fds{replica="http://b:2/v1"} 17.0']
    assert merged.count("# TYPE vllm:num_requests_running gauge") == 1


def test_no_healthy_replica_is_an_empty_exposition():
    assert merge_exposition({}) == ""


def test_the_left_out_comments_read_back_as_written():
    merged = merge_exposition({"http://a:1/v1": "vllm:x 1\n"}, {"http://b:2/v1": "out of rotation (HTTP 503)"})
    assert read_left_out(merged) == {"http://b:2/v1": "out of rotation (HTTP 503)"}
    assert read_left_out("# replica without a mark\nvllm:x 1\n") == {}
