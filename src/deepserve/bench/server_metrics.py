"""Scrape the engine's Prometheus /metrics during a run and summarise what the server saw beside the client's view.

Only the few vLLM series we report are parsed, by line prefix: a full Prometheus parse of vLLM's histograms every
second would take CPU from the event loop that timestamps chunks. Series with several label sets (engines of one
server, or replicas behind deepserve's gateway) are combined: KV-cache usage is a fraction of each engine's own
cache, so the max is taken (the fullest engine); running and waiting requests add up. Counters are kept per series
(name and labels, the replica's included) and each series' growth over the run is summed: behind the gateway a
replica may be missing from some scrapes (only healthy ones are listed) or join late, and a sum across replicas
taken per scrape would then count its whole lifetime, or go negative. A server without /metrics is noted in the
result, never an error.

Behind deepserve's gateway, `<base>/metrics` has only the gateway's series; its `/metrics/engines` has every healthy
replica's, labelled by replica. When the first URL has no vLLM series, the scraper tries that one; the summary says
which URL the numbers came from.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from dataclasses import dataclass, field
from typing import Any

import httpx

from deepserve.bench.config import BenchConfig
from deepserve.engines import vllm_metrics as vllm

# kept per series: growth per series, then summed
COUNTERS = frozenset({vllm.PREFIX_CACHE_QUERIES, vllm.PREFIX_CACHE_HITS, vllm.PREEMPTIONS})
WANTED = frozenset({vllm.RUNNING, vllm.WAITING, *vllm.KV_CACHE_USAGE_NAMES, *COUNTERS})
MAX_OVER_LABEL_SETS = frozenset(vllm.KV_CACHE_USAGE_NAMES)  # per-engine fractions: the fullest engine, not a sum
GATEWAY_ENGINES_PATH = "/metrics/engines"  # deepserve's gateway: every replica's /metrics (gateway/engine_metrics.py)


def parse_metrics(text: str) -> dict[str, float]:
    """The WANTED series in Prometheus text format. Gauges by name, combined over label sets (summed, except the
    KV-cache usage fractions, whose max is taken); COUNTERS by series, `name{labels}` as written (see series_name)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        name = line[:name_end]
        if name not in WANTED:
            continue
        series, _, rest = line.rpartition("}") if "{" in line else (name, "", line[name_end:])
        parts = rest.split()
        try:
            value = float(parts[0])
        except (IndexError, ValueError):
            continue
        if name in COUNTERS:
            values[series + ("}" if "{" in line else "")] = value
            continue
        if name in values:
            value = max(values[name], value) if name in MAX_OVER_LABEL_SETS else values[name] + value
        values[name] = value
    return values


@dataclass
class ServerMetricsSummary:
    """What the server reported during the measured run. Peaks are over scrapes; totals are each counter series'
    growth over the run (see series_growth), summed over series."""

    available: bool
    note: str = ""
    url: str | None = None  # where the numbers came from
    scrapes: int = 0
    peak_running: float | None = None
    peak_waiting: float | None = None
    peak_kv_cache_usage_perc: float | None = None  # 0..1, as vLLM reports it
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    prefix_cache_hit_rate: float | None = None
    preemptions: float | None = None
    samples: list[dict[str, float]] = field(default_factory=list, repr=False)

    def to_json(self) -> dict[str, Any]:
        data = {key: value for key, value in self.__dict__.items() if key != "samples"}
        return data


def summarize_samples(samples: list[dict[str, float]]) -> ServerMetricsSummary:
    summary = ServerMetricsSummary(available=True, scrapes=len(samples), samples=samples)
    if not samples:
        return summary

    def peak(*names: str) -> float | None:
        seen = [sample[name] for sample in samples for name in names if name in sample]
        return max(seen) if seen else None

    def growth(name: str) -> float | None:
        series = {key for sample in samples for key in sample if series_name(key) == name}
        if not series:
            return None
        return sum(series_growth([sample[key] for sample in samples if key in sample]) for key in series)

    summary.peak_running = peak(vllm.RUNNING)
    summary.peak_waiting = peak(vllm.WAITING)
    summary.peak_kv_cache_usage_perc = peak(*vllm.KV_CACHE_USAGE_NAMES)
    summary.prefix_cache_queries = growth(vllm.PREFIX_CACHE_QUERIES)
    summary.prefix_cache_hits = growth(vllm.PREFIX_CACHE_HITS)
    summary.preemptions = growth(vllm.PREEMPTIONS)
    if summary.prefix_cache_queries and summary.prefix_cache_hits is not None:
        summary.prefix_cache_hit_rate = summary.prefix_cache_hits / summary.prefix_cache_queries
    if not any(series_name(key) in WANTED for sample in samples for key in sample):
        summary.note = "the server's /metrics has none of the vLLM series we report"
    return summary


