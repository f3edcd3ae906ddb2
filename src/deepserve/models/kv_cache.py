"""The KV cache a DeepSeek model needs per request, as vLLM 0.32 allocates it: caches per layer, grouped into the
block tables of vLLM's hybrid KV-cache manager, drawn from one pool of equal-sized blocks.

Per layer, by attention kind (models/spec.py):

- MLA (V3, R1, V3.1): one latent of kv_lora_rank + rope = 576 values per token (1,152 B in BF16, 576 in FP8).
- V3.2: the latent (BF16 1,152 B; `fp8` is vLLM's `fp8_ds_mla`, 656 B: 512 FP8 values, 4 FP32 scales, 64 BF16
  RoPE values; `nvfp4_ds_mla` 352 B) plus the lightning indexer's key (128 FP8 values + one FP32 scale = 132 B),
  both per token (vllm/v1/attention/backends/mla/flashmla_sparse.py, vllm/models/deepseek_v32/attention.py).
- V4: every layer keeps a sliding window of its last 128 tokens (584 B each in `fp8_ds_mla`: 448 FP8 NoPE values,
  64 BF16 RoPE values, 8 scale bytes; 1,024 B in BF16); a CSA layer (ratio 4) adds one 584-B entry per 4 tokens and
  an indexer key per 4 tokens (132 B, or 68 B with the FP4 indexer cache), an HCA layer (ratio 128) one entry per
  128 tokens; both keep their compressors' FP32 state over a short window (8 tokens of 2 x 2 x 512 floats on CSA
  layers plus 8 of 512 for the indexer's compressor; 128 of 2 x 512 on HCA layers). Pages hold 256 tokens
  (`--block-size 256`), 64 for the window, 4 or 8 for compressor states, padded to 576 B multiples
  (vllm/models/deepseek_v4/attention.py, compressor.py; vllm/v1/attention/backends/mla/sparse_swa.py).

vLLM gives each group of alike layers a block table and draws every group's blocks from one pool whose block is
as large as the largest group's pages (vllm/v1/core/kv_cache_utils.py: `_get_packed_kv_cache_groups`,
`get_kv_cache_config_from_groups`, `get_max_concurrency_for_kv_cache_config`); `_groups` below follows that
grouping, and tests/unit/models/test_kv_cache.py checks it against vLLM's own code where vLLM is installed.

A request holds, per growing group, one block per block of tokens of its context, and per windowed group (the
sliding window, the compressors' state) a bounded number: while decoding, the blocks covering the window; when
vLLM admits it or sizes the pool at start-up, the window plus the tokens in flight in one engine step
(`SlidingWindowSpec.max_admission_blocks_per_request`), which for V4's compressor state is most of a request's
reservation at long prompts.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from deepserve.errors import ModelError
from deepserve.models.spec import ModelSpec

MLA_BLOCK_TOKENS = 64  # FlashMLA's page (vLLM's MLA block size on GPUs)
V4_BLOCK_TOKENS = 256  # V4 requires --block-size 256 (vllm/models/deepseek_v4/sparse_mla.py)
V4_WINDOW_BLOCK_TOKENS = 64  # DeepseekV4SWACache's own block size
V4_PAGE_ALIGNMENT_FP8 = 576  # fp8_ds_mla pages round up to FlashMLA's TMA stride
V4_PAGE_ALIGNMENT_PLAIN = 512
V4_FP8_ENTRY_BYTES = 584  # 448 FP8 NoPE + 64 BF16 RoPE + 7 UE8M0 scales + 1 pad
V32_FP8_ENTRY_BYTES = 656  # 512 FP8 + 4 FP32 scales + 64 BF16 RoPE
V32_NVFP4_ENTRY_BYTES = 352
INDEXER_FP8_BYTES_PER_VALUE = 1 + 4 / 128  # FP8 keys with one FP32 scale per 128 values
INDEXER_FP4_BYTES_PER_VALUE = 0.5 + 1 / 32  # MXFP4 keys: E2M1 pairs, one E8M0 scale per 32 values
FP32_BYTES = 4
DEFAULT_IN_FLIGHT_TOKENS = 8192  # vLLM's max_num_batched_tokens default (one step in flight)

# What each --kv-cache-dtype means per attention kind: (resolved name, bytes per latent/entry, page alignment).
_LATENT_DTYPES = {"auto": ("bfloat16", 2), "bfloat16": ("bfloat16", 2), "bf16": ("bfloat16", 2)}
_LATENT_DTYPES.update({"float16": ("float16", 2), "fp16": ("float16", 2)})
_LATENT_DTYPES.update({name: ("fp8", 1) for name in ("fp8", "fp8_e4m3", "fp8_e5m2")})


@dataclass(frozen=True)
class CachePage:
    """One layer's cache of one kind: what one block of BLOCK_TOKENS tokens takes."""

    layer: int
    role: str  # "latent", "indexer", "compressed", "window", "state"
    block_tokens: int
    tokens_per_entry: int  # 1, or the compression ratio
    entry_bytes: float  # stored bytes per entry (what the notes and papers quote per token)
    page_bytes: int  # one block's bytes for this layer, padding included (what vLLM allocates)
    window: int | None = None  # tokens kept per request; None: grows with the context

    @property
    def kind(self) -> tuple[str, int, int | None]:
        """vLLM groups layers of one kind: same block size and the same window (or none)."""
        return ("window" if self.window else "full", self.block_tokens, self.window)


