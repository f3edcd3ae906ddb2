"""One function per metric, over RequestRecords. Definitions (formula, exclusions, units) are in docs/METRICS.md;
keep the two in step. Per-request latencies are in milliseconds, record times in seconds."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from deepserve.bench.attribution import EXACT
from deepserve.bench.types import RequestRecord

# vLLM's default report (ttft, tpot, itl) plus e2el; percentiles are always reported at these points.
DEFAULT_PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
# Reported on their own when the run had reasoning or tool calls (phases.py); also valid in --percentile-metrics.
REASONING_METRICS = ("reasoning_ttft", "answer_ttft")
TOOL_CALL_METRICS = ("tool_call_start", "tool_call_end")
ALL_PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el", "client_queue_time", *REASONING_METRICS, *TOOL_CALL_METRICS)
STANDARD_PERCENTILES = (25.0, 75.0, 90.0, 95.0, 99.0)
SLO_METRICS = ("ttft", "tpot", "e2el")
PER_TOKEN_METRICS = ("tpot", "itl")  # undefined for a response that arrived in one write


def successful(records: list[RequestRecord]) -> list[RequestRecord]:
    return [record for record in records if record.success]


def ttft_ms(record: RequestRecord) -> float | None:
    """Time to first token: sent → first chunk that carried a token."""
    if record.first_token_s is None:
        return None
    return (record.first_token_s - record.sent_s) * 1000.0


def e2el_ms(record: RequestRecord) -> float | None:
    """End-to-end latency: sent → last byte of the response."""
    if record.end_s is None:
        return None
    return (record.end_s - record.sent_s) * 1000.0


def arrived_in_one_write(record: RequestRecord) -> bool:
    """Whether every token of a response of two or more tokens reached the client at one instant (one read): a
    server that held the whole answer back (vLLM's starved CPU API server does) leaves no time between its tokens to
    measure, so the request has no TPOT and no ITL (rather than samples of 0)."""
    times = record.chunk_times_s
    return record.output_len >= 2 and bool(times) and times[0] == times[-1]


def tpot_ms(record: RequestRecord) -> float | None:
    """Time per output token after the first: (E2EL − TTFT) / (output tokens − 1); undefined for one token and for
    a response that arrived in one write."""
    ttft, e2el = ttft_ms(record), e2el_ms(record)
    if ttft is None or e2el is None or record.output_len < 2 or arrived_in_one_write(record):
        return None
    return (e2el - ttft) / (record.output_len - 1)


def itl_ms(record: RequestRecord) -> list[float]:
    """Inter-token latencies, one per output token after the first. A chunk carrying k tokens after a gap g adds
    k samples of g/k; extra tokens in the first chunk arrived with the first token and add samples of 0. A response
    that arrived in one write has none."""
    if arrived_in_one_write(record):
        return []
    samples: list[float] = [0.0] * max(record.chunk_tokens[0] - 1, 0) if record.chunk_tokens else []
    times, tokens = record.chunk_times_s, record.chunk_tokens
    for index in range(1, len(times)):
        count = tokens[index]
        if count <= 0:
            continue
        gap_ms = (times[index] - times[index - 1]) * 1000.0
        samples.extend([gap_ms / count] * count)
    return samples


def _since_sent_ms(record: RequestRecord, moment_s: float | None) -> float | None:
    return None if moment_s is None else (moment_s - record.sent_s) * 1000.0


def reasoning_ttft_ms(record: RequestRecord) -> float | None:
    """Time to the first reasoning token: sent → first chunk with reasoning text (None: no reasoning)."""
    return _since_sent_ms(record, record.first_reasoning_s)


def answer_ttft_ms(record: RequestRecord) -> float | None:
    """Time to the first answer token: sent → first chunk with answer text, after any reasoning (a reasoning
    model's user waits this long for the answer itself)."""
    return _since_sent_ms(record, record.first_answer_s)


def tool_call_start_ms(record: RequestRecord) -> float | None:
    """Time to the first tool-call delta: sent → the first chunk carrying a tool call (its id and name)."""
    return _since_sent_ms(record, record.first_tool_call_s)


def tool_call_end_ms(record: RequestRecord) -> float | None:
    """Time to the complete tool calls: sent → their last delta, or the finish reason after it (when an agent can
    run them)."""
    return _since_sent_ms(record, record.tool_call_end_s)


def reasoning_summary(records: list[RequestRecord]) -> dict[str, Any]:
    """Over completed requests that reasoned: how many, their reasoning and answer tokens (mean and total)."""
    thinking = [record for record in successful(records) if record.reasoning_tokens is not None]
    if not thinking:
        return {}
    reasoning = [record.reasoning_tokens or 0 for record in thinking]
    answer = [record.answer_tokens or 0 for record in thinking]
    return {
        "reasoning_requests": sum(1 for tokens in reasoning if tokens > 0),
        "total_reasoning_tokens": sum(reasoning),
        "total_answer_tokens": sum(answer),
        "mean_reasoning_tokens": sum(reasoning) / len(thinking),
        "mean_answer_tokens": sum(answer) / len(thinking),
    }


def tool_call_summary(records: list[RequestRecord]) -> dict[str, Any]:
    """Over completed requests: how many made tool calls, and how many calls in all."""
    calling = [record for record in successful(records) if record.tool_calls]
    if not calling:
        return {}
    return {"tool_call_requests": len(calling), "total_tool_calls": sum(record.tool_calls for record in calling)}


def ttft_by_turn_ms(records: list[RequestRecord]) -> dict[int, list[float]]:
    """Multi-turn: the TTFTs of completed requests grouped by turn number (1 = a conversation's first turn)."""
    grouped: dict[int, list[float]] = {}
    for record in successful(records):
        if record.turn is not None and (value := ttft_ms(record)) is not None:
            grouped.setdefault(record.turn, []).append(value)
    return dict(sorted(grouped.items()))


def input_tokens_by_turn(records: list[RequestRecord]) -> dict[int, float]:
    """Multi-turn: the mean prompt tokens of completed requests per turn number (the history grows each turn)."""
    grouped: dict[int, list[int]] = {}
    for record in successful(records):
        if record.turn is not None:
            grouped.setdefault(record.turn, []).append(record.prompt_len)
    return {turn: sum(lens) / len(lens) for turn, lens in sorted(grouped.items())}


def client_queue_time_ms(record: RequestRecord) -> float:
    """Time a request waited in the client after its arrival (rate mode), for a free concurrency slot."""
    return (record.sent_s - record.scheduled_s) * 1000.0


def request_throughput(records: list[RequestRecord], duration_s: float) -> float:
    """Completed requests per second of the measured run."""
    return len(successful(records)) / duration_s if duration_s > 0 else 0.0


def total_output_tokens(records: list[RequestRecord]) -> int:
    return sum(record.output_len for record in successful(records))


def total_input_tokens(records: list[RequestRecord]) -> int:
    return sum(record.prompt_len for record in successful(records))


def output_throughput(records: list[RequestRecord], duration_s: float) -> float:
    """Output tokens of completed requests per second of the measured run."""
    return total_output_tokens(records) / duration_s if duration_s > 0 else 0.0


def total_token_throughput(records: list[RequestRecord], duration_s: float) -> float:
    """(input + output tokens) of completed requests per second of the measured run."""
    tokens = total_input_tokens(records) + total_output_tokens(records)
    return tokens / duration_s if duration_s > 0 else 0.0


def peak_output_tokens_per_s(records: list[RequestRecord], bucket_s: float = 1.0) -> float:
    """The most output tokens that arrived within one 1-s bucket (buckets start at the run's t = 0)."""
    buckets: Counter[int] = Counter()
    for record in successful(records):
        for arrived_s, count in zip(record.chunk_times_s, record.chunk_tokens, strict=True):
            buckets[math.floor(arrived_s / bucket_s)] += count
    return max(buckets.values()) / bucket_s if buckets else 0.0


def peak_concurrent_requests(records: list[RequestRecord]) -> int:
    """The most requests in flight at one instant (sent, not yet ended), failed ones included: they loaded the
    server too. A request ending at the instant another starts does not overlap it."""
    events: list[tuple[float, int]] = []
    for record in records:
        if record.end_s is not None:
            events += [(record.sent_s, 1), (record.end_s, -1)]
    peak = current = 0
    for _, step in sorted(events):  # at equal times -1 sorts first
        current += step
        peak = max(peak, current)
    return peak


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """`["ttft:300", "tpot:50"]` (vLLM's --goodput) → {"ttft": 300.0, "tpot": 50.0}, in ms."""
    slos: dict[str, float] = {}
    for item in items or []:
        for part in item.split():
            name, sep, value = part.partition(":")
            if not sep or name not in SLO_METRICS:
                raise ValueError(f"goodput SLO {part!r} must be NAME:MS with NAME one of {', '.join(SLO_METRICS)}")
            slos[name] = float(value)
            if slos[name] < 0:
                raise ValueError(f"goodput SLO {part!r} must not be negative")
    return slos


def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    """A completed request meets every SLO given; TPOT of a one-token output counts as 0 (as vLLM does)."""
    values = {"ttft": ttft_ms(record), "tpot": tpot_ms(record) or 0.0, "e2el": e2el_ms(record)}
    return record.success and all((values[name] or 0.0) <= limit for name, limit in slos.items())


def goodput_req_s(records: list[RequestRecord], slos: dict[str, float], duration_s: float) -> float:
    """Completed requests that met all SLOs, per second of the measured run: requests/s, vLLM's goodput (the tuner's
    is output tokens/s, `goodput_output_tok_s`, in tune/goodput.py)."""
    good = sum(1 for record in successful(records) if meets_slos(record, slos))
    return good / duration_s if duration_s > 0 else 0.0


def tokens_per_chunk(record: RequestRecord) -> float | None:
    """Output tokens per token chunk, where the server listed each chunk's tokens (exact attribution): with one
    chunk per engine step (vLLM's --stream-interval 1), the tokens each step delivered to this request, i.e. its own
    mean acceptance length under speculative decoding. None where the counts are estimated."""
    if not record.chunk_tokens or record.token_attribution != EXACT:
        return None
    return record.output_len / len(record.chunk_tokens)


def mean_tokens_per_chunk(records: list[RequestRecord]) -> float | None:
    """The mean of tokens_per_chunk over completed requests that have it (None when none has)."""
    values = [value for record in successful(records) if (value := tokens_per_chunk(record)) is not None]
    return sum(values) / len(values) if values else None


def one_write_requests(records: list[RequestRecord]) -> int:
    """Completed requests of two or more tokens whose whole response arrived in one write (no TPOT, no ITL)."""
    return sum(1 for record in successful(records) if arrived_in_one_write(record))


def failures_by_error(records: list[RequestRecord]) -> dict[str, int]:
    """Failed requests counted per error message, most frequent first."""
    counts = Counter(record.error for record in records if record.error is not None)
    return dict(counts.most_common())


def metric_samples(records: list[RequestRecord], metric: str) -> list[float]:
    """The samples of one percentile metric over completed requests (ITL: all tokens of all of them)."""
    done = successful(records)
    if metric == "itl":
        return [sample for record in done for sample in itl_ms(record)]
    if metric == "client_queue_time":
        return [client_queue_time_ms(record) for record in done]
    per_request = {
        "ttft": ttft_ms,
        "tpot": tpot_ms,
        "e2el": e2el_ms,
        "reasoning_ttft": reasoning_ttft_ms,
        "answer_ttft": answer_ttft_ms,
        "tool_call_start": tool_call_start_ms,
        "tool_call_end": tool_call_end_ms,
    }[metric]
    return [value for record in done if (value := per_request(record)) is not None]


@dataclass
class Distribution:
    """Summary statistics of one metric, in ms. Empty samples give zeros, as vLLM reports them."""

    mean: float
    median: float
    std: float
    percentiles: dict[float, float] = field(default_factory=dict)
    count: int = 0


def distribution(samples: list[float], percentiles: tuple[float, ...]) -> Distribution:
    """Mean, median, population std and percentiles (numpy's linear interpolation, like vLLM)."""
    if not samples:
        return Distribution(0.0, 0.0, 0.0, {p: 0.0 for p in percentiles}, 0)
    values = np.asarray(samples, dtype=float)
    points = {p: float(np.percentile(values, p)) for p in percentiles}
    return Distribution(float(values.mean()), float(np.median(values)), float(values.std()), points, len(samples))


def percentile_word(percentile: float) -> str:
    """99 → "99", 99.9 → "99.9" (vLLM's key spelling: p99_ttft_ms, p99.9_ttft_ms)."""
    return str(int(percentile)) if int(percentile) == percentile else str(percentile)


def parse_percentiles(text: str) -> tuple[float, ...]:
    values = tuple(float(part) for part in text.split(",") if part.strip())
    if any(not 0 <= value <= 100 for value in values):
        raise ValueError(f"metric percentiles must be between 0 and 100, got {text!r}")
    return values


def summarize(
    records: list[RequestRecord],
    duration_s: float,
    percentile_metrics: tuple[str, ...] = DEFAULT_PERCENTILE_METRICS,
    percentiles: tuple[float, ...] = (99.0,),
    slos: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The client-side metrics under vLLM's result key names, plus ours (peak values, failures, P25/P75…)."""
    done = successful(records)
    points = tuple(sorted(set(STANDARD_PERCENTILES) | set(percentiles)))
    summary: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(records) - len(done),
        "total_input_tokens": total_input_tokens(records),
        "total_output_tokens": total_output_tokens(records),
        "request_throughput": request_throughput(records, duration_s),
        "goodput_req_s": goodput_req_s(records, slos, duration_s) if slos else None,
        "output_throughput": output_throughput(records, duration_s),
        "total_token_throughput": total_token_throughput(records, duration_s),
        "max_output_tokens_per_s": peak_output_tokens_per_s(records),
        "max_concurrent_requests": peak_concurrent_requests(records),
    }
    summary["request_goodput"] = summary["goodput_req_s"]  # vLLM's key for the same number, for tools that read it
    summary["one_write_requests"] = one_write_requests(records)
    summary["mean_tokens_per_chunk"] = mean_tokens_per_chunk(records)
    phases = reasoning_summary(records) | tool_call_summary(records)
    summary |= phases
    for metric in reported_metrics(percentile_metrics, phases):
        samples = metric_samples(records, metric)
        stats = distribution(samples, points)
        # No per-token sample because every response came in one write: undefined, not vLLM's zeros.
        undefined = not samples and metric in PER_TOKEN_METRICS and summary["one_write_requests"] > 0
        summary[f"mean_{metric}_ms"] = None if undefined else stats.mean
        summary[f"median_{metric}_ms"] = None if undefined else stats.median
        summary[f"std_{metric}_ms"] = None if undefined else stats.std
        for point, value in stats.percentiles.items():
            summary[f"p{percentile_word(point)}_{metric}_ms"] = None if undefined else value
    by_turn = ttft_by_turn_ms(records)
    if by_turn:
        inputs = input_tokens_by_turn(records)
        summary["ttft_by_turn_ms"] = {
            str(turn): _distribution_json(distribution(samples, points)) for turn, samples in by_turn.items()
        }
        summary["mean_input_tokens_by_turn"] = {str(turn): value for turn, value in inputs.items()}
    summary["errors_by_message"] = failures_by_error(records)
    return summary


def reported_metrics(asked: tuple[str, ...], phases: dict[str, Any]) -> tuple[str, ...]:
    """ASKED (--percentile-metrics), plus the reasoning and tool-call latencies when the run had any (PHASES)."""
    extra = (REASONING_METRICS if "reasoning_requests" in phases else ()) + (
        TOOL_CALL_METRICS if "tool_call_requests" in phases else ()
    )
    return asked + tuple(metric for metric in extra if metric not in asked)


def _distribution_json(stats: Distribution) -> dict[str, float]:
    points = {f"p{percentile_word(point)}": value for point, value in stats.percentiles.items()}
    return {"count": stats.count, "mean": stats.mean, "median": stats.median, "std": stats.std, **points}
