"""From engine flags and hardware to a simulated deployment: the planner's memory plan, vLLM's defaults."""

from __future__ import annotations

import pytest

from deepserve.cli.main import main
from deepserve.engines.config import EngineConfig
from deepserve.errors import ConfigError
from deepserve.plan.planner import make_plan
from deepserve.plan.types import PlanConfig
from deepserve.simulate.closed_loop import simulate_closed_loop
from deepserve.simulate.config import SimulateConfig
from deepserve.simulate.setup import build_core, resolve

AWQ = "cognitivecomputations/DeepSeek-V3-0324-AWQ"


def test_the_kv_cache_and_limits_come_from_the_plan_and_vllms_defaults() -> None:
    deployment = resolve(EngineConfig(model=AWQ), SimulateConfig(gpu="h100"))
    plan = make_plan(PlanConfig(model=AWQ, gpu="h100", gpus=8))
    assert deployment.num_blocks == plan.deployment.memory.kv_cache_tokens // 64  # MLA: 64-token blocks
    assert (deployment.max_num_seqs, deployment.max_num_batched_tokens) == (1024, 8192)  # H100: vLLM's large
    assert deployment.chunked_prefill and deployment.prefix_caching
    assert deployment.max_model_len == 32768 and deployment.served_model_name == AWQ
    small = resolve(EngineConfig(model=AWQ, tensor_parallel_size=8), SimulateConfig(gpu="a100-80gb"))
    assert (small.max_num_seqs, small.max_num_batched_tokens) == (256, 2048)  # vLLM's A100 defaults


def test_engine_flags_change_what_is_simulated() -> None:
    engine = EngineConfig(
        model=AWQ, max_num_seqs=16, max_num_batched_tokens=4096, block_size=16, enable_prefix_caching=False,
        kv_cache_memory_gib=2.0, max_model_len=8192, served_model_name="v3",
    )  # fmt: skip
    deployment = resolve(engine, SimulateConfig(gpu="h100"))
    assert (deployment.max_num_seqs, deployment.max_num_batched_tokens, deployment.block_size) == (16, 4096, 16)
    assert not deployment.prefix_caching and deployment.served_model_name == "v3"
    assert deployment.num_blocks == 2 * 1024**3 // 70272 // 16  # 2 GiB of 70,272-byte tokens
    no_chunks = resolve(EngineConfig(model=AWQ, enable_chunked_prefill=False), SimulateConfig(gpu="h100"))
    assert no_chunks.max_num_batched_tokens == 32768  # vLLM raises the budget to max_model_len
    engine = EngineConfig(model=AWQ, data_parallel_size=2, enable_expert_parallel=True, tensor_parallel_size=4)
    core = build_core(resolve(engine, SimulateConfig(gpu="h100")), SimulateConfig())
    assert core.scheduler.limits.max_num_seqs == 2048  # two attention replicas, each its own max_num_seqs


def test_quantization_flags_map_to_the_planners_formats() -> None:
    fp8 = resolve(EngineConfig(model="deepseek-ai/DeepSeek-V3", quantization="fp8"), SimulateConfig())
    assert fp8.plan is not None and fp8.plan.deployment.fmt.name == "fp8"  # the checkpoint already is FP8
    with pytest.raises(ConfigError, match="needs a checkpoint stored as AWQ.*e.g. cognitivecomputations/"):
        resolve(EngineConfig(model="deepseek-ai/DeepSeek-V3", quantization="awq"), SimulateConfig())
    with pytest.raises(ConfigError, match="stored as GPTQ.*e.g. a local checkpoint directory") as refused:
        resolve(EngineConfig(model="deepseek-ai/DeepSeek-V3", quantization="gptq"), SimulateConfig())
    assert "AWQ" not in str(refused.value)  # no AWQ preset offered for GPTQ
    with pytest.raises(ConfigError, match="not simulated"):
        resolve(EngineConfig(model=AWQ, quantization="bitsandbytes"), SimulateConfig())


def test_what_cannot_run_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError, match="does not fit on 8 x h100"):
        resolve(EngineConfig(model="deepseek-ai/DeepSeek-V3"), SimulateConfig(gpu="h100"))
    with pytest.raises(ConfigError, match="fewer than one sequence"):
        resolve(EngineConfig(model=AWQ, kv_cache_memory_gib=0.1), SimulateConfig(gpu="h100"))
    unchunked = EngineConfig(model=AWQ, enable_chunked_prefill=False, max_num_batched_tokens=2048)
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        build_core(resolve(unchunked, SimulateConfig(gpu="h100")), SimulateConfig())
    with pytest.raises(ValueError, match="two different engines"):
        SimulateConfig(fixed_itl_ms=5, fixed_step_ms=10)


def test_fixed_timings_serve_any_model_name() -> None:
    deployment = resolve(EngineConfig(model="fake-model", max_model_len=4096), SimulateConfig(fixed_itl_ms=1))
    assert deployment.plan is None and deployment.max_model_len == 4096
    assert "fixed TTFT 0 ms, ITL 1 ms" in deployment.describe()
    with pytest.raises(ConfigError, match="no step model"):
        build_core(deployment, SimulateConfig())


