"""A lean streaming HTTP/1.1 client for OpenAI-compatible servers, built for measuring, not for convenience.

Why not aiohttp or httpx: at 1,000 concurrent streams the client's own work per chunk decides how late it notices
a chunk, and that lateness lands in TTFT and ITL. Here the socket callback (`data_received`) does only what
timing needs: one `perf_counter()` per read, HTTP chunked decoding and SSE framing by byte search, and an append.
No coroutine wakes up per chunk and no JSON is parsed while the stream is open; events are decoded once the
response has ended (`decode_events`). See docs/METRICS.md for how tokens are attributed to chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl
import time
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import urlsplit

import httptools
import orjson

from deepserve.bench.phases import ANSWER, REASONING, TOOL_CALL
from deepserve.bench.types import RequestSpec
from deepserve.net import SO_TIMESTAMPNS, TIMESTAMP_SPACE, ArrivalClock

MAX_ERROR_BODY_BYTES = 64 * 1024
READ_BYTES = 256 * 1024
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
    chunk_tokens: list[int] = field(default_factory=list)  # the server's count where it listed them, else 1
    chunk_text_lens: list[int] = field(default_factory=list)  # characters of text each chunk carried
    counted_chunks: int = 0  # chunks whose tokens the server listed (token_ids or logprobs)
    text: str = ""  # the answer's text (reasoning and tool-call arguments left out, as vLLM's client keeps it)
    other_text: str = ""  # the reasoning and tool-call text: counted with the answer's when the server gives no usage
    usage_completion_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    usage_reasoning_tokens: int | None = None  # usage.completion_tokens_details.reasoning_tokens, where reported
    error: str | None = None
    # What each token chunk carried, as phases.py's bit flags (REASONING, ANSWER, TOOL_CALL): empty while every
    # chunk is plain answer text, so the usual stream keeps no list; for a chunk with reasoning and answer text,
    # the reasoning's share of its text
    chunk_kinds: list[int] = field(default_factory=list)
    reasoning_share: dict[int, float] = field(default_factory=dict)
    tool_calls: set[int] = field(default_factory=set)  # the tool calls' indices (one per call)
    finish_s: float | None = None  # arrival of the chunk that gave the finish reason

    @property
    def all_chunks_counted(self) -> bool:
        return bool(self.chunk_times) and self.counted_chunks == len(self.chunk_times)


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
    """Body pieces received over all of a client's connections (≈ SSE events; read by the progress display)."""

    __slots__ = ("events",)

    def __init__(self) -> None:
        self.events = 0


class _ResponseParser:
    """One response, parsed incrementally by httptools (llhttp, in C): status, headers, and a chunked, sized or
    until-close body. The callback per body piece only appends the bytes and the time of the read that brought
    them; SSE framing and JSON wait until the response has ended (`frame_events`, `decode_events`)."""

    __slots__ = (
        "_first_now",
        "_framed",
        "_http",
        "_now",
        "_until_close",
        "body_parts",
        "body_times",
        "done",
        "headers_done",
        "keep_alive",
        "response",
        "tally",
    )

    def __init__(self, tally: Tally) -> None:
        self.tally = tally
        self.response = RawResponse()
        self.done = False
        self.keep_alive = False  # set when a response ended cleanly and the server keeps the connection open
        self.headers_done = False
        self.body_parts: list[bytes] = []
        self.body_times: list[float] = []
        self._now = 0.0
        self._first_now = 0.0
        self._until_close = False
        self._framed = False
        self._http = httptools.HttpResponseParser(self)

    def feed(self, data: bytes, now: float, first_now: float | None = None) -> None:
        """NOW: when DATA arrived (its last byte); FIRST_NOW: when its first byte did, if earlier (a read that
        drained several writes): the first body piece gets that time, the others NOW. Unless DATA starts with the
        response's head: its first byte is then the head's, written when the request arrived, long before the
        first token, so every body piece of the read gets NOW (late by at most the writes after the first one)."""
        self._now = now
        self._first_now = now if first_now is None or not self.headers_done else first_now
        try:
            self._http.feed_data(data)
        except httptools.HttpParserError as exc:
            self.response.error = f"malformed HTTP response: {exc}"
            self._finish()

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        lowered = name.lower()
        if lowered == b"content-length" or (lowered == b"transfer-encoding" and b"chunked" in value.lower()):
            self._framed = True

    def on_headers_complete(self) -> None:
        self.headers_done = True
        self.response.status = int(self._http.get_status_code())
        self._until_close = not self._framed

    def on_body(self, body: bytes) -> None:
        self.body_parts.append(body)
        self.body_times.append(self._first_now)
        self._first_now = self._now
        self.tally.events += 1

    def on_message_complete(self) -> None:
        # llhttp answers should_keep_alive() only inside its callbacks: the parser resets once the message ends.
        self.keep_alive = self.response.error is None and bool(self._http.should_keep_alive())
        self._finish()

    def _finish(self) -> None:
        if self.done:
            return
        self.response.end_s = self._now
        self.done = True
        self._collect()

    def _collect(self) -> None:
        if self.response.status == 200:
            frame_events(self.body_parts, self.body_times, self.response)
        else:
            self.response.body = b"".join(self.body_parts)[:MAX_ERROR_BODY_BYTES]

    def close(self, now: float, reason: str) -> None:
        """The connection ended. For a body delimited by the close that is its end; otherwise, if the response
        was not finished, it was cut short."""
        if self.done:
            return
        self._now = now
        if self.headers_done and self._until_close:
            self._finish()
            return
        self.response.error = reason
        self._finish()


