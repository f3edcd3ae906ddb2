"""One generation's answer, the engine's TokenSink for its request: the tokens as vLLM streams them (one SSE event
per chunk, grouped as its output processor and --stream-interval group them, each event one HTTP chunk as uvicorn
frames vLLM's), or one JSON body for a request that does not stream; and the stream faults injected into it (cut,
stall, error event, malformed event)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson

from deepserve.simulate.http import JSON_CONTENT, Connection
from deepserve.simulate.openai_api import DONE_EVENT, Generation, ReplyFormat, error_body
from deepserve.simulate.scheduler import SimRequest
from deepserve.simulate.send_log import StreamSends

if TYPE_CHECKING:
    from deepserve.simulate.app import SimulatorApp

_SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n"
_CHUNKED_END = b"0\r\n\r\n"
MALFORMED_EVENT = b"data: {not json\n\n"


class Reply:
    """The answer to one generation request: the engine's TokenSink for it."""

    __slots__ = (
        "app", "conn", "cut_after", "cut_mode", "done", "format", "generation", "log", "logged_chunks", "pending",
        "request", "sent", "stalled",
    )  # fmt: skip

    def __init__(self, app: SimulatorApp, conn: Connection, generation: Generation, fmt: ReplyFormat) -> None:
        self.app = app
        self.conn = conn
        self.generation = generation
        self.format = fmt
        self.request: SimRequest | None = None
        self.cut_after: int | None = None  # an injected cut after this many tokens
        self.cut_mode = "close"  # and how (faults.py)
        self.pending: list[int] = []  # tokens not sent yet (several per chunk, or the whole reply)
        self.sent = 0
        self.done = False
        self.stalled = False  # cut by a stall: nothing more is sent, the connection stays open
        self.log: StreamSends | None = None  # with log_sends: when each chunk was written
        self.logged_chunks: list[int] = []  # tokens of each chunk built since the last write (with a log)

    def send_stream_head(self) -> None:
        """The response head of a stream: its events follow as they come, each one HTTP chunk."""
        self.conn.write(_SSE_HEAD + self.conn.close_header() + b"\r\n")

    def on_tokens(self, request: SimRequest, token_ids: list[int], finish_reason: str | None, now_s: float) -> None:
        if self.done or self.stalled:
            return
        self.pending.extend(token_ids)
        if not self.generation.stream:
            if finish_reason is not None:
                body = self.format.full_response(self.pending, finish_reason)
                if self.generation.store:
                    self.app.keep_response(self.format.response_id, body)
                self._finish("completed", self.conn.response(200, JSON_CONTENT, body))
            return
        if self.cut_after is not None and self.sent + len(self.pending) >= self.cut_after:
            self._cut()
            return
        if finish_reason is None and self.sent and len(self.pending) == 1 == self.app.config.tokens_per_chunk:
            event = self.format.token_event(self.sent, self.pending, None, self._usage(1))  # one token, as usual
            self.sent += 1
            self.pending.clear()
            if self.log is not None:
                self.logged_chunks.append(1)
            self._send(b"%x\r\n%s\r\n" % (len(event), event))
            return
        events = self._token_events(finish_reason)
        if finish_reason is not None:
            events += self.format.closing_events(self.sent, self.app.wants_usage(self.generation))
            typed = self.format.typed
            if self.generation.store and typed is not None and typed.final is not None:
                self.app.keep_response(self.format.response_id, orjson.dumps(typed.final))
            self._finish("completed", _frames(events) + _CHUNKED_END)
        elif events:
            self._send(_frames(events))

    def _send(self, data: bytes) -> None:
        """Write DATA, which carries token chunks (timed, with a send log)."""
        if self.log is None:
            self.conn.write(data)
            return
        self.log.timed_write(self.conn.transport, data, self.logged_chunks)
        self.logged_chunks.clear()

    def _token_events(self, finish_reason: str | None, flush: bool = False) -> list[bytes]:
        """Events for the pending tokens, as vLLM's --stream-interval K groups them: the first token at once,
        then K per chunk, and whatever is left when the request finishes (which the last chunk says) or, with
        FLUSH, when its stream is cut."""
        events: list[bytes] = []
        per_chunk = self.app.config.tokens_per_chunk
        if self.app.outputs_are_chunks:
            return self._output_events(finish_reason, flush)
        if per_chunk == 1 and self.sent and self.format.plain_chunks and len(self.pending) > 1:
            bulk = len(self.pending) - 1  # a burst of tokens, one per chunk: all but the last in one pass
            events = self.format.plain_token_events(self.sent, bulk)
            if self.log is not None:
                self.logged_chunks.extend([1] * bulk)
            self.sent += bulk
            del self.pending[:bulk]
        while self.pending:
            size = 1 if self.sent == 0 else per_chunk
            last = len(self.pending) <= size
            if last and finish_reason is None and not flush and len(self.pending) < size:
                break
            events += self._token_event(self.pending[:size], finish_reason if last else None)
        return events

    def _output_events(self, finish_reason: str | None, flush: bool) -> list[bytes]:
        """vLLM's output processor (vllm/v1/engine/output_processor.py): every engine output's tokens in one
        chunk; with --stream-interval K, the first token at once, then whatever has gathered once it is K or more,
        and the rest when the request finishes."""
        if not self.pending:
            return []
        if finish_reason is None and not flush and self.sent and len(self.pending) < self.app.config.tokens_per_chunk:
            return []
        return self._token_event(list(self.pending), finish_reason)

    def _usage(self, new_tokens: int) -> bytes:
        """The usage of every chunk (continuous_usage_stats), else nothing."""
        generation = self.generation
        if generation.continuous_usage and generation.include_usage:
            return b',"usage":' + self.format.usage(self.sent + new_tokens)
        return b""

    def _token_event(self, tokens: list[int], finish_reason: str | None) -> list[bytes]:
        events = self.format.opening_events() if self.sent == 0 else []
        events.append(self.format.token_event(self.sent, tokens, finish_reason, self._usage(len(tokens))))
        if self.log is not None:
            self.logged_chunks.append(len(tokens))
        self.sent += len(tokens)
        del self.pending[: len(tokens)]
        return events

    def _cut(self) -> None:
        assert self.cut_after is not None
        del self.pending[max(self.cut_after - self.sent, 0) :]  # the tokens it still delivers
        events = self._token_events(None, flush=True)
        mode = self.cut_mode
        self.app.stats.cut += 1
        self._stop_engine()
        if mode == "stall":  # an engine hung mid-stream: the connection stays open and silent
            self.stalled = True
            self._send(_frames(events))
            return
        if mode == "close":  # the connection drops mid-stream: no terminator, no [DONE]
            self._send(_frames(events))
            self._settle(None)
            self.conn.abort()
            return
        if mode == "error_event":
            error = error_body(500, "injected stream failure (deepserve simulate)", "InternalServerError")
            events += [b"data: " + error + b"\n\n", DONE_EVENT]
        else:
            events.append(MALFORMED_EVENT)
        self._finish(None, _frames(events) + _CHUNKED_END)

    def _stop_engine(self) -> None:
        if self.request is not None and not self.request.finished:
            self.app.engine.abort(self.request)

    def client_gone(self) -> None:
        """The connection closed before the answer was complete."""
        if self.done:
            return
        self.done = True
        stats = self.app.stats
        stats.aborted += 1
        if self.generation.stream:
            stats.active -= 1
        self._stop_engine()

    def _finish(self, outcome: str | None, data: bytes) -> None:
        self._settle(outcome)
        self._send(data)
        self.conn.request_done()

    def pause(self) -> None:
        """The connection's buffer is full (the client reads slower than tokens come)."""
        if self.request is not None and not self.done:
            self.app.engine.pause(self.request)

    def resume(self) -> None:
        if self.request is not None and not self.done:
            self.app.engine.resume(self.request)

    def _settle(self, outcome: str | None) -> None:
        self.done = True
        stats = self.app.stats
        if outcome == "completed":
            stats.completed += 1
        if self.generation.stream:
            stats.active -= 1
        self.conn.reply = None


def _frames(events: list[bytes]) -> bytes:
    """Each SSE event as one HTTP chunk (chunked transfer encoding), as uvicorn sends vLLM's."""
    return b"".join(b"%x\r\n%s\r\n" % (len(event), event) for event in events)
