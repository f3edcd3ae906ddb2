"""Reading an engine's load from its Prometheus text, and the tpm charge cap that uses the model's context."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp import web

from deepserve.gateway.app import DEFAULT_CHARGE_CAP_TOKENS, GatewayApp
from deepserve.gateway.balancing import make_policy
from deepserve.gateway.config import GatewayConfig
from deepserve.gateway.engine_load import EngineLoadScraper, metrics_paths, parse_engine_load
from deepserve.gateway.upstreams import UpstreamPool
from deepserve.gateway.validation import COMPLETIONS, parse_request
from deepserve.net import free_port

VLLM = """# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 4.0
vllm:num_requests_waiting_by_reason{reason="capacity"} 99.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 8.0
vllm:num_requests_running{engine="1",model_name="m"} 8.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
vllm:request_success_total{finished_reason="stop",model_name="m"} 1234.0
"""


def test_vllm_load_adds_queues_over_engines_and_takes_the_fullest_cache() -> None:
    load = parse_engine_load(VLLM, scraped_at_s=5.0)
    assert (load.waiting, load.running, load.kv_cache_usage, load.scraped_at_s) == (7.0, 16.0, 0.75, 5.0)


def test_older_vllm_and_sglang_names_are_read_too() -> None:
    old = "vllm:gpu_cache_usage_perc 0.5\nvllm:num_requests_waiting 2\nvllm:num_requests_running 1 1700000000\n"
    assert parse_engine_load(old, 0.0).kv_cache_usage == 0.5
    load = parse_engine_load(old, 0.0)
    assert (load.waiting, load.running) == (2.0, 1.0)  # a sample with a timestamp
    sglang = (
        'sglang:num_queue_reqs{model_name="m"} 5\nsglang:num_running_reqs{model_name="m"} 9\nsglang:token_usage 0.4\n'
    )
    load = parse_engine_load(sglang, 0.0)
    assert (load.waiting, load.running, load.kv_cache_usage) == (5.0, 9.0, 0.4)


def test_text_without_engine_series_is_an_idle_engine() -> None:
    load = parse_engine_load("# only comments\nprocess_cpu_seconds_total 3\n", 1.0)
    assert (load.waiting, load.running, load.kv_cache_usage) == (0.0, 0.0, 0.0)


@pytest.mark.parametrize(("context", "charged"), [(None, DEFAULT_CHARGE_CAP_TOKENS), (4096, 4096), (10**6, 10**6)])
def test_a_tpm_charge_never_exceeds_the_models_context(context: int | None, charged: int) -> None:
    """One request asking for 10^12 tokens must not put its key in debt for centuries: at tpm 1,000 it would take
    1.9 million years to pay back; capped, the worst case is the model's context."""
    app = GatewayApp(GatewayConfig.model_validate({"upstream": ["http://127.0.0.1:1/v1"]}))
    app.pool.models = {"m": context}
    raw = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 10**6 - 1}).encode()
    parsed = parse_request(COMPLETIONS, raw, {"m": None}, {})  # the gateway's own check needs a known context
    parsed.max_tokens = 10**12
    assert app.tpm_charge(parsed) == min(parsed.charged_tokens, charged)


# ---- where each engine serves its series ---------------------------------------------------------------------------

# TensorRT-LLM's series (tensorrt_llm/metrics/collector.py, prefix trtllm_) at /prometheus/metrics; its /metrics is JSON
TRTLLM = (
    'trtllm_num_requests_waiting{model_name="m",engine_type="trtllm"} 6.0\n'
    'trtllm_num_requests_running{model_name="m",engine_type="trtllm"} 32.0\n'
    'trtllm_kv_cache_utilization{model_name="m",engine_type="trtllm"} 0.5\n'
)


def test_trtllms_series_are_read() -> None:
    load = parse_engine_load(TRTLLM, 0.0)
    assert (load.waiting, load.running, load.kv_cache_usage) == (6.0, 32.0, 0.5)
    assert metrics_paths() == ("/metrics", "/prometheus/metrics")


async def test_the_scraper_finds_each_engines_path_once() -> None:
    """A TensorRT-LLM stand-in (JSON at /metrics, Prometheus text at /prometheus/metrics) and a server with no
    metrics at all: the first is read at its path from then on, the second is dropped."""
    hits: list[str] = []

    async def iteration_stats(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.json_response([{"iter": 1, "numActiveRequests": 32}])

    async def prometheus(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.Response(text=TRTLLM)

    app = web.Application()
    app.router.add_get("/metrics", iteration_stats)
    app.router.add_get("/prometheus/metrics", prometheus)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]  # the port the system chose
    gone = f"http://127.0.0.1:{free_port()}/v1"
    trtllm = f"http://127.0.0.1:{port}/v1"
    pool = UpstreamPool([trtllm, gone], make_policy("engine_aware"))
    for replica in pool.replicas:
        replica.healthy = True
    try:
        loads: dict[str, Any] = {}
        scraper = EngineLoadScraper(pool, loads, interval_s=0.2)
        await scraper.scrape_once()
        assert (loads[trtllm].waiting, loads[trtllm].running) == (6.0, 32.0) and gone not in loads
        assert hits == ["/metrics", "/prometheus/metrics"]
        await scraper.scrape_once()
        assert hits[2:] == ["/prometheus/metrics"]  # found once, then read there only
    finally:
        await pool.close()
    await runner.cleanup()
