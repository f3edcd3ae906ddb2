"""An engine's own KV pool where it admits fewer requests than the planner's cache model (vLLM's pool of blocks,
plan/memory.py) says the memory holds.

SGLang keeps DeepSeek-V4's cache in pools of its own (sglang 0.5.15, python/sglang/srt/model_executor/
pool_configurator.py, DSV4PoolConfigurator): a "full" pool of compressed entries (every fourth token's in the CSA
layers, every 128th in the HCA layers, the indexer's keys), and a sliding-window (SWA) pool of uncompressed
entries for every layer, sized at `--swa-full-tokens-ratio` of the full pool's tokens (0.1 for V4:
arg_groups/overrides.py). A prompt is written to the SWA pool whole, and with the radix cache on (the default)
its tokens stay there while the request runs: `free_swa_out_of_window_slots` (mem_cache/common.py) frees only
tokens past `cache_protected_len`, the prefix the radix tree holds, so a decoding request keeps its prompt plus
the window and the decode tokens of one eviction interval. The SWA pool, a tenth of the full pool's tokens at
about ten times the bytes per token, then caps the running batch at prompts of a few thousand tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepserve.models.spec import ModelSpec

# sglang 0.5.15 (overrides.py, _deepseek_v4_overrides): the dsv4 attention backend's page of 256 tokens
PAGE_TOKENS = 256
# environ.py: SGLANG_SWA_EVICTION_INTERVAL, decode steps between two evictions of out-of-window tokens
EVICTION_INTERVAL_TOKENS = 128
# environ.py: SGLANG_DSV4_COMPRESS_STATE_DTYPE defaults to float32
STATE_DTYPE_BYTES = 4
INDEXER_QUANT_BLOCK = 128


@dataclass(frozen=True)
class SglangV4Pool:
    """SGLang's DeepSeek-V4 pools on one GPU (one data-parallel rank's cache)."""

    full_tokens: int
    swa_tokens: int
    bytes_per_full_token: float
    request_state_bytes: int  # the HCA layers' compressor state, reserved for every request slot up front
    window: int

    def sequences(self, prompt_len: int, sequence_len: int) -> int:
        """Requests of PROMPT_LEN + output = SEQUENCE_LEN tokens that run at once: the full pool holds each one's
        whole context, the SWA pool its prompt and the decode tail it has not evicted yet."""
        swa_held = prompt_len + max(self.window, PAGE_TOKENS) + EVICTION_INTERVAL_TOKENS
        return max(min(self.full_tokens // max(sequence_len, 1), self.swa_tokens // swa_held), 0)


def sglang_v4_pool(
    spec: ModelSpec, available_bytes: int, swa_ratio: float, running_requests: int, speculative: bool
) -> SglangV4Pool:
    """DSV4PoolConfigurator.calculate_pool_sizes for SPEC with AVAILABLE_BYTES of cache memory on one GPU, the
    SWA pool at SWA_RATIO of the full one, RUNNING_REQUESTS request slots on this rank, and with SPECULATIVE
    decoding's draft layer (its share of the pools and its longer compressor rings)."""
    layers = len(spec.compress_ratios)
    csa, hca = spec.layers_with_ratio(4), spec.layers_with_ratio(128)
    entry = spec.head_dim + spec.qk_rope_head_dim + 8  # FP8 no-rope part, 16-bit rope part, scales
    indexer = spec.index_head_dim + spec.index_head_dim // INDEXER_QUANT_BLOCK * 4
    csa_ring, hca_ring = (16, 256) if speculative else (8, 128)
    window = spec.sliding_window or 128
    csa_state = 2 * 2 * spec.head_dim * STATE_DTYPE_BYTES + 2 * 2 * spec.index_head_dim * STATE_DTYPE_BYTES
    per_full_token = (
        swa_ratio * entry * layers
        + entry * csa / 4
        + entry * hca / 128
        + indexer * csa / 4
        + swa_ratio * csa_ring / window * csa_state * csa
    )
    if speculative:
        per_full_token *= (layers + 1) / layers
    rows = -(-((running_requests + 1) * hca_ring + hca_ring + 1) // 128) * 128
    request_state = rows * 2 * spec.head_dim * STATE_DTYPE_BYTES * hca
    full = int(max(available_bytes - request_state, 0) / per_full_token) // PAGE_TOKENS * PAGE_TOKENS
    swa = int(full * swa_ratio) // PAGE_TOKENS * PAGE_TOKENS
    return SglangV4Pool(full, swa, per_full_token, request_state, window)
