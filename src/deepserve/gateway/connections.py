"""Client connection hygiene for the gateway's HTTP server (http_server.py): header and body read deadlines, a header
size limit, a connection limit and the idle keep-alive limit, checked by one sweep.

* A connection must deliver its request line and headers within `header_timeout_s` of opening (or of the first
  byte of a later request on it), and its body within `body_timeout_s` of its headers; otherwise it gets 408 and is
  closed. A body that times out while the app waits for it also reaches the app, as a disconnect marked in the
  request's scope (`BODY_TIMEOUT_SCOPE_KEY`), so that the usage ledger records a 408.
* Request line and headers larger than `max_header_bytes` get 431 and the connection is closed after reading at most
  that much of them: a 64 MB header costs the process 64 KiB, not 64 MB.
* At most `max_connections` connections are open; one more gets 503 and is closed at once.
* A connection idle between requests for `keep_alive_s` is closed.

Refusals are answered the way nginx answers them: the response is written, the write side is shut, and what the
client still sends is read and thrown away for up to LINGER_S (at most LINGER_MAX_BYTES) before the close, so that
the client reads the status instead of a connection reset.

Deadlines are checked by one sweep over the open connections (`ConnectionGuard.sweep`) every SWEEP_INTERVAL_S,
from an injected clock: the request path pays a clock read per request and no timer, and tests move a fake clock and
call `sweep` instead of waiting."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import time
from typing import Protocol

from deepserve.gateway.clock import Clock

# Set in a request's ASGI scope when its body did not arrive in time (the app answers that request 408).
BODY_TIMEOUT_SCOPE_KEY = "deepserve.body_timeout_s"
LINGER_S = 2.0
LINGER_MAX_BYTES = 1 << 20
SWEEP_INTERVAL_S = 0.5
# An idle keep-alive connection is closed after this long (what uvicorn's --timeout-keep-alive 30 did here).
KEEP_ALIVE_S = 30.0
REFUSAL_REASONS = ("header_timeout", "body_timeout", "header_too_large", "connection_limit")


class GuardedConnection(Protocol):
    """What the guard's sweep asks of a connection (http_server's protocol)."""

    def check_deadlines(self, now_s: float) -> None: ...

    def close(self) -> None: ...


class ConnectionGuard:
    """The limits, the open connections and the refusal counts of one server."""

    def __init__(
        self,
        *,
        header_timeout_s: float,
        body_timeout_s: float,
        max_header_bytes: int,
        max_connections: int,
        keep_alive_s: float = KEEP_ALIVE_S,
        clock: Clock = time.monotonic,
    ) -> None:
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.max_header_bytes = max_header_bytes
        self.max_connections = max_connections
        self.keep_alive_s = keep_alive_s
        self.clock = clock
        self.open: set[GuardedConnection] = set()
        self.lingering: set[GuardedConnection] = set()  # refused: answered, draining what the client still sends
        self.refused: collections.Counter[str] = collections.Counter()  # by reason (REFUSAL_REASONS)
        self._sweeper: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep_forever(), name="connection-guard")

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        for connection in list(self.lingering):
            connection.close()

    async def _sweep_forever(self) -> None:
        interval_s = min(SWEEP_INTERVAL_S, self.header_timeout_s / 4, self.body_timeout_s / 4)
        while True:
            await asyncio.sleep(interval_s)
            self.sweep()

    def sweep(self) -> None:
        """Refuse every connection past a deadline, close idle and refused ones whose time is over."""
        now_s = self.clock()
        for connection in [*self.open, *self.lingering]:
            connection.check_deadlines(now_s)


_REASONS = {
    400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large",
    500: b"Internal Server Error", 503: b"Service Unavailable",
}  # fmt: skip
_CODES = {
    400: "invalid_http_request", 408: "request_timeout", 431: "request_header_fields_too_large",
    500: "internal_error", 503: "too_many_connections",
}  # fmt: skip


def error_response(status: int, message: str) -> bytes:
    """A whole HTTP response with MESSAGE in OpenAI's error shape, closing the connection (written by the server
    itself: before the app saw a request, or instead of an answer the app could not give)."""
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
