"""Which exceptions become an upstream failure (retried, charged to a replica) and which are the gateway's own bugs
(answered 500 in OpenAI's shape, never retried, logged with a traceback)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator

import httpx
import pytest

from deepserve.gateway.http_client import HttpClient
from deepserve.gateway.server import running_gateway
from deepserve.gateway.upstreams import UpstreamReplica
from tests.helpers import FAKE_MODEL

from .conftest import gateway_config, ledger_rows, upstream

CHAT = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


async def test_a_bug_in_the_client_is_a_500_not_a_retried_upstream_failure(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with (
        upstream() as first,
        upstream() as second,
        running_gateway(gateway_config(first.base_url, second.base_url)) as (app, url),
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
        assert first.app.stats.requests == second.app.stats.requests == 0
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
        assert connections == [] and client.open_connections == 0  # nothing opened, nothing leaked
    finally:
        await client.close()
        server.close()


# ---- answers the gateway cannot read are still forwarded, never a 500, and still get their ledger row -----------

MODELS_ANSWER = json.dumps({"object": "list", "data": [{"id": FAKE_MODEL, "max_model_len": 4096}]}).encode()
DEEP = b'{"choices": [], "usage": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
ODD_ANSWERS = {
    "lone surrogate, usage of the wrong types": b'{"choices": [{"text": "\\ud800"}], '
    b'"usage": {"prompt_tokens": "many", "completion_tokens": 100000000000000000000000}}',
    "nested beyond the decoder's stack": DEEP,
    "not JSON": b"\xff\xfe not json",
}


@contextlib.asynccontextmanager
async def scripted_engine(answer: bytes, *, stream: bool) -> AsyncIterator[str]:
    """An engine on loopback that answers /health and /v1/models, and every POST with ANSWER (as the body of a
    JSON answer, or as the body of an event stream)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length")), 0)  # fmt: skip
            await reader.readexactly(length)
            body = MODELS_ANSWER if b"/v1/models" in head else b"{}" if b"/health" in head else answer
            kind = b"text/event-stream" if stream and head.startswith(b"POST") else b"application/json"
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (kind, len(body)))
            writer.write(body)
            await writer.drain()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
    finally:
        server.close()


@pytest.mark.parametrize("what", list(ODD_ANSWERS))
async def test_an_answer_the_gateway_cannot_read_is_forwarded_as_is(what: str) -> None:
    answer = ODD_ANSWERS[what]
    async with (
        scripted_engine(answer, stream=False) as upstream,
        running_gateway(gateway_config(upstream)) as (app, url),
        httpx.AsyncClient(base_url=url) as client,
    ):
        response = await client.post("/chat/completions", json=CHAT)
        assert response.status_code == 200 and response.content == answer
        assert app.ledger is not None and app.ledger.flush()
    assert ledger_rows("status, prompt_tokens, completion_tokens") == [(200, None, None)]


@pytest.mark.parametrize("log_bodies", [False, True])
async def test_a_stream_the_gateway_cannot_read_is_forwarded_as_is(log_bodies: bool) -> None:
    events = (
        b'data: {"choices": [{"delta": {"content": "\\udc00"}}]}\n\n'
        b"data: " + DEEP + b"\n\n"
        b'data: {"choices": [], "usage": {"prompt_tokens": -1, "completion_tokens": "x"}}\n\n'
        b"data: [DONE]\n\n"
    )
    async with (
        scripted_engine(events, stream=True) as upstream,
        running_gateway(gateway_config(upstream, log_bodies=log_bodies)) as (app, url),
        httpx.AsyncClient(base_url=url) as client,
    ):
        body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
        response = await client.post("/chat/completions", json=body)
        assert response.status_code == 200 and response.content == events
        assert app.ledger is not None and app.ledger.flush()
    ((status, prompt_tokens, completion_tokens),) = ledger_rows("status, prompt_tokens, completion_tokens")
    assert (status, prompt_tokens, completion_tokens) == (200, None, None)
