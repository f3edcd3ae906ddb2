"""The shared limits' lean Redis connection against a real redis-server: replies of every kind, pipelines answered in
order, password and database from the URL, a unix socket, and what happens when Redis is silent, drops the
connection or sends something that is not RESP."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis

from deepserve.gateway.resp import ProtocolError, ReplyError, RespConnection

from .conftest import RedisServer, start_redis_server, stop_redis_server


@contextlib.asynccontextmanager
async def connection(url: str, timeout_s: float = 5.0) -> AsyncIterator[RespConnection]:
    conn = RespConnection(url, timeout_s)
    try:
        yield conn
    finally:
        await conn.close()


async def test_replies_of_every_kind(redis_server: RedisServer) -> None:
    async with connection(redis_server.url) as conn:
        assert await conn.call("PING") == "PONG"
        assert await conn.call("SET", "k", "välue") == "OK"
        assert await conn.call("GET", "k") == "välue"
        assert await conn.call("GET", "missing") is None
        assert await conn.call("INCRBY", "n", 5) == 5
        script = "return {1, 'two', {3}, false}"
        assert await conn.call("EVAL", script, 0) == [1, "two", [3], None]
        with pytest.raises(ReplyError, match="ERR"):
            await conn.call("EVAL", "return redis.error_reply('ERR refused')", 0)
        assert await conn.call("PING") == "PONG"  # an error reply leaves the connection usable


async def test_a_long_pipeline_is_answered_in_order(redis_server: RedisServer) -> None:
    payload = "x" * 50_000  # the replies cross many reads of the socket
    async with connection(redis_server.url) as conn:
        replies = await conn.pipeline([("ECHO", f"{i}:{payload}") for i in range(200)] + [("NOSUCHCOMMAND",)])
    assert [r.split(":")[0] for r in replies[:-1]] == [str(i) for i in range(200)]
    assert isinstance(replies[-1], ReplyError)


async def test_calls_from_many_tasks_share_the_connection(redis_server: RedisServer) -> None:
    async with connection(redis_server.url) as conn:
        first = await conn.call("CLIENT", "ID")
        replies = await asyncio.gather(*(conn.call("INCR", "counter") for _ in range(500)))
        assert sorted(replies) == list(range(1, 501))
        assert await conn.call("CLIENT", "ID") == first  # one connection throughout


async def test_password_and_database_come_from_the_url() -> None:
    server = start_redis_server(password="s3cret")
    try:
        async with connection(f"redis://:s3cret@127.0.0.1:{server.port}/3") as conn:
            assert await conn.call("SET", "where", "db3") == "OK"
        direct = redis.Redis(port=server.port, password="s3cret", db=3, decode_responses=True)
        assert direct.get("where") == "db3"
        direct.close()
        async with connection(f"redis://:wrong@127.0.0.1:{server.port}/0") as conn:
            with pytest.raises(ConnectionError, match="refused the connection's set-up"):
                await conn.call("PING")
    finally:
        stop_redis_server(server)


async def test_a_unix_socket(tmp_path: Path) -> None:
    socket_path = tmp_path / "redis.sock"
    server = start_redis_server(args=("--unixsocket", str(socket_path), "--unixsocketperm", "700"))
    try:
        async with connection(f"unix://{socket_path}?db=2") as conn:
            assert await conn.call("SET", "k", "v") == "OK"
            assert " db=2 " in await conn.call("CLIENT", "INFO")
    finally:
        stop_redis_server(server)


# A script that keeps Redis busy for about 2 s (Redis 7 lets a script read TIME and carry on): far beyond the tests'
# looks and timeouts (0.1-0.5 s), however late a loaded machine runs their loop
BUSY_SCRIPT = """
local t = redis.call('TIME')
local start = t[1] * 1000000 + t[2]
repeat t = redis.call('TIME') until t[1] * 1000000 + t[2] - start > 2000000
return 'done'
"""


async def test_send_writes_at_once_and_several_writes_are_answered_in_order(redis_server: RedisServer) -> None:
    async with connection(redis_server.url) as conn:
        assert conn.send([("PING",)]) is None  # no connection yet: `pipeline` opens one
        assert await conn.call("PING") == "PONG"
        slow = conn.send([("EVAL", BUSY_SCRIPT, 0)])  # still running after the 0.1 s below, even if late
        assert slow is not None
        quick = conn.send([("INCR", "n"), ("NOSUCHCOMMAND",)])  # written while the slow one runs
        assert quick is not None
        done, _ = await asyncio.wait(quick, timeout=0.1)
        assert not done and not slow[0].done()  # Redis answers in order: after the slow script
        assert await slow[0] == "done"
        assert await quick[0] == 1 and isinstance(await quick[1], ReplyError)


async def test_a_write_not_answered_in_time_fails_and_the_next_call_connects_again(redis_server: RedisServer) -> None:
    async with connection(redis_server.url, timeout_s=0.5) as conn:
        first = await conn.call("CLIENT", "ID")
        late = conn.send([("EVAL", BUSY_SCRIPT, 0)])
        assert late is not None
        with pytest.raises(TimeoutError, match="within 0.5 s"):
            await late[0]
        deadline = time.monotonic() + 30
        while True:  # Redis answers no one until the script ends: calls until then time out, each on a new connection
            try:
                again = await conn.call("CLIENT", "ID")
                break
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise
        assert isinstance(again, int) and again > first  # a new connection's id, not the late script's reply


async def test_a_silent_server_times_out_and_the_next_call_connects_again() -> None:
    accepted: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)
        await reader.read()  # reads every command, answers none

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with connection(f"redis://127.0.0.1:{port}/0", timeout_s=0.2) as conn:
            calls = [asyncio.ensure_future(conn.call("PING")) for _ in range(3)]
            results = await asyncio.gather(*calls, return_exceptions=True)
            assert all(isinstance(r, TimeoutError) for r in results), results
            with pytest.raises(TimeoutError, match="within 0.2 s"):
                await conn.call("PING")
        assert len(accepted) == 2  # the timed-out connection was closed; the next call opened another
    finally:
        server.close()
        await server.wait_closed()


async def test_a_dropped_connection_fails_its_calls_then_reconnects(redis_server: RedisServer) -> None:
    async with connection(redis_server.url) as conn:
        assert await conn.call("CLIENT", "SETNAME", "lean") == "OK"
        admin = redis.Redis(port=redis_server.port)
        assert admin.client_kill_filter(_type="normal", skipme=True) >= 1
        admin.close()
        with pytest.raises(ConnectionError):
            for _ in range(50):  # the close may arrive a call later
                await conn.call("PING")
                await asyncio.sleep(0.01)
        assert await conn.call("PING") == "PONG"


async def test_bytes_that_are_not_resp_close_the_connection() -> None:
    async def http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()
        writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        await writer.drain()
        await reader.read()

    server = await asyncio.start_server(http, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with connection(f"redis://127.0.0.1:{port}/0", timeout_s=5.0) as conn:
            with pytest.raises(ProtocolError, match="not RESP"):
                await conn.call("PING")
    finally:
        server.close()
        await server.wait_closed()


async def test_nothing_listening_is_a_connection_error() -> None:
    from deepserve.net import free_port

    async with connection(f"redis://127.0.0.1:{free_port()}/0") as conn:
        with pytest.raises(OSError):
            await conn.call("PING")


def test_under_uvloop_as_the_gateway_runs_it(redis_server: RedisServer) -> None:
    uvloop = pytest.importorskip("uvloop")

    async def calls() -> list[object]:
        async with connection(redis_server.url) as conn:
            return await conn.pipeline([("SET", "k", "v"), ("GET", "k"), ("NOSUCHCOMMAND",)])

    ok, value, error = uvloop.run(calls())
    assert (ok, value, isinstance(error, ReplyError)) == ("OK", "v", True)
