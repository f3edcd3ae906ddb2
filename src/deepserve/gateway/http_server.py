"""The gateway's HTTP/1.1 server: an asyncio Protocol per client connection with httptools' request parser (llhttp,
in C), serving an ASGI application (GatewayApp), with the connection guard's deadlines and limits built in
(connections.py).

Why its own server rather than uvicorn's: uvicorn's protocol has no read deadlines, no header size limit and no
connection limit, and adding them meant subclassing its private `httptools_impl.HttpToolsProtocol` and reaching into
its state (issue 23). Owning the protocol also keeps the request path short (about what the gateway's upstream client
costs per request, docs/PERFORMANCE.md): no task wrapper coroutine, the response head written together with the first
body chunk (one `write` per non-streamed answer), and the deadlines swept with the guard instead of a keep-alive timer
per response.

What it implements of HTTP/1.1 and ASGI (3.0, `http` scopes only; no lifespan, no WebSocket):
* keep-alive, pipelining (answered in order; reading pauses while a request waits behind another), HTTP/1.0 clients
  (close-delimited answers without chunked encoding), `Expect: 100-continue`, HEAD (no body written), chunked
  response framing when the app gives no content-length;
* flow control both ways: reading pauses while more than BODY_HIGH_WATER_BYTES of a request body wait for the app,
  and `send` waits while the transport's write buffer is above its high-water mark;
* a malformed request gets 400 in OpenAI's error shape and the connection is closed; an app that fails before its
  answer gives 500 in the same shape (after an answer started, the connection is closed);
* `scope["deepserve.on_disconnect"](callback)`: CALLBACK runs once if the client goes away before the response is
  complete, so the app cancels its work at once without a watcher task per request (`receive()` also returns
  `http.disconnect` then, as ASGI says);
* a graceful shutdown: listeners closed, idle connections closed, requests in flight given a grace period, then a
  `cut` callback (the app ends what is left with an error in OpenAI's shape), then a short margin, then cancelled."""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import socket
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, cast
from urllib.parse import unquote

import httptools

from deepserve.gateway.asgi import App, Message, Scope
from deepserve.gateway.connections import (
    BODY_TIMEOUT_SCOPE_KEY,
    LINGER_MAX_BYTES,
    LINGER_S,
    ConnectionGuard,
    error_response,
)

log = logging.getLogger(__name__)


# scope[DISCONNECT_SCOPE_KEY](callback): call CALLBACK (no arguments) if the client goes away mid-request.
DISCONNECT_SCOPE_KEY = "deepserve.on_disconnect"
# scope[SEND_NOW_SCOPE_KEY](message) -> bool: send MESSAGE without waiting; False (nothing sent) when it must wait.
SEND_NOW_SCOPE_KEY = "deepserve.send_now"
# Pause reading a connection while more of a request body than this waits for the app to receive it.
BODY_HIGH_WATER_BYTES = 1 << 16
_ASGI = {"version": "3.0", "spec_version": "2.3"}
_STATUS_LINES = {
    status.value: b"HTTP/1.1 %d %s\r\n" % (status.value, status.phrase.encode()) for status in http.HTTPStatus
}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_CHUNKED_END = b"0\r\n\r\n"


def _status_line(status: int) -> bytes:
    return _STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status


