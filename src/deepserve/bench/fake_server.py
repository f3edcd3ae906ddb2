"""A scripted OpenAI-compatible streaming server with known timings, for testing benchmark clients.

It streams `max_tokens` tokens per request on a fixed schedule (first token TTFT after the request arrived, then
one chunk every ITL), formats chunks as vLLM does (usage chunk, `data: [DONE]`, HTTP chunked encoding), and logs
the moment it wrote each chunk, so a client's measurements can be compared with what really happened. Faults
(401, HTTP 500 for some requests, a malformed event, a dropped connection) are switched on by `FakeScript`.

Several tokens per chunk, as vLLM sends them with --stream-interval or speculative decoding: `tokens_per_chunk`;
each chunk's text then has one " tok" per token (with `varied_text`, tokens of 1 to 8 characters instead, as real
tokens differ, so that a client estimating tokens from text is not exact by construction). Its token ids are
listed when the request asks for them with vLLM's `return_token_ids` (or always, with `send_token_ids`);
`return_token_ids="reject"` answers that field with HTTP 400 instead, and `"ignore"` accepts it and lists
nothing, as servers without the field do.

Raw asyncio protocol on uvloop when available: the server must not be the bottleneck of a client benchmark.
Run it on its own: `python -m deepserve.bench.fake_server --port 8123 --ttft-ms 50 --itl-ms 10`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from deepserve.bench.client import SO_TIMESTAMPNS, TIMESTAMP_SPACE, ArrivalClock

SIOCOUTQNSD = 0x894B  # Linux: bytes in a TCP socket's send queue not yet sent
JSON_HEADERS = "Content-Type: application/json\r\n"
SSE_HEADERS = "Content-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"


@dataclass
class FakeScript:
    """What the fake server does. Timings in seconds; 0 ITL streams as fast as the client reads."""

    model: str = "fake-model"
    ttft_s: float = 0.0
    itl_s: float = 0.0
    tokens_per_chunk: int = 1
    varied_text: bool = False  # each token's text 1-8 characters long (fixed by its position), not " tok"
    chunks_per_write: int = 1  # events coalesced into one socket write (only when itl_s == 0)
    send_usage: bool = True
    send_token_ids: bool = False  # list every chunk's token ids, asked or not
    return_token_ids: Literal["accept", "ignore", "reject"] = "accept"  # a request's return_token_ids: as vLLM, …
    api_key: str | None = None  # when set, other bearer tokens get 401
    fail_request_indices: frozenset[int] = frozenset()  # these requests (arrival order) get HTTP 500
    fail_mid_stream_indices: frozenset[int] = frozenset()  # these get an error event after a few tokens
    malformed_indices: frozenset[int] = frozenset()  # these get a non-JSON event after the first token
    drop_indices: frozenset[int] = frozenset()  # these lose their connection after the first token
    metrics_text: str | None = None  # Prometheus text served at /metrics; None: 404
    log_sends: bool = False  # keep per-chunk send times (served at /fake/log)
    record_bodies: bool = False  # keep every generation request's body (tests; off at high rates: memory)
    tokenize: bool = True  # serve /tokenize and /detokenize (byte-level); off: 404, as a server without them
    extra_models: tuple[str, ...] = ()  # also served (e.g. LoRA adapters, listed by /v1/models as vLLM does)
    profiler: bool = False  # answer /start_profile and /stop_profile (vLLM started with a profiler config); off: 404
    max_running: int | None = None  # most requests generating at once (vLLM's max_num_seqs); the rest wait their turn


@dataclass
class SendLog:
    recv_s: float
    sends_s: list[float] = field(default_factory=list)  # just before the write
    send_windows_s: list[float] = field(default_factory=list)  # how long the write took (preemption shows here)
    unsent_bytes: list[int] = field(default_factory=list)  # left in the kernel's send queue after it (-1: unknown)
    tokens: list[int] = field(default_factory=list)


class FakeState:
    def __init__(self, script: FakeScript) -> None:
        self.script = script
        self.requests = 0
        self.log: dict[str, SendLog] = {}
        self.bodies: list[dict[str, Any]] = []  # with script.record_bodies: each request's body, in arrival order
        self.request_ids: list[str | None] = []  # and its x-request-id header
        self.profile_calls: list[str] = []  # /start_profile, /stop_profile, in order
        self.probes: list[dict[str, Any]] = []  # requests whose x-request-id ends in "probe" (not counted above)
        self.profile_call_requests: list[int] = []  # generation requests received before each profiler call
        self.slots = asyncio.Semaphore(script.max_running) if script.max_running else None  # made on the server's loop


class _Handler(asyncio.Protocol):
    def __init__(self, state: FakeState) -> None:
        self.state = state
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.read_s = 0.0  # when the last read arrived (kernel time with the raw transport)
        self.read_s_hint: float | None = None  # set by the raw transport just before data_received
        self.busy = False
        self.resume: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses

    def pause_writing(self) -> None:
        self.resume = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.resume is not None and not self.resume.done():
            self.resume.set_result(None)
        self.resume = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.resume_writing()

    def data_received(self, data: bytes) -> None:
        self.read_s = self.read_s_hint if self.read_s_hint is not None else time.perf_counter()
        self.read_s_hint = None
        self.buffer += data
        if not self.busy:
            self._next_request()

    def _next_request(self) -> None:
        head_end = self.buffer.find(b"\r\n\r\n")
        if head_end < 0:
            return
        head = bytes(self.buffer[:head_end]).decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:])}
        length = int(headers.get("content-length", "0"))
        if len(self.buffer) < head_end + 4 + length:
            return
        body = bytes(self.buffer[head_end + 4 : head_end + 4 + length])
        del self.buffer[: head_end + 4 + length]
        method, path = head[0].split(" ")[:2]
        self.busy = True
        asyncio.get_running_loop().create_task(self._serve(method, path, headers, body))

    async def _serve(self, method: str, path: str, headers: dict[str, str], body: bytes) -> None:
        try:
            await self._route(method, path, headers, body)
        finally:
            self.busy = False
            if self.transport is not None:
                self._next_request()

    async def _route(self, method: str, path: str, headers: dict[str, str], body: bytes) -> None:
        script = self.state.script
        if script.api_key and headers.get("authorization") != f"Bearer {script.api_key}":
            self._json(401, {"error": {"message": "invalid API key", "type": "auth_error", "code": 401}})
        elif path == "/v1/models":
            models = (script.model, *script.extra_models)
            self._json(200, {"object": "list", "data": [{"id": name, "object": "model"} for name in models]})
        elif path == "/health":
            self._json(200, {})
        elif path in ("/start_profile", "/stop_profile") and script.profiler and method == "POST":
            self.state.profile_calls.append(path)
            self.state.profile_call_requests.append(self.state.requests)
            self._json(200, {})
        elif path == "/metrics":
            if script.metrics_text is None:
                self._json(404, {"detail": "Not Found"})
            else:
                self._reply(200, "Content-Type: text/plain\r\n", script.metrics_text.encode())
        elif path in ("/tokenize", "/detokenize") and not script.tokenize:
            self._json(404, {"detail": "Not Found"})
        elif path == "/tokenize":
            self._tokenize(json.loads(body))
        elif path == "/detokenize":
            tokens = json.loads(body).get("tokens", [])
            self._json(200, {"prompt": bytes(t for t in tokens if t < 256).decode("utf-8", "replace")})
        elif path == "/fake/log":
            self._json(200, {rid: entry.__dict__ for rid, entry in self.state.log.items()})
        elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            if self.state.slots is None:
                await self._stream(json.loads(body), path.endswith("chat/completions"), headers)
                return
            async with self.state.slots:  # a full batch: wait, as a request in vLLM's waiting queue does
                self.read_s = max(self.read_s, time.perf_counter())
                await self._stream(json.loads(body), path.endswith("chat/completions"), headers)
        else:
            self._json(404, {"error": {"message": f"no route {method} {path}", "type": "not_found", "code": 404}})

    def _tokenize(self, request: dict[str, Any]) -> None:
        """A byte-level tokenizer (one token per UTF-8 byte, BOS 256 when special tokens are added)."""
        if "messages" in request:
            text = "".join(f"<{m.get('role')}>{m.get('content')}" for m in request["messages"]) + "<assistant>"
            special = True
        else:
            text = str(request.get("prompt", ""))
            special = bool(request.get("add_special_tokens", True))
        tokens = ([256] if special else []) + list(text.encode())
        self._json(200, {"tokens": tokens, "count": len(tokens), "max_model_len": 1 << 20})

    async def _stream(self, request: dict[str, Any], chat: bool, headers: dict[str, str]) -> None:
        state, script = self.state, self.state.script
        recv_s = self.read_s  # the read that completed the request: its arrival, not when we got round to it
        index = self._count(request, headers)
        if request.get("model") not in (script.model, *script.extra_models):
            message = f"The model `{request.get('model')}` does not exist."
            self._json(404, {"error": {"message": message, "type": "NotFoundError", "code": 404}})
            return
        if request.get("return_token_ids") is not None and script.return_token_ids == "reject":
            message = "Unrecognized request argument supplied: return_token_ids"
            self._json(400, {"error": {"message": message, "type": "invalid_request_error", "code": 400}})
            return
        list_ids = script.send_token_ids or (
            bool(request.get("return_token_ids")) and script.return_token_ids == "accept"
        )
        if index in script.fail_request_indices:
            self._json(500, {"error": {"message": "scripted server error", "type": "InternalServerError"}})
            return
        max_tokens = int(request.get("max_tokens") or 16)
        prompt_tokens = _prompt_tokens(request)
        log = SendLog(recv_s)
        if script.log_sends:
            state.log[headers.get("x-request-id", str(index))] = log
        self._write(f"HTTP/1.1 200 OK\r\n{SSE_HEADERS}\r\n".encode())
        chunks = _chunk_sizes(max_tokens, script.tokens_per_chunk)
        pending: list[bytes] = []
        for position, tokens in enumerate(chunks):
            if position == 1 and index in script.drop_indices and self.transport is not None:
                self.transport.abort()
                return
            if position == 1 and index in script.malformed_indices:
                pending.append(_frame(b"data: {not json\n\n"))
            if position == 2 and index in script.fail_mid_stream_indices:
                error = {"error": {"message": "scripted mid-stream failure", "type": "InternalServerError"}}
                pending.append(_event(error))
                break
            due_s = recv_s + script.ttft_s + position * script.itl_s
            if script.itl_s > 0 or position == 0:
                await self._flush(pending, log)
                await _sleep_until(due_s)
            pending.append(_cached_token_event(script, chat, position, tokens, list_ids))
            log.tokens.append(tokens)
            if len(pending) >= script.chunks_per_write or script.itl_s > 0:
                await self._flush(pending, log)
                if script.itl_s == 0:
                    await asyncio.sleep(0)  # let the other streams write too
        if script.send_usage:
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens}
            usage["total_tokens"] = prompt_tokens + max_tokens
            pending.append(
                _event({"id": "cmpl-fake", "object": "chunk", "model": script.model, "choices": [], "usage": usage})
            )
        pending.append(_frame(b"data: [DONE]\n\n"))
        pending.append(b"0\r\n\r\n")
        await self._flush(pending, log, log_send=False)

    def _count(self, request: dict[str, Any], headers: dict[str, str]) -> int:
        """The request's arrival index (what the scripted faults refer to). A probe (an x-request-id ending in
        "probe", as the benchmark's token-ids probe) is served but kept apart, so it shifts no index."""
        state = self.state
        request_id = headers.get("x-request-id")
        if request_id is not None and request_id.endswith("probe"):
            state.probes.append(request)
            return -1
        index = state.requests
        state.requests += 1
        if state.script.record_bodies:
            state.bodies.append(request)
        state.request_ids.append(request_id)
        return index

    async def _flush(self, pending: list[bytes], log: SendLog, log_send: bool = True) -> None:
        if not pending:
            return
        if self.resume is not None:
            await self.resume
        data = b"".join(pending)
        pending.clear()
        if not (log_send and self.state.script.log_sends):
            self._write(data)
            return
        before_s = time.perf_counter()
        self._write(data)
        log.sends_s.append(before_s)
        log.send_windows_s.append(time.perf_counter() - before_s)
        log.unsent_bytes.append(self._unsent_bytes())

    def _unsent_bytes(self) -> int:
        """Bytes the kernel has not transmitted yet (SIOCOUTQNSD): a write still queued there (TCP small queues,
        deferred softirq) reaches the client later than the write call, so its time is no ground truth."""
        transport = self.transport
        if not isinstance(transport, _RawTransport) or transport.closed:
            return -1
        if transport.out:
            return len(transport.out)
        try:
            raw = fcntl.ioctl(transport.fd, SIOCOUTQNSD, b"\0\0\0\0")
        except OSError:
            return -1
        return int(struct.unpack("i", raw)[0])

    def _write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    def _json(self, status: int, body: Any) -> None:
        self._reply(status, JSON_HEADERS, json.dumps(body).encode())

    def _reply(self, status: int, headers: str, body: bytes) -> None:
        head = f"HTTP/1.1 {status} {_REASONS.get(status, 'OK')}\r\n{headers}Content-Length: {len(body)}\r\n\r\n"
        self._write(head.encode() + body)


