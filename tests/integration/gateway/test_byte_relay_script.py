"""benchmarks/byte_relay.py, the floor the gateway's hop is measured against: it must relay both ways, keep what a
client sends before its upstream connection is up, and close one side when the other goes."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from types import ModuleType

import pytest

from deepserve.net import free_port
from tests.helpers import load_benchmark_script, until


@pytest.fixture
def relay_script(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_benchmark_script("byte_relay", monkeypatch)


async def _answer_each_line(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """An upstream that answers every line with the line reversed, in two writes, and closes on 'bye'."""
    while line := await reader.readline():
        if line.strip() == b"bye":
            break
        writer.write(line.strip()[::-1])
        await writer.drain()
        writer.write(b"\n")
    writer.close()


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


@contextlib.asynccontextmanager
async def _relay_to(relay_script: ModuleType, upstream_port: int) -> AsyncIterator[int]:
    """The relay in this event loop, listening, in front of UPSTREAM_PORT: its port."""
    port = free_port()
    serving = asyncio.create_task(relay_script.serve(port, ("127.0.0.1", upstream_port)))
    try:
        await until(lambda: _accepts(port))
        yield port
    finally:
        serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving


async def test_the_relay_carries_both_ways_including_what_came_before_the_upstream_connected(
    relay_script: ModuleType,
) -> None:
    upstream = await asyncio.start_server(_answer_each_line, "127.0.0.1", 0)
    try:
        async with _relay_to(relay_script, upstream.sockets[0].getsockname()[1]) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"hello\nworld\n")  # at once: the relay's upstream connection is not up yet
            assert await asyncio.wait_for(reader.readline(), 5) == b"olleh\n"
            assert await asyncio.wait_for(reader.readline(), 5) == b"dlrow\n"
            writer.write(b"bye\n")
            assert await asyncio.wait_for(reader.read(), 5) == b""  # the upstream closed: so does the client side
            writer.close()
    finally:
        upstream.close()


async def test_a_relay_without_its_upstream_closes_the_client(relay_script: ModuleType) -> None:
    async with _relay_to(relay_script, free_port()) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
