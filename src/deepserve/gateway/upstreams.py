"""The upstream pool: replicas of the engine, one shared keep-alive connection pool, health checks, and the one
place where the HTTP client's exceptions become the gateway's `UpstreamError` hierarchy.

Everything the gateway sends an engine goes through one `http_client.HttpClient` (a raw asyncio protocol with
httptools' parser, about a third of aiohttp's CPU per request: benchmarks/upstream_client.py, docs/PERFORMANCE.md):
requests (`post`), and the side calls, each a whole exchange within one deadline (`get`: health checks once a second,
model listings, the engines' /metrics), with one family of errors (CLIENT_FAILURES).

A replica leaves rotation at once when a request to it fails to connect or times out (passive check), or when its
health check fails (active check every `health_check_interval_s`), and comes back when its /health answers again.
When a replica leaves while another is healthy, the requests still waiting for its response head are given up
(`HttpClient.abort_waiting`) so that the caller retries them on another replica instead of waiting for a silent
one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from deepserve.gateway.balancing import BalancingPolicy, RoutingHints
from deepserve.gateway.errors import (
    NoHealthyUpstream,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from deepserve.gateway.http_client import ConnectFailed, FirstByteTimeout, HttpClient, HttpResponse, Origin

log = logging.getLogger(__name__)

# vLLM and SGLang both answer this when the engine can serve.
HEALTH_PATH = "/health"
MODELS_PATH = "/v1/models"
# Re-read /v1/models every this many healthy checks, to notice a replica that was restarted with another model.
MODELS_REFRESH_EVERY = 30
# Below uvicorn's default keep-alive timeout (5 s), which vLLM and SGLang use.
IDLE_CONNECTION_S = 4.0
# What the HTTP client raises when the upstream (or the network) fails; IncompleteResponse and ConnectFailed are
# ConnectionErrors. Anything else is a bug of ours: it must not be retried on every replica nor charged to one.
CLIENT_FAILURES = (OSError, TimeoutError)
# A replica that answers nothing within the health timeout this many times in a row is taken out.
CHECK_TIMEOUTS_TO_FAIL = 3


@dataclass
class UpstreamReplica:
    url: str  # the base URL as configured, e.g. http://127.0.0.1:8001/v1
    healthy: bool = False
    outstanding: int = 0
    models: dict[str, int | None] = field(default_factory=dict)  # served model → max_model_len
    checks_since_models: int = 0
    failed_checks: int = 0  # consecutive health checks that timed out
    last_error: str | None = None
    origin: Origin = field(init=False)
    path_prefix: str = field(init=False)  # what the root URL has after host and port, usually ""

    def __post_init__(self) -> None:
        parts = urlsplit(self.root)
        tls = parts.scheme == "https"
        if not parts.hostname:  # config.check_upstream_url refuses it with advice; never guess a host
            raise ValueError(f"upstream {self.url!r} has no host")
        self.origin = Origin(parts.hostname, parts.port or (443 if tls else 80), tls)
        self.path_prefix = parts.path.rstrip("/")

    @property
    def root(self) -> str:
        return self.url.removesuffix("/v1")


class UpstreamPool:
    def __init__(
        self,
        urls: Sequence[str],
        policy: BalancingPolicy,
        *,
        connect_timeout_s: float = 3.0,
        read_timeout_s: float = 600.0,
        health_check_interval_s: float = 1.0,
        max_model_len: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.replicas = [UpstreamReplica(url) for url in urls]
        self.policy = policy
        self.health_check_interval_s = health_check_interval_s
        self.max_model_len_override = max_model_len
        self.models: dict[str, int | None] = {}  # the union over healthy replicas (read on every request)
        # A check answered later than this counts as timed out (CHECK_TIMEOUTS_TO_FAIL in a row take a replica out).
        self.health_timeout_s = max(0.5, min(2.0, health_check_interval_s * 2))
        self.client = HttpClient(
            connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s, idle_s=IDLE_CONNECTION_S, clock=clock
        )
        self._health_task: asyncio.Task[None] | None = None

    # ---- lifecycle ----------------------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.check_all()
        self._health_task = asyncio.create_task(self._health_loop(), name="upstream-health")

    async def close(self) -> None:
        if self._health_task:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        await self.client.close()

    # ---- routing ------------------------------------------------------------------------------------------------

    def ready(self) -> bool:
        return any(replica.healthy for replica in self.replicas)

    def choose(
        self,
        model: str,
        hints: RoutingHints,
        tried: Sequence[UpstreamReplica],
        preferred: str | None = None,
    ) -> UpstreamReplica:
        """A healthy replica that serves MODEL and was not TRIED: the one whose URL is PREFERRED when it can (a
        continued Responses conversation lives there), else the policy's choice."""
        candidates = [r for r in self.replicas if r.healthy and model in r.models and r not in tried]
        if preferred is not None:
            pinned = next((replica for replica in candidates if replica.url == preferred), None)
            if pinned is not None:
                return pinned
        if not candidates:
            healthy = sum(replica.healthy for replica in self.replicas)
            raise NoHealthyUpstream(
                f"no healthy upstream can serve {model!r} ({healthy} of {len(self.replicas)} replicas healthy"
                + (f", {len(tried)} already tried" if tried else "")
                + ")"
            )
        if len(candidates) == 1:
            return candidates[0]
        chosen = self.policy.choose(candidates, hints)
        assert isinstance(chosen, UpstreamReplica)
        return chosen

    def mark_down(self, replica: UpstreamReplica, reason: str) -> None:
        """Take REPLICA out of rotation until a health check passes. While another replica is healthy, the
        requests that wait for REPLICA's response head are given up, to be retried there; with no other replica
        they keep waiting (an overloaded only replica is slow, and failing its requests would not help)."""
        if replica.healthy:
            log.warning("upstream %s taken out of rotation: %s", replica.url, reason)
        replica.healthy = False
        replica.last_error = reason
        self._update_models()
        if any(other.healthy for other in self.replicas):
            self.client.abort_waiting(
                replica.origin, f"upstream {replica.url} left rotation ({reason}) before it answered"
            )

    # ---- forwarding ---------------------------------------------------------------------------------------------

    async def post(
        self, replica: UpstreamReplica, path: str, body: bytes, *, first_byte_timeout_s: float | None = None
    ) -> HttpResponse:
        """Send BODY; return the response once its headers arrived (within FIRST_BYTE_TIMEOUT_S, when given). The
        caller must release or close it."""
        return await self.request(replica, "POST", path, body, first_byte_timeout_s=first_byte_timeout_s)

    async def request(
        self,
        replica: UpstreamReplica,
        method: str,
        path: str,
        body: bytes = b"",
        *,
        first_byte_timeout_s: float | None = None,
    ) -> HttpResponse:
        """METHOD PATH (from the replica's root, e.g. /v1/responses/ID) with BODY: as `post`."""
        target = replica.path_prefix + path
        try:
            return await self.client.request(method, replica.origin, target, body, head_timeout_s=first_byte_timeout_s)
        except CLIENT_FAILURES as exc:
            raise upstream_error(exc, replica) from exc

    async def get(self, replica: UpstreamReplica, path: str, timeout_s: float) -> tuple[int, bytes]:
        """(status, body) of GET PATH (from the replica's root, e.g. /metrics) within TIMEOUT_S. Raises one of
        CLIENT_FAILURES (a TimeoutError when late)."""
        return await self.client.fetch("GET", replica.origin, replica.path_prefix + path, timeout_s=timeout_s)

    # ---- health -------------------------------------------------------------------------------------------------

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(replica) for replica in self.replicas))
        self._update_models()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_check_interval_s)
            try:
                await self.check_all()
            except Exception:  # never let the loop die: it is what brings replicas back
                log.exception("upstream health check failed")

    async def _check(self, replica: UpstreamReplica) -> None:
        """Healthy on a 200 from /health (and a model listing). Down at once when the replica refuses connections or
        answers an error; down after CHECK_TIMEOUTS_TO_FAIL timeouts in a row, since under heavy load a live replica
        can be slow to answer while it streams to everyone else."""
        try:
            status, _ = await self.get(replica, HEALTH_PATH, self.health_timeout_s)
            if status != 200:
                raise UpstreamUnavailable(f"/health answered {status}")
            if not replica.healthy or not replica.models or replica.checks_since_models >= MODELS_REFRESH_EVERY:
                replica.models = await self._fetch_models(replica)
                replica.checks_since_models = 0
        except TimeoutError as exc:  # asyncio's too on 3.11+ (a CLIENT_FAILURE as well, counted apart)
            replica.failed_checks += 1
            if replica.failed_checks >= CHECK_TIMEOUTS_TO_FAIL:
                self._fail_check(replica, f"{replica.failed_checks} health checks timed out ({type(exc).__name__})")
        except Exception as exc:
            self._fail_check(replica, str(exc) or type(exc).__name__)
        else:
            replica.checks_since_models += 1
            replica.failed_checks = 0
            if not replica.healthy:
                log.warning("upstream %s is healthy", replica.url)
            replica.healthy = True
            replica.last_error = None

    def _fail_check(self, replica: UpstreamReplica, reason: str) -> None:
        self.mark_down(replica, f"health check failed: {reason}")

    async def _fetch_models(self, replica: UpstreamReplica) -> dict[str, int | None]:
        status, body = await self.get(replica, MODELS_PATH, self.health_timeout_s)
        if status != 200:
            raise UpstreamUnavailable(f"{MODELS_PATH} answered {status}")
        listing = json.loads(body)
        return {card["id"]: card.get("max_model_len") for card in listing.get("data", [])}

    def _update_models(self) -> None:
        models: dict[str, int | None] = {}
        for replica in self.replicas:
            if replica.healthy:
                for name, max_len in replica.models.items():
                    models[name] = self.max_model_len_override or max_len or models.get(name)
        self.models = models


def upstream_error(exc: OSError, replica: UpstreamReplica) -> UpstreamError:
    """The gateway's error for one of CLIENT_FAILURES (the caller raises it `from` EXC)."""
    where = f"upstream {replica.url}"
    if isinstance(exc, FirstByteTimeout):
        return UpstreamTimeout(f"{where} sent no response in time ({exc})")
    if isinstance(exc, TimeoutError):
        return UpstreamTimeout(f"{where} did not answer in time")
    if isinstance(exc, ConnectFailed):
        return UpstreamUnavailable(f"{where} refused the connection ({exc})", refused=True)
    return UpstreamUnavailable(f"{where} is unreachable or dropped the connection ({type(exc).__name__}: {exc})")


async def iter_chunks(response: HttpResponse, replica: UpstreamReplica) -> AsyncIterator[bytes]:
    """The response body as it arrives, with client exceptions mapped."""
    try:
        async for chunk in response.chunks():
            yield chunk
    except CLIENT_FAILURES as exc:
        raise upstream_error(exc, replica) from exc


async def read_body(response: HttpResponse, replica: UpstreamReplica) -> bytes:
    try:
        return await response.read()
    except CLIENT_FAILURES as exc:
        raise upstream_error(exc, replica) from exc
