"""The simulator's HTTP/1.1 connections: a raw asyncio protocol with httptools' parser (llhttp, in C), because one
benchmark client drives hundreds of streams and the engine writes each token straight to its connection from the
step callback, without a task per stream. Requests are answered one at a time, in order; what a request means is
its handler's business (app.py), how a generation is written its reply's (reply.py)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol, cast

import httptools

MAX_BODY_BYTES = 64 * 1024 * 1024
JSON_CONTENT = b"content-type: application/json\r\n"
_REASONS = {
    200: b"OK", 400: b"Bad Request", 401: b"Unauthorized", 404: b"Not Found", 405: b"Method Not Allowed",
    413: b"Payload Too Large", 429: b"Too Many Requests", 500: b"Internal Server Error", 502: b"Bad Gateway",
    503: b"Service Unavailable", 504: b"Gateway Timeout",
}  # fmt: skip


@dataclass
class HttpRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    keep_alive: bool
    read_s: float  # perf_counter time of the read that completed it (the kernel's receive time with log_sends)


class RequestHandler(Protocol):
    """What answers a connection's requests (the simulator's app): each exactly once, through CONN."""

    def handle(self, conn: Connection, request: HttpRequest) -> None: ...


class ActiveReply(Protocol):
    """A reply still being written on a connection: told when the client reads slower than it writes, and when the
    client goes away before the end."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def client_gone(self) -> None: ...


class Connection(asyncio.Protocol):
    """One client connection: parses requests (httptools), has HANDLER answer them one at a time, in order; it is in
    OPEN_CONNECTIONS while it is open."""

    def __init__(self, handler: RequestHandler, open_connections: set[Connection]) -> None:
        self.handler = handler
        self._open_connections = open_connections
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.reply: ActiveReply | None = None  # a generation still being written
        self.read_s = 0.0  # when the last read arrived
        self.read_s_hint: float | None = None  # its kernel receive time, set by KernelStampedTransport
        self._queue: deque[HttpRequest] = deque()
        self._current: HttpRequest | None = None
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._dispatching = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses
        self._open_connections.add(self)

    def data_received(self, data: bytes) -> None:
        hint, self.read_s_hint = self.read_s_hint, None
        self.read_s = time.perf_counter() if hint is None else hint
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.send(400, JSON_CONTENT, b'{"detail":"Invalid HTTP request"}')
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._open_connections.discard(self)
        reply, self.reply = self.reply, None
        if reply is not None:
            reply.client_gone()

    def pause_writing(self) -> None:
        if self.reply is not None:
            self.reply.pause()

    def resume_writing(self) -> None:
        if self.reply is not None:
            self.reply.resume()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._url, self._headers, self._body, self._body_bytes = b"", {}, [], 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes <= MAX_BODY_BYTES:
            self._body.append(body)

    def on_message_complete(self) -> None:
        path = self._url.split(b"?", 1)[0].decode("latin-1")
        method = self.parser.get_method().decode()
        keep_alive = self.parser.should_keep_alive()
        request = HttpRequest(method, path, self._headers, b"".join(self._body), keep_alive, self.read_s)
        if self._body_bytes > MAX_BODY_BYTES:
            request.path = "/<too large>"
        self._queue.append(request)
        if self._current is None:
            self._next()

    # answering
    def _next(self) -> None:
        if self._dispatching:  # a handler answered at once: the loop below picks up the next request
            return
        self._dispatching = True
        try:
            while self._current is None and self._queue and self.transport is not None:
                self._current = request = self._queue.popleft()
                if request.path == "/<too large>":
                    self.send(413, JSON_CONTENT, b'{"detail":"request body too large"}')
                    continue
                self.handler.handle(self, request)
        finally:
            self._dispatching = False

    def close_header(self) -> bytes:
        current = self._current
        return b"" if current is None or current.keep_alive else b"connection: close\r\n"

    def response(self, status: int, headers: bytes, body: bytes) -> bytes:
        reason = _REASONS.get(status, b"Error")
        head = b"HTTP/1.1 %d %s\r\n%scontent-length: %d\r\n%s\r\n" % (
            status, reason, headers, len(body), self.close_header(),
        )  # fmt: skip
        return head + body

    def send(self, status: int, headers: bytes, body: bytes) -> None:
        """Answer the current request in full."""
        self.write(self.response(status, headers, body))
        self.request_done()

    def send_later(self, delay_s: float, status: int, headers: bytes, body: bytes) -> None:
        if delay_s <= 0:
            self.send(status, headers, body)
            return
        asyncio.get_running_loop().call_later(delay_s, self.send, status, headers, body)

    def write(self, data: bytes) -> None:
        if data and self.transport is not None:
            self.transport.write(data)

    def request_done(self) -> None:
        current, self._current = self._current, None
        if current is not None and not current.keep_alive:
            if self.transport is not None:
                self.transport.close()
            return
        self._next()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()
