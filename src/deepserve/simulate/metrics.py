"""The simulated engine's Prometheus metrics, under vLLM's V1 names, labels and buckets (vllm/v1/metrics/loggers.py),
so that anything reading a vLLM server (`deepserve bench --server-metrics`, the gateway's routing, dashboards)
reads the simulator the same way. Times are simulated seconds: what the modelled GPU would report.

Written out by hand rather than with prometheus_client's registry: the engine observes every token of every
stream, and a list of bucket counts is the cheapest way to do that on the event loop that also serves them.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

from deepserve.engines import vllm_metrics as names
from deepserve.engines.vllm_metrics import (
    ITERATION_TOKEN_BUCKETS,
    ITL_BUCKETS_S,
    REQUEST_LATENCY_BUCKETS_S,
    TTFT_BUCKETS_S,
    one_two_five_buckets,
)


class Histogram:
    __slots__ = ("bounds", "counts", "observations", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.total = 0.0
        self.observations = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value
        self.observations += 1

    def observe_many(self, value: float, times: int) -> None:
        self.counts[bisect_left(self.bounds, value)] += times
        self.total += value * times
        self.observations += times


@dataclass
class GaugeReading:
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0


@dataclass
class EngineMetrics:
    """Everything /metrics serves besides the gauges, which are read from the engine at scrape time."""

    max_model_len: int
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS_S))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS_S))
    e2e: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS_S))
    queue: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS_S))
    prefill: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS_S))
    decode: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS_S))
    iteration_tokens: Histogram = field(default_factory=lambda: Histogram(ITERATION_TOKEN_BUCKETS))
    prompt_tokens_per_request: Histogram = field(init=False)
    generation_tokens_per_request: Histogram = field(init=False)
    finished: dict[str, int] = field(default_factory=lambda: {"length": 0, "stop": 0, "abort": 0})

    def __post_init__(self) -> None:
        buckets = tuple(float(b) for b in one_two_five_buckets(self.max_model_len))
        self.prompt_tokens_per_request = Histogram(buckets)
        self.generation_tokens_per_request = Histogram(buckets)

    def observe_finished(
        self,
        reason: str,
        arrival_s: float,
        scheduled_s: float | None,
        first_token_s: float | None,
        now_s: float,
        prompt_tokens: int,
        generated_tokens: int,
    ) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1
        self.e2e.observe(now_s - arrival_s)
        if scheduled_s is not None:
            self.queue.observe(scheduled_s - arrival_s)
            if first_token_s is not None:
                self.prefill.observe(first_token_s - scheduled_s)
                self.decode.observe(now_s - first_token_s)
        self.prompt_tokens_per_request.observe(prompt_tokens)
        self.generation_tokens_per_request.observe(generated_tokens)


@dataclass(frozen=True)
class CounterReading:
    prompt_tokens: int
    generation_tokens: int
    preemptions: int
    prefix_queries: int
    prefix_hits: int
    # speculative decoding (None when it is off: vLLM then exports none of its series)
    spec_drafts: int | None = None
    spec_draft_tokens: int | None = None
    spec_accepted_tokens: int | None = None
    spec_accepted_per_position: tuple[int, ...] | None = None


def render(
    model: str,
    metrics: EngineMetrics,
    gauges: GaugeReading,
    counters: CounterReading,
    cache_info: dict[str, str],
    overrides: dict[str, float] | None = None,
) -> str:
    """Prometheus text exposition (version 0.0.4). OVERRIDES replace a series' value by metric name (routing tests
    give replicas the load they want them to report)."""
    labels = f'{names.ENGINE_LABEL}="0",{names.MODEL_LABEL}="{_escape(model)}"'
    out = _Exposition(labels, overrides or {})
    out.gauge(names.RUNNING, "Number of requests in model execution batches.", gauges.running)
    out.gauge(names.WAITING, "Number of requests waiting to be processed.", gauges.waiting)
    out.gauge(names.KV_CACHE_USAGE, "KV-cache usage. 1 means 100 percent usage.", gauges.kv_cache_usage)
    out.counter(names.PREFIX_CACHE_QUERIES, "Prefix cache queries, in terms of number of queried tokens.",
                counters.prefix_queries)  # fmt: skip
    out.counter(names.PREFIX_CACHE_HITS, "Prefix cache hits, in terms of number of cached tokens.",
                counters.prefix_hits)  # fmt: skip
    out.counter(names.PREEMPTIONS, "Cumulative number of preemption from the engine.", counters.preemptions)
    out.counter(names.PROMPT_TOKENS, "Number of prefill tokens processed.", counters.prompt_tokens)
    out.counter(names.GENERATION_TOKENS, "Number of generation tokens processed.", counters.generation_tokens)
    out.labelled_counter(
        names.REQUEST_SUCCESS, "Count of successfully processed requests.", "finished_reason", metrics.finished
    )
    _spec_decode(out, counters)
    out.histogram(names.TTFT, "Histogram of time to first token in seconds.", metrics.ttft)
    out.histogram(names.ITL, "Histogram of inter-token latency in seconds.", metrics.itl)
    out.histogram(names.E2E_LATENCY, "Histogram of e2e request latency in seconds.", metrics.e2e)
    out.histogram(names.QUEUE_TIME, "Histogram of time spent in WAITING phase for request.", metrics.queue)
    out.histogram(names.PREFILL_TIME, "Histogram of time spent in PREFILL phase for request.", metrics.prefill)
    out.histogram(names.DECODE_TIME, "Histogram of time spent in DECODE phase for request.", metrics.decode)
    out.histogram(names.REQUEST_PROMPT_TOKENS, "Number of prefill tokens processed.",
                  metrics.prompt_tokens_per_request)  # fmt: skip
    out.histogram(names.REQUEST_GENERATION_TOKENS, "Number of generation tokens processed.",
                  metrics.generation_tokens_per_request)  # fmt: skip
    out.histogram(names.ITERATION_TOKENS, "Histogram of number of tokens per engine_step.",
                  metrics.iteration_tokens)  # fmt: skip
    out.info(names.CACHE_CONFIG_INFO, "Information of the LLMEngine CacheConfig", cache_info)
    return out.text()


def _spec_decode(out: _Exposition, counters: CounterReading) -> None:
    if counters.spec_accepted_per_position is None:
        return
    out.counter(names.SPEC_DECODE_DRAFTS, "Number of spec decoding drafts.", counters.spec_drafts or 0)
    out.counter(names.SPEC_DECODE_DRAFT_TOKENS, "Number of draft tokens.", counters.spec_draft_tokens or 0)
    out.counter(names.SPEC_DECODE_ACCEPTED_TOKENS, "Number of accepted tokens.", counters.spec_accepted_tokens or 0)
    per_position = {str(position): count for position, count in enumerate(counters.spec_accepted_per_position)}
    out.labelled_counter(
        names.SPEC_DECODE_ACCEPTED_PER_POSITION,
        "Accepted tokens per draft position.",
        names.SPEC_DECODE_POSITION_LABEL,
        per_position,
    )


class _Exposition:
    def __init__(self, labels: str, overrides: dict[str, float]) -> None:
        self.labels = labels
        self.overrides = overrides
        self.lines: list[str] = []

    def _header(self, name: str, help_text: str, kind: str) -> None:
        self.lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]

    def _value(self, name: str, value: float) -> float:
        return self.overrides.get(name, value)

    def gauge(self, name: str, help_text: str, value: float) -> None:
        self._header(name, help_text, "gauge")
        self.lines.append(f"{name}{{{self.labels}}} {_number(self._value(name, value))}")

    def counter(self, name: str, help_text: str, value: float) -> None:
        self._header(name, help_text, "counter")
        self.lines.append(f"{name}{{{self.labels}}} {_number(self._value(name, value))}")

    def labelled_counter(self, name: str, help_text: str, label: str, values: dict[str, int]) -> None:
        self._header(name, help_text, "counter")
        for key, value in values.items():
            self.lines.append(f'{name}{{{self.labels},{label}="{_escape(key)}"}} {_number(value)}')

    def histogram(self, name: str, help_text: str, histogram: Histogram) -> None:
        self._header(name, help_text, "histogram")
        cumulative = 0
        for bound, count in zip(histogram.bounds, histogram.counts, strict=False):
            cumulative += count
            self.lines.append(f'{name}_bucket{{{self.labels},le="{_number(bound)}"}} {_number(cumulative)}')
        self.lines.append(f'{name}_bucket{{{self.labels},le="+Inf"}} {_number(histogram.observations)}')
        self.lines.append(f"{name}_count{{{self.labels}}} {_number(histogram.observations)}")
        self.lines.append(f"{name}_sum{{{self.labels}}} {_number(histogram.total)}")

    def info(self, name: str, help_text: str, values: dict[str, str]) -> None:
        self._header(name, help_text, "gauge")
        pairs = ",".join(f'{key}="{_escape(value)}"' for key, value in values.items())
        self.lines.append(f'{name}{{{pairs},{names.ENGINE_LABEL}="0"}} 1.0')

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def _number(value: float) -> str:
    return repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
