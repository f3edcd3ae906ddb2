"""The simulator's HTTP server: vLLM's OpenAI-compatible API over the simulated engine.

Routes (as vLLM serves them): POST /v1/completions, /v1/chat/completions, /v1/responses, /tokenize, /detokenize;
GET /v1/models, /v1/responses/{id} (Responses answers kept with `store`, the last RECORDED_BODIES), /health,
/version, /metrics. The simulator's own: GET /simulate/stats (what it saw: requests, completions, aborts, injected
faults, bodies with record_bodies), POST /simulate/control (change faults, health, metric values), GET
/simulate/sends (with log_sends: when each chunk was written, send_log.py).

A raw asyncio protocol with httptools' parser (llhttp, in C): one benchmark client drives hundreds of streams, and
the engine writes each token straight to its connection from the step callback, without a task per stream.
Responses stream with chunked transfer encoding, one SSE event per chunk, as uvicorn frames vLLM's. A client that
goes away aborts its request in the engine (vLLM does the same), which frees its KV cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import httptools
import orjson

from deepserve import __version__
from deepserve.simulate.clock import Clock, LoopClock
from deepserve.simulate.config import SimulateConfig
from deepserve.simulate.engine import Engine
from deepserve.simulate.faults import Controls
from deepserve.simulate.metrics import render
from deepserve.simulate.openai_api import (
    DONE_EVENT,
    ApiError,
    Generation,
    ReplyFormat,
    called_tool,
    error_body,
    parse_generation,
    parse_responses,
)
from deepserve.simulate.scheduler import SimRequest
from deepserve.simulate.send_log import KernelStampedServer, SendLog, StreamSends
from deepserve.simulate.setup import SimulatedDeployment, build_engine
from deepserve.simulate.tokenizer import ByteTokenizer, ChatFormatError, generated_text, varied_text

MAX_BODY_BYTES = 64 * 1024 * 1024
RECORDED_BODIES = 10_000  # record_bodies keeps at most this many (the oldest go first)
_REASONS = {
    200: b"OK", 400: b"Bad Request", 401: b"Unauthorized", 404: b"Not Found", 405: b"Method Not Allowed",
    413: b"Payload Too Large", 429: b"Too Many Requests", 500: b"Internal Server Error", 502: b"Bad Gateway",
    503: b"Service Unavailable", 504: b"Gateway Timeout",
}  # fmt: skip
_JSON = b"content-type: application/json\r\n"
_TEXT = b"content-type: text/plain; version=0.0.4; charset=utf-8\r\n"
_SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n"
_CHUNKED_END = b"0\r\n\r\n"
MALFORMED_EVENT = b"data: {not json\n\n"
RESPONSES_PATH = "/v1/responses"


@dataclass
class ServerStats:
    """What the simulator saw, for tests (GET /simulate/stats)."""

    requests: int = 0  # generation requests received
    completed: int = 0  # answered in full
    aborted: int = 0  # the client went away first
    failed: int = 0  # answered with an injected error
    cut: int = 0  # streams cut by an injected fault
    hung: int = 0  # never answered (injected)
    refused: int = 0  # answered 4xx (bad request, unknown model, too long)
    active: int = 0  # streaming now
    metrics_scrapes: int = 0
    health_checks: int = 0
    kv_prefills: int = 0  # prefills for a remote decode (kv_transfer_params do_remote_decode)
    kv_remote_prefills: int = 0  # decodes of prompts prefilled elsewhere (kv_transfer_params do_remote_prefill)
    tokenize_calls: int = 0  # POST /tokenize answered (any status)
    detokenize_calls: int = 0
    profile_calls: list[str] = field(default_factory=list)  # /start_profile, /stop_profile, in order
    profile_call_requests: list[int] = field(default_factory=list)  # generation requests received before each
    request_ids: deque[str | None] = field(default_factory=lambda: deque(maxlen=RECORDED_BODIES))
    bodies: deque[Any] = field(default_factory=lambda: deque(maxlen=RECORDED_BODIES))

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["request_ids"] = list(self.request_ids)
        data["bodies"] = list(self.bodies)
        return data


@dataclass
class _Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    keep_alive: bool
    read_s: float  # perf_counter time of the read that completed it (the kernel's receive time with log_sends)


class SimulatorApp:
    """Routes requests to the engine and the simulator's state; one per server."""

    def __init__(self, deployment: SimulatedDeployment, config: SimulateConfig, engine: Engine, clock: Clock) -> None:
        self.deployment = deployment
        self.config = config
        self.engine = engine
        self.clock = clock
        self.tokenizer = ByteTokenizer()
        self.controls = Controls.from_config(config)
        self.stats = ServerStats()
        self.models = (deployment.served_model_name, *config.lora_modules)
        self.text_of = varied_text if config.token_text == "varied" else generated_text
        self.send_log = SendLog() if config.log_sends else None
        # A stepped engine delivers one engine output per call (with speculative decoding several tokens), which
        # vLLM streams as one chunk; the fixed-latency engine's bursts are separate outputs written together.
        self.outputs_are_chunks = not config.fixed_latency
        self.connections: set[_Connection] = set()
        self.created = int(time.time())
        self.engine_id = f"deepserve-simulate-{uuid.uuid4().hex[:8]}"  # kv_transfer_params' remote_engine_id
        self.stored: OrderedDict[str, bytes] = OrderedDict()  # Responses API answers kept for GET, by id
        self._started = time.monotonic()
        self._ids = 0
        self._routes: dict[tuple[str, str], Callable[[_Connection, _Request], None]] = {
            ("GET", "/health"): self._health,
            ("GET", "/version"): self._version,
            ("GET", "/v1/models"): self._models,
            ("GET", "/metrics"): self._metrics,
            ("POST", "/tokenize"): self._tokenize,
            ("POST", "/detokenize"): self._detokenize,
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/v1/responses"): self._responses,
            ("GET", "/simulate/stats"): self._stats,
            ("POST", "/simulate/control"): self._control,
            ("GET", "/simulate/sends"): self._sends,
        }
        if not config.tokenize_endpoints:
            del self._routes[("POST", "/tokenize")]
        if not config.tokenize_endpoints or not config.detokenize_endpoint:
            del self._routes[("POST", "/detokenize")]
        if not config.metrics_endpoint:
            del self._routes[("GET", "/metrics")]
        if not config.log_sends:
            del self._routes[("GET", "/simulate/sends")]
        if config.profiler_endpoints:
            self._routes[("POST", "/start_profile")] = self._routes[("POST", "/stop_profile")] = self._profile

    def wants_usage(self, generation: Generation) -> bool:
        """Whether a stream ends with the usage chunk: as the request asks (vLLM), or as usage_chunk forces."""
        policy = self.config.usage_chunk
        return generation.include_usage if policy == "requested" else policy == "always"

    def handle(self, conn: _Connection, request: _Request) -> None:
        key = self.config.api_key
        guarded = request.path.startswith("/v1") or request.path == "/simulate/control"  # vLLM guards /v1 only
        if key and guarded and request.headers.get("authorization") != f"Bearer {key}":
            conn.send(401, _JSON, b'{"error":"Unauthorized"}')
            return
        route = self._routes.get((request.method, request.path))
        if route is None and request.method == "GET" and request.path.startswith(RESPONSES_PATH + "/"):
            route = self._stored_response
        if route is not None:
            route(conn, request)
        elif any(path == request.path for _, path in self._routes):
            conn.send(405, _JSON, b'{"detail":"Method Not Allowed"}')
        else:
            conn.send(404, _JSON, b'{"detail":"Not Found"}')

    # ---- the simple routes -------------------------------------------------------------------------------------

    def _health(self, conn: _Connection, request: _Request) -> None:
        self.stats.health_checks += 1
        status = 200 if self.controls.is_healthy(time.monotonic() - self._started, self.stats.requests) else 503
        conn.send_later(self.controls.health_delay_s, status, _JSON, b"" if status == 200 else b'{"error":"unhealthy"}')

    def _version(self, conn: _Connection, request: _Request) -> None:
        text = f"deepserve-simulate {__version__} (vLLM's V1 scheduler, simulated: {self.deployment.timing})"
        conn.send(200, _JSON, orjson.dumps({"version": text}))

    def _models(self, conn: _Connection, request: _Request) -> None:
        base = self.deployment.served_model_name
        cards = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "deepserve-simulate",
                "root": base,
                "parent": None if name == base else base,
            }
            for name in self.models
        ]
        if self.config.models_max_model_len:
            for card in cards:
                card["max_model_len"] = self.deployment.max_model_len
        conn.send(200, _JSON, orjson.dumps({"object": "list", "data": cards}))

    def _metrics(self, conn: _Connection, request: _Request) -> None:
        self.stats.metrics_scrapes += 1
        controls = self.controls
        if controls.metrics_text is not None:
            text = controls.metrics_text
        else:
            engine = self.engine
            info = self.deployment.cache_info()
            text = render(
                self.deployment.served_model_name, engine.metrics, engine.gauges(), engine.counters(), info,
                controls.metric_overrides,
            )  # fmt: skip
        conn.send_later(controls.metrics_delay_s, 200, _TEXT, text.encode("utf-8", "surrogateescape"))

    def _tokenize(self, conn: _Connection, request: _Request) -> None:
        self.stats.tokenize_calls += 1
        try:
            body = _json_object(request.body)
            self._check_model(body)
            tokens = self._tokens_of(body)
        except ChatFormatError as exc:
            self._refuse(conn, ApiError(400, str(exc), param="messages"))
            return
        except ApiError as exc:
            self._refuse(conn, exc)
            return
        max_len = self.deployment.max_model_len
        answer: dict[str, Any] = {"count": len(tokens), "max_model_len": max_len, "tokens": tokens}
        answer["token_strs"] = [self.tokenizer.decode([t]) for t in tokens] if body.get("return_token_strs") else None
        conn.send(200, _JSON, orjson.dumps(answer))

    def _tokens_of(self, body: dict[str, Any]) -> list[int]:
        """vLLM's /tokenize: chat messages through the chat template, or a prompt (with BOS unless
        add_special_tokens is false)."""
        if "messages" in body:
            if not isinstance(body["messages"], list):
                raise ApiError(400, "messages must be a list", param="messages")
            return self.tokenizer.chat_ids(body["messages"], body.get("add_generation_prompt", True) is not False)
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise ApiError(400, "prompt must be a string", param="prompt")
        return self.tokenizer.encode(prompt, add_special_tokens=body.get("add_special_tokens", True) is not False)

    def _detokenize(self, conn: _Connection, request: _Request) -> None:
        self.stats.detokenize_calls += 1
        try:
            body = _json_object(request.body)
            self._check_model(body)
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise ApiError(400, "tokens must be a list of token ids", param="tokens")
        except ApiError as exc:
            self._refuse(conn, exc)
            return
        conn.send(200, _JSON, orjson.dumps({"prompt": self.tokenizer.decode(tokens)}))

    def _profile(self, conn: _Connection, request: _Request) -> None:
        self.stats.profile_calls.append(request.path)
        self.stats.profile_call_requests.append(self.stats.requests)
        conn.send(200, _JSON, b"{}")

    def stats_json(self) -> dict[str, Any]:
        """What GET /simulate/stats answers: what the server saw, the engine's state, the controls."""
        gauges = self.engine.gauges()
        return {
            **self.stats.to_json(),
            "engine": {**self.engine.stats(), **asdict(gauges), **asdict(self.engine.counters())},
            "deployment": self.deployment.describe(),
            "controls": self.controls.to_json(),
            "healthy": self.controls.is_healthy(time.monotonic() - self._started, self.stats.requests),
        }

    def _stats(self, conn: _Connection, request: _Request) -> None:
        conn.send(200, _JSON, orjson.dumps(self.stats_json()))

    def _sends(self, conn: _Connection, request: _Request) -> None:
        assert self.send_log is not None
        conn.send(200, _JSON, orjson.dumps(self.send_log.to_json()))

    def _control(self, conn: _Connection, request: _Request) -> None:
        try:
            self.controls.apply(orjson.loads(request.body or b"{}"))
        except (ValueError, TypeError) as exc:
            self._refuse(conn, ApiError(400, str(exc)))
            return
        conn.send(200, _JSON, orjson.dumps(self.controls.to_json()))

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model not in self.models:
            message = f"The model `{model}` does not exist. Valid aliases: {self.deployment.served_model_name}."
            raise ApiError(404, message, "NotFoundError", "model")  # vLLM's words (its engine's _check_model)

    def _refuse(self, conn: _Connection, error: ApiError) -> None:
        conn.send(error.status, _JSON, orjson.dumps(error.body()))

    # ---- generation ---------------------------------------------------------------------------------------------

    def _completions(self, conn: _Connection, request: _Request) -> None:
        self._generate(conn, request, chat=False)

    def _chat(self, conn: _Connection, request: _Request) -> None:
        self._generate(conn, request, chat=True)

    def _responses(self, conn: _Connection, request: _Request) -> None:
        self._generate(conn, request, chat=True, responses=True)

    def _stored_response(self, conn: _Connection, request: _Request) -> None:
        response_id = request.path.removeprefix(RESPONSES_PATH + "/")
        stored = self.stored.get(response_id)
        if stored is None:
            self._refuse(conn, _not_stored(response_id))
            return
        conn.send(200, _JSON, stored)

    def keep_response(self, response_id: str, body: bytes) -> None:
        self.stored[response_id] = body
        while len(self.stored) > RECORDED_BODIES:
            self.stored.popitem(last=False)

    def _generate(self, conn: _Connection, request: _Request, chat: bool, responses: bool = False) -> None:
        stats = self.stats
        index = stats.requests
        stats.requests += 1
        stats.request_ids.append(request.headers.get("x-request-id"))
        try:
            body = _json_object(request.body)
        except ApiError as exc:
            stats.refused += 1
            self._refuse(conn, exc)
            return
        if self.config.record_bodies:
            stats.bodies.append(body)
        faults = self.controls.faults
        fault = faults.decide(index)
        if self._answered_by_fault(conn, fault):
            return
        try:
            generation = self._parse(body, chat, responses)
        except ApiError as exc:
            stats.refused += 1
            self._refuse(conn, exc)
            return
        self._submit(conn, request, generation, faults.cut_mode_of(index) if fault == "cut" else None)

    def _token_ids_policy(self, generation: Generation, body: dict[str, Any]) -> Generation:
        """vLLM's return_token_ids as asked, or a server that always lists ids, ignores the field, or rejects it."""
        policy = self.config.token_ids
        if policy == "always" and not generation.return_token_ids:
            return dataclasses.replace(generation, return_token_ids=True)
        if policy == "ignore" and generation.return_token_ids:
            return dataclasses.replace(generation, return_token_ids=False)
        if policy == "reject" and body.get("return_token_ids") is not None:
            raise ApiError(400, "Unrecognized request argument supplied: return_token_ids", param="return_token_ids")
        return generation

    def _parse(self, body: dict[str, Any], chat: bool, responses: bool) -> Generation:
        max_model_len = self.deployment.max_model_len
        if responses:
            previous = body.get("previous_response_id")
            if previous is not None and previous not in self.stored:
                raise _not_stored(str(previous))  # vLLM's store is its process's own
            generation = parse_responses(body, self.tokenizer, max_model_len, self.models)
        else:
            generation = parse_generation(body, chat, self.tokenizer, max_model_len, self.models)
        generation = self._answer_shape(self._token_ids_policy(generation, body), body)
        params = body.get("kv_transfer_params")
        return self._kv_transfer(generation, params) if isinstance(params, dict) else generation

    def _kv_transfer(self, generation: Generation, params: dict[str, Any]) -> Generation:
        """vLLM's prefill/decode disaggregation (a NIXL-like connector, simulated): a prefill for a remote decode
        answers with the kv_transfer_params the decode needs; a decode given them skips its prompt's prefill."""
        if params.get("do_remote_decode"):
            self.stats.kv_prefills += 1
            blocks = -(-len(generation.prompt_ids) // 16)
            produced = {
                "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                "remote_request_id": f"{self.engine_id}-{self.stats.kv_prefills}",
                "remote_block_ids": list(range(blocks)), "remote_host": "127.0.0.1", "remote_port": 5600,
                "tp_size": 1,
            }  # fmt: skip
            return dataclasses.replace(generation, kv_transfer=produced)
        if params.get("do_remote_prefill"):
            missing = [key for key in ("remote_engine_id", "remote_block_ids") if params.get(key) is None]
            if missing:
                raise ApiError(400, f"kv_transfer_params lack {', '.join(missing)}", param="kv_transfer_params")
            self.stats.kv_remote_prefills += 1
            return dataclasses.replace(generation, remote_prefill=True)
        return generation

    def _answer_shape(self, generation: Generation, body: dict[str, Any]) -> Generation:
        """Chat replies with reasoning (--reasoning-tokens, unless the request turns thinking off) or a tool call
        (--tool-calls, when the request offers tools)."""
        config = self.config
        if not generation.chat or not (config.reasoning_tokens or config.tool_calls):
            return generation
        template = body.get("chat_template_kwargs")
        thinking = not (
            isinstance(template, dict)
            and (template.get("thinking") is False or template.get("enable_thinking") is False)
        )
        return dataclasses.replace(
            generation,
            reasoning_tokens=config.reasoning_tokens if thinking else 0,
            reasoning_field=config.reasoning_field,
            tool_name=called_tool(body) if config.tool_calls else None,
        )

    def _answered_by_fault(self, conn: _Connection, fault: str | None) -> bool:
        """An injected hang (no answer at all) or error (before any byte); a cut is the reply's to make."""
        if fault == "hang":
            self.stats.hung += 1
            return True  # the connection stays busy: no byte until the client gives up
        if fault == "error":
            self.stats.failed += 1
            status = self.controls.faults.error_status
            conn.send(status, _JSON, error_body(status, "injected failure (deepserve simulate)", "InternalServerError"))
            return True
        return False

    def _submit(self, conn: _Connection, request: _Request, generation: Generation, cut_mode: str | None) -> None:
        """Hand the request to the engine, with the reply that streams (or collects) its tokens."""
        self._ids += 1
        request_id = request.headers.get("x-request-id") or f"{self._ids:08x}"
        reply = _Reply(self, conn, generation, ReplyFormat(generation, request_id, int(time.time()), self.text_of))
        if cut_mode is not None:
            reply.cut_after = self.controls.faults.cut_after_tokens
            reply.cut_mode = cut_mode
        if self.send_log is not None and generation.stream:
            reply.log = self.send_log.open(request_id, request.read_s)
        sim = SimRequest(
            str(self._ids),
            generation.prompt_ids,
            generation.max_tokens,
            min_tokens=generation.min_tokens,
            ignore_eos=generation.ignore_eos,
            eos_after=self.config.natural_output_len,
            sink=reply,
        )
        sim.num_external_tokens = len(generation.prompt_ids) if generation.remote_prefill else 0
        reply.request = sim
        conn.reply = reply
        if generation.stream:
            self.stats.active += 1
            conn.write(_SSE_HEAD + conn.close_header() + b"\r\n")
        self.engine.submit(sim)


class _Reply:
    """The answer to one generation request: the engine's TokenSink for it."""

    __slots__ = (
        "app", "conn", "cut_after", "cut_mode", "done", "format", "generation", "log", "logged_chunks", "pending",
        "request", "sent", "stalled",
    )  # fmt: skip

    def __init__(self, app: SimulatorApp, conn: _Connection, generation: Generation, fmt: ReplyFormat) -> None:
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

    def on_tokens(self, request: SimRequest, token_ids: list[int], finish_reason: str | None, now_s: float) -> None:
        if self.done or self.stalled:
            return
        self.pending.extend(token_ids)
        if not self.generation.stream:
            if finish_reason is not None:
                body = self.format.full_response(self.pending, finish_reason)
                if self.generation.store:
                    self.app.keep_response(self.format.response_id, body)
                self._finish("completed", self.conn.response(200, _JSON, body))
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


def _not_stored(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", "invalid_request_error", "response_id")


def _frames(events: list[bytes]) -> bytes:
    """Each SSE event as one HTTP chunk (chunked transfer encoding), as uvicorn sends vLLM's."""
    return b"".join(b"%x\r\n%s\r\n" % (len(event), event) for event in events)


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return cast(dict[str, Any], value)


class _Connection(asyncio.Protocol):
    """One client connection: parses requests (httptools), answers them one at a time, in order."""

    def __init__(self, app: SimulatorApp) -> None:
        self.app = app
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.reply: _Reply | None = None
        self.read_s = 0.0  # when the last read arrived
        self.read_s_hint: float | None = None  # its kernel receive time, set by KernelStampedTransport
        self._queue: deque[_Request] = deque()
        self._current: _Request | None = None
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._dispatching = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses
        self.app.connections.add(self)

    def data_received(self, data: bytes) -> None:
        hint, self.read_s_hint = self.read_s_hint, None
        self.read_s = time.perf_counter() if hint is None else hint
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.send(400, _JSON, b'{"detail":"Invalid HTTP request"}')
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.app.connections.discard(self)
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
        request = _Request(method, path, self._headers, b"".join(self._body), keep_alive, self.read_s)
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
                    self.send(413, _JSON, b'{"detail":"request body too large"}')
                    continue
                self.app.handle(self, request)
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


class SimulatorServer:
    """The simulator listening on HOST:PORT in the running event loop (PORT 0: any free port)."""

    def __init__(self, deployment: SimulatedDeployment, config: SimulateConfig) -> None:
        self.deployment = deployment
        self.config = config
        self._app: SimulatorApp | None = None
        self._server: asyncio.AbstractServer | None = None
        self._stamped: KernelStampedServer | None = None
        self.host = "127.0.0.1"
        self.port = 0

    async def start(self, host: str = "127.0.0.1", port: int = 0, clock: Clock | None = None) -> SimulatorApp:
        """Listen on HOST:PORT (0: any free port), the engine timed by CLOCK (default: the loop's, scaled by
        time_scale; a ManualClock lets a test move time by hand)."""
        clock = clock or LoopClock(self.config.time_scale)
        engine = build_engine(self.deployment, self.config, clock)
        app = SimulatorApp(self.deployment, self.config, engine, clock)
        if self.config.log_sends:  # kernel receive times: connections on the raw-socket transport
            self._stamped = KernelStampedServer(lambda: _Connection(app), host, port)
            self.port = self._stamped.port
        else:
            loop = asyncio.get_running_loop()
            self._server = await loop.create_server(lambda: _Connection(app), host, port, backlog=4096)
            self.port = int(self._server.sockets[0].getsockname()[1])
        self.host = host
        self._app = app
        return app

    @property
    def app(self) -> SimulatorApp:
        """The running simulator's state (stats, controls, engine): there once start() has returned."""
        if self._app is None:
            raise RuntimeError("the simulator has not started: call start() (or use running_simulator) first")
        return self._app

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (…/v1), as `deepserve serve` prints it."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    @property
    def root_url(self) -> str:
        return self.base_url.removesuffix("/v1")

    async def close(self) -> None:
        """Stop listening and drop every connection (streams in flight and hung requests end as cut off)."""
        if self._stamped is not None:
            self._stamped.close()
            self._stamped = None
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._app is not None:
            for conn in list(self._app.connections):
                conn.abort()
        await asyncio.sleep(0)  # let the aborted connections' connection_lost run


@contextlib.asynccontextmanager
async def running_simulator(
    deployment: SimulatedDeployment,
    config: SimulateConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    clock: Clock | None = None,
) -> AsyncIterator[SimulatorServer]:
    """The simulator serving in this event loop until the block ends (CLOCK: as SimulatorServer.start)."""
    server = SimulatorServer(deployment, config)
    await server.start(host, port, clock)
    try:
        yield server
    finally:
        await server.close()


class SimulatorThread:
    """The simulator on its own event loop in a background thread, for tests and tools that call sync code."""

    def __init__(self, deployment: SimulatedDeployment, config: SimulateConfig, host: str = "127.0.0.1", port: int = 0):
        self.server = SimulatorServer(deployment, config)
        self.server.host, self.server.port = host, port  # the URL is known before the start (when PORT is given)
        self._host, self._port = host, port
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="deepserve-simulate")

    @property
    def app(self) -> SimulatorApp:
        return self.server.app

    @property
    def base_url(self) -> str:
        return self.server.base_url

    @property
    def root_url(self) -> str:
        return self.server.root_url

    def control(self, changes: dict[str, Any]) -> None:
        """Apply CHANGES as POST /simulate/control does (faults, health, metric values), on the simulator's loop."""
        self.call(lambda: self.app.controls.apply(changes))

    def call(self, function: Callable[[], Any]) -> Any:
        """Run FUNCTION on the simulator's loop (its state is not thread-safe) and return its result."""

        async def run() -> Any:
            return function()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def __enter__(self) -> SimulatorThread:
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self.server.start(self._host, self._port), self._loop).result(30)
        except BaseException:
            self._stop_loop()  # a port in use must not leave the thread and its loop running
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self.server.close(), self._loop).result(10)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
