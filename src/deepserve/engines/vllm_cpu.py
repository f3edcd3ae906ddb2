"""How vLLM's CPU build runs an unquantized linear layer, for measuring this machine's GEMM rate the way the engine
sees it (hardware/host.py).

vLLM's CPU platform builds a oneDNN matmul handle per linear layer (`vllm._custom_ops.create_onednn_mm`) and falls
back to PyTorch's `linear` when oneDNN cannot build one for the dtype on this CPU (bf16 on a CPU without
AVX512-BF16 or AMX, for instance). The probe does the same, so the rate it times is the one the engine gets.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

ONEDNN_PRIMITIVE_CACHE = 32  # what vLLM passes when it builds the handle


def cpu_linear(weight: Any) -> tuple[Callable[[Any], Any], str]:
    """A callable x -> x @ weight.T by vLLM's CPU path for WEIGHT (a torch tensor [out, in]), and its name."""
    import torch

    try:
        from vllm import _custom_ops as ops

        if getattr(ops, "_supports_onednn", False):
            handler = ops.create_onednn_mm(weight.t(), ONEDNN_PRIMITIVE_CACHE)
            return (lambda x: ops.onednn_mm(handler, x, None)), "oneDNN (vLLM onednn_mm)"
    except (ImportError, RuntimeError, AttributeError):
        pass  # vLLM itself falls back to torch's linear when the handle cannot be built
    return (lambda x: torch.nn.functional.linear(x, weight)), "torch.nn.functional.linear"
