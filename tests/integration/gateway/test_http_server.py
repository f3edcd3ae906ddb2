"""The gateway's own HTTP/1.1 server (http_server.py) at the byte level: pipelining, HTTP/1.0 clients, Expect:
100-continue, HEAD, malformed requests, idle keep-alive connections and the end of the server's dependence on
uvicorn's private classes."""

from __future__ import annotations

import asyncio
import importlib
import json
import pkgutil
import sys
from urllib.parse import urlsplit

import deepserve.gateway
from tests.helpers import FAKE_MODEL, FakeClock, until

from .conftest import upstream_and_gateway

CHAT = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}


async def _connect(base_url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    parts = urlsplit(base_url)
    assert parts.hostname is not None and parts.port is not None
    return await asyncio.open_connection(parts.hostname, parts.port)


def _post(body: dict[str, object], *extra: bytes, version: bytes = b"1.1") -> bytes:
    data = json.dumps(body).encode()
    head = b"POST /v1/chat/completions HTTP/%s\r\nHost: gateway\r\nContent-Type: application/json\r\n" % version
    return head + b"".join(extra) + b"Content-Length: %d\r\n\r\n" % len(data) + data


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a content-length or chunked body."""
    head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).decode("latin-1")
    status = int(head.split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in head.split("\r\n")[1:] if line)}
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    body = b""
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        chunk = await reader.readexactly(size + 2)
        if not size:
            return status, headers, body
        body += chunk[:-2]


async def test_pipelined_requests_are_answered_in_order_on_one_connection() -> None:
    async with upstream_and_gateway() as (_, _, client):
        reader, writer = await _connect(str(client.base_url))
        first = {**CHAT, "max_tokens": 5, "stream": True}
        second = {**CHAT, "max_tokens": 2}
        writer.write(_post(first) + _post(second))  # both at once: the second waits for the first's answer
        status, headers, body = await _read_response(reader)
        assert status == 200 and headers["transfer-encoding"] == "chunked" and body.endswith(b"data: [DONE]\n\n")
        status, headers, body = await _read_response(reader)
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2
        writer.close()


async def test_an_http_1_0_client_gets_a_stream_ended_by_the_close_without_chunks() -> None:
    async with upstream_and_gateway() as (_, _, client):
        reader, writer = await _connect(str(client.base_url))
        writer.write(_post({**CHAT, "stream": True}, version=b"1.0"))
        raw = await asyncio.wait_for(reader.read(), 10)  # to EOF: the close ends the body
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding" not in head.lower()
        assert b"connection: close" in head.lower()
        assert body.startswith(b"data: ") and body.endswith(b"data: [DONE]\n\n")


async def test_expect_100_continue_is_answered_before_the_body_is_sent() -> None:
    async with upstream_and_gateway() as (_, _, client):
        reader, writer = await _connect(str(client.base_url))
        request = _post(CHAT, b"Expect: 100-continue\r\n")
        head, _, body = request.partition(b"\r\n\r\n")
        writer.write(head + b"\r\n\r\n")  # the body only once the server said it wants it, as curl does
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert interim.startswith(b"HTTP/1.1 100 Continue")
        writer.write(body)
        status, _, answer = await _read_response(reader)
        assert status == 200 and json.loads(answer)["object"] == "chat.completion"
        writer.close()


async def test_a_head_request_gets_headers_only_and_the_connection_goes_on() -> None:
    async with upstream_and_gateway() as (_, _, client):
        reader, writer = await _connect(str(client.base_url))
        writer.write(b"HEAD /health HTTP/1.1\r\nHost: gateway\r\n\r\nGET /health HTTP/1.1\r\nHost: gateway\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200") and b"content-length: 15" in head.lower()
        status, _, body = await _read_response(reader)  # the next response follows the head directly
        assert status == 200 and json.loads(body) == {"status": "ok"}
        writer.close()


async def test_a_malformed_request_gets_400_in_openai_shape_and_a_close() -> None:
    async with upstream_and_gateway() as (_, app, client):
        reader, writer = await _connect(str(client.base_url))
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: nope\r\n\r\n")
        raw = await asyncio.wait_for(reader.read(), 10)
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400") and b"connection: close" in head
        error = json.loads(body)["error"]
        assert error["code"] == "invalid_http_request" and error["type"] == "invalid_request_error"
        await until(lambda: not app.connections.open)


async def test_an_idle_keep_alive_connection_is_closed_by_the_sweep() -> None:
    clock = FakeClock()
    async with upstream_and_gateway(clock=clock) as (_, app, client):
        reader, writer = await _connect(str(client.base_url))
        writer.write(b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n")
        assert (await _read_response(reader))[0] == 200
        clock.advance(app.connections.keep_alive_s - 0.1)
        app.connections.sweep()
        assert len(app.connections.open) == 1
        clock.advance(0.1)
        app.connections.sweep()
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed quietly, as a keep-alive timeout is
        assert (await client.get(str(client.base_url).rstrip("/").removesuffix("/v1") + "/health")).status_code == 200


def test_the_gateway_depends_on_no_private_server_class() -> None:
    """Issue 23: the gateway served through a subclass of uvicorn's private protocol; now through its own server.
    No gateway module imports uvicorn."""
    for module in pkgutil.iter_modules(deepserve.gateway.__path__, "deepserve.gateway."):
        importlib.import_module(module.name)
    loaded = [name for name in sys.modules if name == "uvicorn" or name.startswith("uvicorn.")]
    importers = [
        name
        for name, module in sys.modules.items()
        if name.startswith("deepserve.gateway") and "uvicorn" in vars(module)
    ]
    assert not importers, f"gateway modules import uvicorn: {importers} ({loaded})"
