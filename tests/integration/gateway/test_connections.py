"""Hostile clients at the connection level: sockets that never finish their headers or body, oversized headers, and
more connections than the limit. Deadlines are checked by moving the gateway's clock and sweeping, not by waiting."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
from typing import Any
from urllib.parse import urlsplit

import httpx
import psutil

from deepserve.gateway.app import GatewayApp
from deepserve.gateway.server import running_gateway
from tests.helpers import FAKE_MODEL, Child, FakeClock, until

from .conftest import gateway_config, ledger_rows, start_gateway, start_upstream, upstream, upstream_and_gateway

CHAT = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
HALF_A_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


async def _read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, Any]]:
    """The status and JSON body of the one response the gateway sends before it closes the connection."""
    raw = await asyncio.wait_for(reader.read(), 10)  # to EOF: the gateway shuts its side after answering
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower()
    return int(head.split()[1]), json.loads(body)


async def test_idle_and_half_sent_connections_are_closed_after_the_header_timeout() -> None:
    clock = FakeClock()
    async with upstream_and_gateway(clock=clock, header_timeout_s=10.0) as (_, app, client):
        host, port = _address(str(client.base_url))
        sockets = [await asyncio.open_connection(host, port) for _ in range(200)]
        for _, writer in sockets[::2]:
            writer.write(HALF_A_HEAD)  # the other half never sends a byte
        await until(lambda: len(app.connections.open) == 200)
        clock.now_s += 9.9
        app.connections.sweep()  # what the guard's sweeper does twice a second
        assert len(app.connections.open) == 200
        clock.now_s += 0.1
        app.connections.sweep()
        answers = await asyncio.gather(*(_read_answer(reader) for reader, _ in sockets))
        assert {status for status, _ in answers} == {408}
        assert all(body["error"]["code"] == "request_timeout" for _, body in answers)
        for _, writer in sockets:
            writer.close()
        await until(lambda: not app.connections.open and not app.connections.lingering)
        metrics = app.metrics.render().decode()
        assert 'deepserve_gateway_connections_refused_total{reason="header_timeout"} 200.0' in metrics
        assert (await client.post("/chat/completions", json=CHAT)).status_code == 200  # still serving


async def test_a_body_that_never_completes_gets_408_and_a_ledger_row() -> None:
    clock = FakeClock()
    async with upstream_and_gateway(clock=clock, body_timeout_s=60.0) as (fake, app, client):
        reader, writer = await asyncio.open_connection(*_address(str(client.base_url)))
        writer.write(HALF_A_HEAD + b"Content-Length: 100\r\n\r\n" + b'{"model": "')  # 11 of 100 bytes
        await until(lambda: app.requests_in_flight == 1)  # the app is reading the body
        clock.now_s += 60.0
        app.connections.sweep()
        status, body = await _read_answer(reader)
        assert status == 408 and body["error"]["code"] == "request_timeout"
        writer.close()
        await until(lambda: app.requests_in_flight == 0)
        assert app.ledger is not None and app.ledger.flush()
        assert ledger_rows("status, error") == [(408, "the request body did not arrive within 60 s")]
        assert fake.app.stats.requests == 0


async def test_a_slow_but_steady_request_is_not_cut() -> None:
    clock = FakeClock()
    async with upstream_and_gateway(clock=clock, header_timeout_s=10.0, body_timeout_s=60.0) as (_, app, client):
        reader, writer = await asyncio.open_connection(*_address(str(client.base_url)))
        body = json.dumps(CHAT).encode()
        writer.write(HALF_A_HEAD)
        clock.now_s += 9.0
        app.connections.sweep()
        writer.write(b"Content-Length: %d\r\n\r\n" % len(body) + body[:10])
        await until(lambda: app.requests_in_flight == 1)
        clock.now_s += 59.0
        app.connections.sweep()
        writer.write(body[10:])
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200")
        writer.close()


async def test_a_header_over_the_limit_is_431_and_read_no_further() -> None:
    long_context = {"engine": {"max_model_len": 1 << 18}}  # the upstream takes the 200,000-token prompt below
    async with upstream_and_gateway(upstream_options=long_context, max_header_bytes=8192) as (_, app, client):
        reader, writer = await asyncio.open_connection(*_address(str(client.base_url)))
        writer.write(HALF_A_HEAD + b"X-Big: " + b"a" * 100_000 + b"\r\n\r\n")
        status, body = await _read_answer(reader)
        assert status == 431 and body["error"]["code"] == "request_header_fields_too_large"
        writer.close()
        metrics = app.metrics.render().decode()
        assert 'deepserve_gateway_connections_refused_total{reason="header_too_large"} 1.0' in metrics
        # Headers just under the limit, and a body far over it in the same packets, are fine.
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * 200_000}]}
        response = await client.post("/chat/completions", json=big, headers={"X-Pad": "p" * 7000})
        assert response.status_code == 200


async def test_connections_beyond_the_limit_get_503_and_the_limit_frees_up() -> None:
    async with upstream_and_gateway(max_connections=5) as (_, app, client):
        host, port = _address(str(client.base_url))
        held = [await asyncio.open_connection(host, port) for _ in range(5)]
        await until(lambda: len(app.connections.open) == 5)
        reader, writer = await asyncio.open_connection(host, port)
        status, body = await _read_answer(reader)
        assert status == 503 and body["error"]["code"] == "too_many_connections"
        writer.close()
        for _, held_writer in held:
            held_writer.close()
        await until(lambda: not app.connections.open)
        assert (await client.post("/chat/completions", json=CHAT)).status_code == 200


def _send_huge_header(host: str, port: int, results: list[tuple[int, bytes]]) -> None:
    """Send up to 64 MB of one header, looking for an answer after every 64 KiB; record (bytes sent, answer)."""
    sent, answer = 0, b""
    with socket.create_connection((host, port)) as sock:
        piece = b"a" * 65536
        try:
            sock.sendall(HALF_A_HEAD + b"X-Huge: ")
            while sent < 64 * 2**20 and not answer:
                sock.sendall(piece)
                sent += len(piece)
                if select.select([sock], [], [], 0)[0]:
                    answer = sock.recv(65536)
        except OSError:
            pass  # the gateway closed the connection: what it answered is still in our receive buffer
        if not answer:
            try:
                sock.settimeout(10)
                answer = sock.recv(65536)
            except OSError:
                pass
    results.append((sent, answer))


async def test_a_few_64_mb_headers_cost_little_memory_and_are_refused_early(children: list[Child]) -> None:
    """The defect: httptools gathered each header whole, so a few 64 MB headers pushed the process to hundreds
    of MB before the 401. Now at most 64 KiB of a head is parsed and the rest is never read."""
    fake = start_upstream()
    children.append(fake)
    gateway = start_gateway(gateway_config(fake.url, port=0, require_keys=True))
    children.append(gateway)
    host, port = _address(gateway.url)
    before_mb = psutil.Process(gateway.pid).memory_info().rss / 2**20
    results: list[tuple[int, bytes]] = []
    senders = [threading.Thread(target=_send_huge_header, args=(host, port, results)) for _ in range(4)]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join(timeout=120)  # a bound against hanging only
    after_mb = psutil.Process(gateway.pid).memory_info().rss / 2**20
    assert len(results) == 4
    for sent, answer in results:
        assert answer.startswith(b"HTTP/1.1 431"), answer[:100]
        assert sent < 32 * 2**20  # refused long before the header ended: the rest was never read
    assert after_mb - before_mb < 20, f"the gateway grew from {before_mb:.0f} to {after_mb:.0f} MiB"
    assert httpx.get(gateway.url.removesuffix("/v1") + "/health").status_code == 200
    assert gateway.stop() == 0


async def test_the_guard_is_on_the_gateways_own_server() -> None:
    """running_gateway serves through the app's guard (its server's connections are the guard's)."""
    async with upstream() as served:
        config = gateway_config(served.base_url)
        app = GatewayApp(config)
        async with running_gateway(config, app) as (_, url), httpx.AsyncClient(base_url=url) as client:
            assert (await client.get(url.removesuffix("/v1") + "/health")).status_code == 200
            await until(lambda: len(app.connections.open) == 1)
