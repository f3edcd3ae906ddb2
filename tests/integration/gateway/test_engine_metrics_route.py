"""GET /metrics/engines in front of fake replicas: concurrent callers share one scrape, the result is reused for a
moment, a replica whose answer cannot be read is a comment line, never a 500, and when the gateway requires keys
only a caller with a key learns the replicas' URLs."""

from __future__ import annotations

import asyncio

import httpx

from deepserve.gateway.app import GatewayApp
from deepserve.gateway.engine_metrics import CACHE_S
from deepserve.gateway.fake_upstream import FAKE_MODEL, FakeBehaviour, running_fake_upstream
from deepserve.gateway.keys import KeyStore
from deepserve.gateway.server import running_gateway

from .conftest import FakeClock, gateway_config


async def test_concurrent_callers_share_one_scrape_and_its_result_is_reused_briefly() -> None:
    clock = FakeClock()  # the cache's age is read from it
    async with running_fake_upstream(FakeBehaviour(metrics_delay_s=0.1)) as (fake, upstream):
        config = gateway_config(upstream)
        async with (
            running_gateway(config, GatewayApp(config, clock=clock)) as (_, url),
            httpx.AsyncClient(base_url=url.removesuffix("/v1")) as client,
        ):
            responses = await asyncio.gather(*(client.get("/metrics/engines") for _ in range(20)))
            assert {response.status_code for response in responses} == {200}
            assert all("vllm:num_requests_running{replica=" in response.text for response in responses)
            assert fake.stats.metrics_scrapes == 1
            clock.now_s += CACHE_S / 2
            for _ in range(5):
                await client.get("/metrics/engines")
            assert fake.stats.metrics_scrapes == 1  # within CACHE_S of the scrape
            clock.now_s += CACHE_S / 2  # exactly CACHE_S after the scrape
            fake.behaviour.metrics_text = b"vllm:num_requests_running 7.0\n"
            assert "7.0" in (await client.get("/metrics/engines")).text
            assert fake.stats.metrics_scrapes == 2


async def test_a_replica_answering_bytes_that_are_not_utf8_is_left_out_with_a_comment() -> None:
    async with (
        running_fake_upstream(FakeBehaviour(metrics_text=b'vllm:x{a="\xff"} 1\n')) as (_, broken),
        running_fake_upstream() as (_, good),
        running_gateway(gateway_config(broken, good)) as (_, url),
    ):
        async with httpx.AsyncClient(base_url=url.removesuffix("/v1")) as client:
            response = await client.get("/metrics/engines")
        assert response.status_code == 200
        assert f"# replica {broken} left out: UnicodeDecodeError" in response.text
        assert f'vllm:num_requests_running{{replica="{good}",model_name="{FAKE_MODEL}"}} 0.0' in response.text


async def test_with_keys_required_only_a_caller_with_a_key_sees_the_engines() -> None:
    _, secret = KeyStore().create("ops")
    async with (
        running_fake_upstream() as (_, upstream),
        running_gateway(gateway_config(upstream, require_keys=True)) as (_, url),
        httpx.AsyncClient(base_url=url.removesuffix("/v1")) as client,
    ):
        for headers in ({}, {"Authorization": "Bearer dsk-nobody-nothing"}):
            refused = await client.get("/metrics/engines", headers=headers)
            assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
            assert upstream.removesuffix("/v1") not in refused.text
        allowed = await client.get("/metrics/engines", headers={"Authorization": f"Bearer {secret}"})
        assert allowed.status_code == 200 and f'replica="{upstream}"' in allowed.text
