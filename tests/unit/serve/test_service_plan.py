"""Checks `deepserve serve` makes before anything starts."""

from __future__ import annotations

import importlib.util
import socket
from pathlib import Path

import pytest

from deepserve.engines.config import EngineConfig
from deepserve.errors import ConfigError, EngineError, ModelError
from deepserve.hardware.detect import LocalGpu
from deepserve.models.presets import TINY_MODEL_NAME
from deepserve.net import ensure_port_free
from deepserve.serve import service_plan as service
from deepserve.serve.config import ServeConfig


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service, "has_gpu", lambda: False)


@pytest.fixture
def eight_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service, "has_gpu", lambda: True)
    monkeypatch.setattr(
        service, "local_gpus", lambda: tuple(LocalGpu(i, "NVIDIA H100 80GB HBM3", 81559) for i in range(8))
    )


def test_no_model_and_no_gpu_serves_the_cached_tiny_model(no_gpu: None, isolated_home: Path) -> None:
    plan = service.plan_service(EngineConfig())
    assert plan.device == "cpu"
    assert plan.model.served_name == TINY_MODEL_NAME
    assert Path(plan.model.source).parent == isolated_home / "models"
    assert (Path(plan.model.source) / "config.json").is_file()
    assert "serve " + plan.model.source in service.dry_run_text(plan)


def test_gpu_only_flags_on_cpu_are_refused_with_each_flag_named(no_gpu: None) -> None:
    config = EngineConfig(data_parallel_size=2, gpu_memory_utilization=0.9, quantization="fp8")
    with pytest.raises(ConfigError) as caught:
        service.plan_service(config)
    message = str(caught.value)
    assert "--data-parallel-size 2" in message
    assert "--gpu-memory-utilization 0.9" in message
    assert "--quantization fp8" in message
    assert "need a GPU" in message


def test_device_cuda_without_gpu_is_refused(no_gpu: None) -> None:
    with pytest.raises(ConfigError, match="no NVIDIA GPU"):
        service.plan_service(EngineConfig(device="cuda"))


def test_gpu_machine_needs_a_named_model(eight_gpus: None) -> None:
    with pytest.raises(ModelError, match="--model deepseek-ai/DeepSeek-V3-0324"):
        service.plan_service(EngineConfig())
    plan = service.plan_service(EngineConfig(model="deepseek-ai/deepseek-v3-0324", tensor_parallel_size=8))
    assert plan.model.source == "deepseek-ai/DeepSeek-V3-0324"  # canonical preset name, passed to the engine
    assert plan.device == "cuda"


def test_model_path_without_config_json(no_gpu: None, tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="has no config.json"):
        service.plan_service(EngineConfig(model=str(tmp_path)))


def test_served_model_name_overrides(no_gpu: None) -> None:
    plan = service.plan_service(EngineConfig(served_model_name="deepseek-chat"))
    assert plan.launch.served_model_name == "deepseek-chat"
    assert "--served-model-name deepseek-chat" in plan.launch.shell_line()


def test_port_in_use_is_reported_before_start() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(ConfigError, match=f"port {port} on 127.0.0.1 is already in use.*--port"):
            ensure_port_free("127.0.0.1", port)