class _Cycle:
    """One request and its response: the ASGI `receive` and `send` of the app's call."""

    __slots__ = (
        "body",
        "body_bytes",
        "chunked",
        "connection",
        "disconnected",
        "expect_continue",
        "head",
        "head_written",
        "is_head",
        "keep_alive",
        "more_body",
        "on_disconnect",
        "request_delivered",
        "response_complete",
        "response_started",
        "scope",
        "waiter",
    )

    def __init__(self, connection: _Connection, scope: Scope, keep_alive: bool, expect_continue: bool) -> None:
        self.connection = connection
        self.scope = scope
        self.keep_alive = keep_alive
        self.expect_continue = expect_continue
        self.is_head = scope["method"] == "HEAD"
        self.body: list[bytes] = []
        self.body_bytes = 0  # received and not yet handed to the app
        self.more_body = True  # the request body has not ended yet
        self.request_delivered = False  # receive() returned the last part of the body
        self.disconnected = False  # the client went away (or its body timed out): sends go nowhere
        self.response_started = False
        self.head: bytes | None = None  # the response head, written with the first body chunk
        self.head_written = False
        self.chunked = False
        self.response_complete = False
        self.on_disconnect: Callable[[], None] | None = None
        self.waiter: asyncio.Future[None] | None = None

    # ---- what the connection tells the request ---------------------------------------------------------------------

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def lost(self) -> None:
        """The connection closed before the response was complete."""
        self.disconnected = True
        self.wake()
        callback, self.on_disconnect = self.on_disconnect, None
        if callback is not None:
            callback()

    def set_on_disconnect(self, callback: Callable[[], None]) -> None:
        self.on_disconnect = callback

    # ---- ASGI ----------------------------------------------------------------------------------------------------

    async def receive(self) -> Message:
        if self.expect_continue:
            self.expect_continue = False
            self.connection.write(_CONTINUE)
        while not (self.disconnected or self.response_complete):
            if not self.request_delivered and (self.body or not self.more_body):
                parts = self.body
                body = parts[0] if len(parts) == 1 else b"".join(parts)
                self.body = []
                self.body_bytes = 0
                self.request_delivered = not self.more_body
                self.connection.resume_reading()
                return {"type": "http.request", "body": body, "more_body": self.more_body}
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if self.connection.write_paused and not self.disconnected:
            await self.connection.drain()
        self._take(message)

    def send_now(self, message: Message) -> bool:
        """`send` without waiting, for a caller outside the request's task (the stream relay, from the upstream's
        read callback): False, and nothing done, when MESSAGE would write to a client's connection that pushes back
        and the caller must `await send(message)` instead (a response's start writes nothing: it is always taken)."""
        if self.connection.write_paused and not self.disconnected and message["type"] != "http.response.start":
            return False
        self._take(message)
        return True

    def _take(self, message: Message) -> None:
        if self.disconnected:
            return
        kind = message["type"]
        if kind == "http.response.body" and self.head is not None and not self.response_complete:
            self._write_body(message.get("body", b""), message.get("more_body", False))
        elif kind == "http.response.start" and not self.response_started:
            self.response_started = True
            self.head = self._head(message["status"], message.get("headers", ()))
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r} (response started: {self.response_started})")

    def _head(self, status: int, headers: Iterable[tuple[bytes, bytes]]) -> bytes:
        parts = [_status_line(status)]
        framed = False
        for name, value in headers:
            lowered = name.lower()
            if lowered == b"content-length" or lowered == b"transfer-encoding":
                framed = True
            elif lowered == b"connection" and b"close" in value.lower():
                self.keep_alive = False
            parts += (name, b": ", value, b"\r\n")
        if not framed and not self.is_head and status not in (204, 304):
            if self.scope["http_version"] == "1.1":
                self.chunked = True
                parts.append(b"transfer-encoding: chunked\r\n")
            else:
                self.keep_alive = False  # HTTP/1.0 knows no chunks: the close ends the body
        if self.more_body:
            self.keep_alive = False  # answered before its body ended: the rest of it would be read as a request
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)

    def _write_body(self, body: bytes, more_body: bool) -> None:
        if self.is_head:
            body = b""
        elif self.chunked:
            framed = b"%x\r\n%s\r\n" % (len(body), body) if body else b""
            body = framed if more_body else framed + _CHUNKED_END
        if not self.head_written:
            assert self.head is not None
            body = self.head + body
            self.head_written = True
        connection = self.connection
        connection.write(body)
        if not more_body:
            self.response_complete = True
            self.wake()
            connection.response_done(self)

    def task_done(self, task: asyncio.Task[None]) -> None:
        """The app's call ended: whatever it left unanswered is answered or closed here."""
        self.connection.server.tasks.discard(task)
        error = None if task.cancelled() else task.exception()
        if error is not None:
            log.error("the gateway app failed", exc_info=error)
        if self.response_complete or self.disconnected:
            return
        connection = self.connection
        if not self.head_written and not task.cancelled():
            self.keep_alive = False
            self.response_complete = True
            connection.write(error_response(500, "internal gateway error: the request was not answered"))
        connection.close()


