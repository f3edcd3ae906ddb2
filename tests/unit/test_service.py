"""Checks `deepserve serve` makes before anything starts."""

from __future__ import annotations

import importlib.util
import socket
from pathlib import Path

import pytest

from deepserve import service
from deepserve.config import EngineConfig, ServeConfig
from deepserve.errors import ConfigError, EngineError, ModelError
from deepserve.models.presets import TINY_MODEL_NAME
from deepserve.net import ensure_port_free


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service, "has_gpu", lambda: False)


@pytest.fixture
def one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service, "has_gpu", lambda: True)


def test_no_model_and_no_gpu_serves_the_cached_tiny_model(no_gpu: None, isolated_home: Path) -> None:
    plan = service.plan_service(EngineConfig())
    assert plan.device == "cpu"
    assert plan.model.served_name == TINY_MODEL_NAME
    assert Path(plan.model.source).parent == isolated_home / "models"
    assert (Path(plan.model.source) / "config.json").is_file()
    assert "--model " + plan.model.source in service.dry_run_text(plan)


def test_gpu_only_flags_on_cpu_are_refused_with_each_flag_named(no_gpu: None) -> None:
    config = EngineConfig(tensor_parallel_size=8, gpu_memory_utilization=0.9, quantization="fp8")
    with pytest.raises(ConfigError) as caught:
        service.plan_service(config)
    message = str(caught.value)
    assert "--tensor-parallel-size 8" in message
    assert "--gpu-memory-utilization 0.9" in message
    assert "--quantization fp8" in message
    assert "need a GPU" in message


def test_device_cuda_without_gpu_is_refused(no_gpu: None) -> None:
    with pytest.raises(ConfigError, match="no NVIDIA GPU"):
        service.plan_service(EngineConfig(device="cuda"))


def test_gpu_machine_needs_a_named_model(one_gpu: None) -> None:
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
        service.preflight(plan)


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
    importlib.util.find_spec("vllm") is None, reason="preflight checks that vLLM is installed before the ports"
)
def test_public_port_in_use_is_reported_with_the_gateway_in_front(no_gpu: None) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        plan = service.plan_service(EngineConfig(port=port), ServeConfig())
        with pytest.raises(ConfigError, match=f"port {port} .* already in use"):
            service.preflight(plan)
