"""A lean Redis connection for the shared limits' hot path: commands written in RESP, pipelined on one socket,
answered in order.

Every admitted request costs two script calls (shared_limits.py), on the path of every request. redis-py's asyncio
client spends most of a call's time in its own Python (connection pool, command packing, response callbacks): on a
2-core machine that was about two thirds of what Redis added per request (docs/PERFORMANCE.md). This connection does
only what the scripts need: write commands, read replies (RESP2: simple strings, errors, integers, bulk strings,
arrays) and hand each to the caller waiting for it. redis-py still does everything else (subscriptions, the
revocation hash), off the hot path.

URLs: `redis://[[user]:password@]host[:port][/db]`, `rediss://` (TLS) and `unix://[[user]:password@]/path[?db=N]`,
as redis-py reads them. A call not answered within `timeout_s` fails with TimeoutError and closes the connection
(every call still waiting on it fails with it, as redis-py's would); the next call connects again.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import parse_qs, unquote, urlsplit

DEFAULT_PORT = 6379
Reply = Any  # str | int | None | list[Reply] | ReplyError


class ReplyError(Exception):
    """An error reply from Redis (a script's error, NOSCRIPT, WRONGPASS...): the command failed, the connection is
    fine."""

    @property
    def no_script(self) -> bool:
        return str(self).startswith("NOSCRIPT")


class ProtocolError(ConnectionError):
    """Bytes that are not RESP: the connection cannot be trusted any more."""


@dataclass(frozen=True)
class RedisAddress:
    host: str | None
    port: int
    path: str | None  # a unix socket
    tls: bool
    username: str | None
    password: str | None
    db: int

    @classmethod
    def from_url(cls, url: str) -> RedisAddress:
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(
                f"a Redis URL starts with redis://, rediss:// or unix:// (not {parts.scheme or 'nothing'}), e.g. "
                "redis://127.0.0.1:6379/0"
            )
        unix = parts.scheme == "unix"
        db_text = parse_qs(parts.query).get("db", [""])[0] or ("" if unix else parts.path.strip("/"))
        try:
            db = int(db_text or 0)
        except ValueError:
            raise ValueError(f"the Redis URL's database must be a number, not {db_text!r}") from None
        return cls(
            host=None if unix else parts.hostname or "localhost",
            port=parts.port or DEFAULT_PORT,
            path=parts.path if unix else None,
            tls=parts.scheme == "rediss",
            username=unquote(parts.username) if parts.username else None,
            password=unquote(parts.password) if parts.password else None,
            db=db,
        )


def encode_command(args: tuple[Any, ...] | list[Any]) -> bytes:
    """One command as a RESP array of bulk strings."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


class _Incomplete(Exception):
    pass


def parse_reply(buffer: bytes | bytearray, start: int = 0) -> tuple[Reply, int]:
    """The reply at START of BUFFER and where the next one begins; _Incomplete when it has not all arrived."""
    end = buffer.find(b"\r\n", start)
    if end < 0:
        raise _Incomplete
    kind, line = buffer[start : start + 1], bytes(buffer[start + 1 : end])
    after = end + 2
    if kind == b"+":
        return line.decode(), after
    if kind == b"-":
        return ReplyError(line.decode(errors="replace")), after
    if kind == b":":
        return int(line), after
    if kind == b"$":
        length = int(line)
        if length < 0:
            return None, after
        if len(buffer) < after + length + 2:
            raise _Incomplete
        return bytes(buffer[after : after + length]).decode(errors="replace"), after + length + 2
    if kind == b"*":
        count = int(line)
        if count < 0:
            return None, after
        items = []
        for _ in range(count):
            item, after = parse_reply(buffer, after)
            items.append(item)
        return items, after
    raise ProtocolError(f"Redis sent {bytes(buffer[start:end][:40])!r}, which is not RESP")


class _RespProtocol(asyncio.Protocol):
    """Replies are matched to the calls waiting for them in the order the calls were written."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.waiting: collections.deque[asyncio.Future[Reply]] = collections.deque()
        self.buffer = bytearray()
        self.lost: BaseException | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        start = 0
        try:
            while start < len(self.buffer) and self.waiting:
                reply, start = parse_reply(self.buffer, start)
                future = self.waiting.popleft()
                if not future.done():  # its caller may have gone away
                    future.set_result(reply)
        except _Incomplete:
            pass
        except (ProtocolError, ValueError) as exc:
            self.fail(ProtocolError(str(exc)))
            return
        del self.buffer[:start]

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(exc or ConnectionError("Redis closed the connection"))

    def fail(self, exc: BaseException) -> None:
        self.lost = self.lost or exc
        while self.waiting:
            future = self.waiting.popleft()
            if not future.done():
                future.set_exception(exc)
        if self.transport is not None:
            self.transport.close()


class RespConnection:
    """One connection to Redis, opened on the first call and again after a failure."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self.address = RedisAddress.from_url(url)
        self.timeout_s = timeout_s
        self._protocol: _RespProtocol | None = None
        self._connecting: asyncio.Task[_RespProtocol] | None = None

    async def call(self, *args: Any) -> Reply:
        """One command's reply (a ReplyError is raised)."""
        (reply,) = await self.pipeline([args])
        if isinstance(reply, ReplyError):
            raise reply
        return reply

    async def pipeline(self, commands: list[tuple[Any, ...]] | list[list[Any]]) -> list[Reply]:
        """The replies to COMMANDS, written together; error replies are returned in their place, not raised."""
        if not commands:
            return []
        protocol = await self._connected()
        futures = self._write(protocol, b"".join(encode_command(c) for c in commands), len(commands))
        return await self._answers(protocol, futures)

    def send(self, commands: list[tuple[Any, ...]] | list[list[Any]]) -> list[asyncio.Future[Reply]] | None:
        """Write COMMANDS at once, without waiting for anything: a future per reply (an error reply is its result,
        a failure of the connection its exception), or None when no connection is open (`pipeline` opens one).
        Any number of these may be in flight; Redis answers them in the order they were written."""
        protocol = self._protocol
        if protocol is None or protocol.lost is not None or not commands:
            return None
        futures = self._write(protocol, b"".join(encode_command(c) for c in commands), len(commands))
        last = futures[-1]
        timer = asyncio.get_running_loop().call_later(self.timeout_s, self._expire, protocol, last)
        last.add_done_callback(lambda _: timer.cancel())
        return futures

    async def close(self) -> None:
        if self._connecting is not None and not self._connecting.done():
            self._connecting.cancel()
        if self._protocol is not None:
            self._protocol.fail(ConnectionError("the connection to Redis was closed"))
            self._protocol = None

    # ---- internals ----------------------------------------------------------------------------------------------

    def _write(self, protocol: _RespProtocol, data: bytes, replies: int) -> list[asyncio.Future[Reply]]:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in range(replies)]
        protocol.waiting.extend(futures)
        assert protocol.transport is not None
        protocol.transport.write(data)
        return futures

    async def _answers(self, protocol: _RespProtocol, futures: list[asyncio.Future[Reply]]) -> list[Reply]:
        last = futures[-1]
        timer = asyncio.get_running_loop().call_later(self.timeout_s, self._expire, protocol, last)
        try:
            await asyncio.wait((last,))  # replies come in order: the last one answered means all were
        finally:
            timer.cancel()
        return [future.result() for future in futures]

    def _expire(self, protocol: _RespProtocol, future: asyncio.Future[Reply]) -> None:
        if not future.done():
            protocol.fail(TimeoutError(f"Redis did not answer within {self.timeout_s:g} s"))

    async def _connected(self) -> _RespProtocol:
        protocol = self._protocol
        if protocol is not None and protocol.lost is None:
            return protocol
        connecting = self._connecting
        if connecting is None or connecting.done():  # the first caller connects; the others wait for it
            connecting = self._connecting = asyncio.ensure_future(self._connect())
        protocol = await asyncio.shield(connecting)
        self._protocol = protocol
        return protocol

    async def _connect(self) -> _RespProtocol:
        loop = asyncio.get_running_loop()
        a = self.address
        opening = (
            loop.create_unix_connection(_RespProtocol, a.path)
            if a.path is not None
            else loop.create_connection(
                _RespProtocol, a.host or "localhost", a.port, ssl=ssl.create_default_context() if a.tls else None
            )
        )
        try:
            _, protocol = await asyncio.wait_for(opening, self.timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no connection to Redis within {self.timeout_s:g} s") from None
        setup = self._setup_commands()
        if setup:
            replies = await self._answers(
                protocol, self._write(protocol, b"".join(map(encode_command, setup)), len(setup))
            )
            for reply in replies:
                if isinstance(reply, ReplyError):
                    protocol.fail(ConnectionError(f"Redis refused the connection's set-up: {reply}"))
                    raise ConnectionError(f"Redis refused the connection's set-up: {reply}")
        return protocol

    def _setup_commands(self) -> list[tuple[Any, ...]]:
        a = self.address
        commands: list[tuple[Any, ...]] = []
        if a.password is not None:
            commands.append(("AUTH", a.username, a.password) if a.username else ("AUTH", a.password))
        if a.db:
            commands.append(("SELECT", a.db))
        return commands
