"""The simulator's API: vLLM's OpenAI-compatible routes over the simulated engine, and the simulator's own.

Routes (as vLLM serves them): POST /v1/completions, /v1/chat/completions, /v1/responses, /tokenize, /detokenize;
GET /v1/models, /v1/responses/{id} (Responses answers kept with `store`, the last RECORDED_BODIES), /health,
/version, /metrics. The simulator's own: GET /simulate/stats (what it saw: requests, completions, aborts, injected
faults, bodies with record_bodies), POST /simulate/control (change faults, health, metric values), GET
/simulate/sends (with log_sends: when each chunk was written, send_log.py).

A generation request goes to the engine with its reply (reply.py), which writes the tokens as they come. A client
that goes away aborts its request in the engine (vLLM does the same), which frees its KV cache.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import orjson

from deepserve import __version__
from deepserve.simulate.clock import SimClock
from deepserve.simulate.config import SimulateConfig
from deepserve.simulate.engine import SimEngine
from deepserve.simulate.faults import Controls
from deepserve.simulate.http import JSON_CONTENT, Connection, HttpRequest
from deepserve.simulate.metrics import render
from deepserve.simulate.openai_api import (
    ApiError,
    Generation,
    ReplyFormat,
    called_tool,
    error_body,
    parse_generation,
    parse_responses,
)
from deepserve.simulate.reply import Reply
from deepserve.simulate.scheduler import SimRequest
from deepserve.simulate.send_log import SendLog
from deepserve.simulate.setup import SimulatedDeployment
from deepserve.simulate.tokenizer import ByteTokenizer, ChatFormatError, generated_text, varied_text

RECORDED_BODIES = 10_000  # record_bodies keeps at most this many (the oldest go first)
_TEXT = b"content-type: text/plain; version=0.0.4; charset=utf-8\r\n"
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


class SimulatorApp:
    """Routes requests to the engine and the simulator's state; one per server."""

    def __init__(
        self, deployment: SimulatedDeployment, config: SimulateConfig, engine: SimEngine, clock: SimClock
    ) -> None:
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
        self.created = int(time.time())
        self.engine_id = f"deepserve-simulate-{uuid.uuid4().hex[:8]}"  # kv_transfer_params' remote_engine_id
        self.stored: OrderedDict[str, bytes] = OrderedDict()  # Responses API answers kept for GET, by id
        self._started = time.monotonic()
        self._ids = 0
        self._routes: dict[tuple[str, str], Callable[[Connection, HttpRequest], None]] = {
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

    def handle(self, conn: Connection, request: HttpRequest) -> None:
        key = self.config.api_key
        guarded = request.path.startswith("/v1") or request.path == "/simulate/control"  # vLLM guards /v1 only
        if key and guarded and request.headers.get("authorization") != f"Bearer {key}":
            conn.send(401, JSON_CONTENT, b'{"error":"Unauthorized"}')
            return
        route = self._routes.get((request.method, request.path))
        if route is None and request.method == "GET" and request.path.startswith(RESPONSES_PATH + "/"):
            route = self._stored_response
        if route is not None:
            route(conn, request)
        elif any(path == request.path for _, path in self._routes):
            conn.send(405, JSON_CONTENT, b'{"detail":"Method Not Allowed"}')
        else:
            conn.send(404, JSON_CONTENT, b'{"detail":"Not Found"}')

    # ---- the simple routes -------------------------------------------------------------------------------------

    def _health(self, conn: Connection, request: HttpRequest) -> None:
        self.stats.health_checks += 1
        status = 200 if self.controls.is_healthy(time.monotonic() - self._started, self.stats.requests) else 503
        conn.send_later(
            self.controls.health_delay_s, status, JSON_CONTENT, b"" if status == 200 else b'{"error":"unhealthy"}'
        )

    def _version(self, conn: Connection, request: HttpRequest) -> None:
        text = f"deepserve-simulate {__version__} (vLLM's V1 scheduler, simulated: {self.deployment.timing})"
        conn.send(200, JSON_CONTENT, orjson.dumps({"version": text}))

    def _models(self, conn: Connection, request: HttpRequest) -> None:
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
        conn.send(200, JSON_CONTENT, orjson.dumps({"object": "list", "data": cards}))

    def _metrics(self, conn: Connection, request: HttpRequest) -> None:
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

    def _tokenize(self, conn: Connection, request: HttpRequest) -> None:
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
        conn.send(200, JSON_CONTENT, orjson.dumps(answer))

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

    def _detokenize(self, conn: Connection, request: HttpRequest) -> None:
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
        conn.send(200, JSON_CONTENT, orjson.dumps({"prompt": self.tokenizer.decode(tokens)}))

    def _profile(self, conn: Connection, request: HttpRequest) -> None:
        self.stats.profile_calls.append(request.path)
        self.stats.profile_call_requests.append(self.stats.requests)
        conn.send(200, JSON_CONTENT, b"{}")

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

    def _stats(self, conn: Connection, request: HttpRequest) -> None:
        conn.send(200, JSON_CONTENT, orjson.dumps(self.stats_json()))

    def _sends(self, conn: Connection, request: HttpRequest) -> None:
        assert self.send_log is not None
        conn.send(200, JSON_CONTENT, orjson.dumps(self.send_log.to_json()))

    def _control(self, conn: Connection, request: HttpRequest) -> None:
        try:
            self.controls.apply(orjson.loads(request.body or b"{}"))
        except (ValueError, TypeError) as exc:
            self._refuse(conn, ApiError(400, str(exc)))
            return
        conn.send(200, JSON_CONTENT, orjson.dumps(self.controls.to_json()))

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model not in self.models:
            message = f"The model `{model}` does not exist. Valid aliases: {self.deployment.served_model_name}."
            raise ApiError(404, message, "NotFoundError", "model")  # vLLM's words (its engine's _check_model)

    def _refuse(self, conn: Connection, error: ApiError) -> None:
        conn.send(error.status, JSON_CONTENT, orjson.dumps(error.body()))

    # ---- generation ---------------------------------------------------------------------------------------------

    def _completions(self, conn: Connection, request: HttpRequest) -> None:
        self._generate(conn, request, chat=False)

    def _chat(self, conn: Connection, request: HttpRequest) -> None:
        self._generate(conn, request, chat=True)

    def _responses(self, conn: Connection, request: HttpRequest) -> None:
        self._generate(conn, request, chat=True, responses=True)

    def _stored_response(self, conn: Connection, request: HttpRequest) -> None:
        response_id = request.path.removeprefix(RESPONSES_PATH + "/")
        stored = self.stored.get(response_id)
        if stored is None:
            self._refuse(conn, _not_stored(response_id))
            return
        conn.send(200, JSON_CONTENT, stored)

    def keep_response(self, response_id: str, body: bytes) -> None:
        self.stored[response_id] = body
        while len(self.stored) > RECORDED_BODIES:
            self.stored.popitem(last=False)

    def _generate(self, conn: Connection, request: HttpRequest, chat: bool, responses: bool = False) -> None:
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

    def _answered_by_fault(self, conn: Connection, fault: str | None) -> bool:
        """An injected hang (no answer at all) or error (before any byte); a cut is the reply's to make."""
        if fault == "hang":
            self.stats.hung += 1
            return True  # the connection stays busy: no byte until the client gives up
        if fault == "error":
            self.stats.failed += 1
            status = self.controls.faults.error_status
            conn.send(
                status, JSON_CONTENT, error_body(status, "injected failure (deepserve simulate)", "InternalServerError")
            )
            return True
        return False

    def _submit(self, conn: Connection, request: HttpRequest, generation: Generation, cut_mode: str | None) -> None:
        """Hand the request to the engine, with the reply that streams (or collects) its tokens."""
        self._ids += 1
        request_id = request.headers.get("x-request-id") or f"{self._ids:08x}"
        reply = Reply(self, conn, generation, ReplyFormat(generation, request_id, int(time.time()), self.text_of))
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
            reply.send_stream_head()
        self.engine.submit(sim)


def _not_stored(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", "invalid_request_error", "response_id")


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return cast(dict[str, Any], value)
