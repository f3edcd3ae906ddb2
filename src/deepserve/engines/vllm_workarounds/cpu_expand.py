"""Workaround for vLLM 0.32 defect "the CPU rejection sampler's expand never writes its output".

On CPU (no Triton) vLLM runs the rejection sampler's `expand_kernel` (vllm/v1/sample/rejection_sampler.py:956),
which copies each request's sampling parameter to its draft positions, as `_expand_kernel_impl`
(vllm/utils/cpu_triton_utils.py:390, registered in vllm/platforms/cpu.py:711). That function hands the C++ kernel
`_ensure_int64(output)`: for the float32 temperature / top-p tensors a fresh int64 copy, which the kernel fills and
nobody copies back (its float inputs are truncated to integers on the way in, too). The draft positions keep
uninitialised temperatures, so sampled (temperature > 0) speculative decoding draws tokens from the wrong
distribution and under-counts acceptance; greedy requests are unaffected. Below: the kernel's semantics in eager
PyTorch, writing OUTPUT in place, registered in the broken function's stead before vLLM registers its overrides.
"""

from __future__ import annotations

from types import ModuleType

import torch

from deepserve.engines.vllm_workarounds.hooks import set_attributes

CPU_TRITON_UTILS = "vllm.utils.cpu_triton_utils"
REJECTION_SAMPLER = "vllm.v1.sample.rejection_sampler"


def expand_in_place(
    output: torch.Tensor,
    input_val: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from: float | int,
    replace_to: float | int,
    MAX_NUM_TOKENS: int | None = None,
) -> None:
    """rejection_sampler.py `expand_kernel`: request r's value (REPLACE_FROM replaced by REPLACE_TO) fills
    OUTPUT[cu_num_tokens[r-1]:cu_num_tokens[r]] (from 0 for the first request)."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    expanded = torch.repeat_interleave(values, counts.clamp(min=0))
    output[: expanded.numel()] = expanded.to(output.dtype)


def patch_cpu_triton_utils(module: ModuleType) -> None:
    set_attributes(module, _expand_kernel_impl=expand_in_place)


PATCHES = {CPU_TRITON_UTILS: patch_cpu_triton_utils}
