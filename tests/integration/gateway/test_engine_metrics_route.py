"""GET /metrics/engines in front of fake replicas: concurrent callers share one scrape, the result is reused for a
moment, a replica whose answer cannot be read is a comment line, never a 500, and when the gateway requires keys
only a caller with a key learns the replicas' URLs."""

from __future__ import annotations

import asyncio

import httpx

from deepserve.gateway.app import GatewayApp
from deepserve.gateway.engine_metrics import CACHE_S
from deepserve.gateway.keys import KeyStore
from deepserve.gateway.server import running_gateway
from tests.helpers import FAKE_MODEL, FakeClock

from .conftest import gateway_config, upstream


async def test_concurrent_callers_share_one_scrape_and_its_result_is_reused_briefly() -> None:
    clock = FakeClock()  # the cache's age is read from it
    async with upstream(metrics_delay_s=0.1) as fake:
        config = gateway_config(fake.base_url)
        async with (
            running_gateway(config, GatewayApp(config, clock=clock)) as (_, url),
            httpx.AsyncClient(base_url=url.removesuffix("/v1")) as client,
        ):
            responses = await asyncio.gather(*(client.get("/metrics/engines") for _ in range(20)))
            assert {response.status_code for response in responses} == {200}
            assert all("vllm:num_requests_running{replica=" in response.text for response in responses)
            assert fake.app.stats.metrics_scrapes == 1
            clock.now_s += CACHE_S / 2
            for _ in range(5):
                await client.get("/metrics/engines")
            assert fake.app.stats.metrics_scrapes == 1  # within CACHE_S of the scrape
            clock.now_s += CACHE_S / 2  # exactly CACHE_S after the scrape
            fake.app.controls.metrics_text = "vllm:num_requests_running 7.0\n"
            assert "7.0" in (await client.get("/metrics/engines")).text
            assert fake.app.stats.metrics_scrapes == 2


async def test_a_replica_answering_bytes_that_are_not_utf8_is_left_out_with_a_comment() -> None:
    async with (
        upstream() as broken,
        upstream() as good,
        running_gateway(gateway_config(broken.base_url, good.base_url)) as (_, url),
    ):
        broken.app.controls.metrics_text = b'vllm:x{a="\xff"} 1\n'.decode("utf-8", "surrogateescape")  # not UTF-8
        async with httpx.AsyncClient(base_url=url.removesuffix("/v1")) as client:
            response = await client.get("/metrics/engines")
        assert response.status_code == 200
        assert f"# replica {broken.base_url} left out: UnicodeDecodeError" in response.text
        labels = f'replica="{good.base_url}",engine="0",model_name="{FAKE_MODEL}"'
        assert f"vllm:num_requests_running{{{labels}}} 0.0" in response.text


async def test_with_keys_required_only_a_caller_with_a_key_sees_the_engines() -> None:
    _, secret = KeyStore().create("ops")
    async with (
        upstream() as served,
        running_gateway(gateway_config(served.base_url, require_keys=True)) as (_, url),
        httpx.AsyncClient(base_url=url.removesuffix("/v1")) as client,
    ):
        for headers in ({}, {"Authorization": "Bearer dsk-nobody-nothing"}):
            refused = await client.get("/metrics/engines", headers=headers)
            assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
            assert served.root_url not in refused.text
        allowed = await client.get("/metrics/engines", headers={"Authorization": f"Bearer {secret}"})
        assert allowed.status_code == 200 and f'replica="{served.base_url}"' in allowed.text