class _Connection(asyncio.Protocol):
    """One client connection: parses requests, runs the app for each in turn, applies the guard's limits."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.guard = server.guard
        self.clock = server.guard.clock
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.client: tuple[str, int] | None = None
        self.local: tuple[str, int] | None = None
        self.cycle: _Cycle | None = None  # the request being answered
        self.parsing: _Cycle | None = None  # the request whose body is arriving (the answered one, or a pipelined one)
        self.pipeline: deque[_Cycle] = deque()  # complete heads waiting for the answer before them
        self.write_paused = False
        self.reading_paused = False
        self.shutting_down = False
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._expect_continue = False
        # the guard's state
        self._in_head = True  # between requests or inside a request line and headers
        self._head_bytes = 0  # of the current request line and headers
        self._head_started_s: float | None = None  # first byte of the current head (None: none yet)
        self._body_started_s: float | None = None  # end of the current headers (None: no body being read)
        self._idle_since_s: float | None = None  # a keep-alive connection waiting for its next request
        self._linger_until_s: float | None = None  # refused: close at this time
        self._discarding = False  # what the client sends is read and dropped (refused, or an upgrade followed)
        self._discarded_bytes = 0

    # ---- asyncio.Protocol -------------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        self.client = _address(transport.get_extra_info("peername"))
        self.local = _address(transport.get_extra_info("sockname"))
        self.server.connections.add(self)
        guard = self.guard
        if len(guard.open) >= guard.max_connections:
            guard.refused["connection_limit"] += 1
            self._refuse(503, f"the gateway has its limit of {guard.max_connections} connections open; retry later")
            return
        guard.open.add(self)
        self._head_started_s = self.clock()
        if self.server.shutting_down:
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.guard.open.discard(self)
        self.guard.lingering.discard(self)
        self.transport = None
        for cycle in (self.cycle, *self.pipeline):
            if cycle is not None and not cycle.response_complete:
                cycle.lost()
        self.pipeline.clear()
        self._wake_drainers()

    def data_received(self, data: bytes) -> None:
        if self._discarding:
            self._discard(data)
            return
        if self._in_head:
            # Within a head (or before one): count it. The fast path is a head that fits in what is left.
            if self._head_started_s is None:
                self._idle_since_s = None
                self._head_started_s = self.clock()
            if len(data) > self.guard.max_header_bytes - self._head_bytes:
                self._receive_oversized(data)
                return
            self._head_bytes += len(data)
        self._feed(data)

    def eof_received(self) -> bool | None:
        return None  # the transport closes; a request in flight sees the disconnect

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_drainers()

    # ---- httptools callbacks ----------------------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._expect_continue = False

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self._expect_continue = True
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        self._head_started_s = None
        parser = self.parser
        raw_path, _, query = self._url.partition(b"?")
        path = raw_path.decode("latin-1")
        scope: Scope = {
            "type": "http",
            "asgi": _ASGI,
            "http_version": parser.get_http_version(),
            "method": parser.get_method().decode("latin-1"),
            "scheme": "http",
            "path": unquote(path) if "%" in path else path,
            "raw_path": raw_path,
            "query_string": query,
            "root_path": "",
            "headers": self._headers,
            "client": self.client,
            "server": self.local,
        }
        keep_alive = parser.should_keep_alive() and not self.shutting_down
        cycle = _Cycle(self, scope, keep_alive, self._expect_continue)
        scope[DISCONNECT_SCOPE_KEY] = cycle.set_on_disconnect
        scope[SEND_NOW_SCOPE_KEY] = cycle.send_now
        self.parsing = cycle
        if self.cycle is None:
            self._start(cycle)
        else:  # pipelined: answered after the one before it; read no further meanwhile
            self.pipeline.append(cycle)
            self.pause_reading()

    def on_body(self, body: bytes) -> None:
        cycle = self.parsing
        if cycle is None or cycle.response_complete or cycle.disconnected:
            return  # answered (or given up) before its body ended: the rest is read and dropped
        cycle.body.append(body)
        cycle.body_bytes += len(body)
        if cycle.body_bytes > BODY_HIGH_WATER_BYTES:
            self.pause_reading()
        cycle.wake()

    def on_message_complete(self) -> None:
        self._in_head = True
        self._body_started_s = None
        cycle = self.parsing
        if cycle is not None:
            cycle.more_body = False
            cycle.wake()

    # ---- answering --------------------------------------------------------------------------------------------------

    def _start(self, cycle: _Cycle) -> None:
        self.cycle = cycle
        if cycle.more_body:  # its body must arrive within the body timeout from now (a pipelined one: from its turn)
            self._body_started_s = self.clock()
        task = asyncio.get_running_loop().create_task(self.server.app(cycle.scope, cycle.receive, cycle.send))
        self.server.tasks.add(task)
        task.add_done_callback(cycle.task_done)

    def response_done(self, cycle: _Cycle) -> None:
        """CYCLE's answer is complete: close, or go on with the next request on this connection."""
        if not cycle.keep_alive:
            self.close()
            return
        self.cycle = None
        if self.pipeline:
            self._start(self.pipeline.popleft())
        elif self._in_head and self._head_started_s is None:
            self._idle_since_s = self.clock()
        self.resume_reading()

    def write(self, data: bytes) -> None:
        transport = self.transport
        if transport is not None and data:
            transport.write(data)

    async def drain(self) -> None:
        if self.transport is None:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._drain_waiters.append(waiter)
        await waiter

    def _wake_drainers(self) -> None:
        waiters, self._drain_waiters = self._drain_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def pause_reading(self) -> None:
        if not self.reading_paused and self.transport is not None:
            self.reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.reading_paused and self.transport is not None and not self.pipeline:
            self.reading_paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def shutdown(self) -> None:
        """The server stops: close now if idle, else after the answer in flight."""
        self.shutting_down = True
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            self.close()
            return
        cycle.keep_alive = False
        for waiting in self.pipeline:
            waiting.lost()
        self.pipeline.clear()

    def _feed(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # An upgrade (h2c, websocket) is not offered: the request was answered as plain HTTP/1.1; what follows
            # its head is the other protocol's, so the connection ends with that answer.
            if self.parsing is not None:
                self.parsing.keep_alive = False
            self._discarding = True
        except httptools.HttpParserError as exc:
            self._bad_request(f"the request is not valid HTTP/1.1 ({exc}); send a well-formed request")

    def _bad_request(self, message: str) -> None:
        cycle = self.cycle
        if cycle is not None and cycle.head_written and not cycle.response_complete:
            self.close()  # an answer is on the wire: nothing more can be said on this connection
            return
        if cycle is not None:
            cycle.lost()
        self.guard.open.discard(self)
        self.write(error_response(400, message))
        self.close()

    # ---- the guard's checks -----------------------------------------------------------------------------------------

    def _receive_oversized(self, data: bytes) -> None:
        """DATA runs past the header limit: parse up to the limit; if the head has not ended there, refuse it."""
        room = self.guard.max_header_bytes - self._head_bytes
        self._head_bytes += room
        self._feed(data[:room])
        if self.transport is None or self.transport.is_closing() or self._discarding:
            return
        if self._in_head and not self._discarding:
            self.guard.refused["header_too_large"] += 1
            limit = self.guard.max_header_bytes
            self._refuse(431, f"the request line and headers are over the gateway's limit of {limit} bytes")
            return
        self.data_received(data[room:])  # the head ended within the limit: the rest is its body (or more)

    def check_deadlines(self, now_s: float) -> None:
        guard = self.guard
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if self._linger_until_s is not None:
            if now_s >= self._linger_until_s:
                self.close()
        elif self._head_started_s is not None and now_s - self._head_started_s >= guard.header_timeout_s:
            guard.refused["header_timeout"] += 1
            self._refuse(408, f"the request headers did not arrive within {guard.header_timeout_s:g} s")
        elif self._body_started_s is not None and now_s - self._body_started_s >= guard.body_timeout_s:
            guard.refused["body_timeout"] += 1
            self._body_timed_out()
        elif self._idle_since_s is not None and now_s - self._idle_since_s >= guard.keep_alive_s:
            self.close()

    def _body_timed_out(self) -> None:
        """Tell the app (waiting in receive) that the body will not come, and answer 408 unless it answered."""
        cycle = self.parsing
        self._body_started_s = None
        if cycle is not None and not cycle.response_complete:
            cycle.scope[BODY_TIMEOUT_SCOPE_KEY] = self.guard.body_timeout_s
            cycle.disconnected = True  # the app's receive() returns http.disconnect; its sends go nowhere
            cycle.wake()
            if cycle.head_written:
                self.close()
                return
        self._refuse(408, f"the request body did not arrive within {self.guard.body_timeout_s:g} s")

    def _refuse(self, status: int, message: str) -> None:
        """Answer STATUS with MESSAGE (OpenAI's error shape), shut the write side, and drain the client for a
        while before closing, so that it reads the answer rather than a reset."""
        guard = self.guard
        guard.open.discard(self)
        self._head_started_s = self._body_started_s = self._idle_since_s = None
        self._in_head = True
        cycle = self.cycle
        if cycle is not None and cycle.head_written and not cycle.response_complete:
            self.close()  # a response is on the wire: nothing more can be said on this connection
            return
        transport = self.transport
        if transport is None:
            return
        transport.write(error_response(status, message))
        if len(guard.lingering) >= guard.max_connections or not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        guard.lingering.add(self)
        self._discarding = True
        self._linger_until_s = self.clock() + LINGER_S
        if self.reading_paused:  # read (and drop) what the client still sends
            self.reading_paused = False
            transport.resume_reading()

    def _discard(self, data: bytes) -> None:
        self._discarded_bytes += len(data)
        if self._discarded_bytes > LINGER_MAX_BYTES:
            self.close()


def _address(info: Any) -> tuple[str, int] | None:
    if isinstance(info, tuple) and len(info) >= 2:
        return str(info[0]), int(info[1])
    return None


class HttpServer:
    """APP served on one or more listening sockets in the running event loop, with GUARD's limits."""

    def __init__(self, app: App, guard: ConnectionGuard, *, backlog: int = 4096) -> None:
        self.app = app
        self.guard = guard
        self.backlog = backlog
        self.connections: set[_Connection] = set()
        self.tasks: set[asyncio.Task[None]] = set()  # the app's calls in flight
        self.shutting_down = False
        self._servers: list[asyncio.AbstractServer] = []

    async def listen(self, host: str, port: int, sockets: list[socket.socket] | None = None) -> int:
        """Start listening on HOST:PORT (0: any free port), or on SOCKETS (bound; e.g. SO_REUSEPORT ones of
        `--workers N`); return the port."""
        loop = asyncio.get_running_loop()
        if sockets:
            for sock in sockets:
                self._servers.append(await loop.create_server(self._protocol, sock=sock, backlog=self.backlog))
        else:
            bind = host.strip("[]")
            self._servers.append(
                await loop.create_server(self._protocol, bind, port, backlog=self.backlog, reuse_address=True)
            )
        listening = cast(asyncio.Server, self._servers[0])  # uvloop's servers do not subclass asyncio's
        return int(listening.sockets[0].getsockname()[1])

    def _protocol(self) -> _Connection:
        return _Connection(self)

    async def shutdown(self, grace_s: float, cut: Callable[[], object] | None = None, margin_s: float = 2.0) -> None:
        """Stop listening, close idle connections, give requests in flight GRACE_S to finish, then CUT (the app
        ends what is left), then MARGIN_S more for their last bytes; cancel whatever still runs and close."""
        self.shutting_down = True
        for server in self._servers:
            server.close()
        for connection in list(self.connections):
            connection.shutdown()
        if not await self._wait_for_tasks(grace_s) and cut is not None:
            cut()
            await self._wait_for_tasks(margin_s)
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        for connection in list(self.connections):
            connection.close()
        for server in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 1.0)
        self._servers.clear()

    async def _wait_for_tasks(self, timeout_s: float) -> bool:
        """Whether every request in flight ended within TIMEOUT_S."""
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=timeout_s)
        return not self.tasks
