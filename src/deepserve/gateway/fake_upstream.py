"""A fast fake OpenAI-compatible engine for the gateway's integration tests and overhead benchmark.

It streams like vLLM (`data: {chunk}` events, a usage-only chunk when stream_options.include_usage is set,
`data: [DONE]`), answers /health and /v1/models, and counts what a test needs to check from the engine's side:
requests seen, streams completed, streams aborted by the client (GET /stats). Run it as its own process:

    python -m deepserve.gateway.fake_upstream --port 9001 --ttft-ms 5 --itl-ms 10

Its /metrics reports its load under vLLM's names: `vllm:num_requests_running` (the streams it is sending),
`vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc` (whatever a test sets: `FakeBehaviour.waiting` and
`kv_cache_usage`, `--waiting`/`--kv-cache-usage`, or `POST /fake/load {"waiting": 3, "kv_cache_usage": 0.8}`).

`--lockstep` emits tokens the way vLLM's continuous batching does: one engine step every ITL, and every running
stream gets its next token in that same step (bursts), rather than each stream on its own timer (staggered).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, MutableMapping
from dataclasses import asdict, dataclass, field
from typing import Any

import uvicorn

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

FAKE_MODEL = "fake-model"
FAKE_MAX_MODEL_LEN = 4096
_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream")]


@dataclass
class FakeStats:
    requests: int = 0
    completed: int = 0
    aborted: int = 0
    engine_steps: int = 0  # lockstep: engine steps taken (each one gave every waiting stream a token)
    active: int = 0
    metrics_scrapes: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)  # the last few request bodies, as received


@dataclass
class FakeBehaviour:
    ttft_ms: float = 0.0  # before the first token (or the whole answer when not streamed)
    itl_ms: float = 0.0  # between tokens
    fail_status: int | None = None  # answer every generation request with this status
    healthy: bool = True
    health_delay_s: float = 0.0  # answer /health this late (an overloaded replica)
    model: str = FAKE_MODEL
    max_model_len: int = FAKE_MAX_MODEL_LEN  # refuses max_tokens that do not fit (400), as vLLM does
    advertise_max_model_len: bool = True  # list max_model_len in /v1/models (SGLang and older servers may not)
    waiting: int = 0  # reported as vllm:num_requests_waiting
    kv_cache_usage: float = 0.0  # reported as vllm:kv_cache_usage_perc (0..1)
    metrics_text: bytes | None = None  # its /metrics verbatim instead of the load above
    metrics_delay_s: float = 0.0  # answer /metrics this late
    lockstep: bool = False  # all streams get their tokens in one engine step every itl_ms
    silent: bool = False  # accept every request and answer none while set (a hung engine: alive, but silent)
    token_gate: asyncio.Semaphore | None = None  # when given, each streamed token waits for one release (tests)


class FakeUpstream:
    def __init__(self, behaviour: FakeBehaviour | None = None) -> None:
        self.behaviour = behaviour or FakeBehaviour()
        self.stats = FakeStats()
        self._steps = _EngineSteps(self.stats)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        while self.behaviour.silent and path != "/stats":
            await asyncio.sleep(0.01)
        if path == "/health":
            if self.behaviour.health_delay_s:
                await asyncio.sleep(self.behaviour.health_delay_s)
            await _respond(send, 200 if self.behaviour.healthy else 503, b"{}")
        elif path == "/v1/models":
            card: dict[str, Any] = {"id": self.behaviour.model, "object": "model"}
            if self.behaviour.advertise_max_model_len:
                card["max_model_len"] = self.behaviour.max_model_len
            await _respond(send, 200, json.dumps({"object": "list", "data": [card]}).encode())
        elif path == "/metrics":
            self.stats.metrics_scrapes += 1
            await asyncio.sleep(self.behaviour.metrics_delay_s)
            await _respond(send, 200, self.metrics_text())
        elif path == "/fake/load":
            if scope["method"] == "POST":
                load = json.loads(await _read(receive) or b"{}")
                self.behaviour.waiting = int(load.get("waiting", self.behaviour.waiting))
                self.behaviour.kv_cache_usage = float(load.get("kv_cache_usage", self.behaviour.kv_cache_usage))
            current = {"waiting": self.behaviour.waiting, "kv_cache_usage": self.behaviour.kv_cache_usage}
            await _respond(send, 200, json.dumps(current).encode())
        elif path == "/stats":
            await _respond(send, 200, json.dumps(asdict(self.stats)).encode())
        elif path in ("/v1/completions", "/v1/chat/completions"):
            await self._generate(path, receive, send)
        elif path == "/tokenize":  # vLLM's shape; one token per UTF-8 byte, like the tiny model
            request = json.loads(await _read(receive))
            tokens = list(str(request.get("prompt", "")).encode())
            answer = {"count": len(tokens), "max_model_len": self.behaviour.max_model_len, "tokens": tokens}
            await _respond(send, 200, json.dumps(answer).encode())
        else:
            await _respond(send, 404, b'{"error": {"message": "not found"}}')

    def metrics_text(self) -> bytes:
        if self.behaviour.metrics_text is not None:
            return self.behaviour.metrics_text
        model = f'{{model_name="{self.behaviour.model}"}}'
        return (
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{model} {float(self.stats.active)}\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{model} {float(self.behaviour.waiting)}\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{model} {float(self.behaviour.kv_cache_usage)}\n"
        ).encode()

    async def _generate(self, path: str, receive: Receive, send: Send) -> None:
        body = await _read(receive)
        if not body:  # the client went away (while we were silent)
            return
        request = json.loads(body)
        self.stats.requests += 1
        self.stats.bodies = [*self.stats.bodies[-9:], request]
        behaviour = self.behaviour
        if behaviour.fail_status:
            error = {"error": {"message": "injected failure", "type": "server_error", "param": None, "code": None}}
            await _respond(send, behaviour.fail_status, json.dumps(error).encode())
            return
        tokens = int(request.get("max_tokens") or request.get("max_completion_tokens") or 16)
        if tokens >= behaviour.max_model_len:
            message = f"This model's maximum context length is {behaviour.max_model_len} tokens"
            refusal = {"error": {"message": message, "type": "BadRequestError", "param": None, "code": "400"}}
            await _respond(send, 400, json.dumps(refusal).encode())
            return
        chat = path.endswith("chat/completions")
        prompt_tokens = len(json.dumps(request.get("messages") or request.get("prompt")))
        if request.get("stream"):
            await self._stream(request, chat, tokens, prompt_tokens, receive, send)
            return
        if behaviour.ttft_ms:
            await asyncio.sleep((behaviour.ttft_ms + behaviour.itl_ms * (tokens - 1)) / 1000)
        await _respond(send, 200, json.dumps(_completion(chat, tokens, prompt_tokens)).encode())
        self.stats.completed += 1

    async def _stream(
        self, request: dict[str, Any], chat: bool, tokens: int, prompt_tokens: int, receive: Receive, send: Send
    ) -> None:
        gone = asyncio.Event()
        watcher = asyncio.create_task(_watch(receive, gone))
        self.stats.active += 1
        try:
            await send({"type": "http.response.start", "status": 200, "headers": _SSE})
            delay_s = self.behaviour.ttft_ms / 1000
            lockstep_s = self.behaviour.itl_ms / 1000 if self.behaviour.lockstep else 0.0
            for index in range(tokens):
                if self.behaviour.token_gate is not None:
                    await self.behaviour.token_gate.acquire()
                if delay_s:
                    await asyncio.sleep(delay_s)
                if lockstep_s:
                    await self._steps.next(lockstep_s)
                if gone.is_set():
                    self.stats.aborted += 1
                    return
                chunk = _chunk(chat, index, tokens)
                await send({"type": "http.response.body", "body": b"data: " + chunk + b"\n\n", "more_body": True})
                delay_s = 0.0 if lockstep_s else self.behaviour.itl_ms / 1000
            tail = b""
            if (request.get("stream_options") or {}).get("include_usage"):
                usage = {
                    "id": "fake",
                    "object": "chunk",
                    "model": FAKE_MODEL,
                    "choices": [],
                    "usage": _usage(prompt_tokens, tokens),
                }
                tail = b"data: " + json.dumps(usage, separators=(",", ":")).encode() + b"\n\n"
            await send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n", "more_body": False})
            self.stats.completed += 1
        finally:
            self.stats.active -= 1
            watcher.cancel()


class _EngineSteps:
    """One engine step every STEP_S, shared by every stream that waits for its next token: all of them get it at
    the same instant. Steps are scheduled on an absolute grid (no drift) and stop when no stream waits."""

    def __init__(self, stats: FakeStats) -> None:
        self._stats = stats
        self._step = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None
        self._waiting = 0

    async def next(self, step_s: float) -> None:
        if self._timer is None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_at(loop.time() + step_s, self._tick, loop, loop.time() + step_s, step_s)
        step = self._step
        self._waiting += 1
        try:
            await step.wait()
        finally:
            self._waiting -= 1

    def _tick(self, loop: asyncio.AbstractEventLoop, at: float, step_s: float) -> None:
        step, self._step = self._step, asyncio.Event()
        had_waiters = self._waiting > 0
        self._stats.engine_steps += had_waiters
        step.set()
        if had_waiters:  # keep stepping while the batch has streams; they wait for the next step at once
            self._timer = loop.call_at(at + step_s, self._tick, loop, at + step_s, step_s)
        else:
            self._timer = None


def _chunk(chat: bool, index: int, tokens: int) -> bytes:
    finish = '"length"' if index == tokens - 1 else "null"
    if chat:
        delta = '{"role":"assistant","content":"t"}' if index == 0 else '{"content":"t"}'
        return (
            b'{"id":"fake","object":"chat.completion.chunk","created":0,"model":"' + FAKE_MODEL.encode() + b'",'
            b'"choices":[{"index":0,"delta":' + delta.encode() + b',"finish_reason":' + finish.encode() + b"}]}"
        )
    return (
        b'{"id":"fake","object":"text_completion","created":0,"model":"' + FAKE_MODEL.encode() + b'",'
        b'"choices":[{"index":0,"text":"t","finish_reason":' + finish.encode() + b"}]}"
    )


def _usage(prompt_tokens: int, tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": tokens, "total_tokens": prompt_tokens + tokens}


def _completion(chat: bool, tokens: int, prompt_tokens: int) -> dict[str, Any]:
    text = "t" * tokens
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {
        "id": "fake",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": FAKE_MODEL,
        "choices": [choice],
        "usage": _usage(prompt_tokens, tokens),
    }


async def _read(receive: Receive) -> bytes:
    parts = []
    while True:
        message = await receive()
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(parts)


async def _watch(receive: Receive, gone: asyncio.Event) -> None:
    message = await receive()
    if message["type"] == "http.disconnect":
        gone.set()


async def _respond(send: Send, status: int, body: bytes) -> None:
    headers = [*_JSON, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def uvicorn_config(app: FakeUpstream, port: int, host: str = "127.0.0.1") -> uvicorn.Config:
    return uvicorn.Config(
        app, host=host, port=port, loop="none", http="httptools", lifespan="off", access_log=False,
        log_level="warning", server_header=False, date_header=False, backlog=4096,
    )  # fmt: skip


class _QuietServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the host process (a test) owns the signals
        yield


@contextlib.asynccontextmanager
async def running_fake_upstream(
    behaviour: FakeBehaviour | None = None, port: int = 0
) -> AsyncIterator[tuple[FakeUpstream, str]]:
    """A fake upstream serving in this event loop until the block ends; yields it and its base URL."""
    app = FakeUpstream(behaviour)
    config = uvicorn_config(app, port)
    config.timeout_graceful_shutdown = 2  # a test that failed may leave a request waiting (token_gate) forever
    server = _QuietServer(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.005)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield app, f"http://127.0.0.1:{bound}/v1"
    finally:
        app.behaviour.silent = False  # requests it held would keep the server from stopping
        server.should_exit = True
        await task


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ttft-ms", type=float, default=0.0)
    parser.add_argument("--itl-ms", type=float, default=0.0)
    parser.add_argument("--fail-status", type=int, default=None)
    parser.add_argument("--lockstep", action="store_true", help="one engine step every --itl-ms for all streams")
    parser.add_argument("--waiting", type=int, default=0, help="reported as vllm:num_requests_waiting")
    parser.add_argument("--kv-cache-usage", type=float, default=0.0, help="reported as vllm:kv_cache_usage_perc")
    args = parser.parse_args(argv)
    behaviour = FakeBehaviour(
        ttft_ms=args.ttft_ms, itl_ms=args.itl_ms, fail_status=args.fail_status, lockstep=args.lockstep,
        waiting=args.waiting, kv_cache_usage=args.kv_cache_usage,
    )  # fmt: skip
    app = FakeUpstream(behaviour)
    server = uvicorn.Server(uvicorn_config(app, args.port))

    async def run() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        print(f"FAKE READY http://127.0.0.1:{args.port}/v1", flush=True)
        await task

    try:
        import uvloop

        uvloop.run(run())
    except ImportError:
        asyncio.run(run())
    sys.exit(0)


if __name__ == "__main__":
    main()
