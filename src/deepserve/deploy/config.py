"""The `deploy` section of the config tree: how `deepserve deploy render` packages a deployment for a target (what
the engine section and the plan do not say: replicas, images, storage, scheduling, autoscaling, Slurm's options).
CLI flags of `deploy render` are derived from these fields."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from deepserve.config import Section, changed_fields
from deepserve.errors import ConfigError

QosClass = Literal["burstable", "guaranteed"]
KUBERNETES_OPTIONS = frozenset(
    {
        "runtime_class",
        "node_selector",
        "storage_class",
        "qos",
        "scheduler_name",
        "kueue_queue",
        "exclusive_topology",
        "max_replicas",
        "capacity_per_replica",
        "monitoring_namespace",
        "prometheus_url",
        "prometheus_release",
    }
)
SLURM_OPTIONS = frozenset({"slurm_partition", "slurm_time", "slurm_account", "container_image", "container_mounts"})
# The targets each target-specific option is for (the others apply to every target).
OPTION_TARGETS = {
    **dict.fromkeys(KUBERNETES_OPTIONS, ("kubernetes",)),
    **dict.fromkeys(SLURM_OPTIONS, ("slurm",)),
    "engine_api_key": ("kubernetes", "compose"),
}
DNS_LABEL = r"[a-z0-9]([-a-z0-9]{0,40}[a-z0-9])?"


class DeployConfig(Section):
    """How the rendered files package the deployment (section `deploy` of the config file)."""

    replicas: int = Field(1, ge=1, description="engine replicas behind the gateway (with --prefill-replicas: decode)")
    name: str = Field("deepserve", description="name of the deployment's objects (a DNS label, at most 42)")
    engine_image: str | None = Field(None, description="engine container image (default: the engine's official one)")
    gateway_image: str | None = Field(
        None, description="gateway container image (default: deepserve:VERSION, built from the repository)"
    )
    # ---- prefill/decode disaggregation ----
    prefill_replicas: int = Field(
        0,
        ge=0,
        description="prefill engines in a pool of their own (0: no disaggregation); --replicas is then the decode "
        "pool, joined by --kv-connector (default NixlConnector)",
    )
    # ---- Kubernetes: pods ----
    runtime_class: str | None = Field(None, description="kubernetes: the engine pods' runtimeClassName (e.g. nvidia)")
    node_selector: list[str] = Field(
        default_factory=list, description="kubernetes: KEY=VALUE label the engine's nodes carry; repeat for several"
    )
    storage_class: str | None = Field(
        None, description="kubernetes: storageClassName of the volumes (default: the cluster's default class)"
    )
    qos: QosClass = Field(
        "burstable",
        description="kubernetes: burstable (CPU unlimited above its request: no throttled scheduler loop) or "
        "guaranteed (CPU limit = request)",
    )
    engine_api_key: bool = Field(
        False,
        description="engines require an API key from the Secret NAME-engine-api-key, which the gateway sends",
    )
    # ---- Kubernetes: scheduling ----
    scheduler_name: str | None = Field(
        None, description="kubernetes: schedulerName of the engine pods (e.g. volcano for gang scheduling)"
    )
    kueue_queue: str | None = Field(
        None, description="kubernetes: Kueue LocalQueue for the engines (label kueue.x-k8s.io/queue-name)"
    )
    exclusive_topology: str | None = Field(
        None,
        description="kubernetes: node label whose domains each LeaderWorkerSet group takes alone (e.g. a rack or "
        "NVLink-domain label)",
    )
    # ---- Kubernetes: autoscaling and monitoring ----
    max_replicas: int | None = Field(
        None,
        ge=1,
        description="kubernetes: KEDA scales the (decode) engine replicas up to this on the engines' own load "
        "(default: no engine autoscaling)",
    )
    capacity_per_replica: int | None = Field(
        None,
        ge=1,
        description="kubernetes: requests one replica serves at its target latency, KEDA's scaling target "
        "(default: the plan's)",
    )
    monitoring_namespace: str = Field(
        "monitoring", description="kubernetes: namespace of Prometheus (scrapes engines; KEDA queries it)"
    )
    prometheus_url: str | None = Field(
        None,
        description="kubernetes: Prometheus for KEDA's queries (default: the Prometheus Operator's "
        "prometheus-operated Service in --monitoring-namespace)",
    )
    prometheus_release: str | None = Field(
        "kube-prometheus-stack",
        description="kubernetes: `release` label kube-prometheus-stack's Prometheus selects monitors and rules by "
        "(its Helm release name)",
    )
    # ---- Slurm ----
    slurm_partition: str | None = Field(None, description="slurm: #SBATCH --partition")
    slurm_time: str | None = Field(None, description="slurm: #SBATCH --time, e.g. 7-00:00:00")
    slurm_account: str | None = Field(None, description="slurm: #SBATCH --account")
    container_image: str | None = Field(
        None,
        description="slurm: run each node in this image through pyxis/enroot (srun --container-image); it must hold "
        "deepserve and the engine",
    )
    container_mounts: list[str] = Field(
        default_factory=list, description="slurm: SRC:DST[:FLAGS] for srun --container-mounts; repeat for several"
    )

    @field_validator("name")
    @classmethod
    def _dns_label(cls, value: str) -> str:
        if not re.fullmatch(DNS_LABEL, value):
            raise ValueError(f"{value!r} must be a DNS label: lower-case letters, digits and '-', at most 42")
        return value

    @field_validator("node_selector")
    @classmethod
    def _key_values(cls, value: list[str]) -> list[str]:
        for pair in value:
            key, sep, _ = pair.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"node selector {pair!r} must look like KEY=VALUE, e.g. nvidia.com/gpu.product=H100")
        return value

    @model_validator(mode="after")
    def _autoscaling(self) -> DeployConfig:
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ValueError(
                f"--max-replicas {self.max_replicas} is below --replicas {self.replicas}: KEDA scales between them; "
                f"give --max-replicas {self.replicas} or more"
            )
        return self

    @property
    def disaggregated(self) -> bool:
        return self.prefill_replicas > 0

    @property
    def autoscaled(self) -> bool:
        return self.max_replicas is not None and self.max_replicas > self.replicas


def check_target_options(deploy: DeployConfig, target: str) -> None:
    """Refuse options given for another target, which this one would silently ignore."""
    ignored = [
        "--" + name.replace("_", "-") + f" ({' or '.join(OPTION_TARGETS[name])})"
        for name in changed_fields(deploy)
        if name in OPTION_TARGETS and target not in OPTION_TARGETS[name]
    ]
    if ignored:
        raise ConfigError(f"--target {target} has no use for {', '.join(ignored)}: drop them or render that target")
