"""Workaround for vLLM 0.32 defect "the CPU sparse-SWA tile scheduler lacks two layer types".

`DeepseekSparseSWAMetadataBuilder.build` reads five layer types from `build_tile_scheduler`'s result
(vllm/v1/attention/backends/mla/sparse_swa.py:777-781: swaonly, c4a, c128a, c1a, c2a), but the CPU builder's
override (vllm/models/deepseek_v4/cpu/cpu_mla.py:116) returns only the first three, so the first request fails with
`KeyError: 'c1a'` at sparse_swa.py:780. The CPU path never plans tiles (the override's own docstring): every type
maps to None, as the shared base returns on platforms without the FlashMLA planner.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

CPU_MLA = "vllm.models.deepseek_v4.cpu.cpu_mla"
SPARSE_SWA = "vllm.v1.attention.backends.mla.sparse_swa"
LAYER_TYPES = ("swaonly", "c4a", "c128a", "c1a", "c2a")  # sparse_swa.py:48-56, _LAYER_TYPE_*


def no_tile_plans(self: Any, num_decode_tokens: int) -> dict[str, None]:
    """What the CPU builder means to return: no FlashMLA tile plan for any layer type."""
    return dict.fromkeys(LAYER_TYPES)


def patch_cpu_mla(module: ModuleType) -> None:
    module.DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler = no_tile_plans


PATCHES = {CPU_MLA: patch_cpu_mla}