def frame_events(parts: list[bytes], times: list[float], response: RawResponse) -> None:
    """Split body PARTS into SSE events; each event is stamped with the arrival of the part that completed it."""
    buffer = b""
    payloads, stamps = response.event_payloads, response.event_times
    for part, arrived_s in zip(parts, times, strict=True):
        if not buffer and part.startswith(b"data: ") and part.find(b"\n") == len(part) - 2 and part[-1:] == b"\n":
            payloads.append(part[6:-2])  # the usual case: one piece, one single-line event
            stamps.append(arrived_s)
            continue
        if not buffer and part.endswith(b"\n\n") and part.count(b"\n\n") == 1 and b"\r" not in part:
            events = [part]  # one piece, one event
        else:
            buffer += part
            if b"\r" in buffer:
                buffer = buffer.replace(b"\r\n", b"\n")
            if b"\n\n" not in buffer:
                continue
            *events, buffer = buffer.split(b"\n\n")
        for event in events:
            payload = _sse_data(event)
            if payload is not None:
                payloads.append(payload)
                stamps.append(arrived_s)
    tail = buffer.strip()
    if tail and times:  # a last event without its blank line
        payload = _sse_data(tail)
        if payload is not None:
            payloads.append(payload)
            stamps.append(times[-1])


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