@dataclass(frozen=True)
class CacheGroup:
    """Layers sharing one block table: a request holds the same number of blocks for each of them."""

    pages: tuple[CachePage, ...]

    @property
    def block_tokens(self) -> int:
        return self.pages[0].block_tokens

    @property
    def window(self) -> int | None:
        return self.pages[0].window

    @property
    def page_bytes(self) -> int:
        return sum(page.page_bytes for page in self.pages)

    @property
    def roles(self) -> str:
        counts = Counter(page.role for page in self.pages)
        return ", ".join(f"{count} {role}" for role, count in counts.items())

    def blocks(self, context_len: int, in_flight_tokens: int = 1) -> int:
        """Blocks a request at CONTEXT_LEN tokens holds. A growing group: one per block of tokens. A window: the
        blocks covering the window and the IN_FLIGHT_TOKENS the engine step writes (vLLM frees blocks that fall
        out of the window only once a step is done), never more tokens than the context has, plus one because
        the window need not start at a block boundary (vLLM's `SlidingWindowSpec.max_admission_blocks_per_request`)."""
        if self.window is None:
            return _cdiv(max(context_len, 1), self.block_tokens)
        return _cdiv(min(self.window - 1 + in_flight_tokens, max(context_len, 1)), self.block_tokens) + 1


