from __future__ import annotations

import pytest

from deepserve.errors import ConfigError
from deepserve.hardware.catalog import get_accelerator
from deepserve.models import load_spec
from deepserve.plan.formats import checkpoint_format, get_format
from deepserve.plan.layout import Layout, check_layout
from deepserve.plan.memory import plan_memory, weights_per_gpu
from deepserve.plan.planner import build_deployment

GB = 1e9


@pytest.fixture(scope="module")
def v3():
    return load_spec("deepseek-ai/DeepSeek-V3")


@pytest.fixture(scope="module")
def v3_awq():
    return load_spec("cognitivecomputations/DeepSeek-V3-AWQ")


def _weights(spec, fmt: str, layout: Layout) -> int:
    return sum(c.bytes_per_gpu for c in weights_per_gpu(spec, get_format(fmt), layout))


def test_kv_cache_is_70272_bytes_per_token_in_bf16(v3) -> None:
    deployment = build_deployment(v3, "h200", 8, weights="fp8")
    assert deployment.memory.kv_bytes_per_token == 70_272
    fp8 = build_deployment(v3, "h200", 8, weights="fp8", kv_dtype="fp8")
    assert fp8.memory.kv_bytes_per_token == 35_136


def test_fp8_weights_do_not_fit_on_8_h100(v3) -> None:
    deployment = build_deployment(v3, "h100", 8, weights="fp8")
    assert not deployment.memory.fits
    assert deployment.memory.kv_cache_bytes_per_gpu < 0
    assert deployment.memory.weights_bytes_per_gpu > 80 * GB


def test_awq_int4_fits_on_8_h100_at_about_50_gb_per_gpu(v3_awq) -> None:
    deployment = build_deployment(v3_awq, "h100", 8)
    assert deployment.fmt.name == "awq-int4"
    assert deployment.memory.fits
    assert 42 * GB < deployment.memory.weights_bytes_per_gpu < 55 * GB
    assert deployment.memory.kv_cache_tokens > 100_000


def test_bf16_needs_more_than_1_3_tb(v3) -> None:
    whole_model = _weights(v3, "bf16", Layout(tp=1))
    assert whole_model > 1.3e12
    assert not build_deployment(v3, "h200", 8, weights="bf16").memory.fits


def test_fp8_block_scales_are_counted(v3) -> None:
    blockwise = _weights(v3, "fp8", Layout(tp=1))
    per_tensor = _weights(v3, "fp8-dynamic", Layout(tp=1))
    experts = v3.parameter_breakdown()["routed_experts"]
    # one FP32 scale per 128x128 block: 4/16384 bytes per weight
    assert blockwise - per_tensor == pytest.approx(experts * 4 / 16384, rel=0.05)


def test_awq_group_64_scales_and_zeros(v3) -> None:
    fmt = get_format("awq-int4")
    assert fmt.bytes_per_param("routed_experts") == pytest.approx(0.5 + 2.5 / 64)
    for unconverted in ("embedding", "lm_head", "norms", "router"):
        assert fmt.bytes_per_param(unconverted) == 2


def test_checkpoint_formats_follow_the_presets(v3, v3_awq) -> None:
    assert checkpoint_format(v3).name == "fp8"
    assert checkpoint_format(v3_awq).name == "awq-int4"
    assert checkpoint_format(load_spec("deepseek-ai/DeepSeek-V2-Lite")).name == "bf16"


def test_tp_splits_heads_and_experts_but_replicates_the_latent_projections(v3) -> None:
    fmt = get_format("fp8")
    tp4 = {c.component: c for c in weights_per_gpu(v3, fmt, Layout(tp=4))}
    tp8 = {c.component: c for c in weights_per_gpu(v3, fmt, Layout(tp=8))}
    assert tp8["attention_heads"].params_per_gpu == pytest.approx(tp4["attention_heads"].params_per_gpu / 2, rel=1e-6)
    assert tp8["routed_experts"].params_per_gpu == pytest.approx(tp4["routed_experts"].params_per_gpu / 2, rel=1e-6)
    assert tp8["attention_latent"].params_per_gpu == tp4["attention_latent"].params_per_gpu
    assert tp8["attention_latent"].placement == "replicated"
    assert tp8["router"].placement == "replicated"


def test_dp_attention_replicates_attention_and_spreads_experts(v3) -> None:
    fmt = get_format("fp8")
    dp = {c.component: c for c in weights_per_gpu(v3, fmt, Layout(tp=1, dp=8, ep=True))}
    tp = {c.component: c for c in weights_per_gpu(v3, fmt, Layout(tp=8))}
    assert dp["attention_heads"].params_per_gpu == 8 * tp["attention_heads"].params_per_gpu
    assert dp["routed_experts"].params_per_gpu == tp["routed_experts"].params_per_gpu  # 32 whole experts vs 1/8 of all


