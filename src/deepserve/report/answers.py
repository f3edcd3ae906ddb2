"""The questions the seeds answered by squinting at charts, answered in plain words from the numbers.

- SLO: the highest concurrency whose latency stays within the SLOs, and the throughput there. "Stays" means that
  concurrency and every lower one measured meet them: a lucky pass above a failing point is not capacity.
- Saturation under a request-rate sweep: the completed rate levels off while the offered rate keeps rising. The
  plateau is the highest completed rate; the server saturates at the first offered rate whose completed rate reaches
  95% of that plateau while falling short of the offered rate by more than 10%.
- Saturation under a concurrency sweep: the first concurrency whose output throughput reaches 95% of the peak.
- Efficiency: how close decode runs to the hardware's memory-bandwidth limit (the range over the set's points, and
  the closest point), and, with a price, the cheapest point's cost per million output tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from deepserve.report import derived as dv
from deepserve.report.deployment import SetDeployment
from deepserve.results import series as sr
from deepserve.results.points import ResultPoint, ResultSet
from deepserve.results.slo import Slo, metric_words

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
    judged = [point for point in line.points if all(point.metric(slo.metric) is not None for slo in slos)]
    for point in judged:  # a point without a value (no per-token gaps measured) is neither a pass nor a fail
        if not all(slo.met_by(point.metric(slo.metric)) for slo in slos):
            break
        best = point
    if not judged:
        text = f"{line.label}: no point has a value for {words} (every response arrived in one write)."
        return SloAnswer(line.label, None, None, None, text)
    if best is None:
        first = judged[0]
        measured = ", ".join(f"{metric_words(slo.metric)} {_ms(first.metric(slo.metric))}" for slo in slos)
        text = (
            f"{line.label}: no measured concurrency meets {words}; even concurrency "
            f"{first.params.max_concurrency} has {measured}."
        )
        return SloAnswer(line.label, None, None, None, text)
    output, total = best.metric("output_throughput"), best.metric("total_token_throughput")
    concurrency = best.params.max_concurrency
    highest = judged[-1].params.max_concurrency
    limit = "" if best is not judged[-1] else f" (the highest measured; the SLO may hold beyond {highest})"
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


@dataclass(frozen=True)
class EfficiencyAnswer:
    series: str
    text: str


def efficiency_answers(sets: list[ResultSet], deployments: Sequence[SetDeployment]) -> list[EfficiencyAnswer]:
    """Per set: how close decode runs to the hardware's limit, and what the cheapest point costs."""
    answers = []
    for result_set, deployment in zip(sets, deployments, strict=True):
        limit_text = _limit_answer(result_set, deployment)
        if limit_text:
            answers.append(EfficiencyAnswer(result_set.label, limit_text))
        cost_text = _cost_answer(result_set, deployment)
        if cost_text:
            answers.append(EfficiencyAnswer(result_set.label, cost_text))
    return answers


def _limit_answer(result_set: ResultSet, deployment: SetDeployment) -> str | None:
    points = [point for point in result_set.points if point.metric(dv.LIMIT_FRACTION) is not None]
    if not points or deployment.limit is None:
        return None
    fractions = [point.metric(dv.LIMIT_FRACTION) or 0.0 for point in points]
    closest = points[fractions.index(max(fractions))]
    span = f"{min(fractions):.0%} to {max(fractions):.0%}" if len(points) > 1 else f"{fractions[0]:.0%}"
    return (
        f"{result_set.label}: decode runs at {span} of the hardware's memory-bandwidth limit (closest at a decode "
        f"batch of {closest.metric(dv.DECODE_BATCH) or 0:,.1f}, {closest.params.describe()}: "
        f"{_tps(closest.metric(dv.DECODE_TOK_S))} of {_tps(closest.metric(dv.LIMIT_TOK_S))} tokens/s, "
        f"{_bytes(closest.metric(dv.BYTES_PER_STEP))} read per step per device); "
        f"{deployment.limit.describe()}."
    )


def _cost_answer(result_set: ResultSet, deployment: SetDeployment) -> str | None:
    points = [point for point in result_set.points if point.metric(dv.COST) is not None]
    if not points or deployment.gpu_hour_usd is None:
        return None
    cheapest = min(points, key=lambda point: point.metric(dv.COST) or math.inf)
    text = (
        f"{result_set.label}: the cheapest point costs ${cheapest.metric(dv.COST):,.2f} per million output tokens "
        f"({cheapest.params.describe()}, {_speed(cheapest)})"
    )
    fastest = max(points, key=lambda point: point.metric(dv.PER_USER) or 0.0)
    if fastest is not cheapest and fastest.metric(dv.PER_USER) is not None:
        text += (
            f"; the fastest per user, {_speed(fastest)} ({fastest.params.describe()}), costs "
            f"${fastest.metric(dv.COST):,.2f}"
        )
    text += f"; {deployment.gpus} x ${deployment.gpu_hour_usd:,.2f} per hour"
    if deployment.gpus_assumed:
        text += " (1 GPU assumed: the run recorded no GPU count; pass --gpus N)"
    return text + "."


def _bytes(value: float | None) -> str:
    if value is None:
        return "? bytes"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:,.1f} {unit}"
    return f"{value:,.0f} bytes"


def _speed(point: ResultPoint) -> str:
    value = point.metric(dv.PER_USER)
    return "speed per user unknown" if value is None else f"{value:,.1f} tokens/s per user"
