"""Which GPU software stack an engine command is for: CUDA (NVIDIA) or ROCm (AMD Instinct), and what each engine's
DeepSeek recipes set on ROCm.

The platform comes from the config alone (so that a plan, a dry run or a rendered deployment for AMD nodes is
written the same on any machine): --device rocm or cuda, else the vendor of --gpu-type. `deepserve serve` resolves
--device auto from what this machine's GPUs are before it asks a launcher (serve/service_plan.py)."""

from __future__ import annotations

from typing import Literal

from deepserve.engines.config import EngineConfig
from deepserve.hardware.catalog import get_accelerator

Platform = Literal["cuda", "rocm"]
CUDA: Platform = "cuda"
ROCM: Platform = "rocm"

# AMD's graphics targets whose AITER build lacks kernels a recipe otherwise turns on (see VLLM_ROCM_ENV).
GFX950_GPUS = ("mi355x", "mi350x")


def gpu_platform(config: EngineConfig) -> Platform:
    """ROCM for AMD GPUs, else CUDA."""
    if config.device == ROCM:
        return ROCM
    if config.device == CUDA or not config.gpu_type:
        return CUDA
    return ROCM if get_accelerator(config.gpu_type).vendor == "amd" else CUDA


def is_gfx950(config: EngineConfig) -> bool:
    """An MI350-series GPU (CDNA 4), named by --gpu-type."""
    return bool(config.gpu_type) and any(name in str(config.gpu_type).lower() for name in GFX950_GPUS)


# vLLM on ROCm, DeepSeek: AITER's kernels (fused MoE, MLA decode, RMSNorm, block-scale FP8 GEMMs) are off unless
# VLLM_ROCM_USE_AITER=1; its sub-switches (VLLM_ROCM_USE_AITER_MOE, _MLA, _RMSNORM, _LINEAR, …) default to on and
# take effect only under it (vllm/envs.py and vllm/_aiter_ops.py, 0.32). The switch is what vLLM's DeepSeek recipe for
# AMD sets (vllm-project/recipes DeepSeek/AMD_GPU/README.md @ 90986347; its `--block-size 1` is no longer needed:
# AITER MLA takes any block size since vLLM's AiterMLABackend expands block indices itself) and what llm-d's MI355X
# DeepSeek deployment sets (llm-d/llm-d guides/wide-ep-lws/modelserver/amd/vllm-deepseek-v3/base/decode.yaml @
# 368f5b0a), which also turns AITER's linear layers off on gfx950, where AITER has no large-M GEMM binaries.
# Every name here must exist in the vLLM these commands are for: tests/unit/engines/test_rocm.py checks them against
# the installed vllm/envs.py (VLLM_USE_TRITON_FLASH_ATTN, in older recipes, is gone).
VLLM_ROCM_ENV = {"VLLM_ROCM_USE_AITER": "1"}
VLLM_ROCM_GFX950_ENV = {"VLLM_ROCM_USE_AITER_LINEAR": "0"}

# SGLang on ROCm, DeepSeek: SGLANG_USE_AITER (sglang/srt/environ.py, "AMD & ROCm" section, default off) and the
# AITER attention backend, as the LMSYS/AMD post on DeepSeek-V3 with MTP on 8 x MI300X ran it
# (https://lmsys.org/blog/2025-09-02-sglang-amd-deepseek-v3-mtp/: `--attention-backend aiter`).
SGLANG_ROCM_ENV = {"SGLANG_USE_AITER": "1"}
SGLANG_ROCM_ATTENTION_BACKEND = "aiter"


def vllm_rocm_env(config: EngineConfig) -> dict[str, str]:
    return {**VLLM_ROCM_ENV, **(VLLM_ROCM_GFX950_ENV if is_gfx950(config) else {})}
