"""Kubernetes manifests: the engine (a Deployment when a replica fits on one node, else a LeaderWorkerSet with one
group per replica), the gateway (Deployment, Service, HorizontalPodAutoscaler), and monitoring (PodMonitor,
PrometheusRule, a Grafana dashboard ConfigMap).

In a LeaderWorkerSet group, pod 0 (the leader) runs node rank 0 and serves the API; pods 1..N-1 run their rank
headless. LWS gives every pod LWS_LEADER_ADDRESS (the leader's DNS name) and LWS_WORKER_INDEX; the pod's shell
picks its rank's command line from a `case` on the index, each line written by the engine's own launcher."""

from __future__ import annotations

import json
import math
from typing import Any

from deepserve.deploy.accelerators import gpu_access
from deepserve.deploy.monitoring import dashboard, rule_groups
from deepserve.deploy.source import ENGINE_PORT, GATEWAY_PORT, MASTER_PLACEHOLDER, DeploySpec, shell_line
from deepserve.engines.base import LaunchSpec
from deepserve.gateway.config import gateway_argv

LWS_API = "leaderworkerset.x-k8s.io/v1"
MONITORING_API = "monitoring.coreos.com/v1"
MODEL_CACHE_PATH = "/root/.cache/huggingface"  # where vLLM's and SGLang's images look for the Hugging Face cache
GATEWAY_HOME = "/var/lib/deepserve"
PROBE_PERIOD_S = 10
SHM_SIZE = "16Gi"  # NCCL and vLLM's worker processes share tensors through /dev/shm; a container's default is 64 MiB
DEFAULT_CACHE_SIZE_GIB = 1024  # when the model's size is not known offline
CACHE_HEADROOM = 1.2  # room for a second revision while the first is in use
GATEWAY_MIN_REPLICAS = 2
GATEWAY_MAX_REPLICAS = 8
FILES = ("engine.yaml", "gateway.yaml", "monitoring.yaml")


def names(spec: DeploySpec) -> dict[str, str]:
    n = spec.name
    return {
        "engine": f"{n}-engine",
        "gateway": f"{n}-gateway",
        "cache": f"{n}-model-cache",
        "hf_token": f"{n}-hf-token",
        "keys": f"{n}-gateway-keys",
        "dashboard": f"{n}-dashboard",
    }


def instance_labels(spec: DeploySpec) -> dict[str, str]:
    """What every object of this deployment carries (and the monitoring objects select by)."""
    return {"app.kubernetes.io/name": "deepserve", "app.kubernetes.io/instance": spec.name}


def labels(spec: DeploySpec, component: str) -> dict[str, str]:
    return {**instance_labels(spec), "app.kubernetes.io/component": component}


def render(spec: DeploySpec) -> dict[str, list[dict[str, Any]]]:
    """File name → the objects it holds, in the order kubectl should apply them."""
    engine = leader_worker_set(spec) if spec.nodes > 1 else engine_deployment(spec)
    return {
        "engine.yaml": [model_cache_claim(spec), engine, engine_service(spec)],
        "gateway.yaml": [gateway_deployment(spec), gateway_service(spec), gateway_autoscaler(spec)],
        "monitoring.yaml": [pod_monitor(spec), prometheus_rule(spec), dashboard_config_map(spec)],
    }


# ---- the engine -------------------------------------------------------------------------------------------------


def model_cache_claim(spec: DeploySpec) -> dict[str, Any]:
    size_gib = DEFAULT_CACHE_SIZE_GIB
    if spec.checkpoint_bytes:
        size_gib = math.ceil(spec.checkpoint_bytes * CACHE_HEADROOM / 2**30)
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": names(spec)["cache"], "labels": labels(spec, "engine")},
        "spec": {
            # Every pod of every replica reads the same weights: a shared (NFS, Lustre, Filestore…) volume.
            "accessModes": ["ReadWriteMany"],
            "resources": {"requests": {"storage": f"{size_gib}Gi"}},
        },
    }


def engine_deployment(spec: DeploySpec) -> dict[str, Any]:
    launch = spec.launch(0)
    pod = _engine_pod(spec, launch, command=_k8s_words(_container_command(launch)), serves_api=True)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": names(spec)["engine"], "labels": labels(spec, "engine")},
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": labels(spec, "engine")},
            # A new pod needs the old one's GPUs: stop it first rather than wait forever for free GPUs.
            "strategy": {"type": "Recreate"},
            "template": {"metadata": {"labels": labels(spec, "engine")}, "spec": pod},
        },
    }


