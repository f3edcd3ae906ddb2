"""Client connection hygiene for the gateway's HTTP server: header and body read deadlines, a header size limit and
a connection limit, on top of uvicorn's httptools protocol (which has none of them).

* A connection must deliver its request line and headers within `header_timeout_s` of opening (or of the first
  byte of a later request on it), and its body within `body_timeout_s` of its headers; otherwise it gets 408 and is
  closed. A body that times out while the app waits for it also reaches the app, as a disconnect marked in the
  request's scope (`BODY_TIMEOUT_SCOPE_KEY`), so that the usage ledger records a 408.
* Request line and headers larger than `max_header_bytes` get 431 and the connection is closed after reading at most
  that much of them: a 64 MB header costs the process 64 KiB, not 64 MB.
* At most `max_connections` connections are open; one more gets 503 and is closed at once.

Refusals are answered the way nginx answers them: the response is written, the write side is shut, and what the
client still sends is read and thrown away for up to LINGER_S (at most LINGER_MAX_BYTES) before the close, so that
the client reads the status instead of a connection reset.

Deadlines are checked by one sweep over the open connections (`ConnectionGuard.sweep`) every SWEEP_INTERVAL_S,
from an injected clock: the request path pays one clock read per request and a flag test per read, and tests
move a fake clock and call `sweep` instead of waiting."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import time
from collections.abc import Callable
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

Clock = Callable[[], float]

# Set in a request's ASGI scope when its body did not arrive in time (the app answers that request 408).
BODY_TIMEOUT_SCOPE_KEY = "deepserve.body_timeout_s"
LINGER_S = 2.0
LINGER_MAX_BYTES = 1 << 20
SWEEP_INTERVAL_S = 0.5
REFUSAL_REASONS = ("header_timeout", "body_timeout", "header_too_large", "connection_limit")
_PROTOCOL = HttpToolsProtocol  # called directly rather than through super(): these run on every request


class ConnectionGuard:
    """The limits and the open connections of one server; `protocol_class` is what uvicorn builds per connection."""

    def __init__(
        self,
        *,
        header_timeout_s: float,
        body_timeout_s: float,
        max_header_bytes: int,
        max_connections: int,
        clock: Clock = time.monotonic,
    ) -> None:
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.max_header_bytes = max_header_bytes
        self.max_connections = max_connections
        self.clock = clock
        self.open: set[GuardedHttpProtocol] = set()
        self.lingering: set[GuardedHttpProtocol] = set()  # refused: answered, draining what the client still sends
        self.refused: collections.Counter[str] = collections.Counter()  # by reason (REFUSAL_REASONS)
        self._sweeper: asyncio.Task[None] | None = None

    def protocol_class(self) -> type[GuardedHttpProtocol]:
        """A protocol class bound to this guard (uvicorn instantiates the class it is given)."""
        return type("GuardedHttpProtocol", (GuardedHttpProtocol,), {"guard": self})

    def start(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep_forever(), name="connection-guard")

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        for protocol in list(self.lingering):
            protocol.transport.close()

    async def _sweep_forever(self) -> None:
        interval_s = min(SWEEP_INTERVAL_S, self.header_timeout_s / 4, self.body_timeout_s / 4)
        while True:
            await asyncio.sleep(interval_s)
            self.sweep()

    def sweep(self) -> None:
        """Refuse every connection past a deadline, and close refused ones whose lingering time is over."""
        now_s = self.clock()
        for protocol in [*self.open, *self.lingering]:
            protocol.check_deadlines(now_s)


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the guard's deadlines and limits (see the module docstring)."""

    guard: ClassVar[ConnectionGuard]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._clock = self.guard.clock
        self._in_head = True  # between requests or inside a request line and headers
        self._head_bytes = 0  # of the current request line and headers
        self._head_started_s: float | None = None  # first byte of the current head (None: idle between requests)
        self._body_started_s: float | None = None  # end of the current headers (None: no body being read)
        self._linger_until_s: float | None = None  # refused: close at this time
        self._discarded_bytes = 0

    # ---- asyncio.Protocol ---------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        guard = self.guard
        if len(guard.open) >= guard.max_connections:
            self.transport = transport
            guard.refused["connection_limit"] += 1
            self._refuse(503, f"the gateway has its limit of {guard.max_connections} connections open; retry later")
            return
        guard.open.add(self)
        _PROTOCOL.connection_made(self, transport)
        self._head_started_s = self._clock()

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.open.discard(self)
        self.guard.lingering.discard(self)
        if self.flow is None:  # refused before uvicorn knew of it
            return
        _PROTOCOL.connection_lost(self, exc)

    def data_received(self, data: bytes) -> None:
        if self._in_head and self._linger_until_s is None:
            # Within a head (or before one): count it. The fast path is a head that fits in what is left.
            if self._head_started_s is None:
                self._head_started_s = self._clock()
            if len(data) <= self.guard.max_header_bytes - self._head_bytes:
                self._head_bytes += len(data)
                _PROTOCOL.data_received(self, data)
            else:
                self._receive_oversized(data)
        elif self._linger_until_s is None:  # body bytes: nothing to count
            _PROTOCOL.data_received(self, data)
        else:
            self._discard(data)

    # ---- httptools callbacks ------------------------------------------------------------------------------------

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        self._head_started_s = None
        self._body_started_s = self._clock()
        _PROTOCOL.on_headers_complete(self)

    def on_message_complete(self) -> None:
        self._in_head = True
        self._body_started_s = None
        _PROTOCOL.on_message_complete(self)

    # ---- the guard's checks -------------------------------------------------------------------------------------

    def _receive_oversized(self, data: bytes) -> None:
        """DATA runs past the header limit: parse up to the limit; if the head has not ended there, refuse it."""
        room = self.guard.max_header_bytes - self._head_bytes
        self._head_bytes += room
        _PROTOCOL.data_received(self, data[:room])
        if self.transport.is_closing() or self._linger_until_s is not None:
            return
        if self._in_head:
            self.guard.refused["header_too_large"] += 1
            limit = self.guard.max_header_bytes
            self._refuse(431, f"the request line and headers are over the gateway's limit of {limit} bytes")
            return
        self.data_received(data[room:])  # the head ended within the limit: the rest is its body (or more)

    def check_deadlines(self, now_s: float) -> None:
        guard = self.guard
        if self.transport.is_closing():
            return
        if self._linger_until_s is not None:
            if now_s >= self._linger_until_s:
                self.transport.close()
        elif self._head_started_s is not None and now_s - self._head_started_s >= guard.header_timeout_s:
            guard.refused["header_timeout"] += 1
            self._refuse(408, f"the request headers did not arrive within {guard.header_timeout_s:g} s")
        elif self._body_started_s is not None and now_s - self._body_started_s >= guard.body_timeout_s:
            guard.refused["body_timeout"] += 1
            self._body_timed_out()

    def _body_timed_out(self) -> None:
        """Tell the app (waiting in receive) that the body will not come, and answer 408 unless it answered."""
        cycle = self.cycle
        self._body_started_s = None
        if cycle is not None and not cycle.response_complete:
            cycle.scope[BODY_TIMEOUT_SCOPE_KEY] = self.guard.body_timeout_s  # type: ignore[literal-required]
            started = cycle.response_started
            cycle.disconnected = True  # the app's receive() returns http.disconnect; its sends go nowhere
            cycle.message_event.set()
            if started:
                self.transport.close()
                return
        self._refuse(408, f"the request body did not arrive within {self.guard.body_timeout_s:g} s")

    def _refuse(self, status: int, message: str) -> None:
        """Answer STATUS with MESSAGE (OpenAI's error shape), shut the write side, and drain the client for a
        while before closing, so that it reads the answer rather than a reset."""
        guard = self.guard
        guard.open.discard(self)
        self._head_started_s = self._body_started_s = None
        self._in_head = True
        cycle = self.cycle
        if cycle is not None and cycle.response_started and not cycle.response_complete:
            self.transport.close()  # a response is on the wire: nothing more can be said on this connection
            return
        self.transport.write(_error_response(status, message))
        if len(guard.lingering) >= guard.max_connections or not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        guard.lingering.add(self)
        self._linger_until_s = self._clock() + LINGER_S

    def _discard(self, data: bytes) -> None:
        self._discarded_bytes += len(data)
        if self._discarded_bytes > LINGER_MAX_BYTES:
            self.transport.close()


_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}
_CODES = {408: "request_timeout", 431: "request_header_fields_too_large", 503: "too_many_connections"}


def _error_response(status: int, message: str) -> bytes:
    """A whole HTTP response with MESSAGE in OpenAI's error shape (written before the app saw any request)."""
    error_type = "invalid_request_error" if status < 500 else "server_error"
    error = {"message": message, "type": error_type, "param": None, "code": _CODES[status]}
    body = json.dumps({"error": error}).encode()
    head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n" % (
        status,
        _REASONS[status],
        len(body),
    )
    if status == 503:
        head += b"retry-after: 1\r\n"
    return head + b"\r\n" + body
