"""The gateway in front of an in-process simulator: pass-through, streaming, validation, keys, health."""

from __future__ import annotations

import asyncio
import json
import socket
import sqlite3
from typing import Any

import httpx
import pytest

from deepserve.gateway import http_server
from deepserve.gateway.asgi import Send
from deepserve.gateway.keys import KeyStore
from deepserve.gateway.ledger import default_ledger_path, summarise
from deepserve.gateway.limits import KeyLimits
from deepserve.gateway.relay import StreamRelay
from deepserve.gateway.server import running_gateway
from deepserve.net import free_port
from deepserve.simulate.clock import ManualClock
from deepserve.simulate.tokenizer import generated_text
from tests.helpers import FAKE_MODEL, until

from .conftest import UPSTREAM_MAX_MODEL_LEN, gateway_config, ledger_rows, upstream, upstream_and_gateway

CHAT = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
TOKEN_EVENT = b'"delta":{"content":'  # a chat chunk with a token (the first chunk has the role alone)


async def test_non_streamed_pass_through_models_and_ledger() -> None:
    async with upstream_and_gateway() as (fake, _, client):
        models = (await client.get("/models")).json()
        assert [card["id"] for card in models["data"]] == [FAKE_MODEL]
        assert models["data"][0]["max_model_len"] == UPSTREAM_MAX_MODEL_LEN
        response = await client.post("/chat/completions", json=CHAT)
        assert response.status_code == 200
        body = response.json()
        assert body["choices"][0]["message"]["content"] == generated_text(0, 4)
        assert fake.app.stats.bodies[-1] == CHAT  # forwarded unchanged
        completion = await client.post("/completions", json={"model": FAKE_MODEL, "prompt": "hi", "max_tokens": 2})
        assert completion.json()["choices"][0]["text"] == generated_text(0, 2)
    (row,) = summarise()
    assert row.key == "anonymous" and row.requests == 2 and row.errors == 0
    assert row.completion_tokens == 6


async def test_stream_chunks_are_forwarded_as_they_arrive_and_usage_is_accounted() -> None:
    clock = ManualClock()  # the upstream's tokens come when the test moves its clock: one every 10 ms
    options = {"ttft_ms": 10.0, "itl_ms": 10.0, "clock": clock}
    async with upstream_and_gateway(upstream_options=options) as (fake, app, client):
        text = b""

        async def first_token() -> None:  # the gateway sends the response head with the first token
            await until(lambda: fake.app.stats.active == 1)
            clock.advance(0.010)

        first = asyncio.create_task(first_token())
        async with client.stream("POST", "/chat/completions", json={**CHAT, "stream": True}) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            await first
            chunks = response.aiter_raw()
            for produced in range(1, 5):
                while text.count(TOKEN_EVENT) < produced:  # each token reaches the client before the next exists
                    text += await asyncio.wait_for(anext(chunks), 10)
                assert text.count(TOKEN_EVENT) == produced
                clock.advance(0.010)
            text += b"".join([chunk async for chunk in chunks])
        events = [event for event in text.split(b"\n\n") if event]
        assert events[-1] == b"data: [DONE]"
        assert len(events) == 6  # the role, 4 tokens, [DONE]: the usage chunk the gateway asked for is not shown
        assert b"usage" not in text
        assert fake.app.stats.bodies[-1]["stream_options"] == {"include_usage": True}
        metrics = app.metrics.render().decode()
        assert f'deepserve_gateway_ttft_seconds_count{{model="{FAKE_MODEL}"}} 1.0' in metrics
        assert f'deepserve_gateway_completion_tokens_total{{key="anonymous",model="{FAKE_MODEL}"}} 4.0' in metrics