@dataclass(frozen=True)
class KVCacheLayout:
    """The KV cache of one GPU's layers (all of them, or a pipeline stage's), for one cache dtype."""

    model: str
    attention_kind: str
    kv_dtype: str  # as the engine resolves it: bfloat16, fp8, fp8_ds_mla, nvfp4_ds_mla
    groups: tuple[CacheGroup, ...]
    replicated_over_tp: bool = True  # MLA / V4 caches have no head dimension to split: every TP rank holds all
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def block_bytes(self) -> int:
        """The pool's block: as large as the largest group's pages (every group's blocks come from one pool)."""
        return max((group.page_bytes for group in self.groups), default=0)

    @property
    def is_linear(self) -> bool:
        """One growing group: bytes grow in proportion to tokens (MLA, V3.2, GQA)."""
        return all(group.window is None for group in self.groups) and len(self.groups) == 1

    @property
    def bytes_per_token(self) -> float:
        """Bytes each further token of context costs, pool blocks amortised (page padding included)."""
        return sum(self.block_bytes / g.block_tokens for g in self.groups if g.window is None)

    @property
    def content_bytes_per_token(self) -> float:
        """The entries a token adds, without page padding: the per-token figure papers and the notes quote."""
        return sum(
            page.entry_bytes / page.tokens_per_entry
            for group in self.groups
            if group.window is None
            for page in group.pages
        )

    @property
    def fixed_bytes_per_sequence(self) -> int:
        """What a decoding request holds whatever its length once past its windows: the sliding window and the
        compressors' state (0 for MLA and V3.2)."""
        return sum(g.blocks(1 << 40) for g in self.groups if g.window is not None) * self.block_bytes

    def bytes_per_sequence(self, context_len: int) -> int:
        """Bytes a request at CONTEXT_LEN holds while it decodes (whole blocks of the pool)."""
        return sum(group.blocks(context_len) for group in self.groups) * self.block_bytes

    def admission_bytes_per_sequence(self, context_len: int, in_flight_tokens: int = DEFAULT_IN_FLIGHT_TOKENS) -> int:
        """Bytes vLLM reserves for a request of CONTEXT_LEN when it admits it and when it sizes the cache at
        start-up: windows widened by the tokens one step may have in flight."""
        return sum(group.blocks(context_len, in_flight_tokens) for group in self.groups) * self.block_bytes

    def prompt_in_flight_bytes(self, prompt_len: int, in_flight_tokens: int = DEFAULT_IN_FLIGHT_TOKENS) -> int:
        """What the windowed caches hold beyond their windows while prompt tokens are in flight: every prompt token
        of an unsettled step writes its sliding-window entry and its compressors' state, and vLLM frees the pages
        that fall out of the windows only when the step has settled (`SlidingWindowManager.remove_skipped_blocks`,
        run from the request's next `allocate_slots`). IN_FLIGHT_TOKENS of prompts of PROMPT_LEN tokens are that
        many requests, each holding its windows widened by its share (`admission_bytes_per_sequence`). V4's
        compressor-state pages hold 4 or 8 tokens in a block of the pool's size, so an 8K prompt holds thousands of
        blocks until its step settles: capacity the decoding requests cannot use (0 for MLA and V3.2)."""
        if self.is_linear or prompt_len <= 0 or in_flight_tokens <= 0:
            return 0
        share = min(prompt_len, in_flight_tokens)
        requests = _cdiv(in_flight_tokens, share)
        windowed = [g for g in self.groups if g.window is not None]
        extra = sum(g.blocks(prompt_len, share) - g.blocks(prompt_len) for g in windowed)
        return requests * max(extra, 0) * self.block_bytes

    def sequences(self, kv_bytes: int, context_len: int) -> int:
        """Requests of CONTEXT_LEN tokens that KV_BYTES hold while they decode."""
        per = self.bytes_per_sequence(context_len)
        return max(kv_bytes, 0) // per if per else 0

    def engine_reported_tokens(
        self, kv_bytes: int, max_model_len: int, in_flight_tokens: int = DEFAULT_IN_FLIGHT_TOKENS
    ) -> int:
        """vLLM's start-up "KV cache size: N tokens": requests of max_model_len the pool admits (fractional),
        times max_model_len."""
        per = self.admission_bytes_per_sequence(max_model_len, in_flight_tokens)
        blocks = max(kv_bytes, 0) // self.block_bytes if self.block_bytes else 0
        per_blocks = per // self.block_bytes if self.block_bytes else 1
        return int(blocks / max(per_blocks, 1) * max_model_len)

    def growth(self) -> list[str]:
        """How the cache grows, one line per kind of cache (for `model show` and the plan's explanations)."""
        lines = []
        for group in self.groups:
            per_block = f"{group.page_bytes:,} B per {group.block_tokens} tokens"
            if group.window is None:
                lines.append(f"{group.roles}: grows with the context, {per_block}")
            else:
                held = group.blocks(1 << 40) * self.block_bytes
                lines.append(
                    f"{group.roles}: fixed per request (window of {group.window} tokens), {per_block}; "
                    f"{held / 1e6:,.2f} MB per request in pool blocks"
                )
        return lines

    def to_json(self) -> dict[str, Any]:
        contexts = (8192, 131072, 1048576)
        return {
            "kv_dtype": self.kv_dtype,
            "attention_kind": self.attention_kind,
            "bytes_per_token": round(self.bytes_per_token, 1),
            "content_bytes_per_token": round(self.content_bytes_per_token, 1),
            "fixed_bytes_per_sequence": self.fixed_bytes_per_sequence,
            "block_bytes": self.block_bytes,
            "bytes_per_sequence": {str(n): self.bytes_per_sequence(n) for n in contexts},
            "bytes_per_token_at": {str(n): round(self.bytes_per_sequence(n) / n, 1) for n in contexts},
            "groups": [
                {
                    "layers": len(g.pages),
                    "roles": g.roles,
                    "block_tokens": g.block_tokens,
                    "window": g.window,
                    "page_bytes": g.page_bytes,
                }
                for g in self.groups
            ],
            "growth": self.growth(),
            "notes": list(self.notes),
        }


