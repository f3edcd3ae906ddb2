"""`GET /metrics/engines`: the Prometheus text of every healthy upstream replica, each sample labelled with its
replica, so that a client of the gateway (`deepserve bench` among them) sees the engines' own series (running and
waiting requests, KV-cache usage, prefix-cache hits, preemptions) through the gateway's port alone. The `replica`
label is the upstream URL as configured (the config has no other name for a replica), so the answer does show the
internal URLs: when the gateway requires keys, the app answers only callers with a valid key (docs/GATEWAY.md).

Its callers must not be able to drive the engines' /metrics (on an open gateway anyone may call it): concurrent
requests share one scrape, and its result is answered until CACHE_S after that scrape began (at most 1/CACHE_S
scrapes per second per replica, however many callers). So an answer reflects the engines as they were at most CACHE_S
before it: a client that needs a sample taken after some moment (the benchmark's last sample, after its run) asks
CACHE_S after that moment.

Samples are regrouped by metric family across replicas (one HELP/TYPE header per family), because Prometheus text
format requires a family's samples to be contiguous. A replica that does not answer is named in a comment line and
left out, and so is one out of rotation; the endpoint itself always answers 200. Engines put model
names and counts in their series, never secrets.
"""

from __future__ import annotations

import asyncio
import time

from deepserve.engines.metrics import left_out_comment, sample_name, with_label
from deepserve.gateway.clock import Clock
from deepserve.gateway.upstreams import CLIENT_FAILURES, UpstreamPool, UpstreamReplica

ENGINE_METRICS_PATH = "/metrics/engines"
REPLICA_LABEL = "replica"
SCRAPE_TIMEOUT_S = 5.0
# Short enough for a benchmark polling every 50 ms to see changes within a quarter second, long enough to bound the
# engines' load from an unauthenticated caller in a loop.
CACHE_S = 0.25


class _Family:
    __slots__ = ("headers", "samples")

    def __init__(self) -> None:
        self.headers: dict[str, str] = {}  # HELP and TYPE lines, from the first replica that had them
        self.samples: list[str] = []


def label_sample(line: str, replica: str) -> str:
    """LINE (one Prometheus sample) with replica="REPLICA" as its first label."""
    return with_label(line, REPLICA_LABEL, replica)


def merge_exposition(texts: dict[str, str], errors: dict[str, str] | None = None) -> str:
    """One exposition from several replicas' texts ({replica URL: text}), samples labelled with their replica."""
    families: dict[str, _Family] = {}
    for replica, text in texts.items():
        family: _Family | None = None
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = families.setdefault(parts[2], _Family())
                    family.headers.setdefault(parts[1], line)
                continue  # other comments are dropped
            if family is None:  # a sample before any header: a family of its own
                family = families.setdefault(sample_name(line), _Family())
            family.samples.append(label_sample(line, replica))
    lines = [left_out_comment(replica, reason) for replica, reason in (errors or {}).items()]
    for family in families.values():
        lines += family.headers.values()
        lines += family.samples
    return "\n".join(lines) + "\n" if lines else ""


async def scrape_replicas(pool: UpstreamPool) -> tuple[dict[str, str], dict[str, str]]:
    """({replica URL: its /metrics text}, {replica URL: why it is missing}): the healthy replicas are scraped; one
    out of rotation is named with its last error, not scraped (it may be unreachable, and every caller would wait)."""
    healthy = [replica for replica in pool.replicas if replica.healthy]
    answers = await asyncio.gather(*(_scrape(pool, replica) for replica in healthy))
    texts = {replica.url: text for replica, (text, _) in zip(healthy, answers, strict=True) if text is not None}
    errors = {
        replica.url: f"out of rotation ({replica.last_error or 'not yet checked'})"
        for replica in pool.replicas
        if not replica.healthy
    }
    errors |= {replica.url: error for replica, (_, error) in zip(healthy, answers, strict=True) if error is not None}
    return texts, errors


async def _scrape(pool: UpstreamPool, replica: UpstreamReplica) -> tuple[str | None, str | None]:
    try:
        status, body = await pool.get(replica, "/metrics", SCRAPE_TIMEOUT_S)
        if status != 200:
            return None, f"HTTP {status}"
        return body.decode(), None  # the Prometheus text format is UTF-8
    except (*CLIENT_FAILURES, UnicodeDecodeError) as exc:
        return None, f"{exc.__class__.__name__}: {exc}".rstrip(": ")


class EngineMetricsCache:
    """The merged exposition of POOL's replicas: one scrape for all concurrent callers, reused until CACHE_S after
    it began."""

    def __init__(self, pool: UpstreamPool, cache_s: float = CACHE_S, clock: Clock = time.monotonic):
        self.pool = pool
        self.cache_s = cache_s
        self._clock = clock
        self._body = b""
        self._scraped_at_s = float("-inf")
        self._scrape: asyncio.Task[bytes] | None = None

    async def body(self) -> bytes:
        if self._clock() - self._scraped_at_s < self.cache_s:
            return self._body
        if self._scrape is None:
            self._scrape = asyncio.create_task(self._refresh(), name="engine-metrics-scrape")
        # Shielded: a caller that goes away does not cancel the scrape the others wait for.
        return await asyncio.shield(self._scrape)

    async def _refresh(self) -> bytes:
        began_s = self._clock()  # the age counts from here: what the engines said may be this old, not younger
        try:
            texts, errors = await scrape_replicas(self.pool)
            self._body = merge_exposition(texts, errors).encode()
            self._scraped_at_s = began_s
            return self._body
        finally:
            self._scrape = None
