"""engine_aware balancing against fake engines whose vLLM metrics differ, and the fake's own load reporting."""

from __future__ import annotations

import asyncio

import httpx

from deepserve.gateway.fake_upstream import FAKE_MODEL, FakeBehaviour, running_fake_upstream
from deepserve.gateway.server import running_gateway

from .conftest import gateway_config

CHAT = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


async def test_the_fake_reports_its_load_under_vllms_names_and_a_test_can_set_it() -> None:
    async with (
        running_fake_upstream(FakeBehaviour(itl_ms=20)) as (fake, url),
        httpx.AsyncClient(base_url=url.removesuffix("/v1"), timeout=10) as client,
    ):
        body = {"model": FAKE_MODEL, "prompt": "x", "max_tokens": 20, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as streaming:
            chunks = streaming.aiter_raw()
            await chunks.__anext__()  # the stream runs
            text = (await client.get("/metrics")).text
            assert f'vllm:num_requests_running{{model_name="{FAKE_MODEL}"}} 1.0' in text
            async for _ in chunks:
                pass
        changed = await client.post("/fake/load", json={"waiting": 7, "kv_cache_usage": 0.9})
        assert changed.json() == {"waiting": 7, "kv_cache_usage": 0.9}
        text = (await client.get("/metrics")).text
        assert "vllm:num_requests_waiting" in text and "} 7.0" in text and "} 0.9" in text
        assert fake.behaviour.waiting == 7


async def test_lockstep_gives_every_running_stream_its_token_in_the_same_engine_step() -> None:
    async with (
        running_fake_upstream(FakeBehaviour(itl_ms=30, lockstep=True)) as (fake, url),
        httpx.AsyncClient(base_url=url, timeout=10) as client,
    ):
        body = {"model": FAKE_MODEL, "prompt": "x", "max_tokens": 6, "stream": True}

        async def stream(delay_s: float) -> str:
            await asyncio.sleep(delay_s)
            return (await client.post("/completions", json=body)).text

        texts = await asyncio.gather(*(stream(0.007 * index) for index in range(4)))
        assert all(text.count('"text":"t"') == 6 for text in texts)
        # Each stream on its own timer would take 4 × 6 = 24 wake-ups; in lockstep the four share steps (a stream
        # that arrives between two steps joins the next one), so about 6 or 7 steps serve all 24 tokens.
        assert 6 <= fake.stats.engine_steps <= 8


async def test_engine_aware_routes_by_the_engines_own_metrics() -> None:
    async with (
        running_fake_upstream(FakeBehaviour(waiting=12, kv_cache_usage=0.9)) as (busy, busy_url),
        running_fake_upstream(FakeBehaviour(waiting=0, kv_cache_usage=0.2)) as (idle, idle_url),
        running_gateway(gateway_config(busy_url, idle_url, balancing="engine_aware")) as (app, url),
        httpx.AsyncClient(base_url=url, timeout=10) as client,
    ):
        for index in range(10):  # different prompts: no prefix in common
            assert (await client.post("/chat/completions", json={**CHAT, "messages": [
                {"role": "user", "content": f"{index} " * 50}]})).status_code == 200  # fmt: skip
        assert (busy.stats.requests, idle.stats.requests) == (0, 10)
        busy.behaviour.waiting, busy.behaviour.kv_cache_usage = 0, 0.1  # the tables turn
        idle.behaviour.waiting, idle.behaviour.kv_cache_usage = 20, 0.95
        assert app._engine_load is not None
        await app._engine_load.scrape_once()
        for index in range(10):
            assert (await client.post("/chat/completions", json={**CHAT, "messages": [
                {"role": "user", "content": f"again {index} " * 50}]})).status_code == 200  # fmt: skip
        assert (busy.stats.requests, idle.stats.requests) == (10, 10)
        assert app.pool.policy.engine_load is not None and len(app.pool.policy.engine_load) == 2