def kv_cache_layout(
    spec: ModelSpec,
    kv_dtype: str = "auto",
    *,
    layers: range | None = None,
    draft_layers: int = 0,
    fp4_indexer_cache: bool = False,
) -> KVCacheLayout:
    """The KV cache of SPEC's LAYERS (default: all) in KV_DTYPE (vLLM's --kv-cache-dtype; `auto` is what vLLM
    picks: 16-bit for MLA and V3.2, `fp8_ds_mla` for V4), plus DRAFT_LAYERS speculative-decoding layers (MTP or
    DSpark; a V4 draft layer keeps only a sliding window), with V4's FP4 indexer cache when FP4_INDEXER_CACHE
    (`--attention_config.use_fp4_indexer_cache`, Blackwell)."""
    indices = list(layers if layers is not None else range(spec.num_layers))
    indices += list(range(spec.num_layers, spec.num_layers + draft_layers))
    kind = spec.attention_kind
    if kind == "compressed_sparse":
        return _v4_layout(spec, kv_dtype, indices, fp4_indexer_cache)
    if kind in ("mla", "mla_sparse"):
        return _mla_layout(spec, kv_dtype, indices)
    return _gqa_layout(spec, kv_dtype, indices)


def resolve_kv_dtype(spec: ModelSpec, kv_dtype: str) -> str:
    """The cache dtype the engine uses for --kv-cache-dtype KV_DTYPE on SPEC."""
    return kv_cache_layout(spec, kv_dtype, layers=range(0)).kv_dtype


# ---- per attention kind ----------------------------------------------------------------------------------------


def _latent_dtype(kv_dtype: str) -> tuple[str, int]:
    try:
        return _LATENT_DTYPES[kv_dtype.lower()]
    except KeyError:
        raise ModelError(f"unknown KV-cache dtype {kv_dtype!r}; valid: {', '.join(_LATENT_DTYPES)}") from None


def _mla_layout(spec: ModelSpec, kv_dtype: str, indices: list[int]) -> KVCacheLayout:
    """One latent per token per layer; V3.2 adds the indexer's key. Pages of 64 tokens, no padding."""
    latent_values = (spec.kv_lora_rank or 0) + spec.qk_rope_head_dim
    sparse = spec.attention_kind == "mla_sparse"
    name, entry = _v32_entry(kv_dtype, latent_values) if sparse else _plain_latent(kv_dtype, latent_values)
    pages: list[CachePage] = []
    for layer in indices:
        pages.append(CachePage(layer, "latent", MLA_BLOCK_TOKENS, 1, entry, int(entry * MLA_BLOCK_TOKENS)))
        if sparse:
            key = spec.index_head_dim * INDEXER_FP8_BYTES_PER_VALUE
            pages.append(CachePage(layer, "indexer", MLA_BLOCK_TOKENS, 1, key, int(key * MLA_BLOCK_TOKENS)))
    notes = ("indexer keys are FP8 whatever --kv-cache-dtype",) if sparse else ()
    return KVCacheLayout(spec.name, spec.attention_kind, name, _groups(pages), notes=notes)


def _plain_latent(kv_dtype: str, values: int) -> tuple[str, float]:
    name, width = _latent_dtype(kv_dtype)
    return name, float(values * width)


def _v32_entry(kv_dtype: str, values: int) -> tuple[str, float]:
    """V3.2's FlashMLA-sparse cache: `fp8` is an alias of the packed fp8_ds_mla record."""
    lowered = kv_dtype.lower()
    if lowered in ("fp8_ds_mla", "fp8", "fp8_e4m3"):
        return "fp8_ds_mla", float(V32_FP8_ENTRY_BYTES)
    if lowered == "nvfp4_ds_mla":
        return "nvfp4_ds_mla", float(V32_NVFP4_ENTRY_BYTES)
    return _plain_latent(kv_dtype, values)


def _v4_layout(spec: ModelSpec, kv_dtype: str, indices: list[int], fp4_indexer: bool) -> KVCacheLayout:
    lowered = kv_dtype.lower()
    packed = lowered in ("auto", "fp8", "fp8_ds_mla", "fp8_e4m3")
    if packed:
        name, entry, align = "fp8_ds_mla", float(V4_FP8_ENTRY_BYTES), V4_PAGE_ALIGNMENT_FP8
    else:
        name, width = _latent_dtype(kv_dtype)
        entry, align = float(spec.head_dim * width), V4_PAGE_ALIGNMENT_PLAIN
    key_bytes = spec.index_head_dim * (INDEXER_FP4_BYTES_PER_VALUE if fp4_indexer else INDEXER_FP8_BYTES_PER_VALUE)
    window = spec.sliding_window or 128
    pages: list[CachePage] = []
    for layer in indices:
        pages.append(_page(layer, "window", V4_WINDOW_BLOCK_TOKENS, 1, entry, align, window))
        ratio = max(spec.compress_ratio(layer), 1)
        if ratio == 1:
            continue
        overlap = 2 if ratio == 4 else 1
        pages.append(_page(layer, "compressed", V4_BLOCK_TOKENS, ratio, entry, align))
        state = 2 * overlap * spec.head_dim * FP32_BYTES  # the compressor's KV and score state per token
        pages.append(_page(layer, "state", 4 if ratio == 4 else 8, 1, state, align, overlap * ratio))
        if ratio == 4:
            pages.append(_page(layer, "indexer", V4_BLOCK_TOKENS, ratio, key_bytes, align))
            indexer_state = 2 * 2 * spec.index_head_dim * FP32_BYTES
            pages.append(_page(layer, "state", 4, 1, indexer_state, align, 2 * ratio))
    notes = [
        f"every layer keeps its last {window} tokens; CSA layers (ratio 4) add one entry and one indexer key per "
        "4 tokens, HCA layers (ratio 128) one entry per 128",
        "compressor state and window blocks are what a decoding request holds; vLLM reserves the window plus a "
        "whole step's tokens (max_num_batched_tokens) when it admits a request",
    ]
    if fp4_indexer:
        notes.append("indexer keys in MXFP4 (--attention_config.use_fp4_indexer_cache, Blackwell)")
    return KVCacheLayout(spec.name, spec.attention_kind, name, _groups(pages), notes=tuple(notes))