def leader_worker_set(spec: DeploySpec) -> dict[str, Any]:
    leader = _engine_pod(spec, spec.launch(0), command=rank_script(spec, range(1)), serves_api=True)
    workers = _engine_pod(spec, spec.launch(1), command=rank_script(spec, range(1, spec.nodes)), serves_api=False)
    return {
        "apiVersion": LWS_API,
        "kind": "LeaderWorkerSet",
        "metadata": {"name": names(spec)["engine"], "labels": labels(spec, "engine")},
        "spec": {
            "replicas": spec.replicas,
            # Workers start with the leader: it waits for them in the engine's rendezvous, never ready alone.
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": spec.nodes,
                # One lost node breaks the whole replica's collective: restart the group together.
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": {
                    "metadata": {"labels": {**labels(spec, "engine"), "role": "leader"}},
                    "spec": leader,
                },
                "workerTemplate": {
                    "metadata": {"labels": {**labels(spec, "engine"), "role": "worker"}},
                    "spec": workers,
                },
            },
        },
    }


def rank_script(spec: DeploySpec, ranks: range) -> list[str]:
    """`sh -c` choosing this pod's node-rank command by LWS_WORKER_INDEX; every line is the engine launcher's,
    with node 0's address taken from LWS_LEADER_ADDRESS."""
    variables = {MASTER_PLACEHOLDER: "LWS_LEADER_ADDRESS"}
    lines = ['case "${LWS_WORKER_INDEX}" in']
    for rank in ranks:
        launch = spec.launch(rank)
        lines.append(f"  {rank}) exec {shell_line(launch.argv, variables)} ;;")
    lines.append('  *) echo "no command for node rank ${LWS_WORKER_INDEX}" >&2; exit 1 ;;')
    lines.append("esac")
    # kubelet expands $(VAR) in commands before the shell runs; $$ keeps a literal $( for the shell.
    return ["/bin/sh", "-c", "\n".join(lines).replace("$(", "$$(")]


def _container_command(launch: LaunchSpec) -> list[str]:
    """The launcher's argv; a command that reads files of its own (TensorRT-LLM's options) writes them first."""
    return ["/bin/sh", "-c", launch.shell_script()] if launch.files else launch.argv


def _k8s_words(argv: list[str]) -> list[str]:
    return [word.replace("$(", "$$(") for word in argv]


def _engine_pod(spec: DeploySpec, launch: LaunchSpec, command: list[str], serves_api: bool) -> dict[str, Any]:
    n = names(spec)
    env: list[dict[str, Any]] = [
        {
            "name": "HF_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": n["hf_token"], "key": "HF_TOKEN", "optional": True}},
        },
        {"name": "VLLM_HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    if spec.nodes > 1:  # a pod has lo and eth0; pin the collectives' sockets to the pod network
        env += [{"name": "NCCL_SOCKET_IFNAME", "value": "eth0"}, {"name": "GLOO_SOCKET_IFNAME", "value": "eth0"}]
    env += [{"name": key, "value": value} for key, value in sorted(launch.env.items())]
    access = gpu_access(spec)
    container: dict[str, Any] = {
        "name": "engine",
        "image": spec.engine_image,
        "command": command,
        "env": env,
        "resources": access.k8s_resources(spec.gpus_per_node),
        "volumeMounts": [
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "model-cache", "mountPath": MODEL_CACHE_PATH},
        ],
    }
    if access.k8s_security:
        container["securityContext"] = access.k8s_security
    if serves_api:
        container["ports"] = [{"name": "http", "containerPort": ENGINE_PORT}]
        container.update(_probes(launch.ready_path, spec.config.startup_timeout_s))
    pod: dict[str, Any] = {
        "terminationGracePeriodSeconds": 60,
        # GPU node pools are usually tainted so that only pods asking for GPUs land there.
        "tolerations": [access.k8s_toleration()],
        "containers": [container],
        "volumes": [
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}},
            {"name": "model-cache", "persistentVolumeClaim": {"claimName": n["cache"]}},
        ],
    }
    if spec.runtime_class:
        pod["runtimeClassName"] = spec.runtime_class
    if spec.node_selector:
        pod["nodeSelector"] = spec.node_selector
    return pod


def _probes(path: str, startup_timeout_s: float) -> dict[str, Any]:
    """A start that downloads and loads hundreds of GB takes tens of minutes: the startup probe allows the engine's
    whole --startup-timeout-s before liveness takes over."""
    check = {"httpGet": {"path": path, "port": "http"}, "periodSeconds": PROBE_PERIOD_S, "timeoutSeconds": 5}
    return {
        "startupProbe": {**check, "failureThreshold": math.ceil(startup_timeout_s / PROBE_PERIOD_S)},
        "readinessProbe": {**check, "failureThreshold": 3},
        "livenessProbe": {**check, "failureThreshold": 6},
    }


def engine_service(spec: DeploySpec) -> dict[str, Any]:
    selector = labels(spec, "engine")
    if spec.nodes > 1:  # only leaders serve the API
        selector = {**selector, "role": "leader"}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": names(spec)["engine"] + "-api", "labels": labels(spec, "engine")},
        "spec": {"selector": selector, "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": "http"}]},
    }


