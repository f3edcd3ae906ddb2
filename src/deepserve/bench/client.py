"""A lean streaming HTTP/1.1 client for OpenAI-compatible servers, built for measuring, not for convenience.

Why not aiohttp or httpx: at 1,000 concurrent streams the client's own work per chunk decides how late it notices
a chunk, and that lateness lands in TTFT and ITL. Here the socket callback (`data_received`) does only what
timing needs: one `perf_counter()` per read, HTTP chunked decoding and SSE framing by byte search, and an append.
No coroutine wakes up per chunk and no JSON is parsed while the stream is open; events are decoded once the
response has ended (`decode_events`). See docs/METRICS.md for how tokens are attributed to chunks.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from deepserve.bench.types import RequestSpec

MAX_ERROR_BODY_BYTES = 64 * 1024
DONE = b"[DONE]"


@dataclass(frozen=True)
class Endpoint:
    """Where requests go: scheme, host, port and the path of the completions or chat-completions endpoint."""

    host: str
    port: int
    path: str
    use_tls: bool = False

    @classmethod
    def from_url(cls, url: str) -> Endpoint:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        tls = parts.scheme == "https"
        return cls(parts.hostname, parts.port or (443 if tls else 80), parts.path or "/", tls)


@dataclass
class RawResponse:
    """What arrived on the wire for one request. Times are absolute `time.perf_counter()` seconds."""

    status: int = 0
    event_payloads: list[bytes] = field(default_factory=list)  # the `data:` payload of each SSE event
    event_times: list[float] = field(default_factory=list)  # arrival of the read that completed each event
    body: bytes = b""  # non-SSE body (error responses), truncated
    end_s: float | None = None
    error: str | None = None


@dataclass
class DecodedStream:
    """The meaning of a stream's events: which chunks carried tokens, when, and how many."""

    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    text: str = ""
    usage_completion_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    token_count_source: str = "chunks"  # "token_ids", "logprobs" or "chunks" (one per token-bearing chunk)
    error: str | None = None