class _ResponseSlot:
    """The one response a connection carries at a time: its parser, the future that wakes its waiter, and what
    both kinds of connection do when bytes arrive or the connection ends."""

    tally: Tally
    parser: _ResponseParser | None = None
    waiter: asyncio.Future[None] | None = None
    bytes_received = 0

    def _begin(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        self.parser = _ResponseParser(self.tally)
        self.bytes_received = 0
        self.waiter = loop.create_future()
        return self.waiter

    def _received(self, data: bytes, now: float, first_now: float | None = None) -> None:
        parser = self.parser
        if parser is None:
            return  # nothing asked: ignore
        self.bytes_received += len(data)
        parser.feed(data, now, first_now)
        if parser.done:
            self._wake()

    def _ended(self, exc: Exception | None) -> None:
        if self.parser is not None and not self.parser.done:
            reason = f"connection closed by server: {exc}" if exc else "connection closed by server mid-response"
            self.parser.close(time.perf_counter(), reason)
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class _SocketConnection(_ResponseSlot):
    """One keep-alive plain-TCP connection read with recvmsg, so every read comes with the kernel's receive time:
    chunk times then do not depend on how soon the event loop gets to the socket (under load, or with hundreds
    of streams whose chunks arrive in the same instant). It carries one response at a time."""

    def __init__(self, sock: socket.socket, tally: Tally, clock: ArrivalClock) -> None:
        self.sock = sock
        self.tally = tally
        self.clock = clock
        self.closed = False
        self._loop = asyncio.get_running_loop()
        self._fd = sock.fileno()
        self._loop.add_reader(self._fd, self._on_readable)  # also while idle: notices the server closing it

    @classmethod
    async def open(cls, endpoint: Endpoint, tally: Tally, clock: ArrivalClock) -> _SocketConnection:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(endpoint.host, endpoint.port, type=socket.SOCK_STREAM)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with contextlib.suppress(OSError):  # without kernel timestamps, reads are stamped on arrival in Python
                sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
            await loop.sock_connect(sock, address)
        except BaseException:
            sock.close()
            raise
        return cls(sock, tally, clock)

    def _on_readable(self) -> None:
        try:
            # Peek one byte first: its timestamp is the arrival of the oldest unread write. When the client fell
            # behind, one read drains several writes and carries only the newest one's time.
            _, head_ancillary, _, _ = self.sock.recvmsg(1, TIMESTAMP_SPACE, socket.MSG_PEEK)
            data, ancillary, _, _ = self.sock.recvmsg(READ_BYTES, TIMESTAMP_SPACE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._lost(exc)
            return
        now = time.perf_counter()
        if not data:
            self._lost(None)
            return
        self._received(data, self._arrival_s(ancillary, now), self._arrival_s(head_ancillary, now))

    def _arrival_s(self, ancillary: list[tuple[int, int, bytes]], now: float) -> float:
        return self.clock.received_s(ancillary, now)

    def _lost(self, exc: Exception | None) -> None:
        self.abort()
        self._ended(exc)

    def start(self, request: bytes) -> asyncio.Future[None]:
        waiter = self._begin(self._loop)
        try:
            sent = self.sock.send(request)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            self._lost(exc)
            return waiter
        if sent < len(request):  # a full socket buffer: rare for a request, so the slow path is fine
            rest = self._loop.create_task(self._loop.sock_sendall(self.sock, request[sent:]))
            rest.add_done_callback(self._after_send)
        return waiter

    def _after_send(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self._lost(cast(Exception, task.exception()))

    def abort(self) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):
            self._loop.remove_reader(self._fd)
        self.sock.close()


class _ProtocolConnection(_ResponseSlot, asyncio.Protocol):
    """One keep-alive connection over an asyncio transport (TLS): reads are stamped when Python sees them."""

    def __init__(self, tally: Tally) -> None:
        self.tally = tally
        self.transport: asyncio.Transport | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses

    def data_received(self, data: bytes) -> None:
        self._received(data, time.perf_counter())

    def eof_received(self) -> bool | None:
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._ended(exc)

    def start(self, request: bytes) -> asyncio.Future[None]:
        waiter = self._begin(asyncio.get_running_loop())
        assert self.transport is not None
        self.transport.write(request)
        return waiter

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


_Connection = _SocketConnection | _ProtocolConnection


class StreamingClient:
    """Sends pre-encoded requests over a pool of keep-alive connections and returns what arrived, with times."""

    def __init__(
        self, endpoint: Endpoint, timeout_s: float, connect_timeout_s: float = 30.0, verify_tls: bool = True
    ) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()
        self.clock = ArrivalClock()
        self._ssl = _tls_context(verify_tls) if endpoint.use_tls else None
        self.tally = Tally()

    async def send(self, request: bytes, not_after: float | None = None) -> tuple[float, RawResponse] | None:
        """Send one request; returns (the time it was sent, the response). Never raises for network faults:
        they come back as `RawResponse.error`. NOT_AFTER (perf_counter seconds): a request whose connection is
        ready only after it is not sent at all (None comes back): a duration-bound run ends when it ends."""
        reused = bool(self._idle)
        sent = await self._send_once(request, not_after)
        if sent is None:
            return None
        sent_s, response, conn = sent
        if response.error and reused and conn is not None and conn.bytes_received == 0:
            # An idle keep-alive connection the server had already closed: not the request's fault, retry once.
            sent = await self._send_once(request, not_after)
            if sent is None:
                return None
            sent_s, response, conn = sent
        return sent_s, response

    async def _send_once(
        self, request: bytes, not_after: float | None = None
    ) -> tuple[float, RawResponse, _Connection | None] | None:
        try:
            conn = await self._acquire()
        except (OSError, asyncio.TimeoutError) as exc:
            now = time.perf_counter()
            return now, RawResponse(error=_connect_error(self.endpoint, exc), end_s=now), None
        sent_s = time.perf_counter()
        if not_after is not None and sent_s >= not_after:
            self._release(conn, True)
            return None
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
        if self.endpoint.use_tls:
            loop = asyncio.get_running_loop()
            connect = loop.create_connection(
                lambda: _ProtocolConnection(self.tally), self.endpoint.host, self.endpoint.port, ssl=self._ssl
            )
            _, conn = await asyncio.wait_for(connect, self.connect_timeout_s)
            connection: _Connection = conn
        else:
            opening = _SocketConnection.open(self.endpoint, self.tally, self.clock)
            connection = await asyncio.wait_for(opening, self.connect_timeout_s)
        self._open.add(connection)
        return connection

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


def _tls_context(verify: bool) -> ssl.SSLContext:
    """The default context; VERIFY=False (--insecure) accepts any certificate, e.g. a self-signed one."""
    context = ssl.create_default_context()
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


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
    others: list[str] = []
    times, tokens, text_lens = out.chunk_times, out.chunk_tokens, out.chunk_text_lens
    for payload, arrived_s in zip(response.event_payloads, response.event_times, strict=True):
        if payload == DONE:
            continue
        try:
            event = orjson.loads(payload)
        except orjson.JSONDecodeError:
            out.error = f"malformed SSE event: {payload[:80].decode('utf-8', 'replace')!r}"
            break
        if not isinstance(event, dict):
            out.error = f"malformed SSE event: {payload[:80].decode('utf-8', 'replace')!r}"
            break
        if "error" in event:
            error = event["error"]
            out.error = "stream error: " + str(error.get("message", error) if isinstance(error, dict) else error)
            break
        if event.get("usage"):
            _take_usage(event, out)
        choices = event.get("choices")
        if not choices or type(choices) is not list:
            continue
        choice = choices[0]
        text = choice.get("text") if type(choice) is dict else None
        if type(text) is str and choice.get("logprobs") is None and choice.get("token_ids") is None:
            # the common completions chunk, inlined: one token, its text (this loop runs once per token)
            times.append(arrived_s)
            tokens.append(1)
            text_lens.append(len(text))
            texts.append(text)
        elif type(choice) is dict:
            _take_choice(choice, arrived_s, out, texts, others)
    out.text = "".join(texts)
    out.other_text = "".join(others)
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
        details = usage.get("completion_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("reasoning_tokens"), int):
            out.usage_reasoning_tokens = details["reasoning_tokens"]


def _take_choice(
    choice: dict[str, Any], arrived_s: float, out: DecodedStream, texts: list[str], others: list[str]
) -> None:
    delta = choice.get("delta")
    reasoning = ""
    kind = ANSWER
    if choice.get("finish_reason"):
        out.finish_s = arrived_s
    if isinstance(delta, dict):  # chat
        text = delta.get("content") or ""
        reasoning = _text_of(delta.get("reasoning_content") or delta.get("reasoning"))
        calls = delta.get("tool_calls")
        kind = (REASONING if reasoning else 0) | (ANSWER if text else 0) | (TOOL_CALL if calls else 0)
        if calls:
            arguments = _tool_call_text(calls, out.tool_calls)
            others.append(arguments)
        if "role" in delta and not kind and not choice.get("finish_reason"):
            return  # the role header chunk some servers send before the first token: carries no token
    else:
        text = choice.get("text") or ""
    if not isinstance(text, str):  # e.g. content parts: the text is only needed when there is no usage
        text = ""
    tokens = _listed_token_count(choice)
    if tokens == 0:
        return
    other_chars = len(reasoning) + (len(others[-1]) if kind & TOOL_CALL else 0)
    _keep_kind(out, kind or ANSWER, len(reasoning), len(text) + other_chars - len(reasoning))
    out.counted_chunks += tokens is not None
    out.chunk_times.append(arrived_s)
    out.chunk_tokens.append(1 if tokens is None else tokens)
    out.chunk_text_lens.append(len(text) + other_chars)
    texts.append(text)
    if reasoning:
        others.append(reasoning)


def _text_of(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _tool_call_text(calls: Any, seen: set[int]) -> str:
    """The argument text of a chunk's tool-call deltas (its weight when tokens are spread by text); notes each
    call's index in SEEN."""
    pieces = []
    for position, call in enumerate(calls if isinstance(calls, list) else []):
        if not isinstance(call, dict):
            continue
        index = call.get("index")
        seen.add(index if isinstance(index, int) else position)
        function = call.get("function")
        if isinstance(function, dict):
            pieces += [_text_of(function.get("name")), _text_of(function.get("arguments"))]
    return "".join(pieces)


def _keep_kind(out: DecodedStream, kind: int, reasoning_chars: int, answer_chars: int) -> None:
    """Note what the next token chunk carried, once any chunk carried more than plain answer text."""
    position = len(out.chunk_times)
    if kind != ANSWER or out.chunk_kinds:
        out.chunk_kinds += [ANSWER] * (position - len(out.chunk_kinds))  # the plain chunks before the first other
        out.chunk_kinds.append(kind)
    if kind & REASONING and kind & (ANSWER | TOOL_CALL):
        out.reasoning_share[position] = reasoning_chars / max(reasoning_chars + answer_chars, 1)


def _listed_token_count(choice: dict[str, Any]) -> int | None:
    """Tokens in one chunk as the server listed them (token ids, else logprobs); None when it did not."""
    token_ids = choice.get("token_ids")
    if isinstance(token_ids, list):
        return len(token_ids)
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict):
        listed = logprobs.get("tokens") if "tokens" in logprobs else logprobs.get("content")
        if isinstance(listed, list):
            return len(listed)
    return None