def test_the_cli_prints_the_deployment_and_refuses_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--dry-run", "--model", AWQ, "--gpu", "h100", "--max-num-seqs", "64"]) == 0
    out = capsys.readouterr().out
    assert "as if on 8 x h100-sxm" in out and "max_num_seqs 64" in out
    assert main(["simulate", "--dry-run", "--metric", "vllm:x"]) == 2
    assert "must look like KEY=VALUE" in capsys.readouterr().err
    assert main(["simulate", "--dry-run", "--", "--enforce-eager"]) == 2
    assert "passes nothing" in capsys.readouterr().err


def test_a_config_file_and_the_environment_set_both_sections(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "deepserve.yaml"
    config.write_text(f"engine:\n  model: {AWQ}\n  max_num_seqs: 48\nsimulate:\n  gpu: h100\n")
    monkeypatch.setenv("DEEPSERVE_SIMULATE__TIME_SCALE", "0.5")
    monkeypatch.setenv("DEEPSERVE_ENGINE__BLOCK_SIZE", "32")
    assert main(["simulate", "--config", str(config), "--dry-run", "--max-num-batched-tokens", "4096"]) == 0
    out = capsys.readouterr().out
    assert "8 x h100-sxm" in out and "max_num_seqs 48" in out and "max_num_batched_tokens 4096" in out
    assert "blocks of 32 tokens" in out


def test_the_engine_sections_gpu_type_and_nodes_stand_for_the_hardware_flags() -> None:
    engine = EngineConfig(model=AWQ, gpu_type="h100", nnodes=2, master_addr="10.0.0.1")
    deployment = resolve(engine, SimulateConfig(gpus=16))
    assert deployment.plan is not None and deployment.plan.deployment.nodes == 2
    assert deployment.gpu == "h100-sxm" and deployment.pipeline_stages == 2
    with pytest.raises(ConfigError, match="disagree"):
        resolve(engine, SimulateConfig(gpu="h200"))


def test_on_this_cpu_an_mla_model_is_prefilled_whole_as_vllms_cpu_build_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CPU platform turns chunked prefill and prefix caching off for MLA models and budgets max_model_len
    tokens a step (vllm/platforms/cpu.py): the simulated host deployment does the same, whatever was asked."""
    from deepserve.hardware import host

    measured = host.HostMeasurement("box", "Test CPU", 2, 20.0, 60.0, 14.0, "2026-11-23T00:00:00Z")
    monkeypatch.setattr(host, "measured_host", lambda refresh=False: measured)
    engine = EngineConfig(model="deepserve/tiny-deepseek-v3", max_model_len=8192, enable_chunked_prefill=True)
    deployment = resolve(engine, SimulateConfig(gpu="host", gpus=1))
    assert (deployment.chunked_prefill, deployment.prefix_caching) == (False, False)
    assert (deployment.max_num_batched_tokens, deployment.block_size) == (8192, 16)
    on_gpu = resolve(engine.model_copy(update={"model": "deepseek-ai/DeepSeek-V3"}), SimulateConfig(gpu="h200"))
    assert on_gpu.chunked_prefill


def test_on_a_cpu_with_amx_an_mla_model_is_prefilled_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """With AMX tiles vLLM's CPU build picks its AMX MLA backend and keeps chunked prefill, prefix caching and its
    own budget of 2,048 tokens and 128 sequences, in 128-token blocks (vllm/platforms/cpu.py, arg_utils.py, 0.32)."""
    from deepserve.hardware import host

    measured = host.HostMeasurement("box", "Test CPU", 2, 20.0, 60.0, 900.0, "2026-11-29T00:00:00Z", amx=True)
    monkeypatch.setattr(host, "measured_host", lambda refresh=False: measured)
    engine = EngineConfig(model="deepserve/tiny-deepseek-v3", max_model_len=8192)
    deployment = resolve(engine, SimulateConfig(gpu="host", gpus=1))
    assert (deployment.chunked_prefill, deployment.prefix_caching) == (True, True)
    assert (deployment.max_num_batched_tokens, deployment.max_num_seqs, deployment.block_size) == (2048, 128, 128)


def test_v4_flash_is_simulated_with_its_memory_model() -> None:
    """`deepserve simulate --model deepseek-ai/DeepSeek-V4-Flash --gpu b200 --gpus 4`: the pool of vLLM's hybrid
    cache (256-token blocks, each as large as the largest cache group's pages), and per request the blocks of its
    sliding windows and compressor state (plan/memory.py)."""
    engine, sim = EngineConfig(model="deepseek-ai/DeepSeek-V4-Flash"), SimulateConfig(gpu="b200", gpus=4)
    deployment = resolve(engine, sim)
    memory = deployment.plan.deployment.memory if deployment.plan else None
    assert memory is not None and memory.kv_layout is not None
    assert deployment.block_size == 256
    assert deployment.num_blocks == memory.kv_pool_blocks
    assert deployment.state_blocks_per_sequence == 26  # 2 x 3 window, 3 CSA-state and 17 HCA-state blocks
    assert "sliding windows and compressor state" in deployment.describe()
    core = build_core(deployment, sim)
    assert core.scheduler.kv.state_blocks_per_sequence == 26
    result = simulate_closed_loop(engine, sim, 4, 1024, 64, num_requests=8)
    assert result.requests == 8 and result.mean_tpot_ms > 0
