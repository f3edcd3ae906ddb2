"""One streamed answer's way from the upstream connection to the client.

The events go out from where they arrive: while the request's task sleeps, the upstream connection's read callback
hands each read to `StreamRelay.offer`, which forwards the read's complete events to the client's connection in the
same callback. The task wakes only when the stream ends or fails, or when the client's connection pushes back; then
it sends what the relay holds, waiting for the client to drain, and reads on (`forward`) as before.

Why not a task step per event: an engine that steps all its streams together (vLLM) writes a token to every stream
at once. The event loop runs every ready read callback before any task, so with a task per event each stream's
token waited for all the reads of that instant and then for the relays of the streams ahead of it
(docs/PERFORMANCE.md, "One stream's fixed cost and a burst's per-stream cost"). From the read callback each stream's
token leaves right after its own read.

The response head goes out before any event, when the engine's own head arrives (the engine sends it at once, and a
client parses it while the first token is computed); the task still owns the retry before the first event (no event
goes out until one is complete, so a replica that fails before it is replaced under the same 200 head), errors (a
failure in `offer` reaches the task through the connection), cancellation (the client going away cancels the task;
what the callback writes to a gone client is dropped, as `send` drops it) and flow control (a client that does not
read makes `offer` stop, and the task waits for it as it always did)."""

from __future__ import annotations

import time
from typing import Protocol

from deepserve.gateway.asgi import Message, Send, SendNow
from deepserve.gateway.exchange import Exchange
from deepserve.gateway.http_client import BodySink
from deepserve.gateway.streaming import StreamTap

# The most of a stream's body kept for the usage ledger's body column (log_bodies).
MAX_LOGGED_BODY_BYTES = 1 << 20


class Observer(Protocol):
    def observe(self, amount: float) -> None: ...


class StreamRelay:
    """The events of one stream on their way (its response head went out before them): the time to the first
    event, the ITL histogram, the logged body."""

    __slots__ = ("_exchange", "_itl", "_last_s", "_logged_bytes", "_send_now", "_tap", "held")

    def __init__(self, exchange: Exchange, tap: StreamTap, itl: Observer, send_now: SendNow | None) -> None:
        self._exchange = exchange
        self._tap = tap
        self._itl = itl
        self._send_now = send_now
        self._last_s = 0.0
        self._logged_bytes = 0
        self.held: list[Message] = []  # what `offer` could not send: the task sends it, waiting for the client

    @property
    def offer_sink(self) -> BodySink | None:
        """`offer`, when the server can send from outside the request's task (the gateway's own can; another ASGI
        server cannot, and the task relays every event)."""
        return None if self._send_now is None else self.offer

    def offer(self, data: bytes) -> bool:
        """Forward DATA's complete events now, from the upstream connection's read callback; False (the rest is
        held for the task) when the client's connection pushes back."""
        send_now = self._send_now
        assert send_now is not None
        for message in self._messages(data):
            if self.held or not send_now(message):
                self.held.append(message)
        return not self.held

    async def send_held(self, send: Send) -> None:
        held, self.held = self.held, []
        for message in held:
            await send(message)

    async def forward(self, data: bytes, send: Send) -> None:
        """Forward DATA's complete events from the request's task."""
        for message in self._messages(data):
            await send(message)

    async def finish(self, send: Send) -> None:
        """The stream ended: what the tap kept back (an incomplete last event; the usage chunk is dropped when the
        gateway asked for it), and the end of the response."""
        tap, exchange = self._tap, self._exchange
        rest = tap.finish()
        exchange.usage = tap.usage
        exchange.finished = True
        exchange.response_started = True
        await send({"type": "http.response.body", "body": rest, "more_body": False})

    def _messages(self, data: bytes) -> list[Message]:
        events = self._tap.feed(data)
        if not events:
            return []
        exchange = self._exchange
        now_s = time.perf_counter()
        if exchange.response_started:
            self._itl.observe(now_s - self._last_s)
        else:  # from here on a failure ends the stream with an error event: the client has tokens
            exchange.response_started = True
            exchange.ttft_s = now_s - exchange.started_s
        self._last_s = now_s
        messages: list[Message] = [{"type": "http.response.body", "body": events, "more_body": True}]
        logged = exchange.logged_body
        if logged is not None and self._logged_bytes < MAX_LOGGED_BODY_BYTES:
            logged.append(events)
            self._logged_bytes += len(events)
        return messages