_REASONS = {200: "OK", 401: "Unauthorized", 404: "Not Found", 500: "Internal Server Error"}


def _prompt_tokens(request: dict[str, Any]) -> int:
    if "messages" in request:
        return 1 + sum(len(str(m.get("content", "")).encode()) for m in request["messages"])
    prompt = request.get("prompt", "")
    return 1 + len(str(prompt).encode())


def _chunk_sizes(total: int, per_chunk: int) -> list[int]:
    sizes = [per_chunk] * (total // per_chunk)
    if total % per_chunk:
        sizes.append(total % per_chunk)
    return sizes


def _token_chunk(script: FakeScript, chat: bool, position: int, tokens: int, list_ids: bool) -> dict[str, Any]:
    if script.varied_text:
        first = position * script.tokens_per_chunk
        text = "".join(_varied_token_text(first + i) for i in range(tokens))
    else:
        text = " tok" * tokens
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": None}
    if chat:
        choice["delta"] = {"content": text} if position else {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    if list_ids:
        choice["token_ids"] = [position] * tokens
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": "cmpl-fake", "object": kind, "created": 0, "model": script.model, "choices": [choice]}


def _varied_token_text(token: int) -> str:
    """A token's text of 1 to 8 characters, scrambled by its position (Knuth's multiplicative hash)."""
    return " " + "abcdefg"[: (token * 2654435761 >> 7) % 8]


_CHUNK_CACHE: dict[tuple[Any, ...], bytes] = {}


def _cached_token_event(script: FakeScript, chat: bool, position: int, tokens: int, list_ids: bool) -> bytes:
    """A token event's bytes depend on its position only for the first chunk (chat's role) and with varied text or
    listed ids; each is encoded once, so that the server stays cheap at thousands of chunks per second."""
    by_position = position == 0 or list_ids or script.varied_text
    key: tuple[Any, ...] = (script.model, chat, position if by_position else -1, tokens, list_ids)
    key += (script.varied_text, script.tokens_per_chunk)
    if key not in _CHUNK_CACHE:
        _CHUNK_CACHE[key] = _event(_token_chunk(script, chat, position, tokens, list_ids))
    return _CHUNK_CACHE[key]


def _event(payload: dict[str, Any]) -> bytes:
    return _frame(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")


def _frame(data: bytes) -> bytes:
    """One HTTP chunk (chunked transfer encoding), as uvicorn frames each SSE event."""
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _sleep_until(due_s: float) -> None:
    delay_s = due_s - time.perf_counter()
    if delay_s > 0:
        await asyncio.sleep(delay_s)


class _RawTransport:
    """A minimal transport over a raw socket read with recvmsg, so that request arrival times are the kernel's
    (SO_TIMESTAMPNS): the benchmark's ground truth must not include this server's own event-loop lag."""

    HIGH_WATER = 256 * 1024
    LOW_WATER = 64 * 1024

    def __init__(self, sock: socket.socket, protocol: _Handler) -> None:
        self.sock = sock
        self.protocol = protocol
        self.loop = asyncio.get_running_loop()
        self.fd = sock.fileno()
        self.out = bytearray()
        self.paused = False
        self.closed = False
        self.clock = ArrivalClock()
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        protocol.connection_made(cast(asyncio.Transport, self))
        self.loop.add_reader(self.fd, self._on_readable)

    def _on_readable(self) -> None:
        try:
            data, ancillary, _, _ = self.sock.recvmsg(256 * 1024, TIMESTAMP_SPACE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.abort()
            return
        if not data:
            self.abort()
            return
        now = time.perf_counter()
        self.protocol.read_s_hint = now
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(payload) >= 16:
                seconds, nanoseconds = struct.unpack_from("qq", payload)
                self.protocol.read_s_hint = self.clock.perf_s(seconds * 1_000_000_000 + nanoseconds, now)
        self.protocol.data_received(data)

    def write(self, data: bytes) -> None:
        if self.closed:
            return
        if not self.out:
            try:
                sent = self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self.abort()
                return
            if sent == len(data):
                return
            data = data[sent:]
            self.loop.add_writer(self.fd, self._on_writable)
        self.out += data
        if len(self.out) > self.HIGH_WATER and not self.paused:
            self.paused = True
            self.protocol.pause_writing()

    def _on_writable(self) -> None:
        try:
            sent = self.sock.send(self.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.abort()
            return
        del self.out[:sent]
        if not self.out:
            self.loop.remove_writer(self.fd)
        if self.paused and len(self.out) < self.LOW_WATER:
            self.paused = False
            self.protocol.resume_writing()

    def abort(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.loop.remove_reader(self.fd)
        if self.out:
            self.loop.remove_writer(self.fd)
        self.sock.close()
        self.protocol.connection_lost(None)


async def serve_raw(script: FakeScript, host: str, port: int) -> socket.socket:
    """Listen on HOST:PORT with raw-socket connections (kernel arrival times); returns the listening socket."""
    state = FakeState(script)
    listener = socket.create_server((host, port), backlog=4096)
    listener.setblocking(False)
    loop = asyncio.get_running_loop()

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            _RawTransport(conn, _Handler(state))

    loop.add_reader(listener.fileno(), accept)
    return listener


async def serve(script: FakeScript, host: str, port: int, state: FakeState | None = None) -> asyncio.AbstractServer:
    state = state or FakeState(script)
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: _Handler(state), host, port, backlog=4096)


class FakeServerThread:
    """The fake server on its own event loop in a background thread (for tests that call sync code)."""

    def __init__(self, script: FakeScript, host: str = "127.0.0.1", port: int = 0) -> None:
        self.script = script
        self.state = FakeState(script)  # requests seen, send log
        self.host = host
        self.port = port
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> FakeServerThread:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(serve(self.script, self.host, self.port, self.state), self._loop)
        self._server = future.result(10)
        assert isinstance(self._server, asyncio.Server)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


@contextlib.contextmanager
def running(script: FakeScript) -> Iterator[FakeServerThread]:
    with FakeServerThread(script) as server:
        yield server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="fake-model")
    parser.add_argument("--ttft-ms", type=float, default=0.0)
    parser.add_argument("--itl-ms", type=float, default=0.0)
    parser.add_argument("--tokens-per-chunk", type=int, default=1)
    parser.add_argument("--chunks-per-write", type=int, default=1)
    parser.add_argument("--send-token-ids", action="store_true", help="list every chunk's token ids, asked or not")
    parser.add_argument("--varied-text", action="store_true", help="tokens of 1 to 8 characters, not ' tok'")
    parser.add_argument(
        "--return-token-ids",
        choices=["accept", "ignore", "reject"],
        default="accept",
        help="a request's return_token_ids: accept (list the ids, as vLLM), ignore, or reject with HTTP 400",
    )
    parser.add_argument("--log-sends", action="store_true")
    parser.add_argument("--no-tokenize", action="store_true", help="answer 404 to /tokenize and /detokenize")
    parser.add_argument("--max-seconds", type=float, default=600.0, help="exit after this long, whatever happens")
    parser.add_argument("--max-running", type=int, default=None, help="most requests generating at once")
    args = parser.parse_args()
    script = FakeScript(
        model=args.model,
        ttft_s=args.ttft_ms / 1000,
        itl_s=args.itl_ms / 1000,
        tokens_per_chunk=args.tokens_per_chunk,
        chunks_per_write=args.chunks_per_write,
        send_token_ids=args.send_token_ids,
        varied_text=args.varied_text,
        return_token_ids=args.return_token_ids,
        log_sends=args.log_sends,
        tokenize=not args.no_tokenize,
        max_running=args.max_running,
    )
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()

    async def run() -> None:
        listener = await serve_raw(script, args.host, args.port)
        print(f"READY http://{args.host}:{args.port}", flush=True)
        try:
            await asyncio.sleep(args.max_seconds)
        finally:
            listener.close()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())


if __name__ == "__main__":
    main()
