"""One pool of a prefill/decode disaggregated deployment, alone: what a prefill pool or a decode pool delivers per
GPU when it is kept full (the figures the large-scale EP reports quote), and the KV transfer between them.

A prefill pool runs prompt-only steps of a given number of prompt tokens per GPU; a decode pool runs decode-only
steps at a given number of sequences per GPU. Neither waits for the other: that is what disaggregation buys (no
prompt in a decode step), and what it costs is the KV cache crossing the network once per request.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepserve.hardware.catalog import Network
from deepserve.models.spec import dtype_bytes
from deepserve.plan.perf import PerformanceModel, RankLoad


@dataclass(frozen=True)
class PhaseRate:
    tokens_per_s_per_gpu: float  # prompt tokens (prefill) or output tokens (decode)
    step_s: float
    batch_per_gpu: float  # prompt tokens (prefill) or sequences (decode) per GPU per step


def prefill_rate(model: PerformanceModel, prompt_len: int, tokens_per_gpu: float) -> PhaseRate:
    """Prompt tokens per second per GPU when every GPU prefills TOKENS_PER_GPU prompt tokens per step (prompts of
    PROMPT_LEN, each attending to half of itself on average); pipeline stages work on successive batches."""
    layout = model.layout
    per_rank = tokens_per_gpu * layout.tp
    total = per_rank * layout.dp
    rank = RankLoad(0, per_rank, 0.0, prompt_len / 2)
    step = model.step(0, total, 0, prefill_mean_position=prompt_len / 2, rank=rank).total_s
    return PhaseRate(total / step / layout.gpus, step, tokens_per_gpu)


def decode_rate(model: PerformanceModel, context_len: float, sequences_per_gpu: float) -> PhaseRate:
    """Output tokens per second per GPU when the pool decodes SEQUENCES_PER_GPU x its GPUs sequences at
    CONTEXT_LEN, in pp micro-batches (a data-parallel rank's sequences are its own; under TP a group of tp GPUs
    shares tp times as many)."""
    layout = model.layout
    micro = sequences_per_gpu * layout.gpus / layout.pp
    step = model.step(micro, 0, context_len).total_s
    tokens_per_step = model.tokens_per_step
    return PhaseRate(micro * tokens_per_step / step / layout.gpus, step, sequences_per_gpu)


def kv_transfer_s(model: PerformanceModel, prompt_len: int, network: Network, gpus_per_node: int) -> float:
    """One request's KV cache from the prefill pool to the decode pool: the latent of every layer for the prompt,
    sent by each prefill GPU over its share of the node's network (the engines' connectors move it with RDMA)."""
    spec = model.spec
    nbytes = prompt_len * spec.kv_values_per_token_per_layer * dtype_bytes(model.kv_dtype) * spec.num_layers
    per_gpu_gb_s = network.bandwidth_gb_s_per_node / max(gpus_per_node, 1) * model.rates.network_efficiency
    senders = max(model.layout.pp, 1)  # each stage sends its layers
    return network.collective_latency_us * 1e-6 + nbytes / senders / (per_gpu_gb_s * 1e9)
