"""Prometheus metrics of the gateway. Counters and histograms are updated on the request path; gauges that mirror
live state (queue depth, in-flight, replica health) are read only when /metrics is scraped."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from deepserve.gateway.connections import REFUSAL_REASONS, ConnectionGuard
from deepserve.gateway.ledger import UsageLedger
from deepserve.gateway.limits import AdmissionQueue
from deepserve.gateway.upstreams import UpstreamPool

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class GatewayMetrics:
    def __init__(
        self,
        pool: UpstreamPool,
        queue: AdmissionQueue,
        connections: ConnectionGuard | None = None,
        ledger: Callable[[], UsageLedger | None] = lambda: None,
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "deepserve_gateway_requests", "Requests answered, by key, model and status", ["key", "model", "status"],
            registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "deepserve_gateway_prompt_tokens", "Prompt tokens (upstream usage)", ["key", "model"], registry=r
        )
        self.completion_tokens = Counter(
            "deepserve_gateway_completion_tokens", "Completion tokens (upstream usage)", ["key", "model"], registry=r
        )
        self.ttft_s = Histogram(
            "deepserve_gateway_ttft_seconds", "Time to first streamed chunk, as the gateway forwards it", ["model"],
            buckets=_LATENCY_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.itl_s = Histogram(
            "deepserve_gateway_itl_seconds", "Gap between forwarded stream chunks", ["model"],
            buckets=_ITL_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.e2e_s = Histogram(
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
        r.register(_LiveState(pool, queue))
        if connections is not None:
            r.register(_ConnectionState(connections))
        r.register(_LedgerState(ledger))
        # Labelled children, looked up once: prometheus_client's labels() validates and locks on every call.
        self._requests: dict[tuple[str, str, int], Any] = {}
        self._tokens: dict[tuple[str, str], tuple[Any, Any]] = {}
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

    def for_model(self, model: str) -> ModelMetrics:
        per_model = self._models.get(model)
        if per_model is None:
            per_model = self._models[model] = ModelMetrics(
                self.ttft_s.labels(model), self.itl_s.labels(model), self.e2e_s.labels(model)
            )
        return per_model

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass(frozen=True)
class ModelMetrics:
    ttft_s: Any
    itl_s: Any
    e2e_s: Any


class _LiveState(Collector):
    def __init__(self, pool: UpstreamPool, queue: AdmissionQueue) -> None:
        self.pool = pool
        self.queue = queue

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("deepserve_gateway_queue_depth", "Requests waiting for a slot", self.queue.waiting)
        yield GaugeMetricFamily("deepserve_gateway_in_flight", "Requests being forwarded", self.queue.in_flight)
        healthy = GaugeMetricFamily(
            "deepserve_gateway_upstream_healthy", "1 if the replica is in rotation", labels=["replica"]
        )
        outstanding = GaugeMetricFamily(
            "deepserve_gateway_upstream_in_flight", "Requests in flight on the replica", labels=["replica"]
        )
        for replica in self.pool.replicas:
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
