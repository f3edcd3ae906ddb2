"""Rendered deployments for AMD Instinct nodes (the AMD device plugin's resource, the devices and groups ROCm's
containers need, vLLM's ROCm image and environment) and for TensorRT-LLM (its options file written by the
container's command before trtllm-serve starts)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from deepserve.deploy import compose, kubernetes
from deepserve.deploy.accelerators import AMD_ACCESS, NVIDIA_ACCESS, gpu_access
from deepserve.deploy.config import DeployConfig
from deepserve.deploy.source import DeploySpec, deploy_spec
from deepserve.engines.config import EngineConfig
from deepserve.errors import ConfigError
from deepserve.gateway.config import GatewayConfig

MODEL = "deepseek-ai/DeepSeek-R1"


def spec_for(**fields: Any) -> DeploySpec:
    replicas = fields.pop("replicas", 1)
    config = EngineConfig.model_validate({"model": MODEL, "tensor_parallel_size": 8, **fields})
    return deploy_spec(
        config, GatewayConfig(), command="deepserve deploy render --test", deploy=DeployConfig(replicas=replicas)
    )


def engine_pod(spec: DeploySpec) -> dict[str, Any]:
    engine = next(obj for obj in kubernetes.render(spec)["engine.yaml"] if obj["kind"] in ("Deployment",))
    pod: dict[str, Any] = engine["spec"]["template"]["spec"]
    return pod


def test_the_platform_picks_the_vendor_settings() -> None:
    assert gpu_access(spec_for(gpu_type="mi300x")) is AMD_ACCESS
    assert gpu_access(spec_for(device="rocm")) is AMD_ACCESS
    assert gpu_access(spec_for(gpu_type="h200")) is NVIDIA_ACCESS
    assert gpu_access(spec_for()) is NVIDIA_ACCESS


def gpu_resources(container: dict[str, Any]) -> dict[str, dict[str, str]]:
    """The container's GPU requests and limits (CPU, memory and RDMA resources left out)."""
    return {
        kind: {name: count for name, count in amounts.items() if name.endswith("/gpu")}
        for kind, amounts in container["resources"].items()
    }


def test_amd_pods_ask_the_amd_device_plugin_and_run_vllms_rocm_image(validate: Any) -> None:
    spec = spec_for(gpu_type="mi300x")
    for obj in (o for documents in kubernetes.render(spec).values() for o in documents):
        validate(obj)
    pod = engine_pod(spec)
    (container,) = pod["containers"]
    assert container["image"] == "vllm/vllm-openai-rocm:v0.32.0"
    assert gpu_resources(container) == {"limits": {"amd.com/gpu": "8"}, "requests": {"amd.com/gpu": "8"}}
    assert "nvidia.com/gpu" not in yaml.safe_dump(pod)
    assert pod["tolerations"] == [{"key": "amd.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert container["securityContext"]["seccompProfile"] == {"type": "Unconfined"}
    assert container["securityContext"]["capabilities"] == {"add": ["SYS_PTRACE"]}
    assert {"name": "VLLM_ROCM_USE_AITER", "value": "1"} in container["env"]
    assert "volumeDevices" not in container  # the device plugin mounts /dev/kfd and /dev/dri itself


def test_amd_two_node_group_is_valid_too(validate: Any) -> None:
    spec = spec_for(gpu_type="mi300x", pipeline_parallel_size=2, nnodes=2, master_addr="__DEEPSERVE_MASTER_ADDR__")
    lws = next(obj for obj in kubernetes.render(spec)["engine.yaml"] if obj["kind"] == "LeaderWorkerSet")
    validate(lws)
    for role in ("leaderTemplate", "workerTemplate"):
        (container,) = lws["spec"]["leaderWorkerTemplate"][role]["spec"]["containers"]
        assert gpu_resources(container)["limits"] == {"amd.com/gpu": "8"}


def test_nvidia_pods_are_as_before() -> None:
    pod = engine_pod(spec_for(gpu_type="h200"))
    (container,) = pod["containers"]
    assert gpu_resources(container)["limits"] == {"nvidia.com/gpu": "8"}
    assert "securityContext" not in container and container["image"] == "vllm/vllm-openai:v0.32.0"


def test_amd_compose_passes_the_devices_and_groups() -> None:
    engine = compose.single_host(spec_for(gpu_type="mi300x"))["services"]["engine"]
    assert engine["image"] == "vllm/vllm-openai-rocm:v0.32.0"
    assert engine["devices"] == ["/dev/kfd", "/dev/dri"]
    assert engine["group_add"] == ["video"] and engine["cap_add"] == ["SYS_PTRACE"]
    assert engine["security_opt"] == ["seccomp=unconfined"] and engine["ipc"] == "host"
    assert "deploy" not in engine  # no NVIDIA container toolkit reservation
    assert engine["environment"]["VLLM_ROCM_USE_AITER"] == "1"


def test_amd_replicas_on_one_host_each_see_their_own_gpus() -> None:
    services = compose.single_host(spec_for(gpu_type="mi300x", tensor_parallel_size=4, replicas=2))["services"]
    assert services["engine"]["environment"]["HIP_VISIBLE_DEVICES"] == "0,1,2,3"
    assert services["engine-1"]["environment"]["HIP_VISIBLE_DEVICES"] == "4,5,6,7"


def test_sglang_on_amd_gets_its_rocm_image() -> None:
    pod = engine_pod(spec_for(engine="sglang", gpu_type="mi300x"))
    (container,) = pod["containers"]
    assert "rocm" in container["image"] and {"name": "SGLANG_USE_AITER", "value": "1"} in container["env"]


# ---- TensorRT-LLM ---------------------------------------------------------------------------------------------------


def test_trtllm_pod_writes_its_options_file_then_runs_trtllm_serve(recorder: Any, tmp_path: Path) -> None:
    spec = spec_for(
        engine="trtllm", gpu_type="h200", data_parallel_size=8, tensor_parallel_size=1, enable_expert_parallel=True
    )
    (container,) = engine_pod(spec)["containers"]
    assert container["image"].startswith("nvcr.io/nvidia/tensorrt-llm/release:")
    command = container["command"]
    assert command[:2] == ["/bin/sh", "-c"]
    launch = spec.launch(0)
    (path,) = launch.files
    script = command[2].replace(path, str(tmp_path / "options.yaml")).replace(str(Path(path).parent), str(tmp_path))
    recorded = recorder.programs("trtllm-serve").run(["/bin/sh", "-c", script])
    assert recorded[0]["program"] == "trtllm-serve"
    expected = [word.replace(path, str(tmp_path / "options.yaml")) for word in launch.argv[1:]]
    assert recorded[0]["argv"] == expected
    assert yaml.safe_load((tmp_path / "options.yaml").read_text()) == yaml.safe_load(launch.files[path])
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"


def test_trtllm_compose_entrypoint_is_the_same_script() -> None:
    spec = spec_for(engine="trtllm", gpu_type="h200")
    engine = compose.single_host(spec)["services"]["engine"]
    assert engine["entrypoint"][:2] == ["/bin/sh", "-c"]
    assert engine["entrypoint"][2] == spec.launch(0).shell_script()
    assert engine["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"engine": "trtllm", "gpu_type": "mi300x"}, "no ROCm build"),
        (
            {"engine": "trtllm", "pipeline_parallel_size": 2, "nnodes": 2, "master_addr": "__DEEPSERVE_MASTER_ADDR__"},
            "MPI",
        ),
    ],
)
def test_what_trtllm_cannot_run_is_refused_before_anything_is_written(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        spec_for(**fields)
