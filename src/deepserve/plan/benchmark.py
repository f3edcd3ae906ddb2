"""A finite benchmark run as the client runs it, and the forecast of what it will measure.

The closed-loop formula (perf.closed_loop) is a steady state. A benchmark is finite: so many requests, sent all at
once, at a rate, or by so many clients, with fixed or spread lengths; its first wave, its queue and its drain are
part of what it reports. `BenchmarkForecaster` is the extension point that runs such a run against the step model
in virtual time: the simulator implements it (simulate/forecast.py, which plan may not import: the CLI passes it in),
so plan's validation and search can ask for the forecast without knowing who makes it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from deepserve.plan.perf import PerformanceModel
    from deepserve.plan.types import Deployment


@dataclass(frozen=True)
class BenchmarkRun:
    """What the benchmark client does: NUM_PROMPTS requests of INPUT_LEN/OUTPUT_LEN tokens on average (uniformly
    within mean x (1 +- spread)), at most CONCURRENCY in flight (None: no cap), arriving as a Poisson process of
    REQUEST_RATE per second (None: all at once, or as the concurrency cap lets them)."""

    num_prompts: int
    input_len: int
    output_len: int
    concurrency: int | None = None
    request_rate: float | None = None
    input_spread: float = 0.0
    output_spread: float = 0.0
    seed: int = 0
    warmup_requests: int = 0  # the first requests, left out of the figures (a warm-up, or a run's first wave)

    def describe(self) -> str:
        arrivals = "all at once" if self.request_rate is None else f"{self.request_rate:g} req/s (Poisson)"
        cap = f", at most {self.concurrency} in flight" if self.concurrency else ""
        warmup = f", the first {self.warmup_requests} not counted" if self.warmup_requests else ""
        return f"{self.num_prompts} requests of {self.input_len}/{self.output_len} tokens, {arrivals}{cap}{warmup}"


@dataclass(frozen=True)
class Stats:
    mean: float
    median: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats:
        if not values:
            return cls(0.0, 0.0, 0.0)
        ordered = sorted(values)
        index = min(len(ordered) - 1, max(0, round(0.99 * (len(ordered) - 1))))
        return cls(statistics.fmean(ordered), statistics.median(ordered), ordered[index])

    @classmethod
    def weighted(cls, pairs: Sequence[tuple[float, int]]) -> Stats:
        """Statistics of values each counted COUNT times ((value, count) pairs)."""
        pairs = sorted(p for p in pairs if p[1] > 0)
        total = sum(count for _, count in pairs)
        if not total:
            return cls(0.0, 0.0, 0.0)
        mean = sum(value * count for value, count in pairs) / total
        return cls(mean, _quantile(pairs, round(0.5 * (total - 1))), _quantile(pairs, round(0.99 * (total - 1))))

    def get(self, statistic: str) -> float:
        return float(getattr(self, statistic))


def _quantile(pairs: Sequence[tuple[float, int]], position: int) -> float:
    """The value at POSITION (0-based) of the sorted values, each counted as many times as its pair says."""
    seen = 0
    for value, count in pairs:
        seen += count
        if seen > position:
            return value
    return pairs[-1][0]


@dataclass(frozen=True)
class BenchmarkForecast:
    """What the benchmark would print, in its units (ms for latencies)."""

    run: BenchmarkRun
    duration_s: float
    output_tokens: int
    input_tokens: int
    ttft_ms: Stats
    tpot_ms: Stats
    itl_ms: Stats
    e2el_ms: Stats
    preemptions: int = 0

    @property
    def output_throughput_tok_s(self) -> float:
        return self.output_tokens / self.duration_s

    @property
    def input_throughput_tok_s(self) -> float:
        return self.input_tokens / self.duration_s

    @property
    def request_throughput(self) -> float:
        return self.run.num_prompts / self.duration_s

    def to_json(self) -> dict[str, object]:
        return {
            "run": self.run.describe(),
            "duration_s": round(self.duration_s, 2),
            "output_throughput_tok_s": round(self.output_throughput_tok_s, 1),
            "mean_ttft_ms": round(self.ttft_ms.mean, 1),
            "p99_ttft_ms": round(self.ttft_ms.p99, 1),
            "mean_tpot_ms": round(self.tpot_ms.mean, 2),
            "mean_itl_ms": round(self.itl_ms.mean, 2),
            "mean_e2el_ms": round(self.e2el_ms.mean, 1),
            "preemptions": self.preemptions,
        }


class BenchmarkForecaster(Protocol):
    def forecast(self, deployment: Deployment, model: PerformanceModel, run: BenchmarkRun) -> BenchmarkForecast:
        """RUN against DEPLOYMENT timed by MODEL's steps, as the benchmark client would measure it."""
        ...


class RememberingForecaster:
    """A forecaster that runs each (deployment, parameters, run) once: several published rows (TTFT, TPOT,
    throughput) are figures of one run."""

    def __init__(self, forecaster: BenchmarkForecaster) -> None:
        self.forecaster = forecaster
        self._runs: dict[tuple[object, ...], BenchmarkForecast] = {}

    def forecast(self, deployment: Deployment, model: PerformanceModel, run: BenchmarkRun) -> BenchmarkForecast:
        key = (*_deployment_key(deployment), model.engine.parameters, model.engine.version, run)
        if key not in self._runs:
            self._runs[key] = self.forecaster.forecast(deployment, model, run)
        return self._runs[key]


def _deployment_key(d: Deployment) -> tuple[object, ...]:
    return (
        d.spec.name,
        d.fmt.name,
        d.layout,
        d.accelerator.name,
        d.nodes,
        d.network.name,
        d.engine,
        d.engine_version,
        d.kv_dtype,
        d.max_num_seqs,
        d.max_num_batched_tokens,
        d.memory.kv_cache_tokens,
        d.memory.max_model_len,
        d.options,
        d.calibration,
    )