def engine_urls(spec: DeploySpec) -> list[str]:
    """What the gateway balances over: each LWS group's leader by its stable DNS name (`<lws>-<group>.<lws>`, LWS's
    own headless Service), so the gateway sees every replica; a Deployment's replicas behind its Service."""
    engine = names(spec)["engine"]
    if spec.nodes > 1:
        return [f"http://{engine}-{group}.{engine}:{ENGINE_PORT}/v1" for group in range(spec.replicas)]
    return [f"http://{engine}-api:{ENGINE_PORT}/v1"]


# ---- the gateway ------------------------------------------------------------------------------------------------


def gateway_deployment(spec: DeploySpec) -> dict[str, Any]:
    n = names(spec)
    front = spec.gateway.model_copy(update={"upstream": engine_urls(spec), "host": "0.0.0.0", "port": GATEWAY_PORT})
    copy_keys = (
        f"mkdir -p -m 700 {GATEWAY_HOME}/gateway && if [ -f /keys/keys.sqlite ]; then "
        f"install -m 600 /keys/keys.sqlite {GATEWAY_HOME}/gateway/keys.sqlite; fi"
    )
    state = {"name": "state", "mountPath": GATEWAY_HOME}
    check = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": PROBE_PERIOD_S, "timeoutSeconds": 3}
    pod = {
        # The keys database is SQLite in WAL mode, which needs a writable directory: copy it out of the Secret.
        "initContainers": [
            {
                "name": "keys",
                "image": spec.gateway_image,
                "command": ["/bin/sh", "-c", copy_keys],
                "volumeMounts": [state, {"name": "keys", "mountPath": "/keys", "readOnly": True}],
            }
        ],
        "containers": [
            {
                "name": "gateway",
                "image": spec.gateway_image,
                "command": _k8s_words(gateway_argv(front, "python")),
                "env": [{"name": "DEEPSERVE_HOME", "value": GATEWAY_HOME}],
                "ports": [{"name": "http", "containerPort": GATEWAY_PORT}],
                "readinessProbe": {**check, "failureThreshold": 3},
                "livenessProbe": {**check, "failureThreshold": 6},
                "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
                "volumeMounts": [state],
            }
        ],
        "volumes": [
            {"name": "state", "emptyDir": {}},
            {"name": "keys", "secret": {"secretName": n["keys"], "optional": True}},
        ],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": n["gateway"], "labels": labels(spec, "gateway")},
        "spec": {
            "replicas": GATEWAY_MIN_REPLICAS,
            "selector": {"matchLabels": labels(spec, "gateway")},
            "template": {"metadata": {"labels": labels(spec, "gateway")}, "spec": pod},
        },
    }


def gateway_service(spec: DeploySpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": names(spec)["gateway"], "labels": labels(spec, "gateway")},
        "spec": {
            "selector": labels(spec, "gateway"),
            "ports": [{"name": "http", "port": GATEWAY_PORT, "targetPort": "http"}],
        },
    }


def gateway_autoscaler(spec: DeploySpec) -> dict[str, Any]:
    name = names(spec)["gateway"]
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": name, "labels": labels(spec, "gateway")},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicas": GATEWAY_MIN_REPLICAS,
            "maxReplicas": GATEWAY_MAX_REPLICAS,
            "metrics": [
                {
                    "type": "Resource",
                    "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}},
                }
            ],
        },
    }


# ---- monitoring -------------------------------------------------------------------------------------------------


def pod_monitor(spec: DeploySpec) -> dict[str, Any]:
    """Scrapes every pod with an `http` port (engine leaders and gateways; headless workers have none), labelling
    each series with its component as the alerts and the dashboard expect."""
    component = {
        "sourceLabels": ["__meta_kubernetes_pod_label_app_kubernetes_io_component"],
        "targetLabel": "component",
        "action": "replace",
    }
    instance = instance_labels(spec)
    return {
        "apiVersion": MONITORING_API,
        "kind": "PodMonitor",
        "metadata": {"name": spec.name, "labels": instance},
        "spec": {
            "selector": {"matchLabels": instance},
            "podMetricsEndpoints": [
                {"port": "http", "path": "/metrics", "interval": "15s", "relabelings": [component]}
            ],
        },
    }


def prometheus_rule(spec: DeploySpec) -> dict[str, Any]:
    return {
        "apiVersion": MONITORING_API,
        "kind": "PrometheusRule",
        "metadata": {"name": spec.name, "labels": instance_labels(spec)},
        "spec": rule_groups(spec.gateway),
    }


def dashboard_config_map(spec: DeploySpec) -> dict[str, Any]:
    """Picked up by Grafana's dashboard sidecar (kube-prometheus-stack looks for the grafana_dashboard label)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": names(spec)["dashboard"],
            "labels": {**instance_labels(spec), "grafana_dashboard": "1"},
        },
        "data": {"deepserve.json": json.dumps(dashboard(f"deepserve: {spec.name}"), indent=2)},
    }
