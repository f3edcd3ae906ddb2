"""Workaround for vLLM 0.32 defect "DeepSeek-V4 attention metadata needs Triton on CPU".

V4's attention-metadata builders launch six Triton kernels. vLLM's CPU build runs without Triton (PyPI's triton has
no CPU backend, so vLLM replaces it with a placeholder whose `jit` returns the plain function), and the first
request fails with `TypeError: 'function' object is not subscriptable` at vllm/v1/attention/ops/metadata.py:43
(from vllm/v1/attention/backends/mla/sparse_swa.py:610). Below: the same six computations in eager PyTorch, with
the signatures of vLLM's launchers, installed in their place. Each says which vLLM kernel it follows; the tests run
vLLM's own kernels under Triton's interpreter on the same inputs and compare.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from deepserve.engines.vllm_workarounds.hooks import set_attributes

METADATA = "vllm.v1.attention.ops.metadata"
SPARSE_SWA = "vllm.v1.attention.backends.mla.sparse_swa"
COMPRESSOR_UTILS = "vllm.v1.attention.backends.mla.compressor_utils"
INDEXER = "vllm.v1.attention.backends.mla.indexer"


def token_to_req_indices(
    query_start_loc: torch.Tensor, out: torch.Tensor, num_mapped_tokens: int, num_tokens: int
) -> torch.Tensor:
    """metadata.py `compute_token_to_req_indices`: each of the first NUM_TOKENS tokens' request (the first whose
    query range ends after it); tokens from NUM_MAPPED_TOKENS on map to 0."""
    num_reqs = query_start_loc.shape[0] - 1
    tokens = torch.arange(num_tokens, device=out.device, dtype=query_start_loc.dtype)
    requests = torch.searchsorted(query_start_loc[1:], tokens, right=True).clamp_(max=max(num_reqs - 1, 0))
    out[:num_tokens] = torch.where(tokens < num_mapped_tokens, requests, 0)
    return out[:num_tokens]


def swa_indices_and_lens(
    swa_indices: torch.Tensor,
    swa_lens: torch.Tensor,
    window_size: int,
    index_width: int,
    left_visible: torch.Tensor,
    right_visible: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    token_to_req_indices: torch.Tensor,
    is_valid_token: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    replay_start: torch.Tensor,
    *,
    num_tokens: int,
    token_offset: int,
    has_image: bool = False,
) -> None:
    """sparse_swa.py `_compute_swa_indices_and_lens_kernel`: per token, the cache slots of its sliding window (and
    their count); a padded token gets length 0 and a row of -1."""
    if num_tokens == 0:
        return
    tokens = torch.arange(token_offset, token_offset + num_tokens, device=swa_lens.device)
    valid = is_valid_token[tokens].bool()
    req = torch.where(valid, token_to_req_indices[tokens].long(), 0)
    query_start = query_start_loc[req].long()
    prefix_len = seq_lens[req].long() - (query_start_loc[req + 1].long() - query_start)
    pos = prefix_len + tokens - query_start
    left = left_visible[tokens].long() if has_image else torch.zeros_like(pos)
    right = right_visible[tokens].long() if has_image else torch.zeros_like(pos)
    start = (pos - (window_size - 1) - (left - (window_size - 1)).clamp(min=0)).clamp(min=0)
    start = torch.maximum(start, replay_start[req].long())
    lens = torch.where(valid, pos + right + 1 - start, 0)
    swa_lens[:num_tokens] = lens.to(swa_lens.dtype)
    offsets = torch.arange(index_width, device=swa_lens.device)
    positions = start[:, None] + offsets[None, :]
    inside = offsets[None, :] < lens[:, None]
    block_col = torch.where(inside, positions // block_size, 0)
    slots = block_table[req[:, None], block_col].long() * block_size + positions % block_size
    rows = swa_indices.reshape(swa_indices.shape[0], -1)
    rows[:num_tokens, :index_width] = torch.where(inside, slots, -1).to(rows.dtype)


def prefill_gather_lens(
    prefill_gather_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    replay_start: torch.Tensor,
    num_prefills: int,
    num_decodes: int,
    window_size: int,
) -> None:
    """sparse_swa.py `ComputePrefillMetadataKernel.kernel`: per prefill, its query length plus the part of its
    context still inside the window (none below its replay start)."""
    rows = slice(num_decodes, num_decodes + num_prefills)
    query_len = query_start_loc[num_decodes + 1 : num_decodes + num_prefills + 1] - query_start_loc[rows]
    visible_prefix = (seq_lens[rows] - query_len - replay_start[rows]).clamp(min=0)
    gather = query_len + visible_prefix.clamp(max=window_size - 1)
    prefill_gather_lens[:num_prefills] = gather.to(prefill_gather_lens.dtype)


def compressed_slot_mapping(
    compressed_slot_mapping: torch.Tensor,
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    compress_ratio: int,
    dcp_world_size: int,
    cp_interleave: int,
) -> None:
    """compressor_utils.py `CompressedSlotMappingKernel.kernel`: the last token of every COMPRESS_RATIO positions
    maps to its compressed state's slot, every other token (and a padded one) to -1."""
    num_reqs = min(block_table.shape[0], query_start_loc.shape[0] - 1)
    tokens, req = _tokens_of_requests(query_start_loc, num_reqs)
    if tokens.numel() == 0:
        return
    query_start = query_start_loc[req].long()
    pos = seq_lens[req].long() - (query_start_loc[req + 1].long() - query_start) + tokens - query_start
    slot = slot_mapping[tokens].long()
    valid = (torch.fmod(pos + 1, compress_ratio) == 0) & (slot != -1)
    group = cp_interleave * dcp_world_size
    local_pos = _c_div(pos, group) * cp_interleave + torch.fmod(pos, cp_interleave)
    compressed = _c_div(local_pos, compress_ratio)
    block_col = torch.where(valid, _c_div(compressed, block_size), 0)
    slots = block_table[req, block_col].long() * block_size + torch.fmod(compressed, block_size)
    compressed_slot_mapping[tokens] = torch.where(valid, slots, -1).to(compressed_slot_mapping.dtype)


