"""The runner and client against the simulator with fixed timings on loopback: success, load modes, faults.

Before each run the benchmark sends one probe request (whether the server lists token ids, return_token_ids auto):
it is the simulator's request 0, so the measured requests are 1, 2, … in its arrival order."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from deepserve.bench.client import Endpoint, StreamingClient, build_request_bytes
from deepserve.bench.config import BenchConfig
from deepserve.bench.metrics import itl_ms
from deepserve.bench.output import console_block
from deepserve.bench.runner import BenchError, check_server, run_workload
from deepserve.bench.types import RequestSpec
from deepserve.bench.workloads import Workload
from tests.helpers import present, simulator_thread

pytestmark = pytest.mark.timeout(120)
PROBE = 1  # the token-ids probe comes first: measured request i is the simulator's request i + PROBE


def specs(n: int, output_len: int = 10) -> list[RequestSpec]:
    return [RequestSpec(index=i, prompt=f"prompt {i}", prompt_len=3, output_len=output_len) for i in range(n)]


def config(base_url: str, **sections) -> BenchConfig:
    sections.setdefault("target", {})
    sections["target"] = {"base_url": base_url, **sections["target"]}
    sections.setdefault("metrics", {})
    sections["metrics"] = {"server_metrics_interval_s": 0.1, **sections["metrics"]}
    return BenchConfig.model_validate(sections)


def run(server, n=6, output_len=10, counter=None, **sections):
    bench_config = config(server.root_url, **sections)
    model = check_server(bench_config)
    workload = Workload(specs(n, output_len), {"dataset": "hand-made"}, "test")
    return run_workload(bench_config, model, workload, counter, display=False)


def test_success_measures_the_fixed_timings():
    # timings long enough that a loaded machine's delays stay well within the bounds below (about ±50%)
    with simulator_thread(ttft_ms=200, itl_ms=50, metrics_endpoint=False) as server:
        result = run(server, n=6, output_len=8, load={"max_concurrency": 3})
    data = result.to_json()
    assert (data["completed"], data["failed"]) == (6, 0)
    assert data["total_output_tokens"] == 48  # from the server's usage
    assert data["output_tokens_source"] == "usage"
    assert data["total_input_tokens"] == 6 * (1 + len("prompt 0"))  # usage.prompt_tokens (BOS + bytes), not 3
    assert 100 <= data["median_ttft_ms"] <= 300
    assert 25 <= data["median_tpot_ms"] <= 75
    assert 25 <= data["median_itl_ms"] <= 75
    assert data["max_concurrent_requests"] == 3
    assert data["server_metrics"]["available"] is False  # a server without /metrics: noted
    assert "no metrics endpoint" in data["server_metrics"]["note"]
    record = result.records[0]
    assert len(record.chunk_times_s) == 8 and record.chunk_tokens == [1] * 8


def test_model_defaults_to_the_first_served_one_and_wrong_names_list_the_served():
    with simulator_thread(model="served-one") as server:
        assert check_server(config(server.root_url)) == "served-one"
        assert check_server(config(server.base_url)) == "served-one"  # a trailing /v1 is fine
        with pytest.raises(BenchError, match=r"unknown model 'nope'.*served-one"):
            check_server(config(server.root_url, target={"model": "nope"}))


def test_unreachable_server_fails_before_the_run():
    with simulator_thread() as server:
        url = server.root_url
    with pytest.raises(BenchError, match="cannot reach the server"):
        check_server(config(url))


def test_401_says_to_pass_an_api_key(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with simulator_thread(api_key="sekret") as server:
        with pytest.raises(BenchError, match=r"HTTP 401.*--api-key"):
            check_server(config(server.root_url))
        result = run(server, n=2, target={"api_key": "sekret"})
        assert result.to_json()["completed"] == 2
        monkeypatch.setenv("OPENAI_API_KEY", "sekret")
        assert check_server(config(server.root_url)) == "fake-model"


def test_server_errors_mid_run_become_failed_requests():
    faults = {
        "error_indices": [1 + PROBE, 4 + PROBE],  # HTTP 500 before any byte
        "cut_modes": {2 + PROBE: "error_event", 3 + PROBE: "malformed_event", 5 + PROBE: "close"},  # after a token
    }
    with simulator_thread() as server:
        server.control({"faults": faults})
        result = run(server, n=8, load={"max_concurrency": 1})  # one at a time: arrival order = index
    data = result.to_json()
    assert (data["completed"], data["failed"]) == (3, 5)
    errors = data["errors_by_message"]
    assert errors["HTTP 500: injected failure (deepserve simulate)"] == 2
    assert errors["stream error: injected stream failure (deepserve simulate)"] == 1
    assert sum(count for message, count in errors.items() if message.startswith("malformed SSE event")) == 1
    assert sum(count for message, count in errors.items() if message.startswith("connection closed")) == 1
    failed = {record.index for record in result.records if not record.success}
    assert failed == {1, 2, 3, 4, 5}
    assert data["total_output_tokens"] == 3 * 10  # failed requests excluded


@pytest.mark.parametrize(
    ("token_ids", "mode", "attribution", "sent", "reason"),
    [
        ("requested", "auto", "exact", True, "lists each chunk's token ids"),  # as vLLM: asked after the probe
        ("reject", "auto", "estimated", False, "refused return_token_ids (HTTP 400"),
        ("ignore", "auto", "estimated", False, "its chunks carry no token ids"),
        ("always", "off", "exact", False, "--return-token-ids off"),  # listed unasked
        ("requested", "off", "estimated", False, "--return-token-ids off"),
    ],
)
def test_several_tokens_per_chunk_with_and_without_token_ids(token_ids, mode, attribution, sent, reason):
    with simulator_thread(itl_ms=5, tokens_per_chunk=3, record_bodies=True, token_ids=token_ids) as server:
        result = run(server, n=2, output_len=10, target={"return_token_ids": mode})
        ids = [present(request_id, "the x-request-id header") for request_id in server.app.stats.request_ids]
        bodies = list(server.app.stats.bodies)
    data = result.to_json()
    assert data["completed"] == 2  # a server that rejects the field fails the probe, never the run
    assert data["return_token_ids"]["sent"] is sent and reason in data["return_token_ids"]["reason"]
    probes = [request_id for request_id in ids if request_id.endswith("probe")]
    assert len(probes) == (mode == "auto") and ids[: len(probes)] == probes  # one probe, before the run
    measured = bodies[len(probes) :]
    assert len(measured) == 2 and all(("return_token_ids" in body) is sent for body in measured)
    assert (data["token_attribution"], data["token_attribution_requests"]) == (attribution, {attribution: 2})
    for record in result.records:
        # exact from the ids; estimated from the usage total spread by text (a byte per token: here exact too).
        # vLLM's --stream-interval 3: the first token alone, then 3 per chunk.
        assert record.chunk_tokens == [1, 3, 3, 3] and record.output_len == 10
        assert len(itl_ms(record)) == 9
    block = console_block(result)
    assert ("ITL is estimated for 2 of 2 requests" in block) is (attribution == "estimated")


def test_without_usage_tokens_come_from_the_tokenizer_or_the_chunks():
    class ByteCounter:  # the tiny model's tokenizer, which the simulator's replies follow: a byte per token
        source = "bytes"

        def count(self, text: str) -> int:
            return len(text.encode())

    with simulator_thread(usage_chunk="never", tokens_per_chunk=2, token_ids="ignore") as server:
        by_tokenizer = run(server, n=2, output_len=6, counter=ByteCounter())
        by_chunks = run(server, n=2, output_len=6)
    assert by_tokenizer.output_tokens_source == "tokenizer"
    assert by_tokenizer.records[0].output_len == 6  # 1 + 2 + 2 + 1 bytes
    assert by_tokenizer.records[0].chunk_tokens == [1, 2, 2, 1]  # the count spread by text: a byte per token
    assert by_tokenizer.token_attribution == "estimated"
    assert by_chunks.output_tokens_source == "chunks"
    assert by_chunks.records[0].output_len == 4  # one per chunk: all we know without usage or a tokenizer
    assert by_chunks.token_attribution == "one-per-chunk"
    assert "ITL assumes one token per chunk for 2 of 2 requests" in console_block(by_chunks)


def test_server_metrics_are_scraped_beside_the_run():
    text = "vllm:num_requests_running 4\nvllm:kv_cache_usage_perc 0.4\nvllm:num_preemptions_total 0\n"
    with simulator_thread(itl_ms=10) as server:
        server.control({"metrics_text": text})
        result = run(server, n=4, output_len=20)
    summary = result.to_json()["server_metrics"]
    assert summary["available"] is True and summary["scrapes"] >= 2
    assert summary["peak_running"] == 4.0 and summary["peak_kv_cache_usage_perc"] == 0.4
    assert summary["preemptions"] == 0.0


def test_open_loop_rate_with_a_concurrency_cap_queues_in_the_client():
    with simulator_thread(itl_ms=10) as server:
        result = run(server, n=8, output_len=5, load={"request_rate": 200.0, "max_concurrency": 1})
    scheduled = [record.scheduled_s for record in result.records]
    assert scheduled == sorted(scheduled) and scheduled[-1] > 0  # arrivals spread by the Poisson process
    queue_ms = [(record.sent_s - record.scheduled_s) * 1000 for record in result.records]
    assert max(queue_ms) > 20  # 5 x 10 ms per request against 5 ms between arrivals: they wait for the slot
    assert result.to_json()["max_concurrent_requests"] == 1


def test_warmups_are_sent_but_not_counted():
    with simulator_thread() as server:
        result = run(server, n=3, load={"num_warmups": 2})
    assert server.app.stats.requests == PROBE + 2 + 3
    assert len(result.records) == 3 and result.warmups_done == 2
    assert result.to_json()["num_warmups"] == 2


def test_duration_bound_run_cycles_the_workload_and_stops():
    with simulator_thread(itl_ms=10) as server:
        result = run(server, n=2, output_len=5, load={"duration_s": 0.5, "max_concurrency": 2})
    assert len(result.records) > 2  # the two specs were sent again and again
    assert max(record.sent_s for record in result.records) < 0.5
    assert len({record.index for record in result.records}) == len(result.records)


def test_a_request_whose_connection_is_ready_only_after_the_deadline_is_not_sent():
    """The duration bound holds where the request goes out (after its connection is acquired), not where it was
    released: opening the connection can outlast the run."""

    async def send_both(url: str) -> tuple[object, object]:
        client = StreamingClient(Endpoint.from_url(url + "/v1/completions"), timeout_s=10)
        wire = build_request_bytes(
            client.endpoint, {"model": "fake-model", "prompt": "x", "max_tokens": 2, "stream": True}, {}
        )
        try:
            late = await client.send(wire, not_after=time.perf_counter())
            on_time = await client.send(wire, not_after=time.perf_counter() + 60)
        finally:
            client.close()
        return late, on_time

    with simulator_thread(itl_ms=1) as server:
        late, on_time = asyncio.run(send_both(server.root_url))
        assert server.app.stats.requests == 1  # only the one on time reached the server
    assert late is None and on_time is not None


def test_closed_loop_ramp_raises_concurrency_gradually():
    with simulator_thread(itl_ms=10) as server:
        result = run(server, n=12, output_len=10, load={"max_concurrency": 4, "ramp_up_s": 0.3})
    first = min(result.records, key=lambda record: record.sent_s)
    overlapping_first = [r for r in result.records if r.sent_s < (first.end_s or math.inf) and r is not first]
    assert len(overlapping_first) < 3  # at t = 0 the limit is 1, not 4
    assert result.to_json()["max_concurrent_requests"] <= 4


def test_load_spread_over_worker_processes_merges_records():
    with simulator_thread(itl_ms=2) as server:
        result = run(server, n=10, output_len=5, load={"num_workers": 2, "max_concurrency": 4})
    assert sorted(record.index for record in result.records) == list(range(10))
    assert result.to_json()["completed"] == 10
    assert all(record.sent_s >= 0 for record in result.records)  # one shared clock origin
