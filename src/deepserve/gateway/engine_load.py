"""What each replica's engine says about its own load: requests waiting and running, KV-cache use, read from its
Prometheus /metrics every `interval_s` (for the engine_aware balancing policy).

The text is read by the engines' shared reader (engines/metrics.py), which looks only for the series named in each
engine's table (`metric_names`): waiting and running add up over label sets (several engines behind one server,
e.g. data parallel), the KV-cache fraction takes the fullest engine's.

Engines serve their series at different paths (vLLM and SGLang at /metrics; TensorRT-LLM at /prometheus/metrics,
its /metrics being JSON): each replica's path is found once, by trying the engines' paths in turn, and kept."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from deepserve.engines.metrics import LOAD_QUANTITIES, MetricNames, first_present, read_metrics
from deepserve.engines.registry import ENGINES
from deepserve.gateway.balancing import EngineLoad
from deepserve.gateway.clock import Clock
from deepserve.gateway.upstreams import CLIENT_FAILURES, UpstreamPool, UpstreamReplica

log = logging.getLogger(__name__)


# A scrape that takes longer than this many intervals is abandoned (the replica's load is then unknown).
SCRAPE_TIMEOUT_INTERVALS = 5


def parse_engine_load(text: str, scraped_at_s: float, engines: tuple[MetricNames, ...] | None = None) -> EngineLoad:
    """The load in TEXT (Prometheus text format), by the first engine whose series are present; zeros when none."""
    return find_engine_load(text, scraped_at_s, engines) or EngineLoad(0.0, 0.0, 0.0, scraped_at_s)


def find_engine_load(
    text: str, scraped_at_s: float, engines: tuple[MetricNames, ...] | None = None
) -> EngineLoad | None:
    """As parse_engine_load, but None when TEXT holds no engine's series."""
    for names in engines or tuple(engine.metric_names for engine in ENGINES.values()):
        values = read_metrics(text, names.only(*LOAD_QUANTITIES))
        waiting = first_present(values, names.waiting)
        running = first_present(values, names.running)
        kv_cache = first_present(values, names.kv_cache_usage)
        if waiting is not None or running is not None or kv_cache is not None:
            return EngineLoad(waiting or 0.0, running or 0.0, min(1.0, max(0.0, kv_cache or 0.0)), scraped_at_s)
    return None


def metrics_paths() -> tuple[str, ...]:
    """Where the registered engines serve their load series, /metrics first."""
    paths = [engine.metric_names.path for engine in ENGINES.values()]
    return tuple(sorted(set(paths), key=lambda path: (path != "/metrics", paths.index(path))))


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
        self._paths: dict[str, str] = {}  # replica URL → the path its engine's series were found at

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
        """The replica's load from the path found before; else from each engine's path in turn, keeping the first
        that has an engine's series (an answer without any counts as an idle engine)."""
        known = self._paths.get(replica.url)
        paths = (known,) if known else metrics_paths()
        answered: str | None = None
        for path in paths:
            text = await self._fetch(replica, path)
            if text is None:
                continue
            load = find_engine_load(text, self._clock())
            if load is not None:
                self._paths[replica.url] = path
                self.loads[replica.url] = load
                return
            answered = answered if answered is not None else text
        if answered is None:
            self._paths.pop(replica.url, None)  # gone, or restarted as another engine: look again next time
            self.loads.pop(replica.url, None)
            return
        self.loads[replica.url] = EngineLoad(0.0, 0.0, 0.0, self._clock())

    async def _fetch(self, replica: UpstreamReplica, path: str) -> str | None:
        timeout_s = max(1.0, self.interval_s * SCRAPE_TIMEOUT_INTERVALS)
        try:
            status, body = await self.pool.get(replica, path, timeout_s)
        except CLIENT_FAILURES:
            return None
        return body.decode("utf-8", errors="replace") if status == 200 else None