def uniform_decode(
    seq_lens: torch.Tensor,
    decode_seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    expanded_block_table: torch.Tensor,
    decode_lens: torch.Tensor,
    num_decode_tokens: int,
    max_decode_len: int,
) -> None:
    """indexer.py `PrepareUniformDecodeKernel.kernel`: one row per decode token (MAX_DECODE_LEN per request): its
    own context length (never negative), its request's block-table row, decode length 1."""
    tokens = torch.arange(num_decode_tokens, device=seq_lens.device)
    req, local = tokens // max_decode_len, tokens % max_decode_len
    lengths = (seq_lens[req].long() - max_decode_len + local + 1).clamp(min=0)
    decode_seq_lens[:num_decode_tokens] = lengths.to(decode_seq_lens.dtype)
    width = min(expanded_block_table.stride(0), block_table.shape[1], expanded_block_table.shape[1])
    expanded_block_table[:num_decode_tokens, :width] = block_table[req, :width]
    decode_lens[:num_decode_tokens] = 1


def prefill_chunk_metadata(
    query_start_loc: torch.Tensor,
    uncompressed_seq_lens: torch.Tensor,
    cu_compressed_seq_lens: torch.Tensor,
    row_start_cu_compressed_seq_lens: torch.Tensor,
    token_to_seq: torch.Tensor,
    cu_compressed_seq_len_ks: torch.Tensor,
    cu_compressed_seq_len_ke: torch.Tensor,
    query_slice_start: int,
    query_slice_stop: int,
    # vLLM's argument names: its callers pass them by keyword
    DCP_RANK: int,
    DCP_WORLD: int,
    DCP_INTERLEAVE: int,
    *,
    num_reqs: int,
    COMPRESS_RATIO: int,
) -> None:
    """indexer.py `BuildPrefillChunkMetadataKernel.kernel`: for each query token in the slice, where its row of
    compressed keys starts and ends (this rank's share under decode context parallelism); for each compressed key,
    its request."""
    tokens, req = _tokens_of_requests(query_start_loc, num_reqs)
    in_slice = (tokens >= query_slice_start) & (tokens < query_slice_stop)
    tokens, req = tokens[in_slice], req[in_slice]
    row_start = row_start_cu_compressed_seq_lens[req].long()
    query_len = query_start_loc[req + 1].long() - query_start_loc[req].long()
    context = uncompressed_seq_lens[req].long() - query_len + 1 + tokens - query_start_loc[req].long()
    per_token = _dcp_local_length(_c_div(context, COMPRESS_RATIO), DCP_RANK, DCP_WORLD, DCP_INTERLEAVE)
    out = tokens - query_slice_start
    cu_compressed_seq_len_ks[out] = row_start.to(cu_compressed_seq_len_ks.dtype)
    cu_compressed_seq_len_ke[out] = (row_start + per_token).to(cu_compressed_seq_len_ke.dtype)
    keys, key_req = _tokens_of_requests(cu_compressed_seq_lens, num_reqs)
    token_to_seq[keys] = key_req.to(token_to_seq.dtype)


