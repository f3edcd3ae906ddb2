"""Which measured point wins: among the points where every SLO held, the highest goodput; points within a small
margin of it count as tied, and a tie goes to the one using fewer resources (fewer GPUs, then less memory, then
a smaller batch)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from deepserve.engines.config import EngineConfig
from deepserve.engines.vllm import DEFAULT_GPU_MEMORY_UTILIZATION
from deepserve.results.slo import Slo
from deepserve.tune.goodput import SloCheck, check_slos, output_goodput_tok_s
from deepserve.tune.search import SearchOutcome

JUDGED_AT_LOAD = "the benchmark's load"


@dataclass(frozen=True)
class Scored:
    """One measured point judged against the SLOs."""

    point_id: str
    description: str
    config: EngineConfig
    goodput_output_tok_s: float  # of the run it is judged by (with a load search: the best run that held)
    output_tok_s: float
    holds: bool  # every SLO held in that run
    checks: tuple[SloCheck, ...]
    judged_at: str = JUDGED_AT_LOAD  # or the load the search found

    def to_json(self) -> dict[str, Any]:
        return {
            "point_id": self.point_id,
            "engine": self.description,
            "goodput_output_tok_s": round(self.goodput_output_tok_s, 2),
            "output_tok_s": round(self.output_tok_s, 2),
            "slos_hold": self.holds,
            "slos": [check.words for check in self.checks],
            "judged_at": self.judged_at,
        }


def score(
    point_id: str,
    description: str,
    config: EngineConfig,
    result: dict[str, Any],
    slos: Sequence[Slo],
    search: SearchOutcome | None = None,
) -> Scored:
    """The point's main run against SLOS; with a load search, its best run that held instead, when that one serves
    more (the throughput at the highest load meeting the SLOs, as vLLM's auto-tune ranks)."""
    checks = tuple(check_slos(result, slos))
    main = Scored(
        point_id,
        description,
        config,
        output_goodput_tok_s(result, slos),
        float(result.get("output_throughput") or 0.0),
        all(check.holds for check in checks),
        checks,
    )
    probe = search.best_probe if search is not None else None
    if probe is None or (main.holds and main.goodput_output_tok_s >= probe.goodput_output_tok_s):
        return main
    unit = "requests/s" if search is not None and search.axis == "request_rate" else "concurrent requests"
    return Scored(
        point_id,
        description,
        config,
        probe.goodput_output_tok_s,
        probe.output_tok_s,
        True,
        tuple(SloCheck(slo, probe.summary.get(slo.metric)) for slo in slos),
        judged_at=f"{probe.load:g} {unit} (the highest load meeting the SLOs)",
    )


def resources(config: EngineConfig) -> tuple[float, ...]:
    """What a point costs, compared in order: GPUs, memory share, KV-cache size, batch size, step size. A field
    left to the engine counts as its default (memory) or as large (batch limits: the engines' defaults are)."""
    gpus = config.tensor_parallel_size * config.pipeline_parallel_size * config.data_parallel_size
    return (
        float(gpus),
        config.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION,
        config.kv_cache_memory_gib or math.inf,
        float(config.max_num_seqs or math.inf),
        float(config.max_num_batched_tokens or math.inf),
    )


def choose_best(scored: Sequence[Scored], tie_margin: float = 0.02) -> Scored | None:
    """The highest goodput among points whose SLOs held; within TIE_MARGIN (a fraction) of it, the fewest
    resources. None when no point met every SLO."""
    qualifying = [item for item in scored if item.holds and item.goodput_output_tok_s > 0]
    if not qualifying:
        return None
    top = max(item.goodput_output_tok_s for item in qualifying)
    tied = [item for item in qualifying if item.goodput_output_tok_s >= top * (1 - tie_margin)]
    return min(tied, key=lambda item: (resources(item.config), -item.goodput_output_tok_s))


def ranking(scored: Sequence[Scored]) -> list[Scored]:
    """Points that held first, each group by goodput, highest first (the summary's order)."""
    return sorted(scored, key=lambda item: (not item.holds, -item.goodput_output_tok_s, -item.output_tok_s))
