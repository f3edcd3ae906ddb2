"""The result JSON read back by vLLM's key names, the console block in vLLM's layout, and per-request records."""

from __future__ import annotations

import csv
import json
from datetime import datetime

import pytest

from deepserve.bench.config import BenchConfig
from deepserve.bench.output import BenchResult, console_block, default_result_filename, save_records, save_result
from deepserve.bench.server_metrics import ServerMetricsSummary, spec_decode_from_counters
from deepserve.bench.types import RequestRecord

# The keys tools that read `vllm bench serve` results look up (vllm/benchmarks/serve.py).
VLLM_KEYS = [
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
    "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "max_output_tokens_per_s", "max_concurrent_requests",
    "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "median_tpot_ms", "std_tpot_ms", "p99_tpot_ms",
    "mean_itl_ms", "median_itl_ms", "std_itl_ms", "p99_itl_ms",
    "mean_e2el_ms", "median_e2el_ms", "std_e2el_ms", "p99_e2el_ms",
]  # fmt: skip


def make_result(**config) -> BenchResult:
    records = [
        RequestRecord(0, 10, 0.0, 0.0, 0.1, 0.3, 3, "usage", [0.1, 0.2, 0.3], [1, 1, 1]),
        RequestRecord(1, 20, 0.0, 0.0, 0.2, 0.4, 2, "usage", [0.2, 0.4], [1, 1]),
        RequestRecord(2, 30, 0.0, 0.0, None, 0.05, 0, "usage", error="HTTP 500: boom", status_code=500),
    ]
    bench_config = BenchConfig.model_validate({"load": {"max_concurrency": 8}, **config})
    server = ServerMetricsSummary(available=True, scrapes=2, peak_running=2.0, peak_kv_cache_usage_perc=0.5)
    return BenchResult(
        config=bench_config,
        model_id="org/tiny-model",
        records=records,
        duration_s=0.5,
        server=server,
        workload_definition={"dataset": "random"},
        tokenizer_source="server:http://x/tokenize",
        started_at=datetime(2026, 1, 2, 3, 4, 5),
    )


def test_json_reads_back_by_vllm_key_names(tmp_path):
    result = make_result()
    path = save_result(result, tmp_path / "out" / "r.json")
    data = json.loads(path.read_text())
    missing = [key for key in VLLM_KEYS if key not in data]
    assert not missing
    assert data["completed"] == 2 and data["failed"] == 1
    assert data["total_output_tokens"] == 5 and data["total_input_tokens"] == 30
    assert data["request_throughput"] == pytest.approx(2 / 0.5)
    assert data["mean_ttft_ms"] == pytest.approx(150.0)
    assert data["median_e2el_ms"] == pytest.approx(350.0)
    assert data["max_concurrency"] == 8 and data["request_rate"] == "inf"
    assert data["model_id"] == "org/tiny-model"
    assert data["date"] == "20260102-030405"


def test_json_has_our_additions():
    data = make_result().to_json()
    assert data["workload"] == {"dataset": "random"}
    assert data["tokenizer_source"] == "server:http://x/tokenize"
    assert data["output_tokens_source"] == "usage"
    assert data["incomplete"] is False
    assert data["server_metrics"]["peak_kv_cache_usage_perc"] == 0.5
    assert data["errors_by_message"] == {"HTTP 500: boom": 1}
    assert data["deepserve_version"]
    assert "p25_ttft_ms" in data and "p75_itl_ms" in data
    assert "ttfts" not in data  # per-request lists only with save_detailed, as in vLLM


def test_save_detailed_adds_vllm_per_request_lists():
    data = make_result(output={"save_detailed": True}).to_json()
    assert data["ttfts"] == pytest.approx([0.1, 0.2, 0.0])
    assert data["itls"][0] == pytest.approx([0.1, 0.1])
    assert data["output_lens"] == [3, 2, 0]
    assert data["errors"] == ["", "", "HTTP 500: boom"]


def test_console_block_in_vllm_layout_with_p25_p75():
    text = console_block(make_result(metrics={"goodput": ["ttft:120"]}))
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    assert "Successful requests:                     2" in text
    assert "Maximum request concurrency:             8" in text
    assert "Request goodput (req/s):                 2.00" in text
    for label in ("P25 TTFT (ms):", "P75 TTFT (ms):", "P99 TTFT (ms):", "Median ITL (ms):", "P75 E2EL (ms):"):
        assert label in text
    assert "Time to First Token" in text and "Peak KV-cache usage (%):                 50.00" in text
    assert "HTTP 500: boom" in text


def test_console_block_shows_the_ramp_as_vllm_prints_it():
    ramp = {"ramp_up_strategy": "exponential", "ramp_up_start_rps": 2, "ramp_up_end_rps": 32, "max_concurrency": 8}
    text = console_block(make_result(load=ramp))
    assert "Traffic: exponential ramp from 2 to 32 req/s over the requests (Poisson)" in text.splitlines()
    timed = console_block(make_result(load={"request_rate": 4, "ramp_up_s": 30, "burstiness": 0.5}))
    assert "Traffic: gamma (burstiness 0.5, CV 1.41) at 4 req/s, ramped from 0 over 30 s" in timed
    assert "Traffic:" not in console_block(make_result())  # one rate: the rows above say it


def test_default_filename_follows_vllm():
    assert default_result_filename(make_result()) == "openai-infqps-concurrency8-tiny-model-20260102-030405.json"
    chat = make_result(target={"endpoint": "/v1/chat/completions"}, load={"request_rate": 2.5}, output={"label": "x"})
    assert default_result_filename(chat) == "x-2.5qps-tiny-model-20260102-030405.json"


def test_records_csv_and_jsonl(tmp_path):
    result = make_result()
    rows = list(csv.DictReader(save_records(result.records, tmp_path / "r.csv", "csv").open()))
    assert [row["index"] for row in rows] == ["0", "1", "2"]
    assert float(rows[0]["ttft_ms"]) == pytest.approx(100.0)
    assert rows[2]["error"] == "HTTP 500: boom" and rows[2]["success"] == "False"
    lines = (save_records(result.records, tmp_path / "r.jsonl", "jsonl")).read_text().splitlines()
    first = json.loads(lines[0])
    assert first["chunk_tokens"] == [1, 1, 1] and first["tpot_ms"] == pytest.approx(100.0)


def test_console_block_shows_speculative_decoding_when_the_engine_reported_it():
    result = make_result()
    assert "Speculative Decoding" not in console_block(result)
    result.server.spec_decode = spec_decode_from_counters(20, 60, 36, [18, 14, 4])
    text = console_block(result)
    lines = [line.rstrip() for line in text.splitlines()]
    assert "Acceptance rate (%):                     60.00" in lines
    assert "Mean acceptance length (tokens):         2.80" in lines
    assert "Acceptance at draft position 2 (%):      20.00" in lines
    assert result.to_json()["server_metrics"]["spec_decode"]["acceptance_by_position"] == [0.9, 0.7, 0.2]
