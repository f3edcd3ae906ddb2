"""Attention of the sparse and compressed kinds (V3.2's DeepSeek Sparse Attention, V4's CSA/HCA) on one GPU of a
layout, for the step model: bytes read and FLOPs of one step's attention, from models/attention.py's per-token
work. MLA and GQA keep plan/perf.py's own formulas (docs/PLANNING.md section 3).

Every TP rank reads the whole cache of its sequences (the caches have no head dimension) and computes the whole
lightning indexer (vLLM 0.32 replicates it); the attention heads are split over TP. The tokens given are one
data-parallel rank's (plan/perf.py's RankLoad: the busiest rank sets the step).
"""

from __future__ import annotations

from dataclasses import dataclass

from deepserve.models.attention import decode_attention, prefill_attention
from deepserve.models.spec import ModelSpec

# Attention kinds whose cost is not one latent per position (plan/perf.py asks attention_cost for these).
SPARSE_ATTENTION_KINDS = frozenset({"mla_sparse", "compressed_sparse"})


@dataclass(frozen=True)
class AttentionStepCost:
    """One step's attention on one GPU: cache (and indexer-key) bytes read, FLOPs."""

    bytes: float
    flops: float


def decode_step_cost(
    spec: ModelSpec,
    layers: range,
    kv_dtype: str,
    tp: int,
    decode_tokens: float,
    context_len: float,
    queries_per_sequence: float = 1.0,
) -> AttentionStepCost:
    """DECODE_TOKENS sequences of one rank at CONTEXT_LEN on the stage's LAYERS, each QUERIES_PER_SEQUENCE tokens
    (speculative verification: K+1 queries read the sequence's cache once and each compute their scores)."""
    if not decode_tokens:
        return AttentionStepCost(0.0, 0.0)
    work = decode_attention(spec, context_len, kv_dtype, layers)
    return AttentionStepCost(decode_tokens * work.bytes, decode_tokens * queries_per_sequence * work.flops(tp))


def prefill_step_cost(
    spec: ModelSpec,
    layers: range,
    kv_dtype: str,
    tp: int,
    prefill_tokens: float,
    cached_context: float,
    mean_position: float | None = None,
) -> AttentionStepCost:
    """PREFILL_TOKENS of prompt on one rank after CACHED_CONTEXT tokens of their sequence; several prompts give
    MEAN_POSITION (see models.attention.prefill_attention)."""
    if not prefill_tokens:
        return AttentionStepCost(0.0, 0.0)
    work = prefill_attention(spec, prefill_tokens, cached_context, kv_dtype, layers, mean_position=mean_position)
    return AttentionStepCost(work.bytes, work.flops(tp))
