"""Numbers a report derives from each point's result and its set's deployment: throughput per GPU, speed per user,
cost per million output tokens, and decode against the hardware's limit. One function computes each.

- tokens/s per GPU: output tokens/s divided by the GPUs that served them.
- tokens/s per user: 1000 / median TPOT, the speed at which one user sees tokens arrive once the first is there.
- USD per million output tokens: GPUs x price per GPU-hour / (output tokens/s x 3600) x 1e6 (the planner's
  function, deepserve.plan.cost, which its predictions use too).
- decode batch: the mean number of sequences in decode, by Little's law over the decode phase (completed
  requests/s x mean (E2EL - TTFT)), at least 1 (a step decodes at least one sequence).
- achieved decode tokens/s: that batch x 1000 / mean TPOT (each step emits one token per sequence).
- the hardware limit at that batch and the point's mean context (input + half the output): see hardware_limit.py;
  achieved / limit is how close the engine runs to it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from deepserve.plan.cost import usd_per_million_output_tokens
from deepserve.report.deployment import SetDeployment
from deepserve.results.points import ResultPoint

GPUS = "gpus"
PER_GPU = "output_throughput_per_gpu"
PER_USER = "output_tok_s_per_user"
COST = "usd_per_million_output_tokens"
DECODE_BATCH = "decode_batch"
DECODE_TOK_S = "decode_tok_s"
LIMIT_TOK_S = "decode_limit_tok_s"
LIMIT_FRACTION = "decode_limit_fraction"
BYTES_PER_STEP = "decode_bytes_per_step"


def per_user_tok_s(tpot_ms: float | None) -> float | None:
    return 1000.0 / tpot_ms if tpot_ms else None


def per_gpu_tok_s(output_tok_s: float | None, gpus: int) -> float | None:
    return None if output_tok_s is None else output_tok_s / gpus


def decode_batch(requests_per_s: float | None, mean_e2el_ms: float | None, mean_ttft_ms: float | None) -> float | None:
    """Mean sequences in decode (Little's law: completion rate x time in the decode phase), at least 1."""
    if requests_per_s is None or mean_e2el_ms is None or mean_ttft_ms is None:
        return None
    return max(1.0, requests_per_s * (mean_e2el_ms - mean_ttft_ms) / 1000)


def mean_context_len(point: ResultPoint) -> float | None:
    """Tokens in a sequence's cache halfway through its decode: mean input + half the mean output."""
    completed = point.metric("completed")
    inputs, outputs = point.metric("total_input_tokens"), point.metric("total_output_tokens")
    if completed and inputs is not None and outputs is not None:
        return (inputs + outputs / 2) / completed
    params = point.params
    if params.input_len is not None and params.output_len is not None:
        return params.input_len + params.output_len / 2
    return None


def derive(point: ResultPoint, deployment: SetDeployment) -> dict[str, float]:
    """Every derived value the point's result supports (a missing input leaves its values out)."""
    output = point.metric("output_throughput")
    tpot = point.metric("median_tpot_ms") or point.metric("mean_tpot_ms")
    values: dict[str, float | None] = {
        GPUS: float(deployment.gpus),
        PER_GPU: per_gpu_tok_s(output, deployment.gpus),
        PER_USER: per_user_tok_s(tpot),
        COST: usd_per_million_output_tokens(output, deployment.gpus, deployment.gpu_hour_usd),
    }
    values |= _against_limit(point, deployment)
    return {key: value for key, value in values.items() if value is not None and math.isfinite(value)}


def _against_limit(point: ResultPoint, deployment: SetDeployment) -> dict[str, float | None]:
    batch = decode_batch(point.metric("request_throughput"), point.metric("mean_e2el_ms"), point.metric("mean_ttft_ms"))
    mean_tpot = point.metric("mean_tpot_ms")
    context = mean_context_len(point)
    if batch is None or not mean_tpot or context is None:
        return {}
    achieved = batch * 1000 / mean_tpot
    values: dict[str, float | None] = {DECODE_BATCH: batch, DECODE_TOK_S: achieved}
    limit = deployment.limit
    if limit is not None:
        ceiling = limit.tokens_per_s(batch, context)
        values |= {
            LIMIT_TOK_S: ceiling,
            LIMIT_FRACTION: achieved / ceiling,
            BYTES_PER_STEP: limit.bytes_per_step(batch, context),
        }
    return values


def annotate(points: Sequence[ResultPoint], deployment: SetDeployment) -> None:
    for point in points:
        point.derived = derive(point, deployment)


def pareto_frontier(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (higher is better on both), sorted by x. Of points
    with equal x, only the highest y can be on it."""
    order = sorted(range(len(points)), key=lambda i: (-points[i][0], -points[i][1]))
    frontier, best_y = [], -math.inf
    for index in order:
        if points[index][1] > best_y:
            frontier.append(index)
            best_y = points[index][1]
    return sorted(frontier, key=lambda i: points[i][0])
