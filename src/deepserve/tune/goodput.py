"""Goodput and SLOs of one measured point, from its result JSON (the tune saves vLLM's per-request lists with it,
so both can be recomputed for any SLO later, e.g. by `deepserve report --slo`).

- An SLO (`p99_itl_ms=50`) **holds** at a point when the statistic over all its requests is within the limit: the
  P99 of every inter-token gap, the median TTFT, ...
- A **request meets** an SLO when its own value is within the limit: its TTFT, TPOT or end-to-end latency; for
  ITL, the same statistic over its own gaps (its P99 gap for `p99_itl_ms`). A `std_*` SLO describes spread across
  requests and is judged only as a whole.
- **Goodput** is output tokens per second of the completed requests that meet every SLO (DistServe's goodput,
  counted in tokens as vLLM's output throughput is).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from deepserve.errors import DeepserveError
from deepserve.results.slo import Slo

DETAIL_KEYS = ("output_lens", "ttfts", "latencies", "itls", "errors")


class MissingDetails(DeepserveError):
    """A result without per-request lists: goodput cannot be counted from it."""


@dataclass(frozen=True)
class RequestLatencies:
    """One request as the result's per-request lists record it, in milliseconds."""

    completed: bool
    output_len: int
    ttft_ms: float
    e2el_ms: float
    itls_ms: tuple[float, ...]

    @property
    def tpot_ms(self) -> float:
        """(E2EL − TTFT) / (output tokens − 1); 0 for a one-token output, as vLLM's goodput counts it."""
        if self.output_len < 2:
            return 0.0
        return (self.e2el_ms - self.ttft_ms) / (self.output_len - 1)


@dataclass(frozen=True)
class SloCheck:
    slo: Slo
    value_ms: float | None  # the statistic over the whole point; None when it has no samples

    @property
    def holds(self) -> bool:
        return self.slo.met_by(self.value_ms)

    @property
    def words(self) -> str:
        shown = "no samples" if self.value_ms is None else f"{self.value_ms:,.1f} ms"
        return f"{self.slo.words}: {shown} ({'holds' if self.holds else 'missed'})"


def requests_of(result: dict[str, Any]) -> list[RequestLatencies]:
    """The per-request lists of a result (`--save-detailed`: seconds, one entry per request)."""
    missing = [key for key in DETAIL_KEYS if not isinstance(result.get(key), list)]
    if missing:
        raise MissingDetails(f"the result has no per-request lists ({', '.join(missing)}); it needs --save-detailed")
    rows = zip(*(result[key] for key in DETAIL_KEYS), strict=True)
    return [
        RequestLatencies(
            completed=not error,
            output_len=int(output_len),
            ttft_ms=float(ttft) * 1000.0,
            e2el_ms=float(latency) * 1000.0,
            itls_ms=tuple(float(gap) * 1000.0 for gap in itls),
        )
        for output_len, ttft, latency, itls, error in rows
    ]


def split_metric(slo: Slo) -> tuple[str, str]:
    """p99_itl_ms → ("p99", "itl")."""
    stat, _, metric = slo.metric.removesuffix("_ms").partition("_")
    return stat, metric


def statistic(samples: Sequence[float], stat: str) -> float | None:
    """mean, median, std (population, as the benchmark reports it) or pNN (numpy's linear interpolation)."""
    if not samples:
        return None
    values = np.asarray(samples, dtype=float)
    if stat == "mean":
        return float(values.mean())
    if stat == "median":
        return float(np.median(values))
    if stat == "std":
        return float(values.std())
    return float(np.percentile(values, float(stat[1:])))


def request_meets(request: RequestLatencies, slo: Slo) -> bool:
    stat, metric = split_metric(slo)
    if metric == "itl":
        own = statistic(request.itls_ms, stat)
        return own is None or own <= slo.max_ms  # a one-token reply has no gaps to miss
    if stat == "std":
        return True  # a spread across requests: judged for the point as a whole
    value = {"ttft": request.ttft_ms, "tpot": request.tpot_ms, "e2el": request.e2el_ms}[metric]
    return value <= slo.max_ms


def output_goodput_tok_s(result: dict[str, Any], slos: Sequence[Slo]) -> float:
    """Output tokens per second of the completed requests that meet every SLO."""
    duration_s = float(result.get("duration") or 0.0)
    if duration_s <= 0:
        return 0.0
    good = [r for r in requests_of(result) if r.completed and all(request_meets(r, slo) for slo in slos)]
    return sum(r.output_len for r in good) / duration_s


def attainment(result: dict[str, Any], slos: Sequence[Slo]) -> float:
    """The fraction of all requests (failed ones included) that completed and met every SLO."""
    requests = requests_of(result)
    if not requests:
        return 0.0
    good = sum(1 for r in requests if r.completed and all(request_meets(r, slo) for slo in slos))
    return good / len(requests)


def check_slos(result: dict[str, Any], slos: Sequence[Slo]) -> list[SloCheck]:
    """Each SLO's statistic over the point: the result's own key where the benchmark wrote it, else computed from
    the per-request lists (any percentile: p95, p99.9, ...)."""
    if not result.get("completed"):
        return [SloCheck(slo, None) for slo in slos]  # the benchmark writes zeros for a run with no completions
    checks = []
    for slo in slos:
        value = result.get(slo.metric)
        if not isinstance(value, int | float) or isinstance(value, bool) or math.isnan(value):
            value = _from_details(result, slo)
        checks.append(SloCheck(slo, None if value is None else float(value)))
    return checks


def slos_hold(result: dict[str, Any], slos: Sequence[Slo]) -> bool:
    return all(check.holds for check in check_slos(result, slos))


def _from_details(result: dict[str, Any], slo: Slo) -> float | None:
    stat, metric = split_metric(slo)
    done = [r for r in requests_of(result) if r.completed]
    if metric == "itl":
        return statistic([gap for r in done for gap in r.itls_ms], stat)
    if metric == "tpot":  # a reply of two or more tokens without gaps arrived in one write: it has no TPOT
        return statistic([r.tpot_ms for r in done if r.output_len >= 2 and r.itls_ms], stat)
    return statistic([r.ttft_ms if metric == "ttft" else r.e2el_ms for r in done], stat)