def test_pp_splits_layers(v3) -> None:
    one = _weights(v3, "fp8", Layout(tp=8))
    two = _weights(v3, "fp8", Layout(tp=8, pp=2))
    assert 0.45 * one < two < 0.55 * one


def test_mla_latent_cache_is_replicated_on_every_tp_rank(v3) -> None:
    h200 = get_accelerator("h200")
    fmt = get_format("fp8")
    tp8 = plan_memory(v3, fmt, Layout(tp=8), h200, "bfloat16", 0.9, 32768, 2560, 8192)
    assert tp8.kv_bytes_per_token_per_gpu == tp8.kv_bytes_per_token == 70_272
    # the cache per GPU holds as many tokens as the deployment does: no multiplication by TP
    assert tp8.kv_cache_tokens == tp8.kv_cache_bytes_per_gpu // 70_272
    pp2 = plan_memory(v3, fmt, Layout(tp=4, pp=2), h200, "bfloat16", 0.9, 32768, 2560, 8192)
    assert pp2.kv_bytes_per_token_per_gpu == 31 * 576 * 2  # the first stage's 31 layers


def test_dp_attention_multiplies_cache_capacity(v3) -> None:
    dp = build_deployment(v3, "h200", 8, weights="fp8", layout=Layout(tp=1, dp=8, ep=True))
    per_gpu_tokens = dp.memory.kv_cache_bytes_per_gpu // dp.memory.kv_bytes_per_token_per_gpu
    assert dp.memory.kv_cache_tokens == 8 * per_gpu_tokens


def test_gpu_memory_utilization_and_reserve_shape_the_cache(v3_awq) -> None:
    low = build_deployment(v3_awq, "h100", 8, gpu_memory_utilization=0.8).memory
    high = build_deployment(v3_awq, "h100", 8, gpu_memory_utilization=0.95).memory
    assert high.kv_cache_bytes_per_gpu - low.kv_cache_bytes_per_gpu == pytest.approx(0.15 * 80 * 1024**3, rel=0.01)
    assert 2 * 1024**3 < low.reserve_bytes_per_gpu < 8 * 1024**3
    assert high.budget_bytes_per_gpu == high.weights_bytes_per_gpu + high.reserve_bytes_per_gpu + (
        high.kv_cache_bytes_per_gpu
    )


def test_each_engine_reads_the_memory_fraction_its_own_way(v3) -> None:
    """vLLM's and SGLang's fraction is of the whole GPU; TensorRT-LLM's (--kv_cache_free_gpu_memory_fraction, which
    the launcher passes the same number as) of what the weights and reserve leave, so it keeps a larger cache."""
    vllm = build_deployment(v3, "h200", 8, weights="fp8", gpu_memory_utilization=0.9).memory
    sglang = build_deployment(v3, "h200", 8, weights="fp8", engine="sglang", gpu_memory_utilization=0.9).memory
    trtllm = build_deployment(v3, "h200", 8, weights="fp8", engine="trtllm", gpu_memory_utilization=0.9).memory
    device = get_accelerator("h200").memory_bytes
    assert vllm.budget_bytes_per_gpu == sglang.budget_bytes_per_gpu == int(0.9 * device)
    left = device - trtllm.weights_bytes_per_gpu - trtllm.reserve_bytes_per_gpu
    assert trtllm.kv_cache_bytes_per_gpu == pytest.approx(0.9 * left, abs=1)
    assert trtllm.kv_cache_bytes_per_gpu - vllm.kv_cache_bytes_per_gpu == pytest.approx(
        0.1 * (trtllm.weights_bytes_per_gpu + trtllm.reserve_bytes_per_gpu), abs=2
    )


def test_max_model_len_larger_than_the_cache_does_not_fit(v3_awq) -> None:
    deployment = build_deployment(v3_awq, "h100", 8, max_model_len=163_840, gpu_memory_utilization=0.62)
    assert deployment.memory.kv_cache_bytes_per_gpu > 0
    assert not deployment.memory.fits


@pytest.mark.parametrize(
    ("layout", "gpus", "message"),
    [
        (Layout(tp=3), 3, "does not divide"),
        (Layout(tp=8, pp=2), 8, "16 GPUs but --gpus is 8"),
        (Layout(tp=1, dp=3), 3, "does not divide the expert width"),
        (Layout(tp=8, pp=100), 800, "exceeds the model's 61 layers"),
        (Layout(tp=1, dp=512, ep=True), 512, "at least one routed expert per GPU"),
    ],
)
def test_impossible_layouts_are_clear_errors(v3, layout: Layout, gpus: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_layout(layout, v3, gpus)


def test_unknown_weight_format_lists_valid_ones() -> None:
    with pytest.raises(ConfigError, match="awq-int4"):
        get_format("int3")
