"""What serving costs: the one place that turns a price per GPU-hour and a throughput into USD per million output
tokens, for the planner's predictions and the report's measured points alike."""

from __future__ import annotations


def usd_per_million_output_tokens(output_tok_s: float | None, gpus: int, gpu_hour_usd: float | None) -> float | None:
    """GPUS x GPU_HOUR_USD per hour over OUTPUT_TOK_S x 3,600 tokens per hour, per million tokens; None without a
    price or a throughput."""
    if gpu_hour_usd is None or not output_tok_s or output_tok_s <= 0:
        return None
    return gpu_hour_usd * gpus / 3600 / output_tok_s * 1e6
