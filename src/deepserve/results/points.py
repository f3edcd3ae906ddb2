"""Benchmark results as points on a grid: what was asked (the parameters) and what was measured (the result JSON).

A result is the JSON that `deepserve bench --save-result` writes, which uses vLLM's key names (`completed`,
`request_throughput`, `median_itl_ms`, ...), so files from `vllm bench serve --save-result` read the same way.
A point's parameters come from the sweep index when there is one (it knows exactly what was asked), else from the
result itself (vLLM writes `max_concurrency` and `request_rate`; input and output lengths fall back to the
per-request means).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepserve.errors import DeepserveError

# The keys a summary shows, in the order tables show them: (result key, column heading).
SUMMARY_COLUMNS: tuple[tuple[str, str], ...] = (
    ("completed", "completed"),
    ("failed", "failed"),
    ("duration", "duration (s)"),
    ("request_throughput", "req/s"),
    ("output_throughput", "output tok/s"),
    ("total_token_throughput", "total tok/s"),
    ("median_ttft_ms", "median TTFT (ms)"),
    ("p99_ttft_ms", "P99 TTFT (ms)"),
    ("median_tpot_ms", "median TPOT (ms)"),
    ("median_itl_ms", "median ITL (ms)"),
    ("p99_itl_ms", "P99 ITL (ms)"),
    ("median_e2el_ms", "median E2EL (ms)"),
    ("p99_e2el_ms", "P99 E2EL (ms)"),
)


class ResultsError(DeepserveError):
    """A results file or directory that cannot be read."""


@dataclass(frozen=True)
class PointParams:
    """What a benchmark point asked for. None means "not set" (unlimited concurrency, unknown length)."""

    max_concurrency: int | None = None
    request_rate: float = math.inf  # requests/s offered; inf sends everything at once
    input_len: int | None = None
    output_len: int | None = None
    num_prompts: int | None = None
    variant: str | None = None  # a workload variant of a suite, e.g. "shared prefix" or "no sharing"

    def as_dict(self) -> dict[str, Any]:
        return {
            "max_concurrency": self.max_concurrency,
            "request_rate": None if math.isinf(self.request_rate) else self.request_rate,
            "input_len": self.input_len,
            "output_len": self.output_len,
            "num_prompts": self.num_prompts,
            "variant": self.variant,
        }

    def describe(self) -> str:
        """Short words for a table cell or legend: "c=16 rate=inf in=1024 out=256"."""
        parts = []
        if self.variant:
            parts.append(self.variant)
        if self.variant == "offline" and self.num_prompts is not None:
            parts.append(f"batch={self.num_prompts}")
        if self.max_concurrency is not None:
            parts.append(f"c={self.max_concurrency}")
        parts.append(f"rate={format_rate(self.request_rate)}")
        if self.input_len is not None:
            parts.append(f"in={self.input_len}")
        if self.output_len is not None:
            parts.append(f"out={self.output_len}")
        return " ".join(parts)


@dataclass
class ResultPoint:
    """One benchmark run: its parameters and its result JSON."""

    point_id: str
    params: PointParams
    result: dict[str, Any]
    source: str = ""
    # Values a report computes from the result and the run's deployment (per GPU, per user, cost, hardware
    # limit): kept apart from the measured result and never written back to it.
    derived: dict[str, float] = field(default_factory=dict)

    def metric(self, key: str) -> float | None:
        """A numeric result value (or a derived one), or None where neither has it (vLLM omits metrics not asked
        for). A per-token latency of exactly 0 is None too: no token follows another in no time, so it is the zero
        a benchmark writes when no request had a gap to measure (every response arrived in one write; deepserve
        now writes null there), and a chart, an answer or a ratio must not take it for a speed."""
        value = self.result.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            value = self.derived.get(key)
        if value is not None and value == 0 and is_per_token_latency(key):
            return None
        return None if value is None else float(value)


@dataclass
class ResultSet:
    """Points that belong together (one sweep, one machine, one engine): one colour in every chart."""

    label: str
    points: list[ResultPoint]
    metadata: dict[str, Any] = field(default_factory=dict)
    source: str = ""


def is_per_token_latency(key: str) -> bool:
    """Whether KEY is a TPOT or ITL statistic (mean_tpot_ms, p99_itl_ms, …), undefined without gaps between tokens."""
    return key.endswith(("_tpot_ms", "_itl_ms")) and not key.startswith("std_")


def format_rate(rate: float | None) -> str:
    if rate is None or math.isinf(rate):
        return "inf"
    return f"{rate:g}"


def parse_rate(value: Any) -> float:
    """vLLM writes an unlimited request rate as the string "inf"; our own files may write null."""
    if value is None:
        return math.inf
    if isinstance(value, str):
        return float(value)  # "inf" parses too
    return float(value)


def params_from_result(result: dict[str, Any], given: dict[str, Any] | None = None) -> PointParams:
    """The point's parameters: GIVEN (a sweep index's exact values) first, then what the result itself says."""
    given = given or {}
    concurrency = _first(given.get("max_concurrency"), result.get("max_concurrency"))
    rate = given["request_rate"] if "request_rate" in given else result.get("request_rate")
    num_prompts = _first(given.get("num_prompts"), result.get("num_prompts"))
    return PointParams(
        max_concurrency=int(concurrency) if concurrency is not None else None,
        request_rate=parse_rate(rate),
        input_len=_length(given.get("input_len"), result, "input"),
        output_len=_length(given.get("output_len"), result, "output"),
        num_prompts=int(num_prompts) if num_prompts is not None else None,
        variant=given.get("variant") or result.get("variant"),
    )


def _first(*values: Any) -> Any:
    return next((value for value in values if value is not None), None)


def _length(given: Any, result: dict[str, Any], kind: str) -> int | None:
    """An asked-for length: the sweep's value, the workload definition's, else the mean measured length."""
    if given is not None:
        return int(given)
    for container in (result, result.get("workload") or {}, result.get("workload_definition") or {}):
        if isinstance(container, dict) and container.get(f"random_{kind}_len") is not None:
            return int(container[f"random_{kind}_len"])
    completed = result.get("completed") or 0
    total = result.get(f"total_{kind}_tokens")
    if completed and isinstance(total, int | float):
        return round(total / completed)
    return None


def is_result_json(data: Any) -> bool:
    """Whether DATA looks like a serving benchmark result (ours or vLLM's)."""
    return isinstance(data, dict) and "completed" in data and "duration" in data


def read_result_file(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ResultsError(f"cannot read result file {path}: {exc}") from exc
    if not is_result_json(data):
        raise ResultsError(f"{path} is not a benchmark result (no 'completed' and 'duration' keys)")
    return data
