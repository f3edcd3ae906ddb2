"""Prometheus metrics of the gateway. Counters and histograms are updated on the request path; gauges that mirror
live state (queue depth, in-flight, replica health) are read only when /metrics is scraped.

With several worker processes (`--workers N`) every worker writes its counters and histograms to files in
PROMETHEUS_MULTIPROC_DIR (prometheus_client's multiprocess mode; the supervisor sets it) and /metrics, answered by
whichever worker gets the scrape, adds up all workers' files: the series are the same as with one process. The live
state (queue, in-flight, replicas, client connections, the ledger's counts) is then copied into such files once a
second and at each scrape by every worker (`publish_live_state`): queue depth, in-flight and connection counts are
summed over the live workers, a replica (or Redis) counts as up only if every worker has it; the counts of refused
connections and of ledger rows are counters, so a worker's counts outlive it."""

from __future__ import annotations

import bisect
import itertools
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from deepserve.gateway.connections import REFUSAL_REASONS, ConnectionGuard
from deepserve.gateway.ledger import UsageLedger
from deepserve.gateway.limits import Limiter
from deepserve.gateway.upstreams import UpstreamPool

MULTIPROCESS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class GatewayMetrics:
    def __init__(
        self,
        pool: UpstreamPool,
        limiter: Limiter,
        connections: ConnectionGuard | None = None,
        ledger: Callable[[], UsageLedger | None] = lambda: None,
        prefill_pool: UpstreamPool | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self.multiprocess_dir = os.environ.get(MULTIPROCESS_DIR_ENV) or None
        r = self.registry
        # Counted and observed on the request path (the ITL on every forwarded event): one process's own series are
        # plain numbers on the event loop's thread (LoopCounter, LoopHistogram); several workers' go through
        # prometheus_client's files.
        counter = Counter if self.multiprocess_dir else LoopCounterFamily
        histogram = Histogram if self.multiprocess_dir else LoopHistogramFamily
        self.requests = counter(
            "deepserve_gateway_requests", "Requests answered, by key, model and status", ["key", "model", "status"],
            registry=r,
        )  # fmt: skip
        self.prompt_tokens = counter(
            "deepserve_gateway_prompt_tokens", "Prompt tokens (upstream usage)", ["key", "model"], registry=r
        )
        self.completion_tokens = counter(
            "deepserve_gateway_completion_tokens", "Completion tokens (upstream usage)", ["key", "model"], registry=r
        )
        self.reasoning_tokens = counter(
            "deepserve_gateway_reasoning_tokens",
            "Of the completion tokens, those spent reasoning; source: usage (the engine's count) or deltas (counted "
            "from the stream's reasoning events, one per event)",
            ["key", "model", "source"],
            registry=r,
        )
        self.ttft_s = histogram(
            "deepserve_gateway_ttft_seconds", "Time to first streamed chunk, as the gateway forwards it", ["model"],
            buckets=_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.itl_s = histogram(
            "deepserve_gateway_itl_seconds", "Gap between forwarded stream chunks", ["model"],
            buckets=_ITL_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.e2e_s = histogram(
            "deepserve_gateway_e2e_seconds", "Request arrival to last byte", ["model"],
            buckets=_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.rejections = Counter(
            "deepserve_gateway_rejections", "Requests refused by the gateway, by reason", ["reason"], registry=r
        )
        self.upstream_failures = Counter(
            "deepserve_gateway_upstream_failures", "Failed attempts against a replica, by error code",
            ["replica", "code"], registry=r,
        )  # fmt: skip
        self.retries = Counter("deepserve_gateway_retries", "Requests retried on another replica", registry=r)
        self.pd_phase_s = Histogram(
            "deepserve_gateway_pd_phase_seconds", "Prefill/decode disaggregation: the prefill request's round trip "
            "(phase=prefill) and the decode request's time to its first forwarded event (phase=decode_first_token)",
            ["model", "phase"], buckets=_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.pd_fallbacks = Counter(
            "deepserve_gateway_pd_fallbacks", "Requests decoded without a prefill replica's KV cache, by reason "
            "(no_prefill_replica, prefill_failed)", ["reason"], registry=r,
        )  # fmt: skip
        self.pd_handoffs = Counter(
            "deepserve_gateway_pd_handoffs", "Prefilled requests sent on to a decode replica, by whether the prefill "
            "answered with kv_transfer_params (returned) or without (none: connectors that find the KV by the prompt "
            "itself, such as ExampleConnector, return none)", ["kv_transfer_params"], registry=r,
        )  # fmt: skip
        self.limiter_fallbacks = Counter(
            "deepserve_gateway_limiter_fallbacks", "Requests admitted by this gateway's own limits while the shared "
            "limits' Redis was unreachable (--redis-fail-open)", registry=r,
        )  # fmt: skip
        self.redis_errors = Counter(
            "deepserve_gateway_redis_errors", "Failed calls to the shared limits' Redis", registry=r
        )
        self._live: list[Collector] = [_LiveState(pool, limiter, prefill_pool), _LedgerState(ledger)]
        if connections is not None:
            self._live.append(_ConnectionState(connections))
        self._live_files = _MultiprocessLiveState() if self.multiprocess_dir else None
        if self._live_files is None:
            for collector in self._live:
                r.register(collector)
        # Labelled children, looked up once: prometheus_client's labels() validates and locks on every call.
        self._requests: dict[tuple[str, str, int], Any] = {}
        self._tokens: dict[tuple[str, str], tuple[Any, Any]] = {}
        self._reasoning: dict[tuple[str, str, str], Any] = {}
        self._phases: dict[tuple[str, str], Any] = {}
        self._models: dict[str, ModelMetrics] = {}

    def request_counter(self, key: str, model: str, status: int) -> Any:
        child = self._requests.get((key, model, status))
        if child is None:
            child = self._requests[(key, model, status)] = self.requests.labels(key, model, str(status))
        return child

    def token_counters(self, key: str, model: str) -> tuple[Any, Any]:
        pair = self._tokens.get((key, model))
        if pair is None:
            pair = self._tokens[(key, model)] = (
                self.prompt_tokens.labels(key, model),
                self.completion_tokens.labels(key, model),
            )
        return pair

    def reasoning_counter(self, key: str, model: str, source: str) -> Any:
        child = self._reasoning.get((key, model, source))
        if child is None:
            child = self._reasoning[(key, model, source)] = self.reasoning_tokens.labels(key, model, source)
        return child

    def pd_phase(self, model: str, phase: str) -> Any:
        child = self._phases.get((model, phase))
        if child is None:
            child = self._phases[(model, phase)] = self.pd_phase_s.labels(model, phase)
        return child

    def for_model(self, model: str) -> ModelMetrics:
        per_model = self._models.get(model)
        if per_model is None:
            per_model = self._models[model] = ModelMetrics(
                self.ttft_s.labels(model), self.itl_s.labels(model), self.e2e_s.labels(model)
            )
        return per_model

    def publish_live_state(self) -> None:
        """Several workers: copy this worker's live state where the others' /metrics can add it up."""
        if self._live_files is not None:
            self._live_files.copy(self._live)

    def render(self) -> bytes:
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        self.publish_live_state()
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=self.multiprocess_dir)
        return generate_latest(registry)


class LoopCounter:
    """One label set's counter, counted on the event loop's thread only (see LoopHistogram)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class LoopCounterFamily(Collector):
    """A labelled family of LoopCounters, exposed as prometheus_client exposes a Counter (`_total` samples)."""

    def __init__(
        self, name: str, documentation: str, labelnames: list[str], *, registry: CollectorRegistry | None = None
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self._children: dict[tuple[str, ...], LoopCounter] = {}
        if registry is not None:
            registry.register(self)

    def labels(self, *values: str) -> LoopCounter:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = LoopCounter()
        return child

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self._children.items():
            family.add_metric(list(values), child.value)
        yield family


class LoopHistogram:
    """One label set's histogram, observed on the event loop's thread only: counts in a list, no lock.
    prometheus_client's Histogram takes a lock per bucket and sum and walks its buckets in Python (about 4 µs an
    observation here, against under 1 µs), and the gateway observes the ITL on every event it forwards. The scrape
    reads it on the same thread (render runs in the loop), so nothing is read half-written."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds  # ascending, the last one +Inf
        self.counts = [0] * len(bounds)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


class LoopHistogramFamily(Collector):
    """A labelled family of LoopHistograms, exposed exactly as prometheus_client exposes a Histogram (the same
    `_bucket{le}`, `_sum`, `_count` and `_created`-free samples, the same bucket bounds)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: list[str],
        *,
        buckets: tuple[float, ...],
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self.bounds = (*buckets, math.inf) if buckets[-1] != math.inf else buckets
        self._bounds_text = [floatToGoString(bound) for bound in self.bounds]
        self._children: dict[tuple[str, ...], LoopHistogram] = {}
        if registry is not None:
            registry.register(self)

    def labels(self, *values: str) -> LoopHistogram:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = LoopHistogram(self.bounds)
        return child

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self._children.items():
            cumulative = list(itertools.accumulate(child.counts))
            family.add_metric(list(values), list(zip(self._bounds_text, cumulative, strict=True)), child.sum)
        yield family


@dataclass(frozen=True)
class ModelMetrics:
    ttft_s: Any
    itl_s: Any
    e2e_s: Any


class _LiveState(Collector):
    def __init__(self, pool: UpstreamPool, limiter: Limiter, prefill_pool: UpstreamPool | None = None) -> None:
        self.pool = pool
        self.limiter = limiter
        self.prefill_pool = prefill_pool

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("deepserve_gateway_queue_depth", "Requests waiting for a slot", self.limiter.waiting)
        yield GaugeMetricFamily("deepserve_gateway_in_flight", "Requests being forwarded", self.limiter.in_flight)
        if self.limiter.shared:
            yield GaugeMetricFamily(
                "deepserve_gateway_redis_up",
                "1 while the shared limits' Redis answers",
                1.0 if self.limiter.up else 0.0,
            )
        yield from _replica_families("deepserve_gateway_upstream", "", self.pool)
        if self.prefill_pool is not None:
            yield from _replica_families("deepserve_gateway_prefill_upstream", "prefill ", self.prefill_pool)


def _replica_families(prefix: str, kind: str, pool: UpstreamPool) -> Iterator[Metric]:
    healthy = GaugeMetricFamily(f"{prefix}_healthy", f"1 if the {kind}replica is in rotation", labels=["replica"])
    outstanding = GaugeMetricFamily(
        f"{prefix}_in_flight", f"Requests in flight on the {kind}replica", labels=["replica"]
    )
    for replica in [*pool.replicas, *pool.draining]:  # draining: left the pool, requests still in flight there
        healthy.add_metric([replica.url], 1.0 if replica.healthy else 0.0)
        outstanding.add_metric([replica.url], replica.outstanding)
    yield healthy
    yield outstanding


class _ConnectionState(Collector):
    def __init__(self, guard: ConnectionGuard) -> None:
        self.guard = guard

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("deepserve_gateway_connections", "Client connections open", len(self.guard.open))
        refused = CounterMetricFamily(
            "deepserve_gateway_connections_refused",
            "Client connections answered and closed by the server's limits, by reason",
            labels=["reason"],
        )
        for reason in REFUSAL_REASONS:
            refused.add_metric([reason], self.guard.refused[reason])
        yield refused


class _LedgerState(Collector):
    def __init__(self, ledger: Callable[[], UsageLedger | None]) -> None:
        self.ledger = ledger

    def collect(self) -> Iterator[Metric]:
        ledger = self.ledger()
        if ledger is None:
            return
        stats = ledger.stats
        for name, help_text, value in (
            ("rows_written", "Usage ledger rows committed", stats.written),
            ("write_failures", "Failed usage ledger writes (each retried, the row kept)", stats.write_failures),
            ("rows_repaired", "Usage ledger rows stored only after unstorable text was replaced or left out",
             stats.rows_repaired),
            ("rows_lost", "Usage ledger rows given up (the database stayed unwritable)", stats.rows_lost),
        ):  # fmt: skip
            yield CounterMetricFamily(f"deepserve_gateway_ledger_{name}", help_text, value)
        yield GaugeMetricFamily("deepserve_gateway_ledger_pending_rows", "Usage rows not yet written", ledger.pending)


# Live gauges combined over the workers by their minimum (1 only if every worker says 1); the others are summed.
_MINIMUM_OVER_WORKERS = frozenset(
    {"deepserve_gateway_redis_up", "deepserve_gateway_upstream_healthy", "deepserve_gateway_prefill_upstream_healthy"}
)


class _MultiprocessLiveState:
    """The live collectors' series as prometheus_client multiprocess metrics (one file per worker, combined at
    scrape time): a gauge is set to the value read (summed over the live workers, or their minimum), a counter is
    advanced by what it grew since the last copy (so a worker's counts outlive it, as the request counters do)."""

    def __init__(self) -> None:
        self._gauges: dict[str, Gauge] = {}
        self._counters: dict[str, Counter] = {}
        self._copied: dict[tuple[str, tuple[str, ...]], float] = {}

    def copy(self, collectors: list[Collector]) -> None:
        for collector in collectors:
            for family in collector.collect():
                for sample in family.samples:
                    values = tuple(sample.labels.values())
                    if family.type == "counter":
                        if sample.name.endswith("_total"):
                            self._advance(family, sample.labels, values, sample.value)
                        continue
                    gauge = self._gauge(family, sample.labels)
                    (gauge.labels(*values) if values else gauge).set(sample.value)

    def _gauge(self, family: Metric, labels: dict[str, str]) -> Gauge:
        gauge = self._gauges.get(family.name)
        if gauge is None:
            minimum = family.name in _MINIMUM_OVER_WORKERS
            gauge = self._gauges[family.name] = Gauge(
                family.name, family.documentation + (" (in every worker)" if minimum else ""), list(labels),
                multiprocess_mode="livemin" if minimum else "livesum", registry=None,
            )  # fmt: skip
        return gauge

    def _advance(self, family: Metric, labels: dict[str, str], values: tuple[str, ...], total: float) -> None:
        counter = self._counters.get(family.name)
        if counter is None:
            counter = self._counters[family.name] = Counter(
                family.name, family.documentation, list(labels), registry=None
            )
        grown = total - self._copied.get((family.name, values), 0.0)
        if grown > 0:
            (counter.labels(*values) if values else counter).inc(grown)
            self._copied[(family.name, values)] = total
