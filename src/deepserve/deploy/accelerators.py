"""What an engine container needs from its host to reach the GPUs, per vendor: the renderers (kubernetes.py,
compose.py) ask here at the point where they give a container its GPUs, and nothing else in them knows a vendor.

NVIDIA: the device plugin's `nvidia.com/gpu` resource on Kubernetes; compose reserves GPUs through the NVIDIA
container toolkit (`deploy.resources.reservations.devices`, driver nvidia).

AMD (ROCm): Kubernetes' AMD device plugin advertises `amd.com/gpu` and mounts /dev/kfd and /dev/dri into the pods
that ask for it, so pods list no devices (ROCm/k8s-device-plugin @ ed764684, docs/user-guide/configuration.md and
k8s-ds-amdgpu-dp-health.yaml); its vLLM example runs the container with SYS_PTRACE, group 44 (video) and an
unconfined seccomp profile (example/vllm-serve/deployment.yaml, example/pod/pytorch-non-privileged.yaml). Docker
runs vLLM's ROCm image with `--device /dev/kfd --device /dev/dri --group-add video --cap-add SYS_PTRACE
--security-opt seccomp=unconfined --ipc=host` (vllm docs/getting_started/installation/gpu.rocm.inc.md @ 06d0369d).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepserve.deploy.source import DeploySpec
from deepserve.engines.platform import ROCM, gpu_platform

VIDEO_GID = 44  # the video group on Debian/Ubuntu hosts and images (the AMD device plugin's example's runAsGroup)


@dataclass(frozen=True)
class GpuAccess:
    """One vendor's settings for an engine container."""

    vendor: str
    resource: str  # the device plugin's extended resource (Kubernetes)
    taint_key: str  # GPU node pools are tainted so that only pods asking for GPUs land there
    k8s_security: dict[str, Any] = field(default_factory=dict)  # the container's securityContext
    compose_devices: tuple[str, ...] = ()  # device nodes passed through (compose)
    compose_groups: tuple[str, ...] = ()
    compose_caps: tuple[str, ...] = ()
    compose_security_opt: tuple[str, ...] = ()
    visible_devices_variable: str = "CUDA_VISIBLE_DEVICES"  # which GPUs a process may use

    def k8s_resources(self, count: int) -> dict[str, Any]:
        return {"limits": {self.resource: str(count)}, "requests": {self.resource: str(count)}}

    def k8s_toleration(self) -> dict[str, str]:
        return {"key": self.taint_key, "operator": "Exists", "effect": "NoSchedule"}

    def compose_settings(self, count: int, device_ids: list[str] | None) -> dict[str, Any]:
        """The engine service's keys that give it COUNT GPUs (DEVICE_IDS: which ones, for replicas on one host)."""
        if self.vendor == "nvidia":
            gpus: dict[str, Any] = {"driver": "nvidia", "capabilities": ["gpu"]}
            gpus.update({"device_ids": device_ids} if device_ids else {"count": count})
            return {"deploy": {"resources": {"reservations": {"devices": [gpus]}}}}
        settings: dict[str, Any] = {
            "devices": list(self.compose_devices),
            "group_add": list(self.compose_groups),
            "cap_add": list(self.compose_caps),
            "security_opt": list(self.compose_security_opt),
        }
        if device_ids:  # /dev/dri holds every GPU of the host: each replica's engine sees only its own
            settings["environment"] = {self.visible_devices_variable: ",".join(device_ids)}
        return settings


NVIDIA_ACCESS = GpuAccess(vendor="nvidia", resource="nvidia.com/gpu", taint_key="nvidia.com/gpu")
AMD_ACCESS = GpuAccess(
    vendor="amd",
    resource="amd.com/gpu",
    taint_key="amd.com/gpu",
    k8s_security={
        "runAsGroup": VIDEO_GID,
        "capabilities": {"add": ["SYS_PTRACE"]},
        "seccompProfile": {"type": "Unconfined"},
    },
    compose_devices=("/dev/kfd", "/dev/dri"),
    compose_groups=("video",),
    compose_caps=("SYS_PTRACE",),
    compose_security_opt=("seccomp=unconfined",),
    visible_devices_variable="HIP_VISIBLE_DEVICES",
)


def gpu_access(spec: DeploySpec) -> GpuAccess:
    """The settings for the deployment's GPUs: AMD's for --device rocm or an AMD --gpu-type, else NVIDIA's."""
    return AMD_ACCESS if gpu_platform(spec.config) == ROCM else NVIDIA_ACCESS
