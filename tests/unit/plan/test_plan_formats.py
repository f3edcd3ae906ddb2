"""Weight formats of DeepSeek-V4's checkpoints (FP4 experts with FP8 attention) and where each runs natively."""

from __future__ import annotations

import pytest

from deepserve.hardware.catalog import get_accelerator
from deepserve.models.presets import preset_spec
from deepserve.plan.formats import checkpoint_format, format_support, get_format


def test_fp4_scale_overheads() -> None:
    mxfp4, nvfp4 = get_format("mxfp4"), get_format("nvfp4")
    assert mxfp4.bytes_per_param("routed_experts") == 0.5 + 1 / 32  # one E8M0 scale per 32 weights
    assert nvfp4.bytes_per_param("routed_experts") == 0.5 + 1 / 16  # one FP8 scale per 16 weights
    # the FP8 part of V4's release: E4M3 with one UE8M0 (1-byte) scale per 128x128 block
    assert mxfp4.bytes_per_param("attention_heads") == 1 + 1 / (128 * 128)
    assert mxfp4.bytes_per_param("shared_experts") == mxfp4.bytes_per_param("indexer") == 1 + 1 / (128 * 128)
    assert mxfp4.bytes_per_param("compressor") == mxfp4.bytes_per_param("embedding") == 2
    assert mxfp4.bytes_per_param("hyper_connections") == 4  # FP32 in the checkpoint and in vLLM


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("deepseek-ai/DeepSeek-V4-Flash", "mxfp4"),
        ("deepseek-ai/DeepSeek-V4-Pro-0813", "mxfp4"),
        ("nvidia/DeepSeek-V4-Pro-NVFP4", "nvfp4"),
        ("sgl-project/DeepSeek-V4-Flash-FP8", "fp8"),
        ("deepseek-ai/DeepSeek-V4-Flash-Base", "fp8"),
        ("deepseek-ai/DeepSeek-V3.2", "fp8"),
        ("deepseek-ai/DeepSeek-V3.1", "fp8"),
    ],
)
def test_checkpoint_formats(name: str, fmt: str) -> None:
    assert checkpoint_format(preset_spec(name)).name == fmt


@pytest.mark.parametrize(
    "name",
    [
        "deepseek-ai/DeepSeek-V4-Flash",
        "deepseek-ai/DeepSeek-V4-Flash-0731",
        "deepseek-ai/DeepSeek-V4-Pro",
        "deepseek-ai/DeepSeek-V4-Pro-0813",
    ],
)
def test_v4_checkpoint_sizes_match_the_published_ones(name: str) -> None:
    """Recipes: ~160 GB (Flash), ~167 GB (Flash-0731 with DSpark, no MTP head), ~865 GB (Pro), ~893 GB (Pro-0813).
    The checkpoint holds the main model and its draft modules, in the mixed MXFP4 + FP8 format with every scale."""
    from deepserve.models.presets import preset_info
    from deepserve.plan.layout import Layout
    from deepserve.plan.memory import weights_per_gpu

    spec, info = preset_spec(name), preset_info(name)
    assert info is not None and (published := info.fact("checkpoint_gb")) is not None
    fmt = checkpoint_format(spec)
    stored = sum(c.bytes_per_gpu for c in weights_per_gpu(spec, fmt, Layout(tp=1), spec.num_mtp_layers))
    assert stored / 1e9 == pytest.approx(published.value, rel=0.01)


@pytest.mark.parametrize(
    ("gpu", "fmt", "kind", "dtype"),
    [
        ("b200", "mxfp4", "native", "fp8"),
        ("b300", "nvfp4", "native", "fp4"),
        ("gb200", "mxfp4", "native", "fp8"),
        ("h200", "mxfp4", "weight-only", "bf16"),
        ("h100", "nvfp4", "weight-only", "bf16"),
        ("h20", "mxfp4", "weight-only", "bf16"),
        ("mi355x", "mxfp4", "native", "fp4"),
        ("mi300x", "mxfp4", "unsupported", "bf16"),
        ("mi355x", "nvfp4", "unsupported", "bf16"),
        ("rtx-pro-6000", "nvfp4", "native", "fp4"),
        ("rtx-pro-6000", "mxfp4", "weight-only", "bf16"),
        ("h200", "fp8", "native", "fp8"),
    ],
)
def test_where_fp4_experts_run(gpu: str, fmt: str, kind: str, dtype: str) -> None:
    support = format_support(get_format(fmt), get_accelerator(gpu))
    assert (support.kind, support.expert_compute_dtype) == (kind, dtype)
