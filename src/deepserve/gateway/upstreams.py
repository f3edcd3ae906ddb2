"""The upstream pool: replicas of the engine, one shared keep-alive connection pool, health checks, and the one
place where the HTTP client's exceptions become the gateway's `UpstreamError` hierarchy.

Everything the gateway sends an engine goes through one `http_client.HttpClient` (a raw asyncio protocol with
httptools' parser, about a third of aiohttp's CPU per request: benchmarks/upstream_client.py, docs/PERFORMANCE.md):
requests (`post`), and the side calls, each a whole exchange within one deadline (`get`: health checks once a second,
model listings, the engines' /metrics), with one family of errors (CLIENT_FAILURES).

A replica leaves rotation at once when a request to it fails to connect or times out (passive check), or when its
health check fails (active check every `health_check_interval_s`), and comes back when its /health answers again.

With `discover`, the replicas are not the configured URLs but one per address their host names resolve to (a
Kubernetes headless Service lists one address per ready pod), re-resolved every `discovery_interval_s`: an address
that appears is a new replica (checked at once), one that goes away leaves rotation and is dropped once its requests
in flight have ended (a pod being replaced finishes its streams). A resolution that fails keeps the replicas it
found before (the health checks still judge them).

With an API key file, every call to an engine carries `Authorization: Bearer KEY` (vLLM's --api-key), the file
re-read when it changes (a rotated Kubernetes Secret).
When a replica leaves while another is healthy, the requests still waiting for its response head are given up
(`HttpClient.abort_waiting`) so that the caller retries them on another replica instead of waiting for a silent
one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from deepserve.errors import ConfigError
from deepserve.gateway.balancing import BalancingPolicy, RoutingHints
from deepserve.gateway.clock import Clock
from deepserve.gateway.errors import (
    NoHealthyUpstream,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from deepserve.gateway.http_client import (
    ConnectFailed,
    FirstByteTimeout,
    HttpClient,
    HttpResponse,
    Origin,
    Resolver,
    system_resolve,
)

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


@dataclass(eq=False)  # one replica is one object: compared (and hashed) by identity
class UpstreamReplica:
    url: str  # the base URL as configured (or found under a DNS name), e.g. http://127.0.0.1:8001/v1
    server_name: str | None = None  # the DNS name its address was found under (Host header, TLS server name)
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
        self.origin = Origin(parts.hostname, parts.port or (443 if tls else 80), tls, self.server_name)
        self.path_prefix = parts.path.rstrip("/")

    @property
    def root(self) -> str:
        return self.url.removesuffix("/v1")


class UpstreamKey:
    """The API key the engines require (vLLM's --api-key), from a file re-read when it changes; `header` is the
    complete header line every call to an engine carries (empty without a file)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.header = b""
        self._version: object = None
        if path is not None:
            self.refresh()

    def refresh(self) -> None:
        if self.path is None:
            return
        info = self.path.stat()
        version = (info.st_ino, info.st_size, info.st_mtime_ns)
        if version == self._version:
            return
        key = self.path.read_text().strip()
        if not key or not key.isprintable() or not key.isascii():
            raise ConfigError(f"the upstream API key file {self.path} must hold one printable ASCII key")
        self.header = b"Authorization: Bearer " + key.encode() + b"\r\n"
        self._version = version


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
        clock: Clock = time.monotonic,
        client: HttpClient | None = None,
        api_key_file: Path | None = None,
        discover: bool = False,
        discovery_interval_s: float = 10.0,
        resolve: Resolver = system_resolve,
    ) -> None:
        """URLS are the replicas, or with DISCOVER the names whose addresses are (see the module docstring). CLIENT
        is shared with other pools (the process's one HTTP client); one of the pool's own otherwise."""
        self.seeds = list(urls)
        self.discover_replicas = discover
        self.discovery_interval_s = discovery_interval_s
        self._resolve = resolve
        self.replicas = [] if discover else [UpstreamReplica(url) for url in urls]
        self.draining: list[UpstreamReplica] = []  # left the pool, requests still in flight there
        self.policy = policy
        self.health_check_interval_s = health_check_interval_s
        self.max_model_len_override = max_model_len
        self.models: dict[str, int | None] = {}  # the union over healthy replicas (read on every request)
        # A check answered later than this counts as timed out (CHECK_TIMEOUTS_TO_FAIL in a row take a replica out).
        self.health_timeout_s = max(0.5, min(2.0, health_check_interval_s * 2))
        self._owns_client = client is None
        self.client = client or HttpClient(
            connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s, idle_s=IDLE_CONNECTION_S, clock=clock
        )
        self.key = UpstreamKey(api_key_file)
        self._health_task: asyncio.Task[None] | None = None
        self._discovery_task: asyncio.Task[None] | None = None

    # ---- lifecycle ----------------------------------------------------------------------------------------------

    async def start(self) -> None:
        if self.discover_replicas:
            await self.discover()  # checks every replica it finds
            self._discovery_task = asyncio.create_task(self._discovery_loop(), name="upstream-discovery")
        else:
            await self._check_new(self.replicas)
            self._update_models()
        self._health_task = asyncio.create_task(self._health_loop(), name="upstream-health")

    async def close(self) -> None:
        for task in (self._health_task, self._discovery_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._owns_client:
            await self.client.close()

    # ---- discovery ----------------------------------------------------------------------------------------------

    async def discover(self) -> None:
        """Resolve every seed's host name: a replica per new address (checked at once), retire those whose address
        went away; a seed whose resolution fails keeps its replicas."""
        found: dict[str, str] = {}  # replica URL -> the name it was found under
        failed: set[str] = set()
        for seed in self.seeds:
            try:
                found.update(await self._replica_urls(seed))
            except OSError as exc:
                failed.add(_host_of(seed))
                log.warning("resolving upstream %s failed (%s); keeping its %d replicas", seed, exc,
                            sum(replica.server_name == _host_of(seed) for replica in self.replicas))  # fmt: skip
        known = {replica.url for replica in self.replicas}
        added = [UpstreamReplica(url, server_name=name) for url, name in found.items() if url not in known]
        # Checked before the pool changes, and the pool changed in one step: a request never meets a pool whose
        # gone replicas have left while its new ones are not yet known to be healthy.
        await self._check_new(added)
        for replica in list(self.replicas):
            if replica.url not in found and (replica.server_name or _host_of(replica.url)) not in failed:
                self._retire(replica)
        for replica in added:
            log.warning("upstream %s joined (an address of %s)", replica.url, replica.server_name)
        self.replicas += added
        self._update_models()

    async def _replica_urls(self, seed: str) -> dict[str, str]:
        """{replica URL: name} for SEED: one per address its host name resolves to (an address stays as it is)."""
        parts = urlsplit(seed)
        host = parts.hostname or ""
        if Origin(host, 0, False).is_address:
            return {seed: host}
        port = parts.port or (443 if parts.scheme == "https" else 80)
        addresses = await self._resolve(host, port)
        if not addresses:
            raise OSError(f"{host} resolved to no address")
        return {
            urlunsplit((parts.scheme, f"{_bracketed(address)}:{port}", parts.path, "", "")): host
            for address in addresses
        }

    def _retire(self, replica: UpstreamReplica) -> None:
        """REPLICA's address went away: no new request goes there; those in flight finish (its pod is draining)."""
        self.replicas.remove(replica)
        replica.healthy = False
        if replica.outstanding:
            self.draining.append(replica)
        log.warning("upstream %s left (its address is gone); %d requests in flight finish there", replica.url,
                    replica.outstanding)  # fmt: skip
        self.client.close_idle(replica.origin)
        self._update_models()

    async def _discovery_loop(self) -> None:
        while True:
            await asyncio.sleep(self.discovery_interval_s)
            try:
                await self.discover()
            except Exception:  # never let the loop die: it is what follows the replicas
                log.exception("discovering upstream replicas failed")

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
            return await self.client.request(
                method, replica.origin, target, body, head_timeout_s=first_byte_timeout_s, headers=self.key.header
            )
        except CLIENT_FAILURES as exc:
            raise upstream_error(exc, replica) from exc

    async def get(self, replica: UpstreamReplica, path: str, timeout_s: float) -> tuple[int, bytes]:
        """(status, body) of GET PATH (from the replica's root, e.g. /metrics) within TIMEOUT_S. Raises one of
        CLIENT_FAILURES (a TimeoutError when late)."""
        target = replica.path_prefix + path
        return await self.client.fetch("GET", replica.origin, target, timeout_s=timeout_s, headers=self.key.header)

    # ---- health -------------------------------------------------------------------------------------------------

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(replica) for replica in self.replicas))
        self._update_models()

    async def _check_new(self, replicas: Sequence[UpstreamReplica]) -> None:
        """Check REPLICAS, none of which has passed a check yet; those whose check timed out are checked again at once
        (up to CHECK_TIMEOUTS_TO_FAIL checks in all): a replica slow to answer once, as a busy engine is, would
        otherwise stay out of rotation for an interval, and a gateway starting with one replica would announce itself
        ready with none healthy."""
        pending = list(replicas)
        for _ in range(CHECK_TIMEOUTS_TO_FAIL):
            await asyncio.gather(*(self._check(replica) for replica in pending))
            pending = [replica for replica in pending if not replica.healthy and replica.failed_checks]
            if not pending:
                break

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_check_interval_s)
            self.draining = [replica for replica in self.draining if replica.outstanding]
            try:
                self.key.refresh()
            except (OSError, ConfigError) as exc:  # a Secret being replaced: the last key stays in use
                log.warning("reading the upstream API key file failed (%s); keeping the key read before", exc)
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


def _host_of(url: str) -> str:
    return urlsplit(url).hostname or ""


def _bracketed(address: str) -> str:
    return f"[{address}]" if ":" in address else address


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
