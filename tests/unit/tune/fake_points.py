"""Result JSON of a small analytic server, for tune tests that start no engine: requests run in batches of
min(max_num_seqs, concurrency); each takes a prefill then one step per further token; a request waits for the
batches ahead of it among those in flight. The per-request lists are vLLM's --save-detailed ones (seconds)."""

from __future__ import annotations

import math
from typing import Any

from deepserve.bench.config import BenchConfig
from deepserve.errors import DeepserveError
from deepserve.tune.engine import EngineFailed, PointRun
from deepserve.tune.grid import TunePoint

PREFILL_MS = 20.0
STEP_MS = 10.0


def result_from_requests(
    ttfts_ms: list[float],
    itls_ms: list[list[float]],
    output_lens: list[int],
    duration_s: float,
    errors: list[str] | None = None,
) -> dict[str, Any]:
    """A result JSON with the headline keys and the per-request lists, from per-request values in ms."""
    errors = errors or [""] * len(ttfts_ms)
    latencies_s = [(ttft + sum(gaps)) / 1000 for ttft, gaps in zip(ttfts_ms, itls_ms, strict=True)]
    completed = sum(1 for error in errors if not error)
    output_tokens = sum(n for n, error in zip(output_lens, errors, strict=True) if not error)
    return {
        "completed": completed,
        "failed": len(errors) - completed,
        "duration": duration_s,
        "num_prompts": len(errors),
        "request_throughput": completed / duration_s,
        "output_throughput": output_tokens / duration_s,
        "output_lens": [n if not error else 0 for n, error in zip(output_lens, errors, strict=True)],
        "ttfts": [ttft / 1000 for ttft in ttfts_ms],
        "itls": [[gap / 1000 for gap in gaps] for gaps in itls_ms],
        "latencies": latencies_s,
        "errors": errors,
    }


def batched_server_result(max_num_seqs: int, concurrency: int, prompts: int = 32, output_len: int = 16) -> dict:
    running = min(max_num_seqs, concurrency)
    request_ms = PREFILL_MS + (output_len - 1) * STEP_MS
    waves_in_flight = math.ceil(concurrency / running)
    ttfts = [(index // running % waves_in_flight) * request_ms + PREFILL_MS for index in range(prompts)]
    itls = [[STEP_MS] * (output_len - 1) for _ in range(prompts)]
    duration_s = math.ceil(prompts / running) * request_ms / 1000
    result = result_from_requests(ttfts, itls, [output_len] * prompts, duration_s)
    result["max_concurrency"] = concurrency
    return result  # no percentile keys: the tune computes them from the per-request lists


class FakeEngine:
    """A point runner: the analytic server at the point's max_num_seqs. Like vLLM's CPU build it refuses a
    max_num_batched_tokens below max_model_len; it can be told to fail a point's benchmark or to be interrupted."""

    def __init__(self, interrupt_at: str | None = None, bench_error_at: str | None = None) -> None:
        self.started: list[str] = []
        self.interrupt_at = interrupt_at
        self.bench_error_at = bench_error_at

    def __call__(self, point: TunePoint, bench: BenchConfig) -> PointRun:
        self.started.append(point.point_id)
        config = point.config
        if config.max_num_batched_tokens and config.max_num_batched_tokens < (config.max_model_len or 0):
            raise EngineFailed(
                "the engine exited with code 1 (log: fake.log)",
                ["ValueError: max_num_batched_tokens (128) is smaller than max_model_len (256)"],
            )
        if point.point_id == self.interrupt_at:
            raise KeyboardInterrupt
        if point.point_id == self.bench_error_at:
            raise DeepserveError("the server closed every connection")
        concurrency = bench.load.max_concurrency or 16
        result = batched_server_result(config.max_num_seqs or 256, concurrency, bench.workload.num_prompts or 32)
        return PointRun(result, startup_s=1.0, engine_log="fake.log")
