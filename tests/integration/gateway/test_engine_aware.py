"""engine_aware balancing against simulated engines whose vLLM metrics differ, and how a test sets the load an
engine reports."""

from __future__ import annotations

import asyncio

import httpx

from deepserve.engines import vllm_metrics as vllm
from deepserve.gateway.server import running_gateway
from tests.helpers import FAKE_MODEL

from .conftest import gateway_config, upstream

CHAT = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


def load(waiting: int, kv_cache_usage: float) -> dict[str, float]:
    """The metric values an engine reports for this load (Controls.metric_overrides)."""
    return {vllm.WAITING: waiting, vllm.KV_CACHE_USAGE: kv_cache_usage}


async def test_the_engine_reports_its_load_under_vllms_names_and_a_test_can_set_it() -> None:
    async with (
        upstream(itl_ms=20) as engine,
        httpx.AsyncClient(base_url=engine.root_url, timeout=10) as client,
    ):
        body = {"model": FAKE_MODEL, "prompt": "x", "max_tokens": 20, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as streaming:
            chunks = streaming.aiter_raw()
            await chunks.__anext__()  # the stream runs
            text = (await client.get("/metrics")).text
            assert f'{vllm.RUNNING}{{engine="0",model_name="{FAKE_MODEL}"}} 1.0' in text
            async for _ in chunks:
                pass
        changed = await client.post("/simulate/control", json={"metric_overrides": load(7, 0.9)})
        assert changed.json()["metric_overrides"] == load(7, 0.9)
        text = (await client.get("/metrics")).text
        assert f'{vllm.WAITING}{{engine="0",model_name="{FAKE_MODEL}"}} 7.0' in text and "} 0.9" in text


async def test_lockstep_gives_every_running_stream_its_token_in_the_same_engine_step() -> None:
    async with (
        upstream(step_ms=30) as engine,
        httpx.AsyncClient(base_url=engine.base_url, timeout=10) as client,
    ):
        body = {"model": FAKE_MODEL, "prompt": "x", "max_tokens": 6, "stream": True}

        async def stream(delay_s: float) -> str:
            await asyncio.sleep(delay_s)
            return (await client.post("/completions", json=body)).text

        texts = await asyncio.gather(*(stream(0.007 * index) for index in range(4)))
        assert all(text.count('"finish_reason"') == 6 for text in texts)  # six token chunks each
        # Each stream on its own timer would take 4 × 6 = 24 wake-ups; in lockstep the four share steps (a stream
        # that arrives between two steps joins the next one), so about 6 or 7 steps serve all 24 tokens; on a loaded
        # machine the arrivals may spread over a few more steps, never near 24.
        assert 6 <= engine.app.engine.stats()["steps"] <= 12


async def test_engine_aware_routes_by_the_engines_own_metrics() -> None:
    async with upstream() as busy, upstream() as idle:
        busy.app.controls.metric_overrides = load(12, 0.9)
        idle.app.controls.metric_overrides = load(0, 0.2)
        async with (
            running_gateway(gateway_config(busy.base_url, idle.base_url, balancing="engine_aware")) as (app, url),
            httpx.AsyncClient(base_url=url, timeout=10) as client,
        ):
            for index in range(10):  # different prompts: no prefix in common
                assert (await client.post("/chat/completions", json={**CHAT, "messages": [
                    {"role": "user", "content": f"{index} " * 50}]})).status_code == 200  # fmt: skip
            assert (busy.app.stats.requests, idle.app.stats.requests) == (0, 10)
            busy.app.controls.metric_overrides = load(0, 0.1)  # the tables turn
            idle.app.controls.metric_overrides = load(20, 0.95)
            assert app.engine_load_scraper is not None
            await app.engine_load_scraper.scrape_once()
            for index in range(10):
                assert (await client.post("/chat/completions", json={**CHAT, "messages": [
                    {"role": "user", "content": f"again {index} " * 50}]})).status_code == 200  # fmt: skip
            assert (busy.app.stats.requests, idle.app.stats.requests) == (10, 10)
            assert app.pool.policy.engine_load is not None and len(app.pool.policy.engine_load) == 2
