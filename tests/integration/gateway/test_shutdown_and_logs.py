"""The gateway as its own process: SIGTERM drains (streams longer than the grace period end with an error event
and their terminator, and are recorded as cut), the access log prints a line per request, and an exit code that
says when usage rows were lost."""

from __future__ import annotations

import json
import signal
import sqlite3

import httpx

from deepserve.gateway.ledger import default_ledger_path
from deepserve.gateway.server import EXIT_LEDGER_ROWS_LOST
from tests.helpers import FAKE_MODEL, Child

from .conftest import gateway_config, ledger_rows, start_gateway, start_upstream

CHAT = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


async def test_sigterm_cuts_streams_longer_than_the_grace_period_cleanly(children: list[Child]) -> None:
    fake = start_upstream("--fixed-itl-ms", "20")
    children.append(fake)
    gateway = start_gateway(gateway_config(fake.url, port=0, shutdown_grace_s=0.5))
    children.append(gateway)
    long_stream = {**CHAT, "max_tokens": 3000, "stream": True}  # a minute of tokens
    received = b""
    async with (
        httpx.AsyncClient(base_url=gateway.url, timeout=30) as client,
        client.stream("POST", "/chat/completions", json=long_stream) as response,
    ):
        async for chunk in response.aiter_raw():  # raises if the chunked body ends without its terminator
            received += chunk
            if received.count(b"data:") == 3 and gateway.process.poll() is None:
                gateway.process.send_signal(signal.SIGTERM)
    events = [event for event in received.split(b"\n\n") if event]
    error = json.loads(events[-1].removeprefix(b"data: "))["error"]
    assert error["code"] == "gateway_shutdown" and error["type"] == "server_error"
    assert gateway.wait() == 0
    tokens_delivered = len(events) - 1
    ((status, completion_tokens, cut),) = ledger_rows("status, completion_tokens, error")
    assert status == 503 and completion_tokens == tokens_delivered and cut.startswith("cut: ")


async def test_a_short_stream_finishes_during_the_grace_period(children: list[Child]) -> None:
    fake = start_upstream("--fixed-itl-ms", "50")
    children.append(fake)
    gateway = start_gateway(gateway_config(fake.url, port=0, shutdown_grace_s=30))
    children.append(gateway)
    received = b""
    short_stream = {**CHAT, "max_tokens": 20, "stream": True}  # a second of tokens
    async with (
        httpx.AsyncClient(base_url=gateway.url, timeout=30) as client,
        client.stream("POST", "/chat/completions", json=short_stream) as response,
    ):
        async for chunk in response.aiter_raw():
            received += chunk
            if gateway.process.poll() is None:
                gateway.process.send_signal(signal.SIGTERM)
    assert received.endswith(b"data: [DONE]\n\n")
    assert gateway.wait() == 0
    assert ledger_rows("status, completion_tokens") == [(200, 20)]


async def test_the_access_log_prints_one_line_per_request(children: list[Child]) -> None:
    fake = start_upstream()
    children.append(fake)
    gateway = start_gateway(gateway_config(fake.url, port=0, access_log=True))
    children.append(gateway)
    root = gateway.url.removesuffix("/v1")
    async with httpx.AsyncClient(timeout=30) as client:
        assert (await client.post(gateway.url + "/chat/completions", json=CHAT)).status_code == 200
        assert (await client.post(gateway.url + "/chat/completions", json={**CHAT, "model": "x"})).status_code == 404
        assert (await client.get(root + "/health")).status_code == 200
        assert (await client.get(root + "/nowhere")).status_code == 404
    assert gateway.stop() == 0
    lines = [line for line in gateway.output if " access " in line]
    assert len(lines) == 4, gateway.output
    chat, refused, health, nowhere = lines
    assert '"POST /v1/chat/completions" 200 ' in chat
    assert f"key=anonymous model={FAKE_MODEL} upstream={fake.url} " in chat and "tokens=" in chat
    assert '"POST /v1/chat/completions" 404 ' in refused and "model=- upstream=-" in refused
    assert '"GET /health" 200 ' in health and '"GET /nowhere" 404 ' in nowhere


async def test_without_access_log_nothing_is_printed_per_request(children: list[Child]) -> None:
    fake = start_upstream()
    children.append(fake)
    gateway = start_gateway(gateway_config(fake.url, port=0))
    children.append(gateway)
    async with httpx.AsyncClient(timeout=30) as client:
        assert (await client.post(gateway.url + "/chat/completions", json=CHAT)).status_code == 200
    assert gateway.stop() == 0
    assert not [line for line in gateway.output if "chat/completions" in line]


async def test_the_gateway_exits_non_zero_when_usage_rows_could_not_be_written(children: list[Child]) -> None:
    fake = start_upstream()
    children.append(fake)
    gateway = start_gateway(gateway_config(fake.url, port=0))
    children.append(gateway)
    locker = sqlite3.connect(default_ledger_path(), isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")  # someone holds the ledger's write lock until the gateway has stopped
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            assert (await client.post(gateway.url + "/chat/completions", json=CHAT)).status_code == 200
        assert gateway.stop() == EXIT_LEDGER_ROWS_LOST
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    assert any("1 usage rows could not be written" in line for line in gateway.output), gateway.output[-10:]