def _page(
    layer: int, role: str, block: int, ratio: int, entry: float, align: int, window: int | None = None
) -> CachePage:
    """A page of BLOCK tokens: BLOCK / RATIO entries, padded to ALIGN bytes."""
    raw = block // ratio * entry
    padded = int(math.ceil(raw / align) * align)
    return CachePage(layer, role, block, ratio, entry, padded, window)


def _gqa_layout(spec: ModelSpec, kv_dtype: str, indices: list[int]) -> KVCacheLayout:
    _, width = _latent_dtype(kv_dtype)
    entry = float(2 * spec.num_kv_heads * spec.head_dim * width)
    block = 16
    pages = [CachePage(layer, "kv", block, 1, entry, int(entry * block)) for layer in indices]
    name = _latent_dtype(kv_dtype)[0]
    return KVCacheLayout(spec.name, "gqa", name, _groups(pages), replicated_over_tp=False)


# ---- vLLM's grouping --------------------------------------------------------------------------------------------


def _groups(pages: list[CachePage]) -> tuple[CacheGroup, ...]:
    """vLLM 0.32's grouping for a block-outermost pool (`_get_packed_kv_cache_groups`): layers of one kind form a
    bucket; a bucket whose page sizes repeat one-to-one is a pattern, split into groups of `repeats` pattern
    instances, the split chosen for least padding over all pattern buckets; other buckets stay whole. A model whose
    pages all have one size is one group per kind."""
    if not pages:
        return ()
    buckets: dict[tuple[str, int, int | None], list[CachePage]] = {}
    for page in pages:
        buckets.setdefault(page.kind, []).append(page)
    shapes = []
    for bucket in buckets.values():
        by_size: dict[int, list[CachePage]] = {}
        for page in bucket:
            by_size.setdefault(page.page_bytes, []).append(page)
        balanced = len({len(same) for same in by_size.values()}) == 1
        shapes.append((bucket, by_size, balanced))
    if len({page.page_bytes for page in pages}) <= 1:
        return tuple(CacheGroup(tuple(bucket)) for bucket, _, _ in shapes)
    floor = max((max(map(len, s.values())) for _, s, b in shapes if b and len(s) > 1), default=0)
    repeats = _least_padding_divisor([max(map(len, s.values())) for _, s, b in shapes if b], floor) if floor else 0
    groups: list[CacheGroup] = []
    for bucket, by_size, balanced in shapes:
        count = _cdiv(max(map(len, by_size.values())), repeats) if balanced and repeats else 1
        if count == 1:
            groups.append(CacheGroup(tuple(bucket)))
            continue
        instances = list(zip(*by_size.values(), strict=False))
        for index in range(count):
            groups.append(CacheGroup(tuple(page for instance in instances[index::count] for page in instance)))
    return tuple(groups)


def _least_padding_divisor(values: list[int], lower_bound: int) -> int:
    """vLLM's `_approximate_gcd`: the chunk size d >= LOWER_BOUND that pads VALUES up to multiples of d least
    (ties: the larger d)."""
    best, best_pad = lower_bound, None
    for d in range(max(lower_bound, 1), max(values) + 1):
        pad = sum((d - value % d) % d for value in values)
        if best_pad is None or pad <= best_pad:
            best, best_pad = d, pad
    return best


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
