"""The questions the seeds answered by squinting at charts, answered in plain words from the numbers.

- SLO: the highest concurrency whose latency stays within the SLOs, and the throughput there. "Stays" means that
  concurrency and every lower one measured meet them: a lucky pass above a failing point is not capacity.
- Saturation under a request-rate sweep: the completed rate levels off while the offered rate keeps rising. The
  plateau is the highest completed rate; the server saturates at the first offered rate whose completed rate reaches
  95% of that plateau while falling short of the offered rate by more than 10%.
- Saturation under a concurrency sweep: the first concurrency whose output throughput reaches 95% of the peak.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from deepserve.report import series as sr
from deepserve.report.slo import Slo, metric_words
from deepserve.results.points import ResultSet

PLATEAU_FRACTION = 0.95  # within 5% of the best is "on the plateau"
KEEPING_UP_FRACTION = 0.90  # completing at least 90% of the offered rate is "keeping up"


@dataclass(frozen=True)
class SloAnswer:
    series: str
    concurrency: int | None  # None: no measured concurrency meets the SLOs
    output_throughput: float | None
    total_throughput: float | None
    text: str


@dataclass(frozen=True)
class SaturationAnswer:
    series: str
    saturated: bool
    offered_rate: float | None  # request-rate sweeps: where it saturates
    completed_rate: float | None  # the plateau (or the best measured when it did not saturate)
    text: str


def slo_answers(sets: list[ResultSet], slos: Sequence[Slo]) -> list[SloAnswer]:
    lines = sr.build_series(sets, sr.is_concurrency_point, sr.concurrency_x, "max_concurrency")
    return [_slo_answer(line, slos) for line in lines] if slos else []


def _slo_answer(line: sr.Series, slos: Sequence[Slo]) -> SloAnswer:
    words = " and ".join(slo.words for slo in slos)
    best = None
    for point in line.points:
        if not all(slo.met_by(point.metric(slo.metric)) for slo in slos):
            break
        best = point
    if best is None:
        first = line.points[0]
        measured = ", ".join(f"{metric_words(slo.metric)} {_ms(first.metric(slo.metric))}" for slo in slos)
        text = (
            f"{line.label}: no measured concurrency meets {words}; even concurrency "
            f"{first.params.max_concurrency} has {measured}."
        )
        return SloAnswer(line.label, None, None, None, text)
    output, total = best.metric("output_throughput"), best.metric("total_token_throughput")
    concurrency = best.params.max_concurrency
    highest = line.points[-1].params.max_concurrency
    limit = "" if best is not line.points[-1] else f" (the highest measured; the SLO may hold beyond {highest})"
    text = (
        f"{line.label}: the highest concurrency that meets {words} is {concurrency}{limit}; "
        f"there it delivers {_tps(output)} output tokens/s ({_tps(total)} total tokens/s)."
    )
    return SloAnswer(line.label, concurrency, output, total, text)


def saturation_answers(sets: list[ResultSet]) -> list[SaturationAnswer]:
    rate_lines = sr.build_series(sets, sr.is_rate_point, sr.rate_x, "request_rate")
    concurrency_lines = sr.build_series(sets, sr.is_concurrency_point, sr.concurrency_x, "max_concurrency")
    return [_rate_saturation(line) for line in rate_lines] + [
        _concurrency_saturation(line) for line in concurrency_lines
    ]


def _rate_saturation(line: sr.Series) -> SaturationAnswer:
    completed = [point.metric("request_throughput") or 0.0 for point in line.points]
    plateau = max(completed)
    for offered, done in zip(line.xs, completed, strict=True):
        if done >= PLATEAU_FRACTION * plateau and done < KEEPING_UP_FRACTION * offered:
            text = (
                f"{line.label}: the server saturates at about {plateau:.2f} requests/s. From an offered rate of "
                f"{offered:g} requests/s on, it completes {done:.2f} requests/s and extra load only queues "
                f"(at {line.xs[-1]:g} offered: {completed[-1]:.2f} completed)."
            )
            return SaturationAnswer(line.label, True, offered, plateau, text)
    text = (
        f"{line.label}: the server did not saturate up to an offered {line.xs[-1]:g} requests/s "
        f"(it completed {completed[-1]:.2f} requests/s there)."
    )
    return SaturationAnswer(line.label, False, None, plateau, text)


def _concurrency_saturation(line: sr.Series) -> SaturationAnswer:
    outputs = [point.metric("output_throughput") or 0.0 for point in line.points]
    peak = max(outputs)
    index = next(i for i, value in enumerate(outputs) if value >= PLATEAU_FRACTION * peak)
    concurrency = line.xs[index]
    if index == len(outputs) - 1:
        text = (
            f"{line.label}: output throughput was still rising at the highest concurrency measured, "
            f"{concurrency:g} ({_tps(outputs[index])} tokens/s)."
        )
        return SaturationAnswer(line.label, False, None, None, text)
    text = (
        f"{line.label}: output throughput levels off from concurrency {concurrency:g} "
        f"({_tps(outputs[index])} tokens/s, within 5% of the peak {_tps(peak)}); "
        "more concurrency adds latency, not throughput."
    )
    return SaturationAnswer(line.label, True, None, None, text)


def _tps(value: float | None) -> str:
    return "?" if value is None else f"{value:,.0f}"


def _ms(value: float | None) -> str:
    return "no value" if value is None else f"{value:,.1f} ms"