def test_engine_not_installed_says_how_to_install(no_gpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = service.plan_service(EngineConfig(engine="sglang"))
    monkeypatch.setattr(service.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(EngineError, match='sglang is not installed.*pip install "sglang\\[all\\]"'):
        service.check_can_run(plan)


def test_gateway_takes_the_public_address_and_the_engine_moves_behind_it(no_gpu: None) -> None:
    plan = service.plan_service(EngineConfig(host="0.0.0.0", port=9000), ServeConfig(engine_port=9001))
    assert plan.gateway is not None
    assert plan.public.base_url == "http://127.0.0.1:9000/v1"
    assert (plan.config.host, plan.config.port) == ("127.0.0.1", 9001)
    gateway_argv = plan.gateway.argv
    assert gateway_argv[gateway_argv.index("--upstream") + 1] == "http://127.0.0.1:9001/v1"
    assert gateway_argv[gateway_argv.index("--host") + 1] == "0.0.0.0"
    assert plan.public.served_model_name == plan.launch.served_model_name


def test_no_gateway_serves_the_engine_on_the_public_address(no_gpu: None) -> None:
    plan = service.plan_service(EngineConfig(port=9000), ServeConfig(gateway=False))
    assert plan.gateway is None
    assert plan.public.base_url == "http://127.0.0.1:9000/v1"


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="check_can_run checks that vLLM is installed before the ports"
)
def test_public_port_in_use_is_reported_with_the_gateway_in_front(no_gpu: None) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        plan = service.plan_service(EngineConfig(port=port), ServeConfig())
        with pytest.raises(ConfigError, match=f"port {port} .* already in use"):
            service.check_can_run(plan)


def test_a_model_too_big_for_this_machines_ram_is_refused_unless_forced(
    no_gpu: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(service.psutil, "virtual_memory", lambda: type("Mem", (), {"available": 24 * 10**9})())
    plan = service.plan_service(EngineConfig(model="deepseek-ai/DeepSeek-V3"), ServeConfig(gateway=False))
    with pytest.raises(
        ConfigError, match="memory plan says this cannot run.*673.2 GB of weights.*24.0 GB is available"
    ):
        service.check_can_run(plan)
    assert "# memory plan: does not fit" in service.dry_run_text(plan)
    forced = service.plan_service(EngineConfig(model="deepseek-ai/DeepSeek-V3"), ServeConfig(gateway=False, force=True))
    monkeypatch.setattr(service.importlib.util, "find_spec", lambda name: None)  # past the fit check, to the next
    with pytest.raises(EngineError, match="not installed"):
        service.check_can_run(forced)


def test_gpu_fit_uses_the_gpus_found_and_names_the_layout_that_would_fit(eight_gpus: None) -> None:
    plan = service.plan_service(EngineConfig(model="deepseek-ai/DeepSeek-V3", tensor_parallel_size=8))
    assert plan.fit is not None and plan.fit.fits is False
    assert "16 x h100-sxm (2 node(s))" in plan.fit.suggestion
    with pytest.raises(ConfigError, match="--pipeline-parallel-size 2 --nnodes 2"):
        service.check_can_run(plan)


def test_layout_needing_more_gpus_than_the_node_has_is_refused(eight_gpus: None) -> None:
    with pytest.raises(ConfigError, match="needs 16 GPUs per node over 1 node"):
        service.plan_service(EngineConfig(model="deepseek-ai/DeepSeek-V3", tensor_parallel_size=16))


def test_dry_run_for_another_machine_prints_every_node_as_users_type_it(no_gpu: None) -> None:
    config = EngineConfig(
        model="deepseek-ai/DeepSeek-V3",
        device="cuda",
        gpu_type="h100",
        tensor_parallel_size=8,
        pipeline_parallel_size=2,
        nnodes=2,
        master_addr="10.0.0.1",
        host="0.0.0.0",
    )
    plan = service.plan_service(config, ServeConfig(), on_this_machine=False)
    text = service.dry_run_text(plan, ServeConfig())
    assert plan.role == "head"
    assert "# node 0 of 2 (this node)" in text and "# node 1 of 2:" in text
    assert "#   deepserve serve --model deepseek-ai/DeepSeek-V3" in text and "--node-rank 1" in text
    engine_lines = [line for line in text.splitlines() if line.startswith("vllm serve")]
    assert len(engine_lines) == 2 and "--headless" in engine_lines[1] and "--headless" not in engine_lines[0]
    assert "# memory plan: deepseek-ai/DeepSeek-V3 (fp8) on 16 x h100-sxm, TP=8 PP=2: fits" in text
    assert "deepserve.cli.main gateway" in text  # the gateway runs on node 0 only
    assert text.count("deepserve.cli.main gateway") == 1


def test_worker_node_plans_no_gateway_and_checks_its_rank(no_gpu: None) -> None:
    worker = EngineConfig(pipeline_parallel_size=2, nnodes=2, node_rank=1, master_addr="127.0.0.1")
    plan = service.plan_service(worker, ServeConfig())
    assert plan.role == "worker" and plan.gateway is None and "--headless" in plan.launch.argv


# ---- AMD Instinct GPUs and TensorRT-LLM ----------------------------------------------------------------------------


@pytest.fixture
def eight_mi300x(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service, "has_gpu", lambda: True)
    monkeypatch.setattr(
        service,
        "local_gpus",
        lambda: tuple(LocalGpu(i, "AMD Instinct MI300X", 196592, "amd", "gfx942") for i in range(8)),
    )


def test_an_amd_machine_serves_with_rocm_settings(eight_mi300x: None) -> None:
    plan = service.plan_service(
        EngineConfig(model="deepseek-ai/DeepSeek-R1", tensor_parallel_size=8, max_model_len=32768)
    )
    assert plan.device == "rocm" and plan.config.device == "rocm"
    assert plan.launch.env == {"VLLM_ROCM_USE_AITER": "1"}
    assert plan.fit is not None and plan.fit.fits  # the memory plan on the detected MI300X
    text = service.dry_run_text(plan)
    assert "on rocm" in text and '"VLLM_ROCM_USE_AITER": "1"' in text


def test_a_device_of_the_other_vendor_is_refused(eight_mi300x: None) -> None:
    with pytest.raises(ConfigError, match="--device cuda was given, but this machine's GPUs are AMD Instinct MI300X"):
        service.plan_service(EngineConfig(model="deepseek-ai/DeepSeek-R1", device="cuda", tensor_parallel_size=8))


def test_device_rocm_without_gpu_is_refused(no_gpu: None) -> None:
    with pytest.raises(ConfigError, match="no AMD GPU"):
        service.plan_service(EngineConfig(device="rocm"))


def test_trtllm_on_cpu_stops_at_the_command_line_and_says_how_to_get_it(
    no_gpu: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = service.plan_service(EngineConfig(engine="trtllm"))
    text = service.dry_run_text(plan)
    assert "trtllm-serve" in text and "--extra_llm_api_options" in text
    (path,) = plan.launch.files
    assert f"# file written before the engine starts: {path}" in text and "#   enable_iter_perf_stats: true" in text
    monkeypatch.setattr(service.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(EngineError, match=r"trtllm is not installed .*nvcr.io/nvidia/tensorrt-llm/release"):
        service.check_can_run(plan)


# ---- speculative decoding ------------------------------------------------------------------------------------------


def test_speculation_is_resolved_for_the_model_and_shown_in_the_dry_run(eight_gpus: None) -> None:
    config = EngineConfig(
        model="deepseek-ai/DeepSeek-V3", tensor_parallel_size=8, gpu_type="h200", speculative_method="auto"
    )
    plan = service.plan_service(config)
    assert (plan.config.speculative_method, plan.config.num_speculative_tokens) == ("mtp", 1)
    text = service.dry_run_text(plan)
    assert "# note: speculative decoding: mtp, 1 draft token(s) per step (vLLM's own default" in text
    assert """--speculative-config '{"method":"mtp","num_speculative_tokens":1}'""" in text
    assert plan.fit is not None and plan.fit.fits
    without = service.plan_service(config.model_copy(update={"speculative_method": None}))
    assert "speculative" not in service.dry_run_text(without)
    assert without.fit is not None
    # the MTP layer's weights and cache come out of the KV cache the memory plan reports
    assert _kv_tokens(plan.fit.summary) < _kv_tokens(without.fit.summary)


def _kv_tokens(summary: str) -> int:
    return int(summary.rsplit("KV cache ", 1)[1].split(" tokens")[0].replace(",", ""))


def test_a_model_without_an_mtp_module_is_refused_with_the_alternative(eight_gpus: None) -> None:
    config = EngineConfig(
        model="cognitivecomputations/DeepSeek-V3-AWQ", tensor_parallel_size=8, num_speculative_tokens=2
    )
    with pytest.raises(ConfigError, match="ships no draft module.*ngram"):
        service.plan_service(config)


def test_cpu_mtp_on_the_tiny_model_counts_the_module(no_gpu: None, tmp_path: Path) -> None:
    import json

    from deepserve.models.tiny import tiny_config

    (tmp_path / "config.json").write_text(json.dumps(tiny_config() | {"num_nextn_predict_layers": 1}))
    plan = service.plan_service(EngineConfig(model=str(tmp_path), num_speculative_tokens=2))
    assert plan.config.speculative_method == "mtp"
    assert plan.fit is not None and "with its MTP module" in plan.fit.summary
    assert '"num_speculative_tokens":2' in plan.launch.shell_line()


@pytest.mark.parametrize(("gpu_type", "command"), [("h200", "vllm serve"), ("mi300x", "VLLM_ROCM_USE_AITER=1")])
def test_dry_run_with_a_gpu_type_plans_for_those_gpus_on_a_machine_without_one(
    no_gpu: None, gpu_type: str, command: str
) -> None:
    """`--gpu-type` names the nodes a dry run is for: it must not fall back to this machine's CPU build."""
    config = EngineConfig(model="deepseek-ai/DeepSeek-R1", gpu_type=gpu_type, tensor_parallel_size=8)
    plan = service.plan_service(config, ServeConfig(), on_this_machine=False)
    text = service.dry_run_text(plan, ServeConfig())
    assert "on cpu" not in text and "does not fit" not in text
    assert any(line.startswith(command) for line in text.splitlines())