async def test_a_stream_to_a_client_that_stops_reading_waits_for_it_and_arrives_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The relay writes from the upstream's read callback while the client takes the writes; a client that stops
    reading makes it hand the stream back to the request's task, which waits for the client to drain (flow
    control), and the client still gets every event, in order."""
    handed_back = 0
    send_held = StreamRelay.send_held

    async def counted_send_held(relay: StreamRelay, send: Send) -> None:
        nonlocal handed_back
        handed_back += 1
        await send_held(relay, send)

    monkeypatch.setattr(StreamRelay, "send_held", counted_send_held)
    connection_made = http_server._Connection.connection_made

    def on_a_slow_network(connection: Any, transport: asyncio.BaseTransport) -> None:
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        connection_made(connection, transport)

    # The kernel's buffers on loopback would take the whole stream: small ones, as on a slow link, make it push back.
    monkeypatch.setattr(http_server._Connection, "connection_made", on_a_slow_network)
    tokens = 3000
    async with upstream_and_gateway() as (_, _, client):
        host, port = client.base_url.host, client.base_url.port
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the gateway's writes back up
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
        body = json.dumps({**CHAT, "max_tokens": tokens, "stream": True}).encode()
        head = f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n\r\n"
        writer.write(head.encode() + body)
        await until(lambda: handed_back > 0, timeout_s=20)  # nothing read yet: the gateway had to wait
        text = b""
        while not text.endswith(b"\r\n0\r\n\r\n"):  # the chunked body's end
            text += await asyncio.wait_for(reader.read(65536), 30)
        writer.close()
    assert text.startswith(b"HTTP/1.1 200")
    assert text.count(TOKEN_EVENT) == tokens
    assert text.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")


async def test_stream_usage_kept_when_the_client_asked() -> None:
    async with upstream_and_gateway() as (_, _, client):
        request = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
        response = await client.post("/chat/completions", json=request)
        usage = [json.loads(e[6:]) for e in response.text.split("\n\n") if '"usage"' in e]
        assert usage[0]["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"{oops", 400),
        (json.dumps({**CHAT, "max_tokens": "many"}).encode(), 400),
        (json.dumps({**CHAT, "max_tokens": 5000}).encode(), 400),  # beyond the upstream's UPSTREAM_MAX_MODEL_LEN
        (json.dumps({**CHAT, "frobnicate": 1}).encode(), 400),
        (json.dumps({**CHAT, "model": "gpt-4"}).encode(), 404),
        (json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * 70_000}]}).encode(), 413),
        (json.dumps({**CHAT, "messages": None}).encode(), 400),
        (b'{"model": "fake-model", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400),
        (b'{"model": "fake-model", "messages": [{"role": "user", "content": "\\ud800"}], "stream": true}', 400),
        (json.dumps({**CHAT, "max_tokens": None}).encode()[:-1] + b', "seed": 1' + b"0" * 5000 + b"}", 400),
    ],
)
async def test_bad_requests_get_4xx_in_openai_shape_and_are_not_forwarded(body: bytes, status: int) -> None:
    async with upstream() as fake:
        config = gateway_config(fake.base_url, max_body_bytes=65_536 if status == 413 else 1 << 22)
        async with running_gateway(config) as (_, url), httpx.AsyncClient(base_url=url) as client:
            response = await client.post("/chat/completions", content=body)
            assert response.status_code == status
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
            assert fake.app.stats.requests == 0


async def test_a_prompt_of_null_is_400_on_completions_too() -> None:
    async with upstream_and_gateway() as (fake, _, client):
        response = await client.post("/completions", json={"model": FAKE_MODEL, "prompt": None})
        assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
        assert fake.app.stats.requests == 0


async def test_refusals_leave_no_request_text_in_the_ledger() -> None:
    secret = "the user's private text " * 200
    async with upstream_and_gateway() as (_, app, client):
        for body in (
            {**CHAT, "model": secret},  # unknown model: 404
            {**CHAT, "messages": [{"content": secret}]},  # no role: 400
            {**CHAT, "temperature": secret},  # wrong type: 400
            {**CHAT, secret: 1},  # unsupported parameter: 400
        ):
            response = await client.post("/chat/completions", json=body)
            assert response.status_code in (400, 404)
            assert len(response.text) < 1000  # the answer quotes a bounded part of the value only
        assert app.ledger is not None and app.ledger.flush()
    errors = [error for (error,) in ledger_rows("error")]
    assert len(errors) == 4
    assert all(error and "private" not in error and len(error) <= 300 for error in errors), errors


async def test_model_alias_is_mapped() -> None:
    async with upstream() as fake:
        config = gateway_config(fake.base_url, model_alias=["deepseek-v3=" + FAKE_MODEL])
        async with running_gateway(config) as (_, url), httpx.AsyncClient(base_url=url) as client:
            response = await client.post("/chat/completions", json={**CHAT, "model": "deepseek-v3"})
            assert response.status_code == 200
            assert fake.app.stats.bodies[-1] == CHAT
            ids = {card["id"] for card in (await client.get("/models")).json()["data"]}
            assert ids == {FAKE_MODEL, "deepseek-v3"}


async def test_keys_limits_models_and_revocation() -> None:
    store = KeyStore()
    _, limited = store.create("limited", KeyLimits(rpm=2))
    _, other_model = store.create("other", models=["some-other-model"])
    async with upstream() as served:
        config = gateway_config(served.base_url, require_keys=True)
        async with running_gateway(config) as (app, url), httpx.AsyncClient(base_url=url) as client:
            assert (await client.post("/chat/completions", json=CHAT)).status_code == 401
            wrong = await client.post("/chat/completions", json=CHAT, headers={"Authorization": "Bearer dsk-x-y"})
            assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
            auth = {"Authorization": f"Bearer {limited}"}
            assert [
                (await client.post("/chat/completions", json=CHAT, headers=auth)).status_code for _ in range(2)
            ] == [
                200,
                200,
            ]
            third = await client.post("/chat/completions", json=CHAT, headers=auth)
            assert third.status_code == 429 and int(third.headers["retry-after"]) >= 1
            assert third.json()["error"]["code"] == "rate_limit_exceeded"
            denied = await client.post(
                "/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {other_model}"}
            )
            assert denied.status_code == 403
            _, late = store.create("late")
            store.revoke("limited")
            assert app.keyring is not None
            app.keyring.refresh()  # what the gateway does every second
            assert (await client.post("/chat/completions", json=CHAT, headers=auth)).status_code == 401
            late_auth = {"Authorization": f"Bearer {late}"}
            assert (await client.post("/chat/completions", json=CHAT, headers=late_auth)).status_code == 200
    keys = {row.key: row for row in summarise()}
    assert keys["limited"].requests == 3 and keys["limited"].errors == 1


async def test_health_and_ready_without_a_live_upstream() -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    async with running_gateway(gateway_config(dead)) as (_, url), httpx.AsyncClient(base_url=url) as client:
        root = url.removesuffix("/v1")
        assert (await client.get(root + "/health")).status_code == 200
        ready = await client.get(root + "/ready")
        assert ready.status_code == 503 and ready.json()["healthy_upstreams"] == 0
        response = await client.post("/chat/completions", json=CHAT)
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "no_healthy_upstream"
        metrics = (await client.get(root + "/metrics")).text
        assert f'deepserve_gateway_upstream_healthy{{replica="{dead}"}} 0.0' in metrics


async def test_bodies_are_logged_only_when_opted_in() -> None:
    for log_bodies in (False, True):
        async with upstream_and_gateway(log_bodies=log_bodies) as (_, _, client):
            await client.post("/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": "private"}]})
            await client.post("/chat/completions", json={**CHAT, "stream": True})
        rows = (
            sqlite3.connect(default_ledger_path()).execute("SELECT request_body, response_body FROM usage").fetchall()
        )
        texts = [text for row in rows[-2:] for text in row]
        if log_bodies:
            answer = generated_text(0, 4)
            assert "private" in (texts[0] or "") and answer in (texts[1] or "") and "data:" in (texts[3] or "")
        else:
            assert texts == [None] * 4


async def test_with_log_bodies_a_body_that_cannot_be_encoded_does_not_stop_the_ledger() -> None:
    """The defect: with --log-bodies, a body holding a lone surrogate was forwarded, then killed the ledger's
    writer thread, and every later row was lost."""
    bad = b'{"model": "fake-model", "messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 4}'
    async with upstream_and_gateway(log_bodies=True) as (fake, app, client):
        assert (await client.post("/chat/completions", content=bad)).status_code == 400
        for _ in range(3):
            assert (await client.post("/chat/completions", json=CHAT)).status_code == 200
        assert app.ledger is not None and app.ledger.flush()
        assert fake.app.stats.requests == 3
    rows = ledger_rows("status, request_body")
    assert [status for status, _ in rows] == [400, 200, 200, 200]
    assert rows[0][1] is None and all('"hello"' in body for _, body in rows[1:])


async def test_tokenize_is_forwarded_with_aliases_mapped() -> None:
    async with upstream_and_gateway(model_alias=[f"deepseek-chat={FAKE_MODEL}"]) as (fake, _, client):
        root = str(client.base_url).removesuffix("/v1/")
        answer = await client.post(f"{root}/tokenize", json={"model": "deepseek-chat", "prompt": "héllo"})
        assert answer.status_code == 200
        assert answer.json()["count"] == 1 + len("héllo".encode())  # BOS, then one token per byte (the tiny model's)
        assert fake.app.stats.requests == 0  # nothing was generated


async def test_tokenize_of_an_unknown_model_is_a_404_in_openais_shape() -> None:
    async with upstream_and_gateway() as (fake, _, client):
        root = str(client.base_url).removesuffix("/v1/")
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1, 2]})):
            answer = await client.post(f"{root}{path}", json={"model": "nope", **body})
            assert answer.status_code == 404, (path, answer.text)
            error = answer.json()["error"]
            assert error["code"] == "model_not_found" and error["param"] == "model"
            assert error["type"] == "invalid_request_error" and FAKE_MODEL in error["message"]
        assert fake.app.stats.requests == 0
