"""Which exceptions become an upstream failure (retried, charged to a replica) and which are the gateway's own bugs
(answered 500 in OpenAI's shape, never retried, logged with a traceback)."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from deepserve.gateway.fake_upstream import FAKE_MODEL, running_fake_upstream
from deepserve.gateway.http_client import HttpClient
from deepserve.gateway.server import running_gateway
from deepserve.gateway.upstreams import UpstreamReplica

from .conftest import gateway_config

CHAT = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


async def test_a_bug_in_the_client_is_a_500_not_a_retried_upstream_failure(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with (
        running_fake_upstream() as (first, first_url),
        running_fake_upstream() as (second, second_url),
        running_gateway(gateway_config(first_url, second_url)) as (app, url),
        httpx.AsyncClient(base_url=url) as client,
    ):
        calls: list[str] = []

        async def broken_request(*args: object, **kwargs: object) -> object:
            calls.append("request")
            raise ValueError("a bug of ours")

        monkeypatch.setattr(HttpClient, "request", broken_request)
        caplog.set_level(logging.ERROR)
        tokenize = url.removesuffix("/v1") + "/tokenize"
        for path, body in (("/chat/completions", CHAT), (tokenize, {"model": FAKE_MODEL, "prompt": "hi"})):
            response = await client.post(path, json=body)
            assert response.status_code == 500, path
            error = response.json()["error"]
            assert error["code"] == "internal_error" and "ValueError" in error["message"]
        assert calls == ["request", "request"]  # once per request: not retried on the other replica
        assert all(replica.healthy for replica in app.pool.replicas)  # nor charged to a replica
        assert first.stats.requests == second.stats.requests == 0
        assert any(record.exc_info and record.exc_info[0] is ValueError for record in caplog.records)


async def test_a_target_that_is_not_latin_1_fails_before_a_connection_is_taken() -> None:
    connections: list[int] = []

    async def count(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        writer.close()

    server = await asyncio.start_server(count, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = HttpClient(connect_timeout_s=2.0, read_timeout_s=2.0, idle_s=4.0)
    replica = UpstreamReplica(f"http://127.0.0.1:{port}/\u20ac/v1")  # built directly: config would refuse it
    try:
        with pytest.raises(UnicodeEncodeError):
            await client.request("POST", replica.origin, replica.path_prefix + "/v1/completions", b"{}")
        await asyncio.sleep(0.05)
        assert connections == [] and not client._all  # nothing opened, nothing leaked
    finally:
        await client.close()
        server.close()
