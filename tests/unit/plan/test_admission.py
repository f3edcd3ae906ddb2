"""`deepserve serve` asks the memory plan before starting: refusals carry the plan's numbers and the nearest fit."""

from __future__ import annotations

import pytest

from deepserve.engines.config import EngineConfig
from deepserve.errors import ConfigError
from deepserve.hardware.catalog import get_accelerator
from deepserve.plan.admission import accelerator_for, check_cpu_fit, check_gpu_fit

H100 = get_accelerator("h100")
GB = 10**9


def test_fp8_deepseek_v3_on_one_h100_node_is_refused_with_the_two_node_layout() -> None:
    check = check_gpu_fit(EngineConfig(tensor_parallel_size=8), "deepseek-ai/DeepSeek-V3", H100)
    assert check.fits is False
    assert "weights 85.1 GB" in check.summary and "77.3 GB budget" in check.summary
    assert "it fits on 16 x h100-sxm (2 node(s))" in check.suggestion
    assert "--pipeline-parallel-size 2 --nnodes 2" in check.suggestion


def test_awq_on_one_node_and_fp8_on_two_nodes_fit() -> None:
    awq = check_gpu_fit(EngineConfig(tensor_parallel_size=8), "cognitivecomputations/DeepSeek-V3-0324-AWQ", H100)
    assert awq.fits is True and "awq-int4" in awq.summary
    two_nodes = EngineConfig(tensor_parallel_size=8, pipeline_parallel_size=2, nnodes=2, master_addr="10.0.0.1")
    assert check_gpu_fit(two_nodes, "deepseek-ai/DeepSeek-V3", H100).fits is True


def test_a_cache_too_small_for_the_context_says_how_far_to_lower_it() -> None:
    config = EngineConfig(
        tensor_parallel_size=8, pipeline_parallel_size=2, nnodes=2, master_addr="10.0.0.1", gpu_memory_utilization=0.6
    )
    check = check_gpu_fit(config, "deepseek-ai/DeepSeek-V3", H100)  # vLLM's default context: 163,840 tokens
    assert check.fits is False
    assert "fewer than --max-model-len 163,840" in check.summary and "lower --max-model-len" in check.summary
    assert check_gpu_fit(config.model_copy(update={"max_model_len": 32768}), "deepseek-ai/DeepSeek-V3", H100).fits


def test_fp8_at_load_on_a_16_bit_checkpoint_counts_one_byte_weights() -> None:
    bf16 = check_gpu_fit(EngineConfig(tensor_parallel_size=8), "deepseek-ai/DeepSeek-V2-Lite", H100)
    fp8 = check_gpu_fit(EngineConfig(tensor_parallel_size=8, quantization="fp8"), "deepseek-ai/DeepSeek-V2-Lite", H100)
    assert "(bf16)" in bf16.summary and "(fp8-dynamic)" in fp8.summary


def test_what_cannot_be_checked_is_said_not_guessed() -> None:
    unknown_model = check_gpu_fit(EngineConfig(), "some-org/unknown-model", H100)
    assert unknown_model.fits is None and "config.json is not on this machine" in unknown_model.summary
    assert check_gpu_fit(EngineConfig(), "deepseek-ai/DeepSeek-V3", None).fits is None
    assert accelerator_for(None, "NVIDIA H100 80GB HBM3") == H100
    assert accelerator_for("h200", "NVIDIA H100 80GB HBM3") == get_accelerator("h200")
    assert accelerator_for(None, None) is None


def test_cpu_fit_counts_weights_kv_and_processes_against_free_ram() -> None:
    refused = check_cpu_fit(EngineConfig(), "deepseek-ai/DeepSeek-V3", 24 * GB, 1)
    assert (
        refused.fits is False and "673.2 GB of weights" in refused.summary and "24.0 GB is available" in refused.summary
    )
    assert "serve it on GPUs" in refused.suggestion
    loopback = EngineConfig(pipeline_parallel_size=2, nnodes=2, master_addr="127.0.0.1")
    two_here = check_cpu_fit(loopback, "deepseek-ai/DeepSeek-V2-Lite", 10**15, 2)
    one_here = check_cpu_fit(loopback, "deepseek-ai/DeepSeek-V2-Lite", 10**15, 1)
    assert "2 engine process(es)" in two_here.summary and "1 engine process(es)" in one_here.summary


def test_the_activation_reserve_assumes_vllms_own_token_budget_for_the_gpu() -> None:
    """vLLM batches 8192 tokens per step by default on GPUs of 70 GiB or more (not the A100), 2048 elsewhere."""
    model = "deepseek-ai/DeepSeek-V2-Lite"
    for gpu, budget in (("h100", 8192), ("l40s", 2048), ("a100", 2048)):
        accelerator = get_accelerator(gpu)
        default = check_gpu_fit(EngineConfig(tensor_parallel_size=8), model, accelerator)
        given = check_gpu_fit(EngineConfig(tensor_parallel_size=8, max_num_batched_tokens=budget), model, accelerator)
        assert default.summary == given.summary, gpu


def test_serve_refuses_a_context_beyond_the_models_positions_on_gpus_and_on_cpu() -> None:
    too_long = EngineConfig(tensor_parallel_size=8, max_model_len=163841)
    with pytest.raises(ConfigError, match="--max-model-len 163,841 exceeds deepseek-ai/DeepSeek-V3's 163,840 posit"):
        check_gpu_fit(too_long, "deepseek-ai/DeepSeek-V3", H100)
    with pytest.raises(ConfigError, match="give 163840 or less"):
        check_cpu_fit(too_long.model_copy(update={"tensor_parallel_size": 1}), "deepseek-ai/DeepSeek-V3", 10**12, 1)
    assert check_gpu_fit(too_long.model_copy(update={"max_model_len": 163840}), "deepseek-ai/DeepSeek-V3", H100)