def _dcp_local_length(length: torch.Tensor, rank: int, world: int, interleave: int) -> torch.Tensor:
    if world <= 1:
        return length
    base = _c_div(_c_div(length, interleave), world) * interleave
    remainder = (length - base * world - rank * interleave).clamp(min=0, max=interleave)
    return base + remainder


def _tokens_of_requests(cumulative: torch.Tensor, num_reqs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every index in [CUMULATIVE[r], CUMULATIVE[r+1]) for r < NUM_REQS, and its r."""
    starts = cumulative[:num_reqs].long()
    counts = (cumulative[1 : num_reqs + 1].long() - starts).clamp(min=0)
    req = torch.repeat_interleave(torch.arange(num_reqs, device=cumulative.device), counts)
    first = torch.repeat_interleave(starts - counts.cumsum(0) + counts, counts)
    return first + torch.arange(req.numel(), device=cumulative.device), req


def _c_div(a: torch.Tensor, b: int) -> torch.Tensor:
    """Integer division rounding toward zero, as Triton's `//` does on integers."""
    return torch.div(a, b, rounding_mode="trunc")


class EagerKernel:
    """Stands where vLLM keeps a Triton kernel launcher object: called with the launcher's arguments; nothing to
    warm up."""

    def __init__(self, function: Callable[..., None]) -> None:
        self.function = function

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.function(*args, **kwargs)

    def register_warmup(self, *args: Any, **kwargs: Any) -> None:
        """vLLM registers kernels for JIT warm-up; eager code needs none."""


def patch_metadata(module: ModuleType) -> None:
    set_attributes(module, compute_token_to_req_indices=token_to_req_indices)


def patch_sparse_swa(module: ModuleType) -> None:
    set_attributes(
        module,
        compute_token_to_req_indices=token_to_req_indices,  # bound by name at its import
        _COMPUTE_SWA_INDICES_AND_LENS_KERNEL=EagerKernel(swa_indices_and_lens),
        _COMPUTE_PREFILL_METADATA_KERNEL=EagerKernel(prefill_gather_lens),
    )


def patch_compressor_utils(module: ModuleType) -> None:
    set_attributes(module, _COMPRESSED_SLOT_MAPPING_KERNEL=EagerKernel(compressed_slot_mapping))


def patch_indexer(module: ModuleType) -> None:
    set_attributes(
        module,
        _PREPARE_UNIFORM_DECODE_KERNEL=EagerKernel(uniform_decode),
        _BUILD_PREFILL_CHUNK_METADATA_KERNEL=EagerKernel(prefill_chunk_metadata),
    )


PATCHES = {
    METADATA: patch_metadata,
    SPARSE_SWA: patch_sparse_swa,
    COMPRESSOR_UTILS: patch_compressor_utils,
    INDEXER: patch_indexer,
}
