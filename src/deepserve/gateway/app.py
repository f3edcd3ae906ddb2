"""The gateway as a plain ASGI application: authenticate, read and validate, admit, forward, account.

No web framework: routing is one dict lookup, and the body the client sent is forwarded as the same bytes object
unless a model alias or the stream usage option must be written into it. Streamed chunks are sent on as they arrive.
A watcher task per request waits for the client to go away and then cancels the request, which closes the upstream
connection (the engine sees the disconnect and frees the sequence's KV cache). At shutdown, `cut_in_flight` cancels
what is still in flight the same way, and each request ends with an error in OpenAI's shape (a stream with an error
event and its terminator)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from deepserve.gateway.asgi import (
    JSON_HEADER,
    Message,
    Receive,
    Scope,
    Send,
    header,
    read_request_body,
    request_headers,
    send_error,
    send_json,
)
from deepserve.gateway.balancing import PolicySettings, RoutingHints, make_policy, prompt_text_for_routing
from deepserve.gateway.clock import Clock
from deepserve.gateway.config import GatewayConfig
from deepserve.gateway.connections import ConnectionGuard
from deepserve.gateway.disaggregation import decode_body, kv_transfer_params, prefill_body
from deepserve.gateway.engine_load import EngineLoadScraper
from deepserve.gateway.engine_metrics import ENGINE_METRICS_PATH, EngineMetricsCache
from deepserve.gateway.errors import (
    AuthenticationFailed,
    BodyTooLarge,
    ClientGone,
    GatewayError,
    GatewayShuttingDown,
    InternalError,
    MethodNotAllowed,
    NoHealthyUpstream,
    NotFound,
    Overloaded,
    PermissionDenied,
    RateLimited,
    UpstreamBadStatus,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from deepserve.gateway.exchange import Exchange, billable_tokens
from deepserve.gateway.http_client import HttpClient, HttpResponse, Resolver, system_resolve
from deepserve.gateway.http_server import DISCONNECT_SCOPE_KEY, SEND_NOW_SCOPE_KEY
from deepserve.gateway.keys import ApiKey, KeyRing, key_source
from deepserve.gateway.ledger import UsageLedger, UsageRow
from deepserve.gateway.limits import Limiter, make_limiter
from deepserve.gateway.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from deepserve.gateway.metrics import GatewayMetrics
from deepserve.gateway.relay import StreamRelay
from deepserve.gateway.responses import ResponseRoutes
from deepserve.gateway.streaming import StreamTap
from deepserve.gateway.upstreams import (
    CLIENT_FAILURES,
    IDLE_CONNECTION_S,
    UpstreamPool,
    UpstreamReplica,
    iter_chunks,
    read_body,
    upstream_error,
)
from deepserve.gateway.usage import TokenCounts
from deepserve.gateway.validation import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    RESPONSES,
    ApiRoute,
    ParsedRequest,
    load_json_object,
    parse_request,
    resolve_model,
)

log = logging.getLogger(__name__)
# One line per request when --access-log is on (server.run_gateway sends it to stderr).
access_log = logging.getLogger("deepserve.gateway.access")

_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_KEY_REFRESH_INTERVAL_S = 1.0
# The most tokens a request is charged to its key's tokens-per-minute bucket when the model's context length is not
# known (no max_model_len from the upstream's /v1/models nor --max-model-len): DeepSeek-V3's context, 128K tokens.
# A charge never exceeds the context: the engine cannot use more, whatever max_tokens says.
DEFAULT_CHARGE_CAP_TOKENS = 131072


class GatewayApp:
    def __init__(
        self,
        config: GatewayConfig,
        *,
        keyring: KeyRing | None = None,
        ledger: UsageLedger | None = None,
        limiter: Limiter | None = None,
        clock: Clock = time.monotonic,
        resolve: Resolver = system_resolve,
    ) -> None:
        """CLOCK times every deadline of the gateway (client connections, upstream requests, the slot queue, the
        engine-metrics cache, the age of the engines' load); tests pass a fake one and call the checks directly.
        LIMITER defaults to the one the config asks for (`make_limiter`). RESOLVE finds the addresses of a host
        name (the upstreams' with --discover-upstreams; tests give their own DNS)."""
        self.config = config
        self.aliases = config.aliases()
        self.template_defaults = config.chat_template_defaults()
        self.keys_required = config.keys_required()
        policy = make_policy(
            config.balancing, PolicySettings(config.score_weights(), config.engine_metrics_interval_s, clock)
        )
        self.client = HttpClient(
            connect_timeout_s=config.connect_timeout_s,
            read_timeout_s=config.upstream_timeout_s,
            idle_s=IDLE_CONNECTION_S,
            clock=clock,
        )  # the process's one HTTP client: every pool's requests, checks and scrapes
        pool_settings: dict[str, Any] = {
            "health_check_interval_s": config.health_check_interval_s,
            "max_model_len": config.max_model_len,
            "clock": clock,
            "client": self.client,
            "api_key_file": config.upstream_api_key_file,
            "discover": config.discover_upstreams,
            "discovery_interval_s": config.discovery_interval_s,
            "resolve": resolve,
        }
        self.pool = UpstreamPool(config.upstream, policy, **pool_settings)
        self.prefill_pool = (  # prefill/decode disaggregation: the prefill replicas, balanced by a policy of their own
            UpstreamPool(config.prefill_upstream, make_policy(config.balancing, PolicySettings()), **pool_settings)
            if config.prefill_upstream
            else None
        )
        self.limiter = limiter or make_limiter(config, clock)
        self.connections = ConnectionGuard(
            header_timeout_s=config.header_timeout_s,
            body_timeout_s=config.body_timeout_s,
            max_header_bytes=config.max_header_bytes,
            max_connections=config.max_connections,
            clock=clock,
        )
        self.metrics = GatewayMetrics(self.pool, self.limiter, self.connections, lambda: self.ledger, self.prefill_pool)
        self.keyring = keyring
        self.ledger = ledger
        self.lost_ledger_rows = 0  # set by close(): rows the ledger could not write
        self._owns_state = keyring is None and ledger is None
        self._engine_metrics = EngineMetricsCache(self.pool, clock=clock)
        self.engine_load_scraper = (  # engine_aware balancing only
            EngineLoadScraper(self.pool, policy.engine_load, config.engine_metrics_interval_s, clock)
            if policy.engine_load is not None
            else None
        )
        self._prompt_for_routing = policy.wants_prompt
        self._prefix_for_routing = policy.wants_prefix
        self._session_header = config.session_header.encode()
        self._key_task: asyncio.Task[None] | None = None
        self._in_flight: dict[Exchange, asyncio.Task[Any]] = {}  # proxied requests, for cut_in_flight
        self._access_log = access_log if config.access_log else None
        self._routes: dict[str, Callable[[Scope, Receive, Send], Awaitable[None]]] = {
            CHAT_COMPLETIONS.path: self._chat_completions,
            COMPLETIONS.path: self._completions,
            RESPONSES.path: self._responses,
            "/v1/models": self._models,
            "/tokenize": self._tokenizer,
            "/detokenize": self._tokenizer,
            "/health": self._health,
            "/ready": self._ready,
            "/metrics": self._metrics,
            ENGINE_METRICS_PATH: self._replica_metrics,
        }
        # the proxied endpoints write their own access-log lines
        self._proxied = tuple(self._routes[endpoint.path] for endpoint in (CHAT_COMPLETIONS, COMPLETIONS, RESPONSES))
        self.responses = ResponseRoutes()

    # ---- lifecycle ----------------------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._owns_state:
            self.keyring = KeyRing(key_source(self.config.keys_file))
            self.ledger = UsageLedger(self.config.ledger_path)
        await self.limiter.start()
        if self.keyring is not None:
            self.keyring.revoked_ids = self.limiter.revoked_ids  # one set: what Redis announces is refused at once
        self.limiter.watch(self.metrics.limiter_fallbacks.inc, self.metrics.redis_errors.inc)
        await self.pool.start()
        if self.prefill_pool is not None:
            await self.prefill_pool.start()
        if self.engine_load_scraper is not None:
            await self.engine_load_scraper.scrape_once()
            self.engine_load_scraper.start()
        self.connections.start()
        self._key_task = asyncio.create_task(self._refresh_keys(), name="key-refresh")

    async def close(self) -> None:
        if self._key_task:
            self._key_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._key_task
        if self.engine_load_scraper is not None:
            await self.engine_load_scraper.close()
        await self.limiter.close()
        await self.connections.close()
        await self.pool.close()
        if self.prefill_pool is not None:
            await self.prefill_pool.close()
        await self.client.close()
        if self._owns_state and self.ledger:
            self.lost_ledger_rows = self.ledger.close()
        if self._owns_state and self.keyring:
            self.keyring.source.close()
        self.metrics.publish_live_state()  # with several workers: this one's last counts outlive it

    @property
    def requests_in_flight(self) -> int:
        """Requests being proxied now (what `cut_in_flight` would end)."""
        return len(self._in_flight)

    def cut_in_flight(self, reason: str) -> int:
        """End every proxied request still in flight (the shutdown grace period is over): a stream gets an error
        event and its terminator, a request not yet answered gets 503; the ledger records them with REASON and the
        tokens delivered. Returns how many were cut."""
        cut = 0
        for exchange, task in list(self._in_flight.items()):
            if not exchange.finished and exchange.cut is None:
                exchange.cut = reason
                task.cancel()
                cut += 1
        return cut

    async def _refresh_keys(self) -> None:
        while True:
            await asyncio.sleep(_KEY_REFRESH_INTERVAL_S)
            await self.refresh_keys()
            self.metrics.publish_live_state()  # with several workers: where the others' /metrics see it

    async def refresh_keys(self) -> None:
        """Reload the key database if it changed, and tell the other gateways (through Redis, when limits are
        shared) about revocations they may not have seen: their hosts may have their own copy of the database."""
        if self.keyring is None:
            return
        try:
            self.keyring.refresh()
        except Exception:
            log.exception("reloading keys failed; keeping the previous set")
        if not self.limiter.shared:
            return
        for key_id, revoked_at in self.keyring.revoked_here.items():
            if key_id not in self.keyring.revoked_ids:
                try:
                    await self.limiter.publish_revocation(key_id, revoked_at)
                except Exception as exc:  # tried again on the next refresh
                    log.warning("could not publish the revocation of key %s to Redis: %s", key_id, exc)
                    return

    # ---- ASGI ---------------------------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            handler = self._routes.get(scope["path"])
            if handler is None and scope["path"].startswith(_RESPONSE_BY_ID):
                handler = self._response_by_id
            if self._access_log is not None and handler not in self._proxied:
                await self._access_logged(handler or self._not_found, scope, receive, send)
            elif handler is None:
                await self._not_found(scope, receive, send)
            else:
                await handler(scope, receive, send)

    async def _not_found(self, scope: Scope, receive: Receive, send: Send) -> None:
        routes = ", ".join(self._routes)
        await send_error(send, NotFound(f"no route {scope['path'][:200]}; the gateway serves {routes}"))

    async def _access_logged(
        self, handler: Callable[[Scope, Receive, Send], Awaitable[None]], scope: Scope, receive: Receive, send: Send
    ) -> None:
        """HANDLER, then one access-log line (the proxied endpoints write their own, with key, model and tokens)."""
        started_s = time.perf_counter()
        status = 0

        async def noting_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await handler(scope, receive, noting_status)
        finally:
            if self._access_log is not None:
                elapsed_ms = (time.perf_counter() - started_s) * 1000
                self._access_log.info(
                    '%s "%s %s" %d %.1fms', _client_text(scope.get("client")), scope["method"], scope["path"][:200],
                    status, elapsed_ms,
                )  # fmt: skip

    # ---- small routes -------------------------------------------------------------------------------------------

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, 200, b'{"status":"ok"}')

    async def _ready(self, scope: Scope, receive: Receive, send: Send) -> None:
        healthy = sum(replica.healthy for replica in self.pool.replicas)
        body = json.dumps({"ready": healthy > 0, "healthy_upstreams": healthy, "upstreams": len(self.pool.replicas)})
        await send_json(send, 200 if healthy else 503, body.encode())

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _send_prometheus(send, self.metrics.render())

    async def _replica_metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The engines' own series, labelled by replica URL: when the gateway requires keys, only for a caller with
        a valid key (the URLs say where the engines live); on an open gateway, for anyone."""
        if self.keys_required:
            try:
                self._authenticate(header(scope, b"authorization"))
            except GatewayError as exc:
                self.metrics.rejections.labels(exc.code or exc.error_type).inc()
                await send_error(send, exc)
                return
        await _send_prometheus(send, await self._engine_metrics.body())

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            key = self._authenticate(header(scope, b"authorization"))
        except GatewayError as exc:
            await send_error(send, exc)
            return
        created = int(time.time())
        cards = [
            {"id": name, "object": "model", "created": created, "owned_by": "deepserve", "max_model_len": max_len}
            for name, max_len in self.pool.models.items()
        ]
        cards += [
            {"id": alias, "object": "model", "created": created, "owned_by": "deepserve", "root": target}
            for alias, target in self.aliases.items()
            if target in self.pool.models
        ]
        if key is not None:
            cards = [card for card in cards if key.allows(str(card["id"]))]
        await send_json(send, 200, json.dumps({"object": "list", "data": cards}).encode())

    async def _tokenizer(self, scope: Scope, receive: Receive, send: Send) -> None:
        """vLLM's /tokenize and /detokenize, forwarded to a replica that serves the model, so that clients (the
        benchmark among them) count tokens exactly as the engine does. Nothing is generated: no queue, no charge."""
        try:
            if scope["method"] != "POST":
                raise MethodNotAllowed(f"{scope['path']} takes POST")
            headers = request_headers(scope, self._session_header)
            key = self._authenticate(headers.authorization)
            raw = await read_request_body(receive, headers.content_length, self.config.max_body_bytes, scope)
            request = load_json_object(raw)
            client_model = str(request.get("model") or next(iter(self.pool.models), ""))
            model = resolve_model(client_model, self.pool.models, self.aliases)
            self._authorize(key, client_model, model)
            if model != client_model:
                raw = json.dumps({**request, "model": model}).encode()
            replica = self.pool.choose(model, RoutingHints(), ())
            response = await self.pool.post(replica, scope["path"], raw)
            try:
                body = await read_body(response, replica)
            finally:
                response.release()
        except GatewayError as exc:
            await send_error(send, exc)
            return
        except Exception as exc:  # a bug of ours: answer in OpenAI's shape, keep the traceback in the log
            log.exception("unexpected error while forwarding %s", scope["path"])
            await send_error(send, InternalError(f"internal gateway error ({type(exc).__name__})"))
            return
        await send_json(send, response.status, body)

    # ---- the proxied endpoints ----------------------------------------------------------------------------------

    async def _chat_completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._proxy(CHAT_COMPLETIONS, scope, receive, send)

    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._proxy(COMPLETIONS, scope, receive, send)

    async def _responses(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._proxy(RESPONSES, scope, receive, send)

    async def _response_by_id(self, scope: Scope, receive: Receive, send: Send) -> None:
        """GET /v1/responses/{id} (stored responses; `?stream=true` replays a background one) and POST
        /v1/responses/{id}/cancel, forwarded to the replica that answered the response (vLLM keeps them in its own
        memory: responses.py), or, for one this process did not relay, to each healthy replica until one has it.
        Nothing is generated: no queue, no charge, no ledger row."""
        try:
            response_id, action = _response_id_and_action(scope)
            key = self._authenticate(header(scope, b"authorization"))
            replicas = self._replicas_holding(response_id, key)
            query = scope.get("query_string") or b""
            target = scope["path"] + ("?" + query.decode("latin-1") if query else "")
            streamed = b"stream=true" in query.lower()
            for index, replica in enumerate(replicas):
                response = await self.pool.request(replica, scope["method"], target)
                if response.status == 404 and index < len(replicas) - 1:
                    await read_body(response, replica)
                    response.release()
                    continue  # not this one's
                await self._relay_answer(response, replica, streamed and action == "" and response.status == 200, send)
                return
        except GatewayError as exc:
            await send_error(send, exc)
        except Exception as exc:  # a bug of ours: answer in OpenAI's shape, keep the traceback in the log
            log.exception("unexpected error while forwarding %s", scope["path"][:200])
            await send_error(send, InternalError(f"internal gateway error ({type(exc).__name__})"))

    def _replicas_holding(self, response_id: str, key: ApiKey | None) -> list[UpstreamReplica]:
        """Where RESPONSE_ID may be: the replica that answered it, or every healthy one; NotFound when another key
        asked for it (or no replica can be asked)."""
        stored = self.responses.find(response_id)
        if stored is not None and key is not None and stored.key_id not in (None, key.id):
            raise _response_not_found(response_id)
        healthy = [replica for replica in self.pool.replicas if replica.healthy]
        if stored is not None:
            holder = [replica for replica in healthy if replica.url == stored.replica]
            return holder or healthy
        if not healthy:
            raise NoHealthyUpstream("no healthy upstream to ask for the response")
        return healthy

    async def _relay_answer(self, response: HttpResponse, replica: UpstreamReplica, streamed: bool, send: Send) -> None:
        """RESPONSE as the upstream gave it: a stream relayed as it comes, anything else whole."""
        complete = False
        try:
            if not streamed:
                body = await read_body(response, replica)
                complete = True
                await send_json(send, response.status, body)
                return
            await send({"type": "http.response.start", "status": response.status, "headers": _SSE_HEADERS})
            async for chunk in iter_chunks(response, replica):
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            complete = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            if complete:
                response.release()
            else:
                response.close()

    async def _proxy(self, endpoint: ApiRoute, scope: Scope, receive: Receive, send: Send) -> None:
        exchange = Exchange(endpoint, scope.get("client"), scope["method"])
        exchange.send_now = scope.get(SEND_NOW_SCOPE_KEY)
        watcher: asyncio.Task[None] | None = None
        task = asyncio.current_task()
        if task is not None:
            self._in_flight[exchange] = task
        try:
            if scope["method"] != "POST":
                raise MethodNotAllowed(f"{endpoint.path} takes POST")
            headers = request_headers(scope, self._session_header)
            exchange.key = self._authenticate(headers.authorization)
            raw = await read_request_body(receive, headers.content_length, self.config.max_body_bytes, scope)
            if self.config.log_bodies:
                exchange.request_body = raw
            parsed = parse_request(endpoint, raw, self.pool.models, self.aliases, self.template_defaults)
            exchange.parsed = parsed
            self._authorize(exchange.key, parsed.client_model, parsed.model)
            preferred = self._continued_on(parsed, exchange.key) if endpoint is RESPONSES else None
            key = exchange.key
            exchange.admission = await self.limiter.admit(
                key.id if key else None, key.limits if key else None, self.tpm_charge(parsed)
            )
            watcher = _cancel_on_disconnect(scope, receive, exchange, task)
            await self.limiter.acquire_slot(exchange.admission)
            prompt = prompt_text_for_routing(parsed.request, endpoint.prompt_field) if self._prompt_for_routing else ""
            prefix = parsed.affinity_text if self._prefix_for_routing else ""
            hints = RoutingHints(prefix, headers.session, prompt)
            await self._forward(exchange, parsed, hints, send, preferred)
        except GatewayError as exc:
            await self._fail(exchange, exc, send)
        except Exception as exc:  # a bug of ours: still answer in OpenAI's shape, and keep the traceback in the log
            log.exception("unexpected error while proxying %s", endpoint.path)
            await self._fail(exchange, InternalError(f"internal gateway error ({type(exc).__name__})"), send)
        except asyncio.CancelledError:
            if exchange.client_gone:
                _uncancel()
                exchange.status, exchange.error = ClientGone.status, "client disconnected"
            elif exchange.cut is not None:
                _uncancel()
                message = f"the gateway is shutting down ({exchange.cut}); retry the request"
                await self._fail(exchange, GatewayShuttingDown(message, ledger_message=f"cut: {exchange.cut}"), send)
            else:
                raise
        finally:
            self._in_flight.pop(exchange, None)
            if watcher is not None:
                watcher.cancel()
            self._account(exchange)

    def _authenticate(self, authorization: bytes | None) -> ApiKey | None:
        key = None
        if authorization and authorization[:7].lower() == b"bearer " and self.keyring is not None:
            key = self.keyring.verify(authorization[7:].decode("latin-1").strip())
        if key is None and self.keys_required:
            what = "an invalid or revoked" if authorization else "no"
            raise AuthenticationFailed(
                f"{what} API key was given; send 'Authorization: Bearer dsk-…' "
                "(an admin creates one with `deepserve keys create NAME`)"
            )
        return key

    def _authorize(self, key: ApiKey | None, client_model: str, model: str) -> None:
        if key is not None and not (key.allows(client_model) or key.allows(model)):
            allowed = ", ".join(sorted(key.models or ()))
            raise PermissionDenied(f"this key may not use {client_model!r}; it may use: {allowed}", param="model")

    def tpm_charge(self, parsed: ParsedRequest) -> int:
        """Tokens charged to the key's tpm bucket on admission (corrected with the real usage afterwards): the
        estimate, but never more than the model's context (DEFAULT_CHARGE_CAP_TOKENS when that is unknown), so
        that one request with an absurd max_tokens cannot put a key in debt for years."""
        context = self.pool.models.get(parsed.model) or DEFAULT_CHARGE_CAP_TOKENS
        return min(parsed.charged_tokens, context)

    def _continued_on(self, parsed: ParsedRequest, key: ApiKey | None) -> str | None:
        """The replica a Responses request that continues an earlier one (previous_response_id) must go to, when this
        gateway relayed that one; NotFound when another key made it."""
        previous = parsed.request.get("previous_response_id")
        if not isinstance(previous, str):
            return None
        stored = self.responses.find(previous)
        if stored is None:
            return None
        if key is not None and stored.key_id not in (None, key.id):
            raise _response_not_found(previous, param="previous_response_id")
        return stored.replica

    async def _forward(
        self, exchange: Exchange, parsed: ParsedRequest, hints: RoutingHints, send: Send, preferred: str | None = None
    ) -> None:
        """Try replicas until one answers, while the client has received nothing. Another replica is preferred for
        a retry; when there is none, a replica that dropped the connection (rather than refusing it) is tried
        again: a keep-alive connection it had just closed fails exactly like that, and a new one is fine. PREFERRED
        (a replica's URL) is tried first when it can serve the request."""
        body = parsed.body
        if self._disaggregated(exchange.endpoint, parsed):
            prefilled = await self._prefill(exchange, parsed, hints)
            if isinstance(prefilled, _EngineAnswer):  # the prefill engine refused the request: that is the answer
                await self._send_whole(exchange, prefilled.status, prefilled.body, send)
                return
            body = prefilled
        tried: list[UpstreamReplica] = []
        failure: UpstreamError | None = None  # the last attempt's
        while True:
            try:
                replica = self.pool.choose(parsed.model, hints, tried, preferred)
            except NoHealthyUpstream:
                if failure is None:
                    raise
                dropped = isinstance(failure, UpstreamUnavailable) and not failure.refused
                if not (dropped and tried[-1].healthy):
                    raise failure from None  # what went wrong, rather than "no replica left"
                replica = tried[-1]
            tried.append(replica)
            exchange.upstream = replica.url
            replica.outstanding += 1
            try:
                await self._attempt(exchange, parsed, replica, send, body)
                return
            except UpstreamError as exc:
                self._count_failure(self.pool, replica, exc)
                if exchange.response_started or not exc.retryable or len(tried) > self.config.max_retries:
                    raise
                failure = exc
                self.metrics.retries.inc()
            finally:
                replica.outstanding -= 1

    def _count_failure(self, pool: UpstreamPool, replica: UpstreamReplica, exc: UpstreamError) -> None:
        self.metrics.upstream_failures.labels(replica.url, exc.code or "").inc()
        if (isinstance(exc, UpstreamUnavailable) and exc.refused) or isinstance(exc, UpstreamTimeout):
            # Nothing listens, or it is silent: no new request should wait for it until a health check passes
            # again (and requests already waiting for it move to another replica).
            pool.mark_down(replica, exc.message)

    # ---- prefill/decode disaggregation --------------------------------------------------------------------------

    def _disaggregated(self, endpoint: ApiRoute, parsed: ParsedRequest) -> bool:
        """Prefilled apart: completions and chat, when prefill replicas are configured and the client does not run
        the KV-transfer protocol itself."""
        return (
            self.prefill_pool is not None
            and endpoint in (CHAT_COMPLETIONS, COMPLETIONS)
            and "kv_transfer_params" not in parsed.request
        )

    async def _prefill(self, exchange: Exchange, parsed: ParsedRequest, hints: RoutingHints) -> bytes | _EngineAnswer:
        """Prefill the prompt on a prefill replica (disaggregation.py); the decode request's body, or the prefill
        engine's refusal. With no prefill to be had, the request as it is: its decode replica prefills it (a
        fallback)."""
        pool = self.prefill_pool
        assert pool is not None
        request, body = prefill_body(parsed.body)
        started_s = time.perf_counter()
        tried: list[UpstreamReplica] = []
        reason = "no_prefill_replica"
        while len(tried) <= self.config.max_retries:
            try:
                replica = pool.choose(parsed.model, hints, tried)
            except NoHealthyUpstream:
                break
            tried.append(replica)
            replica.outstanding += 1
            try:
                status, answer = await self._send_prefill(pool, replica, exchange.endpoint.path, body)
            except UpstreamError as exc:
                self._count_failure(pool, replica, exc)
                reason = "prefill_failed"
                continue
            finally:
                replica.outstanding -= 1
            if status != 200:
                return _EngineAnswer(status, answer)
            exchange.prefill_upstream = replica.url
            self.metrics.pd_phase(parsed.model, "prefill").observe(time.perf_counter() - started_s)
            params = kv_transfer_params(answer)
            # Without kv_transfer_params the decode request goes as the client sent it: a connector that finds the
            # KV by the prompt itself (vLLM's ExampleConnector) loads it so, and never returns any.
            self.metrics.pd_handoffs.labels("none" if params is None else "returned").inc()
            exchange.decode_sent_s = time.perf_counter()
            return parsed.body if params is None else decode_body(request, params)
        self.metrics.pd_fallbacks.labels(reason).inc()
        log.warning("prefill/decode: %s; the decode replica prefills the request itself", reason.replace("_", " "))
        return parsed.body

    async def _send_prefill(
        self, pool: UpstreamPool, replica: UpstreamReplica, path: str, body: bytes
    ) -> tuple[int, bytes]:
        """A prefill request's (status, whole answer); an upstream 5xx is an UpstreamBadStatus (tried elsewhere)."""
        response = await pool.post(replica, path, body)
        complete = False
        try:
            answer = await read_body(response, replica)
            complete = True
        finally:
            if complete:
                response.release()
            else:
                response.close()
        if response.status >= 500:
            detail = answer[:300].decode(errors="replace")
            raise UpstreamBadStatus(f"prefill upstream {replica.url} answered {response.status}: {detail}")
        return response.status, answer

    async def _attempt(
        self, exchange: Exchange, parsed: ParsedRequest, replica: UpstreamReplica, send: Send, body: bytes
    ) -> None:
        # A stream's head comes at once from a live engine (its tokens follow): a replica silent for longer hangs.
        # A non-streamed answer's head comes with the whole answer, so only the read timeout applies to it.
        first_byte_timeout_s = self.config.first_byte_timeout_s if parsed.stream else None
        response = await self.pool.post(
            replica, exchange.endpoint.path, body, first_byte_timeout_s=first_byte_timeout_s
        )
        complete = False
        try:
            if response.status >= 500:
                detail = (await read_body(response, replica))[:300].decode(errors="replace")
                raise UpstreamBadStatus(f"upstream {replica.url} answered {response.status}: {detail}")
            if parsed.stream and response.status == 200:
                await self._relay_stream(exchange, parsed, response, replica, send)
            else:
                answer = await read_body(response, replica)
                await self._send_whole(exchange, response.status, answer, send)
            complete = True
        finally:
            if complete:
                response.release()  # read to the end: the connection goes back to the pool
            else:
                response.close()  # mid-response: close it, so that the engine sees the abort

    async def _send_whole(self, exchange: Exchange, status: int, body: bytes, send: Send) -> None:
        exchange.status = status
        if exchange.head_sent:  # a retry's refusal, after the first replica's 200 head went out: an error event
            exchange.finished = exchange.response_started = True
            await send({"type": "http.response.body", "body": _error_event(status, body), "more_body": False})
            return
        if status == 200 and b'"usage"' in body:
            with contextlib.suppress(ValueError, AttributeError, RecursionError):  # an answer we cannot read is
                answer = orjson.loads(body)  # forwarded all the same, only not accounted
                usage = answer.get("usage")
                exchange.usage = usage if isinstance(usage, dict) else None
                if exchange.endpoint is RESPONSES and isinstance(answer.get("id"), str):
                    exchange.response_id = answer["id"]
        if self.config.log_bodies:
            exchange.logged_body = [body]
        exchange.finished = True
        exchange.response_started = True
        headers = [JSON_HEADER, (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _relay_stream(
        self, exchange: Exchange, parsed: ParsedRequest, response: HttpResponse, replica: UpstreamReplica, send: Send
    ) -> None:
        """Forward the complete events as they arrive: from the upstream connection's read callback while the
        client's connection takes them (relay.py), else from here, one await on the connection for whatever arrived
        together and one write to the client."""
        tap = exchange.tap = StreamTap(parsed.strip_usage_chunk, exchange.endpoint.stream_shape)
        exchange.logged_body = [] if self.config.log_bodies else None
        itl = self.metrics.for_model(parsed.client_model).itl_s
        relay = StreamRelay(exchange, tap, itl, exchange.send_now)
        sink = relay.offer_sink
        if not exchange.head_sent:
            # The head now, as the engine sent its own: a client that parses it at the first token instead (every
            # stream of an engine step at once) adds that to every stream's TTFT (docs/PERFORMANCE.md)
            await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
            await send({"type": "http.response.body", "body": b"", "more_body": True})
            exchange.head_sent = True
        while True:
            try:
                chunk = await response.next_data(sink)
            except CLIENT_FAILURES as exc:
                raise upstream_error(exc, replica) from exc
            if relay.held:
                await relay.send_held(send)
            if chunk:
                await relay.forward(chunk, send)
            elif response.complete:
                break
        await relay.finish(send)

    async def _fail(self, exchange: Exchange, exc: GatewayError, send: Send) -> None:
        exchange.error = exc.ledger_text()
        if isinstance(exc, (RateLimited, Overloaded)):
            self.metrics.rejections.labels(exc.reason).inc()
        elif isinstance(exc, (AuthenticationFailed, PermissionDenied, BodyTooLarge)):
            self.metrics.rejections.labels(exc.code or exc.error_type).inc()
        if isinstance(exc, ClientGone):
            exchange.status = exc.status
            return
        exchange.finished = True
        if exchange.response_started or exchange.head_sent:
            # The stream's head is on the wire (status 200): end it with an error event.
            exchange.status = exc.status
            await send({"type": "http.response.body", "body": exc.sse_event(), "more_body": False})
        else:
            exchange.status = exc.status
            exchange.response_started = True
            await send_error(send, exc)

    def _account(self, exchange: Exchange) -> None:
        """Metrics, the key's token correction, the ledger row and the access-log line; never raises into the
        request."""
        try:
            self._remember_response(exchange)
            tokens = exchange.token_counts()
            if exchange.admission is not None:
                self.limiter.release(exchange.admission, billable_tokens(exchange, tokens))
            self._observe(exchange, tokens)
            if self.ledger is not None:
                self.ledger.record(self._usage_row(exchange, tokens))
            if self._access_log is not None:
                self._log_access(exchange, tokens)
        except Exception:
            log.exception("accounting for a request failed")

    def _remember_response(self, exchange: Exchange) -> None:
        response_id = exchange.response_id or (exchange.tap.response_id if exchange.tap is not None else None)
        if response_id is not None and exchange.upstream is not None and exchange.status == 200:
            self.responses.remember(response_id, exchange.upstream, exchange.key.id if exchange.key else None)

    def _log_access(self, exchange: Exchange, tokens: TokenCounts) -> None:
        assert self._access_log is not None
        prompt, completion = tokens.prompt, tokens.completion
        ttft = f"{exchange.ttft_s * 1000:.1f}ms" if exchange.ttft_s is not None else "-"
        self._access_log.info(
            '%s "%s %s" %d %.1fms key=%s model=%s upstream=%s ttft=%s tokens=%s+%s',
            _client_text(exchange.client), exchange.method, exchange.endpoint.path, exchange.status,
            (time.perf_counter() - exchange.started_s) * 1000, exchange.key_name, exchange.model,
            exchange.upstream or "-", ttft, _or_dash(prompt), _or_dash(completion),
        )  # fmt: skip

    def _observe(self, exchange: Exchange, tokens: TokenCounts) -> None:
        model, key = exchange.model, exchange.key_name
        metrics = self.metrics
        metrics.request_counter(key, model, exchange.status).inc()
        if exchange.parsed is None:
            return
        per_model = metrics.for_model(model)
        per_model.e2e_s.observe(time.perf_counter() - exchange.started_s)
        if exchange.ttft_s is not None:
            per_model.ttft_s.observe(exchange.ttft_s)
            if exchange.decode_sent_s is not None:  # disaggregated: the decode's part of the TTFT
                decode_ttft_s = exchange.started_s + exchange.ttft_s - exchange.decode_sent_s
                metrics.pd_phase(exchange.parsed.model, "decode_first_token").observe(decode_ttft_s)
        prompt, completion = tokens.prompt, tokens.completion
        if prompt or completion:
            prompt_tokens, completion_tokens = metrics.token_counters(key, model)
            prompt_tokens.inc(prompt or 0)
            completion_tokens.inc(completion or 0)
        if tokens.reasoning:
            metrics.reasoning_counter(key, model, tokens.reasoning_source or "").inc(tokens.reasoning)

    def _usage_row(self, exchange: Exchange, tokens: TokenCounts) -> UsageRow:
        request_body = response_body = None
        if self.config.log_bodies and exchange.parsed is not None:
            request_body = (exchange.request_body or b"").decode(errors="replace")  # as the client sent it
            response_body = b"".join(exchange.logged_body or []).decode(errors="replace")
        return UsageRow(
            ts=exchange.arrival_ts,
            key=exchange.key_name,
            model=exchange.model,
            endpoint=exchange.endpoint.path,
            stream=bool(exchange.parsed and exchange.parsed.stream),
            status=exchange.status,
            prompt_tokens=tokens.prompt,
            completion_tokens=tokens.completion,
            latency_ms=(time.perf_counter() - exchange.started_s) * 1000,
            ttft_ms=exchange.ttft_s * 1000 if exchange.ttft_s is not None else None,
            upstream=exchange.upstream,
            error=exchange.error,
            request_body=request_body,
            response_body=response_body,
            reasoning_tokens=tokens.reasoning,
            reasoning_source=tokens.reasoning_source,
            prefill_upstream=exchange.prefill_upstream,
        )


class _EngineAnswer:
    """An answer from an engine that ends the request as it is (a prefill engine's refusal)."""

    __slots__ = ("body", "status")

    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self.body = body


_RESPONSE_BY_ID = RESPONSES.path + "/"


def _response_id_and_action(scope: Scope) -> tuple[str, str]:
    """(id, "") for GET /v1/responses/{id}, (id, "cancel") for POST /v1/responses/{id}/cancel; else 404 or 405."""
    response_id, _, action = scope["path"].removeprefix(_RESPONSE_BY_ID).partition("/")
    if not response_id or action not in ("", "cancel"):
        raise NotFound(f"no route {scope['path'][:200]}; stored responses are at {_RESPONSE_BY_ID}{{id}}[/cancel]")
    wanted = "GET" if action == "" else "POST"
    if scope["method"] != wanted:
        raise MethodNotAllowed(
            f"{scope['method']} is not served for stored responses: GET {_RESPONSE_BY_ID}{{id}} retrieves one and "
            f"POST {_RESPONSE_BY_ID}{{id}}/cancel cancels a background one (the engine, vLLM 0.32, deletes none)"
        )
    return response_id, action


def _response_not_found(response_id: str, param: str = "response_id") -> NotFound:
    return NotFound(f"Response with id '{response_id[:80]}' not found.", param=param)


def _or_dash(value: int | None) -> str:
    return "-" if value is None else str(value)


def _client_text(client: Any) -> str:
    if isinstance(client, (tuple, list)) and len(client) == 2:
        return f"{client[0]}:{client[1]}"
    return "-"


def _error_event(status: int, body: bytes) -> bytes:
    """An engine's refusal (STATUS, BODY) as a stream's last event: its own error object where it sent one in
    OpenAI's shape, else one that quotes it."""
    with contextlib.suppress(ValueError, RecursionError):
        answer = orjson.loads(body)
        if isinstance(answer, dict) and isinstance(answer.get("error"), dict):
            return b"data: " + orjson.dumps(answer) + b"\n\n"
    detail = body[:300].decode(errors="replace")
    return UpstreamBadStatus(f"upstream answered {status}: {detail}").sse_event()


def _cancel_on_disconnect(
    scope: Scope, receive: Receive, exchange: Exchange, task: asyncio.Task[Any] | None
) -> asyncio.Task[None] | None:
    """Cancel TASK when the client disconnects before the response is complete: through the gateway's server's
    disconnect callback (no task per request), or under another ASGI server through a task that waits in receive."""

    def gone() -> None:
        if not exchange.finished and task is not None:
            exchange.client_gone = True
            task.cancel("client disconnected")

    on_disconnect = scope.get(DISCONNECT_SCOPE_KEY)
    if on_disconnect is not None:
        on_disconnect(gone)
        return None
    return asyncio.create_task(_watch_disconnect(receive, gone))


async def _watch_disconnect(receive: Receive, gone: Callable[[], None]) -> None:
    if (await receive())["type"] == "http.disconnect":
        gone()


def _uncancel() -> None:
    task = asyncio.current_task()
    if task is not None and hasattr(task, "uncancel"):
        task.uncancel()


async def _send_prometheus(send: Send, body: bytes) -> None:
    headers = [(b"content-type", METRICS_CONTENT_TYPE), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})
