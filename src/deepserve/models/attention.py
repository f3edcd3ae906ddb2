"""What attention costs per token, for every attention kind: cache bytes read and FLOPs of the attention itself and
of the lightning indexer that picks what sparse attention reads. The planner's step model (plan/perf.py) and its
explanations read these; the projections around attention (and the indexer's and compressors' projections) are
GEMMs counted with the layer's parameters (ModelSpec.layer_parameter_breakdown).

Per layer, for a query at position c (it attends to the c tokens before it, itself included):

| layer | entries attended | FLOPs per head and entry | indexer scores |
|---|---|---|---|
| MLA (V3) | c latents | 2 (576 + 512): absorbed scores and values | - |
| V3.2 sparse MLA | min(c, index_topk) latents | 2 (576 + 512) | c keys |
| V4 window only (ratio 0) | min(c, window) entries | 2 (512 + 512): one shared 512-value K=V entry | - |
| V4 CSA (ratio 4) | min(c, window) + min(c/4, index_topk) | 2 (512 + 512) | c/4 keys |
| V4 HCA (ratio 128) | min(c, window) + c/128 | 2 (512 + 512) | - |
| GQA | c | 4 head_dim | - |

The indexer scores a key with index_n_heads dot products of index_head_dim (FP8) and a weighted sum over its heads:
2 x index_n_heads x (index_head_dim + 1) FLOPs per key, and reads the key (132 B in FP8, 68 B in MXFP4). vLLM 0.32
replicates the indexer on every tensor-parallel rank (vllm/models/deepseek_v4/attention.py: "no tensor parallel,
just replicated"); the attention heads are split.

A prompt chunk of p tokens after c cached tokens sums the same over positions c+1 .. c+p: the indexer's work grows
with the square of the prompt (each token scores every earlier key), V3.2's sparse attention only linearly past
index_topk, V4's HCA layers as the square over 128.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

from deepserve.models.kv_cache import (
    INDEXER_FP4_BYTES_PER_VALUE,
    INDEXER_FP8_BYTES_PER_VALUE,
    kv_cache_layout,
)
from deepserve.models.spec import ModelSpec


@dataclass(frozen=True)
class LayerAttention:
    """How one layer attends (see the module's table)."""

    kind: str  # "mla", "mla_sparse", "window", "csa", "hca", "gqa"
    window: int = 0  # uncompressed tokens attended (V4's sliding window)
    compress_ratio: int = 1  # tokens per compressed entry
    topk: int = 0  # entries the indexer keeps (0: all)
    indexed: bool = False  # a lightning indexer scores every compressed entry
    entry_bytes: float = 0.0  # cache bytes per attended entry
    flops_per_entry_per_head: float = 0.0

    def attended(self, position: float) -> float:
        """Entries a query at POSITION attends to."""
        window = min(position, self.window) if self.window else 0.0
        if self.kind == "window":
            return window
        compressed = position / self.compress_ratio
        return window + (min(compressed, self.topk) if self.topk else compressed)

    def scored(self, position: float) -> float:
        """Keys the indexer scores for a query at POSITION."""
        return position / self.compress_ratio if self.indexed else 0.0

    def stored(self, context: float) -> float:
        """Entries the cache holds for CONTEXT tokens (what a prompt chunk reads of the cached context)."""
        window = min(context, self.window) if self.window else 0.0
        return window if self.kind == "window" else window + context / self.compress_ratio

    def attended_sum(self, start: float, end: float) -> float:
        """Sum of attended(x) over positions start < x <= end (integrated: a chunk of tokens)."""
        total = _integral_min(1.0, self.window, start, end) if self.window else 0.0
        if self.kind == "window":
            return total
        cap = self.topk if self.topk else float("inf")
        return total + _integral_min(1.0 / self.compress_ratio, cap, start, end)

    def scored_sum(self, start: float, end: float) -> float:
        if not self.indexed:
            return 0.0
        return _integral_min(1.0 / self.compress_ratio, float("inf"), start, end)


@dataclass(frozen=True)
class AttentionWork:
    """Attention of one sequence on a set of layers: a decode token's, or a prompt chunk's (all its tokens)."""

    cache_bytes: float  # cache the attention reads; every TP rank reads all of it (the caches are replicated)
    flops_per_head: float  # attention FLOPs per query head; TP splits the heads
    heads: int  # query heads of the model (all ranks)
    indexer_bytes: float = 0.0  # the indexer's key cache read
    indexer_flops: float = 0.0  # the indexer's FLOPs, on every TP rank (it is replicated)
    attended_entries: float = 0.0  # entries attended, summed over layers and tokens (for explanations)

    def flops(self, tensor_parallel: int = 1) -> float:
        """FLOPs on one GPU of a TP group of TENSOR_PARALLEL: its share of the heads plus the whole indexer."""
        return self.flops_per_head * self.heads / tensor_parallel + self.indexer_flops

    @property
    def bytes(self) -> float:
        return self.cache_bytes + self.indexer_bytes


@lru_cache(maxsize=256)
def attention_layers(
    spec: ModelSpec, kv_dtype: str = "auto", layers: range | None = None
) -> tuple[LayerAttention, ...]:
    """How each of SPEC's LAYERS (default: all) attends, with the cache entry sizes of KV_DTYPE (remembered: the
    step model asks once per engine step)."""
    indices = layers if layers is not None else range(spec.num_layers)
    layout = kv_cache_layout(spec, kv_dtype, layers=range(0, 0))  # resolves the dtype only
    kind = spec.attention_kind
    entry = _entry_bytes(spec, layout.kv_dtype)
    if kind == "compressed_sparse":
        per_head = 2.0 * (spec.head_dim + spec.head_dim)
        return tuple(_v4_layer(spec, spec.compress_ratio(i), entry, per_head) for i in indices)
    if kind in ("mla", "mla_sparse"):
        kv_lora = spec.kv_lora_rank or 0
        per_head = 2.0 * (kv_lora + spec.qk_rope_head_dim + kv_lora)
        sparse = kind == "mla_sparse"
        layer = LayerAttention(
            kind, topk=spec.index_topk if sparse else 0, indexed=sparse, entry_bytes=entry,
            flops_per_entry_per_head=per_head,
        )  # fmt: skip
        return tuple(layer for _ in indices)
    gqa = LayerAttention("gqa", entry_bytes=entry, flops_per_entry_per_head=4.0 * spec.head_dim)
    return tuple(gqa for _ in indices)


def decode_attention(
    spec: ModelSpec,
    context_len: float,
    kv_dtype: str = "auto",
    layers: range | None = None,
    fp4_indexer_cache: bool = False,
) -> AttentionWork:
    """One decode token of a sequence at CONTEXT_LEN tokens, on LAYERS (default: all)."""
    kinds = _layer_counts(spec, kv_dtype, layers)
    key = _indexer_key_bytes(spec, fp4_indexer_cache)
    attended = sum(n * layer.attended(context_len) for layer, n in kinds)
    scored = sum(n * layer.scored(context_len) for layer, n in kinds)
    return AttentionWork(
        cache_bytes=sum(n * layer.attended(context_len) * layer.entry_bytes for layer, n in kinds),
        flops_per_head=sum(n * layer.attended(context_len) * layer.flops_per_entry_per_head for layer, n in kinds),
        heads=spec.num_attention_heads,
        indexer_bytes=scored * key,
        indexer_flops=scored * _indexer_flops_per_key(spec),
        attended_entries=attended,
    )


def prefill_attention(
    spec: ModelSpec,
    prompt_tokens: float,
    cached_context: float = 0.0,
    kv_dtype: str = "auto",
    layers: range | None = None,
    fp4_indexer_cache: bool = False,
    mean_position: float | None = None,
) -> AttentionWork:
    """A chunk of PROMPT_TOKENS after CACHED_CONTEXT tokens of its sequence, on LAYERS: each token attends to
    the positions before it. Several prompts in one step give MEAN_POSITION instead (the mean over their tokens
    of the position each attends from): their work is PROMPT_TOKENS times one token's at that position. The cache
    read is the cached context's entries, once per layer."""
    layer_kinds = attention_layers(spec, kv_dtype, layers)
    key = _indexer_key_bytes(spec, fp4_indexer_cache)
    if mean_position is not None:
        attended = [prompt_tokens * layer.attended(mean_position) for layer in layer_kinds]
        scored = sum(prompt_tokens * layer.scored(mean_position) for layer in layer_kinds)
    else:
        end = cached_context + prompt_tokens
        attended = [layer.attended_sum(cached_context, end) for layer in layer_kinds]
        scored = sum(layer.scored_sum(cached_context, end) for layer in layer_kinds)
    stored_keys = sum(layer.scored(cached_context) for layer in layer_kinds)
    return AttentionWork(
        cache_bytes=sum(layer.stored(cached_context) * layer.entry_bytes for layer in layer_kinds),
        flops_per_head=sum(n * layer.flops_per_entry_per_head for n, layer in zip(attended, layer_kinds, strict=True)),
        heads=spec.num_attention_heads,
        indexer_bytes=stored_keys * key,
        indexer_flops=scored * _indexer_flops_per_key(spec),
        attended_entries=sum(attended),
    )


@lru_cache(maxsize=256)
def _layer_counts(spec: ModelSpec, kv_dtype: str, layers: range | None) -> tuple[tuple[LayerAttention, int], ...]:
    """LAYERS' attention kinds with how many layers attend each way (V4's 61 layers are three kinds)."""
    return tuple(Counter(attention_layers(spec, kv_dtype, layers)).items())


def _v4_layer(spec: ModelSpec, ratio: int, entry: float, per_head: float) -> LayerAttention:
    window = spec.sliding_window or 128
    if ratio <= 1:
        return LayerAttention("window", window=window, entry_bytes=entry, flops_per_entry_per_head=per_head)
    if ratio == 4:
        return LayerAttention(
            "csa", window=window, compress_ratio=4, topk=spec.index_topk, indexed=True, entry_bytes=entry,
            flops_per_entry_per_head=per_head,
        )  # fmt: skip
    return LayerAttention(
        "hca", window=window, compress_ratio=ratio, entry_bytes=entry, flops_per_entry_per_head=per_head
    )


def _entry_bytes(spec: ModelSpec, resolved_kv_dtype: str) -> float:
    """Bytes of one cached entry (a latent, a V4 compressed or window entry) in the resolved cache dtype."""
    probe = kv_cache_layout(spec, resolved_kv_dtype, layers=range(min(spec.num_layers, 1)))
    roles = {page.role: page.entry_bytes for group in probe.groups for page in group.pages}
    return roles.get("latent") or roles.get("window") or roles.get("kv") or 0.0


def _indexer_key_bytes(spec: ModelSpec, fp4: bool) -> float:
    per_value = INDEXER_FP4_BYTES_PER_VALUE if fp4 and spec.compress_ratios else INDEXER_FP8_BYTES_PER_VALUE
    return spec.index_head_dim * per_value


def _indexer_flops_per_key(spec: ModelSpec) -> float:
    return 2.0 * spec.index_n_heads * (spec.index_head_dim + 1)


def _integral_min(slope: float, cap: float, start: float, end: float) -> float:
    """Sum over positions start < x <= end of min(slope * x, cap), as the integral of the continuous function."""
    if end <= start:
        return 0.0
    knee = cap / slope if slope > 0 else float("inf")  # where slope * x reaches cap
    low_end = min(end, max(start, knee))
    linear = slope * (low_end**2 - start**2) / 2 if low_end > start else 0.0
    flat = cap * (end - max(start, knee)) if end > knee else 0.0
    return linear + flat
