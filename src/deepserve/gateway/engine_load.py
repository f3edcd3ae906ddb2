"""What each replica's engine says about its own load: requests waiting and running, KV-cache use, read from its
Prometheus /metrics every `interval_s` (for the engine_aware balancing policy).

The text is read by the engines' shared reader (engines/metrics.py), which looks only for the series named in each
engine's table (`load_metrics`): waiting and running add up over label sets (several engines behind one server,
e.g. data parallel), the KV-cache fraction takes the fullest engine's."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import aiohttp

from deepserve.engines.base import LoadMetricNames
from deepserve.engines.metrics import LOAD_QUANTITIES, first_present, read_metrics
from deepserve.engines.registry import ENGINES
from deepserve.gateway.balancing import EngineLoad
from deepserve.gateway.upstreams import UpstreamPool, UpstreamReplica

log = logging.getLogger(__name__)

Clock = Callable[[], float]

# A scrape that takes longer than this many intervals is abandoned (the replica's load is then unknown).
SCRAPE_TIMEOUT_INTERVALS = 5


def parse_engine_load(text: str, scraped_at_s: float, engines: tuple[LoadMetricNames, ...] | None = None) -> EngineLoad:
    """The load in TEXT (Prometheus text format), by the first engine whose series are present; zeros when none."""
    for names in engines or tuple(engine.load_metrics for engine in ENGINES.values()):
        values = read_metrics(text, names.only(*LOAD_QUANTITIES))
        waiting = first_present(values, names.waiting)
        running = first_present(values, names.running)
        kv_cache = first_present(values, names.kv_cache_usage)
        if waiting is not None or running is not None or kv_cache is not None:
            return EngineLoad(waiting or 0.0, running or 0.0, min(1.0, max(0.0, kv_cache or 0.0)), scraped_at_s)
    return EngineLoad(0.0, 0.0, 0.0, scraped_at_s)


class EngineLoadScraper:
    """Keeps LOADS ({replica URL: EngineLoad}) current for POOL's healthy replicas."""

    def __init__(
        self, pool: UpstreamPool, loads: dict[str, EngineLoad], interval_s: float, clock: Clock = time.monotonic
    ) -> None:
        self.pool = pool
        self.loads = loads
        self.interval_s = interval_s
        self._clock = clock  # stamps each load; the policy judges its age by the same clock
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="engine-load-scrape")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def scrape_once(self) -> None:
        healthy = [replica for replica in self.pool.replicas if replica.healthy]
        await asyncio.gather(*(self._scrape(replica) for replica in healthy))
        for url in set(self.loads) - {replica.url for replica in healthy}:
            del self.loads[url]  # out of rotation: its last load must not linger

    async def _loop(self) -> None:
        while True:
            try:
                await self.scrape_once()
            except Exception:  # never let the loop die: routing would silently go blind
                log.exception("scraping the engines' load failed")
            await asyncio.sleep(self.interval_s)

    async def _scrape(self, replica: UpstreamReplica) -> None:
        timeout = aiohttp.ClientTimeout(total=max(1.0, self.interval_s * SCRAPE_TIMEOUT_INTERVALS))
        try:
            async with self.pool.session.get(replica.root + "/metrics", timeout=timeout) as response:
                if response.status != 200:
                    raise aiohttp.ClientResponseError(response.request_info, (), status=response.status)
                text = (await response.read()).decode("utf-8", errors="replace")
        except (aiohttp.ClientError, asyncio.TimeoutError):
            self.loads.pop(replica.url, None)
            return
        self.loads[replica.url] = parse_engine_load(text, self._clock())