def series_name(key: str) -> str:
    """The metric name of a parse_metrics key: `vllm:x_total{replica="a"}` -> `vllm:x_total`."""
    return key.partition("{")[0]


def series_growth(values: list[float]) -> float:
    """How much one counter series grew over its scrapes (from its first one: a series that appears late is counted
    from then, not over its lifetime). A drop is a restart of the counter: it counts again from zero."""
    grown = 0.0
    for previous, value in itertools.pairwise(values):
        grown += value - previous if value >= previous else value
    return grown


class ServerMetricsScraper:
    """Polls URL every interval_s from `start()` until `stop()`; one scrape before and after the run. FALLBACK_URL
    (a gateway's /metrics/engines) replaces URL when URL answers without any vLLM series and the fallback has some."""

    def __init__(
        self,
        url: str,
        interval_s: float = 1.0,
        headers: dict[str, str] | None = None,
        fallback_url: str | None = None,
        verify: bool = True,
    ) -> None:
        self.url = url
        self.fallback_url = fallback_url
        self.interval_s = interval_s
        self._client = httpx.AsyncClient(timeout=5.0, headers=headers or {}, verify=verify)
        self._samples: list[dict[str, float]] = []
        self._task: asyncio.Task[None] | None = None
        self._unavailable: str | None = None
        self._fallback_note = ""

    async def start(self) -> None:
        await self._scrape()  # the baseline for counters
        if self.fallback_url and not any(self._samples[-1:]):
            await self._try_fallback()
        if self._unavailable is None:
            self._task = asyncio.create_task(self._loop())

    async def _try_fallback(self) -> None:
        assert self.fallback_url is not None
        try:
            response = await self._client.get(self.fallback_url)
        except httpx.HTTPError:
            return
        sample = parse_metrics(response.text) if response.status_code == 200 else {}
        self._fallback_note = f" (nor has {self.fallback_url})"
        if sample:
            self.url, self._samples, self._unavailable = self.fallback_url, [sample], None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self._scrape()

    async def _scrape(self) -> None:
        try:
            response = await self._client.get(self.url)
        except httpx.HTTPError as exc:
            if not self._samples:
                self._unavailable = f"no metrics endpoint at {self.url} ({exc.__class__.__name__})"
            return
        if response.status_code != 200:
            if not self._samples:
                self._unavailable = f"no metrics endpoint at {self.url} (HTTP {response.status_code})"
            return
        self._samples.append(parse_metrics(response.text))

    async def stop(self) -> ServerMetricsSummary:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            await self._scrape()
        await self._client.aclose()
        if self._unavailable is not None:
            return ServerMetricsSummary(available=False, note=self._unavailable, url=self.url)
        summary = summarize_samples(self._samples)
        summary.url = self.url
        if summary.note:
            summary.note += self._fallback_note
        return summary


def scraper_for(config: BenchConfig) -> ServerMetricsScraper | None:
    """The scraper CONFIG asks for (None with --no-server-metrics): --server-metrics-url, else the server's /metrics
    with deepserve's gateway's /metrics/engines as the fallback."""
    metrics = config.metrics
    if not metrics.server_metrics:
        return None
    root = config.target.root_url
    url = metrics.server_metrics_url or root + "/metrics"
    fallback = None if metrics.server_metrics_url else root + GATEWAY_ENGINES_PATH  # behind deepserve's gateway
    headers = config.target.request_headers()
    verify = not config.target.insecure
    return ServerMetricsScraper(url, metrics.server_metrics_interval_s, headers, fallback, verify)
