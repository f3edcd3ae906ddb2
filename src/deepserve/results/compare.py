"""A regression gate: a candidate's results against a baseline's, metric by metric, with a verdict a CI job can act on.

`--fail-on METRIC=+10%` fails when METRIC rose by more than 10% (a latency); `METRIC=-5%` when it fell by more than
5% (a throughput). A change beyond the threshold is a regression only if it is also beyond noise: when the runs were
repeated (`--num-runs`), the two 95% confidence intervals of the means must not overlap, the candidate's lying wholly
on the worse side of the baseline's. A single run has no interval, and the threshold alone decides (docs/REPORTS.md,
"A regression gate in CI"). Sweeps are compared point by point (points matched by their parameters).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepserve.errors import ConfigError
from deepserve.results.points import ResultPoint, ResultSet
from deepserve.results.store import ResultsStore
from deepserve.results.sweepdir import load_result_set

_FAIL_ON = re.compile(r"^\s*([A-Za-z0-9_.]+)\s*[=:]\s*([+-])\s*([0-9]*\.?[0-9]+)\s*%\s*$")


@dataclass(frozen=True)
class Threshold:
    """METRIC regresses when it moves by more than FRACTION in its worse DIRECTION (+1: up is worse)."""

    metric: str
    direction: int
    fraction: float

    @property
    def words(self) -> str:
        return f"{self.metric} {'+' if self.direction > 0 else '-'}{self.fraction:.0%}"


def parse_fail_on(text: str) -> Threshold:
    """ "p99_ttft_ms=+10%" (fail when it rises by more than 10%) or "output_throughput=-5%" (when it falls)."""
    match = _FAIL_ON.match(text)
    if match is None:
        raise ConfigError(
            f"--fail-on {text!r} must be METRIC=+N% (fail when it rises more than N%, for a latency) or "
            "METRIC=-N% (when it falls, for a throughput), e.g. p99_ttft_ms=+10% or output_throughput=-5%"
        )
    metric, sign, number = match.groups()
    return Threshold(metric, 1 if sign == "+" else -1, float(number) / 100)


@dataclass(frozen=True)
class Span:
    """A metric of one result: its value (the mean over runs) and its 95% confidence interval, when it has one."""

    value: float
    low: float | None = None
    high: float | None = None
    runs: int = 1

    @property
    def has_interval(self) -> bool:
        return self.low is not None and self.high is not None

    def words(self) -> str:
        if not self.has_interval:
            return f"{self.value:,.4g}"
        return f"{self.value:,.4g} (95% CI {self.low:,.4g} to {self.high:,.4g}, {self.runs} runs)"


def span_of(result: dict[str, Any], metric: str) -> Span | None:
    """METRIC of a result JSON (None when it has no number for it), with the interval `--num-runs` recorded."""
    value = result.get(metric)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    interval = (result.get("confidence_intervals") or {}).get(metric) or {}
    low, high = interval.get("ci95_low"), interval.get("ci95_high")
    return Span(float(value), low, high, int(interval.get("n") or 1))


@dataclass(frozen=True)
class Verdict:
    threshold: Threshold
    baseline: Span | None
    candidate: Span | None
    regressed: bool
    why: str
    where: str = ""  # the sweep point, in a sweep-level comparison

    @property
    def change(self) -> float | None:
        if self.baseline is None or self.candidate is None or self.baseline.value == 0:
            return None
        return self.candidate.value / self.baseline.value - 1


def judge(threshold: Threshold, baseline: Span | None, candidate: Span | None, where: str = "") -> Verdict:
    """Whether CANDIDATE regressed from BASELINE by more than THRESHOLD and beyond noise, and why, in words."""
    name = threshold.metric
    if baseline is None or candidate is None:
        missing = "baseline" if baseline is None else "candidate"
        return Verdict(threshold, baseline, candidate, True, f"{name}: the {missing} has no value for it", where)
    worse = threshold.direction * (candidate.value - baseline.value)
    limit = threshold.fraction * abs(baseline.value)
    moved = (candidate.value / baseline.value - 1) if baseline.value else math.inf
    change = f"{name} {baseline.words()} → {candidate.words()} ({moved:+.1%}; allowed {threshold.words})"
    if worse <= limit:
        return Verdict(threshold, baseline, candidate, False, f"ok: {change}", where)
    if _intervals_overlap(baseline, candidate, threshold.direction):
        return Verdict(
            threshold, baseline, candidate, False, f"within noise: {change}, but the 95% intervals overlap", where
        )
    repeated = baseline.has_interval or candidate.has_interval
    beyond = " and beyond the runs' 95% confidence intervals" if repeated else " (single runs: no interval to judge)"
    return Verdict(threshold, baseline, candidate, True, f"REGRESSION: {change}{beyond}", where)


def _intervals_overlap(baseline: Span, candidate: Span, direction: int) -> bool:
    """Whether the candidate's interval reaches back into the baseline's (a point value where one has none)."""
    if not baseline.has_interval and not candidate.has_interval:
        return False
    base_low, base_high = _bounds(baseline)
    cand_low, cand_high = _bounds(candidate)
    return cand_low <= base_high if direction > 0 else cand_high >= base_low


def _bounds(span: Span) -> tuple[float, float]:
    if span.low is None or span.high is None:
        return span.value, span.value
    return span.low, span.high


def load_subject(ref: str, store: ResultsStore) -> ResultSet:
    """What `runs compare` compares: a run id of the results store, a result JSON file, or a sweep directory."""
    if ref.isdigit():
        run = store.get(int(ref))
        return ResultSet(f"run {run.run_id}", [run.as_point()], run.metadata, str(store.path))
    return load_result_set(Path(ref))


def gate(baseline: ResultSet, candidate: ResultSet, thresholds: Sequence[Threshold]) -> list[Verdict]:
    """Two single results metric by metric; sweeps (or directories of results) point by point."""
    if len(baseline.points) == 1 and len(candidate.points) == 1:
        return compare_results(baseline.points[0].result, candidate.points[0].result, thresholds)
    return compare_sets(baseline, candidate, thresholds)


def compare_results(
    baseline: dict[str, Any], candidate: dict[str, Any], thresholds: Sequence[Threshold]
) -> list[Verdict]:
    return [judge(t, span_of(baseline, t.metric), span_of(candidate, t.metric)) for t in thresholds]


def compare_sets(baseline: ResultSet, candidate: ResultSet, thresholds: Sequence[Threshold]) -> list[Verdict]:
    """Point by point, points matched by their parameters (concurrency, rate, lengths, variant); a baseline point the
    candidate lacks is a failure (the candidate did not measure it), extra candidate points are not judged."""
    by_params = {_key(point): point for point in candidate.points}
    verdicts = []
    for point in baseline.points:
        where = point.params.describe()
        match = by_params.get(_key(point))
        if match is None:
            verdicts.append(Verdict(thresholds[0], None, None, True, "the candidate has no such point", where))
            continue
        verdicts += [
            judge(t, span_of(point.result, t.metric), span_of(match.result, t.metric), where) for t in thresholds
        ]
    return verdicts


def _key(point: ResultPoint) -> tuple[Any, ...]:
    params = point.params
    return (params.max_concurrency, params.request_rate, params.input_len, params.output_len, params.variant)