def build_request_bytes(
    endpoint: Endpoint, payload: dict[str, Any], headers: dict[str, str], request_id: str | None = None
) -> bytes:
    """The complete HTTP request, encoded once before the run so that sending costs one write."""
    body = json.dumps(payload, separators=(",", ":")).encode()
    lines = [
        f"POST {endpoint.path} HTTP/1.1",
        f"Host: {endpoint.host}:{endpoint.port}",
        "Content-Type: application/json",
        "Accept: text/event-stream",
        f"Content-Length: {len(body)}",
    ]
    if request_id:
        lines.append(f"x-request-id: {request_id}")
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def build_payload(
    spec: RequestSpec, model: str, chat: bool, extra_body: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The OpenAI request body for SPEC; usage is requested in the stream so token counts come from the server."""
    payload: dict[str, Any] = {"model": model, "max_tokens": spec.output_len, "stream": True}
    payload["stream_options"] = {"include_usage": True}
    if chat:
        prompt = spec.prompt
        payload["messages"] = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    else:
        payload["prompt"] = spec.prompt if isinstance(spec.prompt, str) else _messages_text(spec.prompt)
    if spec.min_output_len is not None:
        payload["min_tokens"] = spec.min_output_len
    if spec.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(extra_body or {})
    payload.update(spec.extra_body)
    return payload


def _messages_text(messages: list[dict[str, str]]) -> str:
    return "\n".join(message.get("content", "") for message in messages)


class Tally:
    """Events received over all of a client's connections (read by the progress display)."""

    __slots__ = ("events",)

    def __init__(self) -> None:
        self.events = 0


class _ResponseParser:
    """Incremental HTTP/1.1 response parser: status and headers, then a chunked, sized or until-close body whose
    SSE events are framed as they arrive. Fed from `data_received`; keeps the per-read work to byte searches."""

    __slots__ = (
        "_body_left",
        "_chunk_left",
        "_chunked",
        "_head",
        "_in_body",
        "_pending",
        "_sse",
        "done",
        "keep_alive",
        "response",
        "tally",
    )

    def __init__(self, tally: Tally) -> None:
        self.tally = tally
        self.response = RawResponse()
        self.done = False
        self.keep_alive = True
        self._head = bytearray()
        self._in_body = False
        self._chunked = False
        self._body_left = -1  # -1: until the connection closes
        self._chunk_left = 0  # bytes left in the current HTTP chunk; 0: expecting a size line
        self._pending = bytearray()  # chunked framing bytes not yet parsed
        self._sse = bytearray()  # SSE text not yet split into events

    def feed(self, data: bytes, now: float) -> None:
        if not self._in_body:
            self._head += data
            cut = self._head.find(b"\r\n\r\n")
            if cut < 0:
                return
            data = bytes(self._head[cut + 4 :])
            self._parse_head(bytes(self._head[:cut]))
            self._in_body = True
            if self.done or not data:
                return
        if self._chunked:
            self._feed_chunked(data, now)
        else:
            self._feed_sized(data, now)

    def _parse_head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        status_parts = lines[0].split(" ", 2)
        self.response.status = int(status_parts[1]) if len(status_parts) > 1 and status_parts[1].isdigit() else 0
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == "transfer-encoding" and "chunked" in value:
                self._chunked = True
            elif name == "content-length" and value.isdigit():
                self._body_left = int(value)
            elif name == "connection" and value == "close":
                self.keep_alive = False
        if lines[0].startswith("HTTP/1.0"):
            self.keep_alive = False
        if not self._chunked and self._body_left == 0:
            self._finish(time.perf_counter())
        elif not self._chunked and self._body_left < 0:
            self.keep_alive = False

    def _feed_sized(self, data: bytes, now: float) -> None:
        if self._body_left >= 0:
            data = data[: self._body_left]
            self._body_left -= len(data)
        self._body(data, now)
        if self._body_left == 0:
            self._finish(now)

    def _feed_chunked(self, data: bytes, now: float) -> None:
        buf = self._pending
        buf += data
        pos = 0
        end = len(buf)
        while pos < end:
            if self._chunk_left > 0:
                take = min(self._chunk_left, end - pos)
                self._body(bytes(buf[pos : pos + take]), now)
                pos += take
                self._chunk_left -= take
                if self._chunk_left == 0:
                    self._chunk_left = -2  # the CRLF after the chunk data
                continue
            if self._chunk_left == -2:
                if end - pos < 2:
                    break
                pos += 2
                self._chunk_left = 0
                continue
            line_end = buf.find(b"\r\n", pos)
            if line_end < 0:
                break
            size_text = bytes(buf[pos:line_end]).split(b";", 1)[0].strip()
            pos = line_end + 2
            try:
                size = int(size_text, 16)
            except ValueError:
                self.response.error = f"malformed HTTP chunk size {size_text[:20]!r}"
                self.keep_alive = False
                self._finish(now)
                return
            if size == 0:  # last chunk; trailers (if any) are ignored
                self._finish(now)
                return
            self._chunk_left = size
        del buf[:pos]

    def _body(self, data: bytes, now: float) -> None:
        if self.response.status != 200:
            if len(self.response.body) < MAX_ERROR_BODY_BYTES:
                self.response.body += data
            return
        sse = self._sse
        sse += data
        if sse.find(b"\n\n") < 0 and sse.find(b"\r\n\r\n") < 0:
            return
        text = bytes(sse).replace(b"\r\n", b"\n") if b"\r" in sse else bytes(sse)
        events = text.split(b"\n\n")
        sse[:] = events.pop()  # the unfinished tail
        self.tally.events += len(events)
        payloads = self.response.event_payloads
        times = self.response.event_times
        for event in events:
            payload = _sse_data(event)
            if payload is not None:
                payloads.append(payload)
                times.append(now)

    def _finish(self, now: float) -> None:
        if self.done:
            return
        tail = bytes(self._sse).strip()
        if tail and self.response.status == 200:  # a last event without its blank line
            payload = _sse_data(tail)
            if payload is not None:
                self.response.event_payloads.append(payload)
                self.response.event_times.append(now)
        self.response.end_s = now
        self.done = True

    def close(self, now: float, reason: str) -> None:
        """The connection ended. Without a length or chunk framing that is the end of the body; otherwise, if the
        response was not finished, it was cut short."""
        if self.done:
            return
        if self._in_body and not self._chunked and self._body_left < 0:
            self._finish(now)
            return
        self.response.error = reason
        self.response.end_s = now
        self.done = True


def _sse_data(event: bytes) -> bytes | None:
    """The data of one SSE event (data lines joined); None for comments and events without data."""
    event = event.strip()
    if not event or event.startswith(b":"):
        return None
    if event.startswith(b"data:") and b"\n" not in event:  # the common case: one data line
        return event[5:].lstrip()
    lines = [line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:")]
    if not lines:  # not SSE at all: keep it so that decoding reports the stream as malformed
        return event
    return b"\n".join(lines)


class _Connection(asyncio.Protocol):
    """One keep-alive connection; it carries one response at a time."""

    def __init__(self, tally: Tally) -> None:
        self.tally = tally
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.parser: _ResponseParser | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.bytes_received = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        parser = self.parser
        if parser is None:
            return
        self.bytes_received += len(data)
        parser.feed(data, now)
        if parser.done:
            self._wake()

    def eof_received(self) -> bool | None:
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.parser is not None and not self.parser.done:
            reason = f"connection closed by server: {exc}" if exc else "connection closed by server mid-response"
            self.parser.close(time.perf_counter(), reason)
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def start(self, request: bytes) -> asyncio.Future[None]:
        self.parser = _ResponseParser(self.tally)
        self.bytes_received = 0
        self.waiter = asyncio.get_running_loop().create_future()
        assert self.transport is not None
        self.transport.write(request)
        return self.waiter

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class StreamingClient:
    """Sends pre-encoded requests over a pool of keep-alive connections and returns what arrived, with times."""

    def __init__(self, endpoint: Endpoint, timeout_s: float, connect_timeout_s: float = 30.0) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()
        self._ssl = ssl.create_default_context() if endpoint.use_tls else None
        self.tally = Tally()

    async def send(self, request: bytes) -> tuple[float, RawResponse]:
        """Send one request; returns (the time it was sent, the response). Never raises for network faults:
        they come back as `RawResponse.error`."""
        reused = bool(self._idle)
        sent_s, response, conn = await self._send_once(request)
        if response.error and reused and conn is not None and conn.bytes_received == 0:
            # An idle keep-alive connection the server had already closed: not the request's fault, retry once.
            sent_s, response, conn = await self._send_once(request)
        return sent_s, response

    async def _send_once(self, request: bytes) -> tuple[float, RawResponse, _Connection | None]:
        try:
            conn = await self._acquire()
        except (OSError, asyncio.TimeoutError) as exc:
            now = time.perf_counter()
            return now, RawResponse(error=_connect_error(self.endpoint, exc), end_s=now), None
        sent_s = time.perf_counter()
        waiter = conn.start(request)
        try:
            await asyncio.wait_for(waiter, self.timeout_s)
        except asyncio.TimeoutError:
            conn.abort()
            assert conn.parser is not None
            conn.parser.close(time.perf_counter(), f"timeout: no complete response after {self.timeout_s:g} s")
        except asyncio.CancelledError:
            conn.abort()
            self._open.discard(conn)
            raise
        assert conn.parser is not None
        parser = conn.parser
        conn.parser = None
        self._release(conn, parser.keep_alive and parser.done and parser.response.error is None)
        return sent_s, parser.response, conn

    async def _acquire(self) -> _Connection:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
            self._open.discard(conn)
        loop = asyncio.get_running_loop()
        connect = loop.create_connection(
            lambda: _Connection(self.tally), self.endpoint.host, self.endpoint.port, ssl=self._ssl
        )
        _, conn = await asyncio.wait_for(connect, self.connect_timeout_s)
        self._open.add(conn)
        return conn

    def _release(self, conn: _Connection, reusable: bool) -> None:
        if reusable and not conn.closed:
            self._idle.append(conn)
        else:
            conn.abort()
            self._open.discard(conn)

    def close(self) -> None:
        for conn in list(self._open):
            conn.abort()
        self._open.clear()
        self._idle.clear()


def _connect_error(endpoint: Endpoint, exc: BaseException) -> str:
    where = f"{endpoint.host}:{endpoint.port}"
    if isinstance(exc, asyncio.TimeoutError):
        return f"connect timeout to {where}"
    return f"connection failed to {where}: {exc.__class__.__name__}: {exc}"


def http_error_message(status: int, body: bytes) -> str:
    """`HTTP 500: <the server's message>`, taking the message from OpenAI's error shape when it is there."""
    text = body.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict):
        error = data.get("error", data)
        message = error.get("message") if isinstance(error, dict) else error
        if message is None and isinstance(data.get("detail"), str | list):
            message = data["detail"]
        if message is not None:
            text = str(message)
    return f"HTTP {status}: {text[:300]}" if text else f"HTTP {status}"


def decode_events(response: RawResponse) -> DecodedStream:
    """Turn a finished response's SSE events into token-bearing chunks, text and usage."""
    out = DecodedStream()
    if response.status != 200:
        out.error = response.error or http_error_message(response.status, response.body)
        return out
    texts: list[str] = []
    for payload, arrived_s in zip(response.event_payloads, response.event_times, strict=True):
        if payload == DONE:
            continue
        try:
            event = json.loads(payload)
        except ValueError:
            out.error = f"malformed SSE event: {payload[:80].decode('utf-8', 'replace')!r}"
            break
        if not isinstance(event, dict):
            out.error = f"malformed SSE event: {payload[:80].decode('utf-8', 'replace')!r}"
            break
        if "error" in event:
            error = event["error"]
            out.error = "stream error: " + str(error.get("message", error) if isinstance(error, dict) else error)
            break
        _take_usage(event, out)
        choices = event.get("choices")
        if choices and isinstance(choices, list) and isinstance(choices[0], dict):
            _take_choice(choices[0], arrived_s, out, texts)
    out.text = "".join(texts)
    if out.error is None:
        out.error = response.error
    if out.error is None and not out.chunk_times:
        out.error = "no token in the response stream"
    return out


def _take_usage(event: dict[str, Any], out: DecodedStream) -> None:
    usage = event.get("usage")
    if isinstance(usage, dict):
        if isinstance(usage.get("completion_tokens"), int):
            out.usage_completion_tokens = usage["completion_tokens"]
        if isinstance(usage.get("prompt_tokens"), int):
            out.usage_prompt_tokens = usage["prompt_tokens"]


def _take_choice(choice: dict[str, Any], arrived_s: float, out: DecodedStream, texts: list[str]) -> None:
    delta = choice.get("delta")
    if isinstance(delta, dict):  # chat
        text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""
        if "role" in delta and not text and not choice.get("finish_reason"):
            return  # the role header chunk some servers send before the first token: carries no token
    else:
        text = choice.get("text") or ""
    tokens, source = _chunk_token_count(choice)
    if tokens == 0:
        return
    if source != "chunks":
        out.token_count_source = source
    out.chunk_times.append(arrived_s)
    out.chunk_tokens.append(tokens)
    texts.append(text)


def _chunk_token_count(choice: dict[str, Any]) -> tuple[int, str]:
    """Tokens in one chunk: the server's token ids or logprobs when it sent them, else one per chunk."""
    token_ids = choice.get("token_ids")
    if isinstance(token_ids, list):
        return len(token_ids), "token_ids"
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict):
        listed = logprobs.get("tokens") if "tokens" in logprobs else logprobs.get("content")
        if isinstance(listed, list):
            return len(listed), "logprobs"
    return 1, "chunks"


def reconcile_chunk_tokens(chunk_tokens: list[int], total: int) -> list[int]:
    """Make the per-chunk counts add up to the server's total: add a shortfall to the last chunk; take an excess
    away from the last chunks backwards (a chunk may drop to zero, except the first, which keeps one)."""
    counts = list(chunk_tokens)
    if not counts or total <= 0:
        return counts
    diff = total - sum(counts)
    if diff > 0:
        counts[-1] += diff
    index = len(counts) - 1
    while diff < 0 and index >= 0:
        floor = 1 if index == 0 else 0
        take = min(counts[index] - floor, -diff)
        counts[index] -= take
        diff += take
        index -= 1
    return counts
