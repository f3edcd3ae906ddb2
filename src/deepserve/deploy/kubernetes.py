"""Kubernetes manifests a platform team can apply as they are.

- engine.yaml: the model cache (a ReadWriteMany claim), the Job that downloads the model into it once (engine pods
  wait for its marker file and then load offline), and per pool of engines (one pool; or a prefill and a decode pool
  joined by a KV connector) a workload, a headless Service listing its ready API pods, and a PodDisruptionBudget;
  a NetworkPolicy that lets only the gateway (and Prometheus, and the engines themselves) reach the engines.
- gateway.yaml: the gateway as a StatefulSet (each pod keeps its usage ledger on a volume of its own), its Service,
  a HorizontalPodAutoscaler and a PodDisruptionBudget; Redis (shared limits and revocations) with its policy.
- monitoring.yaml: PodMonitor, PrometheusRule and the Grafana dashboard, labelled for kube-prometheus-stack.
- autoscaling.yaml (with --max-replicas): a KEDA ScaledObject scaling the serving pool on the engines' own load.

A replica that fits on one node is a Deployment; one that spans nodes is a LeaderWorkerSet with a group per
replica. In a group, pod 0 (the leader) runs node rank 0 and serves the API; pods 1..N-1 run their rank headless.
LWS gives every pod LWS_LEADER_ADDRESS and LWS_WORKER_INDEX; the pod's shell picks its rank's command line from a
`case` on the index, each line written by the engine's own launcher."""

from __future__ import annotations

import json
import math
import shlex
from typing import Any

from deepserve.deploy.accelerators import gpu_access
from deepserve.deploy.monitoring import dashboard, rule_groups
from deepserve.deploy.source import (
    ENGINE_PORT,
    GATEWAY_PORT,
    KV_SHARED_PATH,
    MASTER_PLACEHOLDER,
    DeploySpec,
    Pool,
    gateway_command,
    shell_line,
)
from deepserve.engines.base import LaunchSpec
from deepserve.engines.vllm import SYMMETRIC_CONNECTORS
from deepserve.errors import ConfigError
from deepserve.hardware.network import POD_INTERFACE

LWS_API = "leaderworkerset.x-k8s.io/v1"
MONITORING_API = "monitoring.coreos.com/v1"
KEDA_API = "keda.sh/v1alpha1"
MODEL_CACHE_PATH = "/root/.cache/huggingface"  # where vLLM's and SGLang's images look for the Hugging Face cache
COMPILE_CACHE_PATH = "/var/cache/vllm"  # VLLM_CACHE_ROOT: torch.compile and CUDA-graph artefacts, kept on the volume
READY_DIR = f"{MODEL_CACHE_PATH}/deepserve-ready"  # the download Job's marker files
GATEWAY_HOME = "/var/lib/deepserve"
KEYS_DIR = "/etc/deepserve/keys"  # the keys Secret, mounted whole so that the kubelet updates it in place
ENGINE_KEY_DIR = "/etc/deepserve/engine-api-key"
REDIS_IMAGE = "redis:7.4-alpine"
REDIS_PORT = 6379
PROBE_PERIOD_S = 10
GIB = 2**30
SHM_BYTES_PER_GPU = 2 * GIB  # NCCL and vLLM's worker processes share tensors through /dev/shm (16 GiB for 8 GPUs)
# Host memory of an engine pod besides /dev/shm: per GPU worker process its CUDA context, torch, pinned staging
# buffers and the weight shard it reads through the page cache; plus the API server, tokenizer and engine core.
HOST_BYTES_PER_GPU = 8 * GIB
HOST_BYTES_BASE = 16 * GIB
CPUS_PER_GPU = 4  # a worker process per GPU, the engine core's busy loop per DP rank, detokenizing
CPUS_BASE = 4
DEFAULT_CACHE_SIZE_GIB = 1024  # when the model's size is not known offline
CACHE_HEADROOM = 1.2  # room for a second revision while the first is in use
GATEWAY_MIN_REPLICAS = 2
GATEWAY_MAX_REPLICAS = 8
GATEWAY_LEDGER_SIZE = "10Gi"
ROLLOUT_MARGIN_S = 600  # scheduling and the image pull, on top of the engine's start
DOWNLOAD_BYTES_PER_S = 250e6  # a 2 Gb/s pull from the Hugging Face hub: 685 GB in about 46 minutes
KV_CACHE_TARGET = 0.8  # KEDA adds a replica when the replicas' KV caches are this full on average
FILES = ("engine.yaml", "gateway.yaml", "monitoring.yaml")
POOL_LABEL = "deepserve/pool"
NAMESPACE_PLACEHOLDER = "__DEEPSERVE_POD_NAMESPACE__"  # the gateway pod's namespace, from its POD_NAMESPACE


def names(spec: DeploySpec) -> dict[str, str]:
    n = spec.name
    return {
        "engine": f"{n}-engine",
        "gateway": f"{n}-gateway",
        "gateway_pods": f"{n}-gateway-pods",
        "cache": f"{n}-model-cache",
        "download": f"{n}-model-download",
        "hf_token": f"{n}-hf-token",
        "keys": f"{n}-gateway-keys",
        "engine_key": f"{n}-engine-api-key",
        "redis": f"{n}-redis",
        "dashboard": f"{n}-dashboard",
    }


def workload_name(spec: DeploySpec, pool: Pool) -> str:
    return f"{spec.name}-{pool.role}"


def api_service_name(spec: DeploySpec, pool: Pool) -> str:
    return f"{workload_name(spec, pool)}-api"


def instance_labels(spec: DeploySpec) -> dict[str, str]:
    """What every object of this deployment carries (and the monitoring objects select by)."""
    return {"app.kubernetes.io/name": "deepserve", "app.kubernetes.io/instance": spec.name}


def labels(spec: DeploySpec, component: str) -> dict[str, str]:
    return {**instance_labels(spec), "app.kubernetes.io/component": component}


def pool_labels(spec: DeploySpec, pool: Pool) -> dict[str, str]:
    return {**labels(spec, "engine"), POOL_LABEL: pool.role}


def render(spec: DeploySpec) -> dict[str, list[dict[str, Any]]]:
    """File name → the objects it holds, in the order kubectl should apply them."""
    files = {
        "engine.yaml": engine_objects(spec),
        "gateway.yaml": gateway_objects(spec),
        "monitoring.yaml": [pod_monitor(spec), prometheus_rule(spec), dashboard_config_map(spec)],
    }
    if spec.deploy.autoscaled:
        files["autoscaling.yaml"] = [scaled_object(spec)]
    return files


# ---- the engines ------------------------------------------------------------------------------------------------


def engine_objects(spec: DeploySpec) -> list[dict[str, Any]]:
    objects = [model_cache_claim(spec)]
    if downloads(spec):
        objects.append(model_download_job(spec))
    for pool in spec.pools:
        objects += [engine_workload(spec, pool), engine_service(spec, pool), disruption_budget(spec, pool)]
    return [*objects, engine_network_policy(spec)]


def downloads(spec: DeploySpec) -> bool:
    """A hub model is downloaded once by a Job; a path must already be on the nodes (or in the volume)."""
    return not spec.model.source.startswith(("/", "."))


def ready_marker(spec: DeploySpec) -> str:
    return f"{READY_DIR}/{spec.model.source.replace('/', '--')}"


def model_cache_claim(spec: DeploySpec) -> dict[str, Any]:
    size_gib = DEFAULT_CACHE_SIZE_GIB
    if spec.checkpoint_bytes:
        size_gib = math.ceil(spec.checkpoint_bytes * CACHE_HEADROOM / GIB)
    # Every pod of every replica reads the same weights and compile cache: a shared (NFS, Lustre, Filestore…) volume.
    return _claim(spec, names(spec)["cache"], "ReadWriteMany", f"{size_gib}Gi", labels(spec, "engine"))


def _claim(spec: DeploySpec, name: str, access: str, size: str, labelled: dict[str, str]) -> dict[str, Any]:
    claim: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name, "labels": labelled},
        "spec": {"accessModes": [access], "resources": {"requests": {"storage": size}}},
    }
    if spec.deploy.storage_class:
        claim["spec"]["storageClassName"] = spec.deploy.storage_class
    return claim


def model_download_job(spec: DeploySpec) -> dict[str, Any]:
    """Downloads the checkpoint into the shared volume once, then writes the marker file the engines wait for: no
    engine pod downloads hundreds of GB inside its startup probe, and every pod loads the same files."""
    n = names(spec)
    script = "\n".join(
        [
            "set -e",
            "python3 -c 'import sys; from huggingface_hub import snapshot_download; snapshot_download(sys.argv[1])' "
            + shlex.quote(spec.model.source),
            f"mkdir -p {READY_DIR}",
            f"touch {shlex.quote(ready_marker(spec))}",
        ]
    )
    container = {
        "name": "download",
        "image": spec.engine_image,  # the engine's image already holds huggingface_hub
        "command": ["/bin/sh", "-c", script],
        "env": [_hf_token_env(spec)],
        "resources": {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "8Gi"}},
        "volumeMounts": [{"name": "model-cache", "mountPath": MODEL_CACHE_PATH}],
    }
    pod = {
        "restartPolicy": "OnFailure",
        "containers": [container],
        "volumes": [{"name": "model-cache", "persistentVolumeClaim": {"claimName": n["cache"]}}],
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": n["download"], "labels": labels(spec, "model-download")},
        "spec": {
            "backoffLimit": 6,
            "template": {"metadata": {"labels": labels(spec, "model-download")}, "spec": pod},
        },
    }


def engine_workload(spec: DeploySpec, pool: Pool) -> dict[str, Any]:
    return leader_worker_set(spec, pool) if spec.nodes > 1 else engine_deployment(spec, pool)


def engine_deployment(spec: DeploySpec, pool: Pool) -> dict[str, Any]:
    launch = spec.launch(0, pool=pool)
    pod = _engine_pod(spec, pool, launch, command=_k8s_words(_container_command(launch)), serves_api=True)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": workload_name(spec, pool), "labels": _workload_labels(spec, pool)},
        "spec": {
            "replicas": pool.replicas,
            "selector": {"matchLabels": pool_labels(spec, pool)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": rolling_update(pool.replicas)},
            # A normal start of a large model takes tens of minutes: only a start slower than that is a failure.
            "progressDeadlineSeconds": progress_deadline_s(spec),
            "template": {"metadata": _pod_metadata(spec, pool), "spec": pod},
        },
    }


def rolling_update(replicas: int) -> dict[str, int]:
    """A rollout that keeps serving. Several replicas: replace one at a time (the others serve, no spare GPUs
    needed). One replica: start the new pod beside the old one (it needs a spare node's GPUs; until it gets them the
    old pod keeps serving and the rollout waits)."""
    if replicas > 1:
        return {"maxSurge": 0, "maxUnavailable": 1}
    return {"maxSurge": 1, "maxUnavailable": 0}


def progress_deadline_s(spec: DeploySpec) -> int:
    """How long a new pod may take to become ready before `kubectl rollout status` calls the rollout failed: the
    engine's whole start, and on the first rollout the model's download (the pods wait for it)."""
    download_s = 0
    if downloads(spec):
        download_s = math.ceil((spec.checkpoint_bytes or DEFAULT_CACHE_SIZE_GIB * GIB) / DOWNLOAD_BYTES_PER_S)
    return start_budget_s(spec) + download_s


def start_budget_s(spec: DeploySpec) -> int:
    """How long a replica takes to serve once its model is on the volume: the engine's start and the margin."""
    return int(spec.config.startup_timeout_s) + ROLLOUT_MARGIN_S


def leader_worker_set(spec: DeploySpec, pool: Pool) -> dict[str, Any]:
    leader = _engine_pod(spec, pool, spec.launch(0, pool=pool), rank_script(spec, pool, range(1)), serves_api=True)
    workers = _engine_pod(
        spec, pool, spec.launch(1, pool=pool), rank_script(spec, pool, range(1, spec.nodes)), serves_api=False
    )
    metadata: dict[str, Any] = {"name": workload_name(spec, pool), "labels": _workload_labels(spec, pool)}
    if spec.deploy.exclusive_topology:  # one group per topology domain (rack, NVLink domain), alone there
        metadata["annotations"] = {"leaderworkerset.sigs.k8s.io/exclusive-topology": spec.deploy.exclusive_topology}
    pod_metadata = _pod_metadata(spec, pool)
    return {
        "apiVersion": LWS_API,
        "kind": "LeaderWorkerSet",
        "metadata": metadata,
        "spec": {
            "replicas": pool.replicas,
            # Workers start with the leader: it waits for them in the engine's rendezvous, never ready alone.
            "startupPolicy": "LeaderCreated",
            # Groups are replaced like single pods: one group at a time while the others serve (one replica: a new
            # group beside the old, which needs a spare group of nodes).
            "rolloutStrategy": {"type": "RollingUpdate", "rollingUpdateConfiguration": rolling_update(pool.replicas)},
            "leaderWorkerTemplate": {
                "size": spec.nodes,
                # One lost node breaks the whole replica's collective: restart the group together.
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": {
                    "metadata": {**pod_metadata, "labels": {**pod_metadata["labels"], "role": "leader"}},
                    "spec": leader,
                },
                "workerTemplate": {
                    "metadata": {**pod_metadata, "labels": {**pod_metadata["labels"], "role": "worker"}},
                    "spec": workers,
                },
            },
        },
    }


def _workload_labels(spec: DeploySpec, pool: Pool) -> dict[str, str]:
    """The workload's labels; Kueue admits a workload by its queue-name label."""
    queue = {"kueue.x-k8s.io/queue-name": spec.deploy.kueue_queue} if spec.deploy.kueue_queue else {}
    return {**pool_labels(spec, pool), **queue}


def _pod_metadata(spec: DeploySpec, pool: Pool) -> dict[str, Any]:
    metadata: dict[str, Any] = {"labels": pool_labels(spec, pool)}
    if spec.uses_network and spec.network.pod_networks:  # the RDMA NICs as secondary networks (Multus)
        metadata["annotations"] = {"k8s.v1.cni.cncf.io/networks": spec.network.pod_networks}
    return metadata


def rank_script(spec: DeploySpec, pool: Pool, ranks: range) -> list[str]:
    """`sh -c` choosing this pod's node-rank command by LWS_WORKER_INDEX; every line is the engine launcher's,
    with node 0's address taken from LWS_LEADER_ADDRESS."""
    variables = {MASTER_PLACEHOLDER: "LWS_LEADER_ADDRESS"}
    lines = ['case "${LWS_WORKER_INDEX}" in']
    for rank in ranks:
        launch = spec.launch(rank, pool=pool)
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


def _engine_pod(
    spec: DeploySpec, pool: Pool, launch: LaunchSpec, command: list[str], serves_api: bool
) -> dict[str, Any]:
    access = gpu_access(spec)
    container: dict[str, Any] = {
        "name": "engine",
        "image": spec.engine_image,
        "command": command,
        "env": _engine_env(spec, pool, launch),
        "resources": engine_resources(spec),
        "volumeMounts": _engine_mounts(spec),
    }
    security = _security_context(spec, access.k8s_security)
    if security:
        container["securityContext"] = security
    if serves_api:
        container["ports"] = [{"name": "http", "containerPort": ENGINE_PORT}]
        container.update(_probes(launch.health_path, spec.config.startup_timeout_s))
    pod: dict[str, Any] = {
        "terminationGracePeriodSeconds": 60,
        # GPU node pools are usually tainted so that only pods asking for GPUs land there.
        "tolerations": [access.k8s_toleration()],
        "containers": [container],
        "volumes": _engine_volumes(spec),
    }
    if downloads(spec):
        pod["initContainers"] = [_wait_for_model(spec)]
    optional = {
        "runtimeClassName": spec.runtime_class,
        "nodeSelector": spec.node_selector,
        "schedulerName": spec.deploy.scheduler_name,
    }
    pod.update({key: value for key, value in optional.items() if value})
    return pod


def _hf_token_env(spec: DeploySpec) -> dict[str, Any]:
    secret = {"name": names(spec)["hf_token"], "key": "HF_TOKEN", "optional": True}
    return {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": secret}}


def _engine_env(spec: DeploySpec, pool: Pool, launch: LaunchSpec) -> list[dict[str, Any]]:
    pod_ip = {"valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    env: list[dict[str, Any]] = [_hf_token_env(spec), {"name": "VLLM_HOST_IP", **pod_ip}]
    if downloads(spec):  # the Job downloaded it: load from the volume, never from the hub
        env.append({"name": "HF_HUB_OFFLINE", "value": "1"})
    env.append({"name": "VLLM_CACHE_ROOT", "value": COMPILE_CACHE_PATH})
    if pool.config.kv_connector in SYMMETRIC_CONNECTORS:  # NIXL's handshake: the address the other pool dials
        env.append({"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", **pod_ip})
    if spec.deploy.engine_api_key:  # vLLM requires it on /v1 (not on /health and /metrics) when set
        secret = {"name": names(spec)["engine_key"], "key": "api-key"}
        env.append({"name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": secret}})
    variables = {**(spec.network.env(POD_INTERFACE) if spec.uses_network else {}), **launch.env}
    return env + [{"name": key, "value": value} for key, value in sorted(variables.items())]


def engine_resources(spec: DeploySpec) -> dict[str, dict[str, str]]:
    """Sized from the layout: GPUs, CPUs and host memory (its /dev/shm included, which counts against the memory
    limit) per pod. Burstable by default on purpose: a CPU limit throttles the engine's scheduler loop; guaranteed
    (--qos guaranteed) sets it equal to the request."""
    gpus = spec.gpus_per_node
    memory = f"{engine_memory_bytes(gpus) // GIB}Gi"
    cpus = str(CPUS_BASE + CPUS_PER_GPU * gpus)
    extended = {gpu_access(spec).resource: str(gpus), **(spec.network.resources() if spec.uses_network else {})}
    limits = {"memory": memory, **extended}
    if spec.deploy.qos == "guaranteed":
        limits["cpu"] = cpus
    return {"requests": {"cpu": cpus, "memory": memory, **extended}, "limits": limits}


def _security_context(spec: DeploySpec, vendor_security: dict[str, Any]) -> dict[str, Any]:
    """The GPU vendor's settings (AMD: the video group, SYS_PTRACE, unconfined seccomp), plus IPC_LOCK over RDMA:
    registered (pinned) memory needs the memlock limit lifted, which a container cannot do itself."""
    security = {**vendor_security}
    capabilities = list(vendor_security.get("capabilities", {}).get("add", []))
    if spec.uses_network and spec.network.rdma:
        capabilities.append("IPC_LOCK")
    if capabilities:
        security["capabilities"] = {"add": capabilities}
    return security


def engine_memory_bytes(gpus: int) -> int:
    return shm_bytes(gpus) + HOST_BYTES_BASE + HOST_BYTES_PER_GPU * gpus


def shm_bytes(gpus: int) -> int:
    return SHM_BYTES_PER_GPU * max(gpus, 1)


def _engine_mounts(spec: DeploySpec) -> list[dict[str, Any]]:
    mounts = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "model-cache", "mountPath": MODEL_CACHE_PATH},
        # vLLM's compile cache on the shared volume: a restarted or added pod skips torch.compile.
        {"name": "model-cache", "mountPath": COMPILE_CACHE_PATH, "subPath": "vllm-cache"},
    ]
    if spec.shares_kv_directory:  # ExampleConnector: both pools read and write KV files in one directory
        mounts.append({"name": "model-cache", "mountPath": KV_SHARED_PATH, "subPath": f"kv-transfer/{spec.name}"})
    return mounts


def _engine_volumes(spec: DeploySpec) -> list[dict[str, Any]]:
    size = f"{shm_bytes(spec.gpus_per_node) // GIB}Gi"
    return [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": size}},
        {"name": "model-cache", "persistentVolumeClaim": {"claimName": names(spec)["cache"]}},
    ]


def _wait_for_model(spec: DeploySpec) -> dict[str, Any]:
    marker = shlex.quote(ready_marker(spec))
    wait = (
        f"until [ -f {marker} ]; do echo 'waiting for the model download (Job {names(spec)['download']})'; "
        "sleep 15; done"
    )
    return {
        "name": "wait-for-model",
        "image": spec.engine_image,
        "command": ["/bin/sh", "-c", wait],
        "resources": {"requests": {"cpu": "50m", "memory": "32Mi"}, "limits": {"memory": "64Mi"}},
        "volumeMounts": [{"name": "model-cache", "mountPath": MODEL_CACHE_PATH, "readOnly": True}],
    }


def _probes(path: str, startup_timeout_s: float) -> dict[str, Any]:
    """Loading hundreds of GB and compiling take tens of minutes: the startup probe allows the engine's whole
    --startup-timeout-s before liveness takes over. Liveness and readiness on /health, which fails when the engine
    core died (/v1/models keeps answering then)."""
    check = {"httpGet": {"path": path, "port": "http"}, "periodSeconds": PROBE_PERIOD_S, "timeoutSeconds": 5}
    return {
        "startupProbe": {**check, "failureThreshold": math.ceil(startup_timeout_s / PROBE_PERIOD_S)},
        "readinessProbe": {**check, "failureThreshold": 3},
        "livenessProbe": {**check, "failureThreshold": 6},
    }


def engine_service(spec: DeploySpec, pool: Pool) -> dict[str, Any]:
    """Headless: its DNS name lists the pool's ready API pods (LWS leaders), each of which the gateway balances
    over, adding and removing them as replicas come and go."""
    selector = pool_labels(spec, pool)
    if spec.nodes > 1:  # only leaders serve the API
        selector = {**selector, "role": "leader"}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": api_service_name(spec, pool), "labels": pool_labels(spec, pool)},
        "spec": {
            "clusterIP": "None",
            "selector": selector,
            "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": "http"}],
        },
    }


def disruption_budget(spec: DeploySpec, pool: Pool) -> dict[str, Any]:
    """A node drain takes one engine pod (so at most one replica) at a time."""
    return _budget(workload_name(spec, pool), pool_labels(spec, pool))


def _budget(name: str, selected: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "labels": selected},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selected}},
    }


def engine_network_policy(spec: DeploySpec) -> dict[str, Any]:
    """Closed by default: the engines' API answers only the gateway and Prometheus; the engines reach each other
    on every port (rendezvous, collectives, KV transfer)."""
    http = [{"protocol": "TCP", "port": ENGINE_PORT}]
    monitoring = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": spec.deploy.monitoring_namespace}}
    }
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": names(spec)["engine"], "labels": labels(spec, "engine")},
        "spec": {
            "podSelector": {"matchLabels": labels(spec, "engine")},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": labels(spec, "gateway")}}], "ports": http},
                {"from": [monitoring], "ports": http},
                {"from": [{"podSelector": {"matchLabels": labels(spec, "engine")}}]},
            ],
        },
    }


def engine_url(spec: DeploySpec, pool: Pool) -> str:
    """The pool's headless Service by its full name (the namespace from the gateway pod's POD_NAMESPACE, which the
    kubelet expands in the command): the gateway resolves it to every ready replica."""
    return f"http://{api_service_name(spec, pool)}.{NAMESPACE_PLACEHOLDER}.svc.cluster.local:{ENGINE_PORT}/v1"


# ---- the gateway ------------------------------------------------------------------------------------------------


def gateway_objects(spec: DeploySpec) -> list[dict[str, Any]]:
    n = names(spec)
    objects = [
        gateway_service(spec),
        gateway_pods_service(spec),
        gateway_stateful_set(spec),
        gateway_autoscaler(spec),
        _budget(n["gateway"], labels(spec, "gateway")),
    ]
    if deploys_redis(spec):
        objects += [redis_service(spec), redis_stateful_set(spec), redis_network_policy(spec)]
    return objects


def deploys_redis(spec: DeploySpec) -> bool:
    """Shared limits and revocations need one Redis for every gateway pod: ours, unless the config names one."""
    return spec.gateway.redis_url is None


def redis_url(spec: DeploySpec) -> str:
    return spec.gateway.redis_url or f"redis://{names(spec)['redis']}:{REDIS_PORT}/0"


def gateway_argv(spec: DeploySpec) -> list[str]:
    """The gateway's command: the serving pool's replicas found through its headless Service, prefill replicas the
    same way, keys from the Secret's file, limits shared in Redis."""
    pools = spec.pools
    argv = gateway_command(
        spec,
        [engine_url(spec, spec.serving_pool)],
        GATEWAY_PORT,
        discover_upstreams=True,
        prefill_upstream=[engine_url(spec, pool) for pool in pools if pool.role == "prefill"],
        keys_file=f"{KEYS_DIR}/keys.sqlite",
        upstream_api_key_file=f"{ENGINE_KEY_DIR}/api-key" if spec.deploy.engine_api_key else None,
        redis_url=redis_url(spec),
    )
    # The kubelet expands $(VAR) in a command: keep the config's own words literal, expand only the namespace.
    return [word.replace(NAMESPACE_PLACEHOLDER, "$(POD_NAMESPACE)") for word in _k8s_words(argv)]


def gateway_stateful_set(spec: DeploySpec) -> dict[str, Any]:
    """A StatefulSet, so that each gateway pod's usage ledger (SQLite) lives on a volume of its own that outlives
    the pod (SQLite does not share a file safely over a network filesystem)."""
    n = names(spec)
    state = {"name": "state", "mountPath": GATEWAY_HOME}
    mounts = [state, {"name": "keys", "mountPath": KEYS_DIR, "readOnly": True}]
    volumes: list[dict[str, Any]] = [{"name": "keys", "secret": {"secretName": n["keys"], "optional": True}}]
    if spec.deploy.engine_api_key:
        mounts.append({"name": "engine-api-key", "mountPath": ENGINE_KEY_DIR, "readOnly": True})
        volumes.append({"name": "engine-api-key", "secret": {"secretName": n["engine_key"]}})
    check = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": PROBE_PERIOD_S, "timeoutSeconds": 3}
    namespace = {"valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}
    container = {
        "name": "gateway",
        "image": spec.gateway_image,
        # $(POD_NAMESPACE) in the upstream URLs is expanded by the kubelet from the env below.
        "command": gateway_argv(spec),
        "env": [{"name": "DEEPSERVE_HOME", "value": GATEWAY_HOME}, {"name": "POD_NAMESPACE", **namespace}],
        "ports": [{"name": "http", "containerPort": GATEWAY_PORT}],
        "readinessProbe": {**check, "failureThreshold": 3},
        "livenessProbe": {**check, "failureThreshold": 6},
        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
        "volumeMounts": mounts,
    }
    ledger = _claim(spec, "state", "ReadWriteOnce", GATEWAY_LEDGER_SIZE, labels(spec, "gateway"))
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": n["gateway"], "labels": labels(spec, "gateway")},
        "spec": {
            "replicas": GATEWAY_MIN_REPLICAS,
            "serviceName": n["gateway_pods"],
            "podManagementPolicy": "Parallel",  # the pods share nothing on disk: start and stop them together
            "selector": {"matchLabels": labels(spec, "gateway")},
            "template": {
                "metadata": {"labels": labels(spec, "gateway")},
                "spec": {"containers": [container], "volumes": volumes},
            },
            "volumeClaimTemplates": [{key: ledger[key] for key in ("metadata", "spec")}],
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


def gateway_pods_service(spec: DeploySpec) -> dict[str, Any]:
    """The StatefulSet's governing Service (stable pod names)."""
    service = gateway_service(spec)
    service["metadata"] = {**service["metadata"], "name": names(spec)["gateway_pods"]}
    service["spec"] = {**service["spec"], "clusterIP": "None"}
    return service


def gateway_autoscaler(spec: DeploySpec) -> dict[str, Any]:
    name = names(spec)["gateway"]
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": name, "labels": labels(spec, "gateway")},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": name},
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


def redis_service(spec: DeploySpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": names(spec)["redis"], "labels": labels(spec, "redis")},
        "spec": {
            "selector": labels(spec, "redis"),
            "ports": [{"name": "redis", "port": REDIS_PORT, "targetPort": "redis"}],
        },
    }


def redis_stateful_set(spec: DeploySpec) -> dict[str, Any]:
    """One Redis for every gateway pod: the rpm/tpm windows, concurrency leases and revocations they share.
    Append-only persistence keeps revocations across a restart."""
    name = names(spec)["redis"]
    ping = {"exec": {"command": ["redis-cli", "ping"]}, "periodSeconds": PROBE_PERIOD_S, "timeoutSeconds": 3}
    container = {
        "name": "redis",
        "image": REDIS_IMAGE,
        "args": ["--appendonly", "yes", "--save", ""],
        "ports": [{"name": "redis", "containerPort": REDIS_PORT}],
        "readinessProbe": ping,
        "livenessProbe": {**ping, "failureThreshold": 6},
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }
    data = _claim(spec, "data", "ReadWriteOnce", "1Gi", labels(spec, "redis"))
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name, "labels": labels(spec, "redis")},
        "spec": {
            "replicas": 1,
            "serviceName": name,
            "selector": {"matchLabels": labels(spec, "redis")},
            "template": {"metadata": {"labels": labels(spec, "redis")}, "spec": {"containers": [container]}},
            "volumeClaimTemplates": [{key: data[key] for key in ("metadata", "spec")}],
        },
    }


def redis_network_policy(spec: DeploySpec) -> dict[str, Any]:
    """Redis holds the limits and revocations: only the gateway pods reach it."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": names(spec)["redis"], "labels": labels(spec, "redis")},
        "spec": {
            "podSelector": {"matchLabels": labels(spec, "redis")},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": labels(spec, "gateway")}}],
                    "ports": [{"protocol": "TCP", "port": REDIS_PORT}],
                }
            ],
        },
    }


# ---- engine autoscaling -----------------------------------------------------------------------------------------


def scaled_object(spec: DeploySpec) -> dict[str, Any]:
    """KEDA scales the serving pool on the engines' own signals, read from Prometheus: requests running and waiting
    per replica against what one replica serves at its target (the plan's capacity), and the replicas' average
    KV-cache usage. Scaling down waits a whole engine start (a replica takes that long to come back)."""
    pool = spec.serving_pool
    capacity = spec.capacity_per_replica
    if capacity is None:
        raise ConfigError(
            "--max-replicas scales on requests per replica against one replica's capacity, which is not known: "
            "plan the layout with --gpu/--gpus, or give --capacity-per-replica N (or --max-num-seqs)"
        )
    selector = engine_series_selector(spec, pool)
    load = f"sum(vllm:num_requests_running{{{selector}}}) + sum(vllm:num_requests_waiting{{{selector}}})"
    kv = f"sum(avg by (pod) (vllm:kv_cache_usage_perc{{{selector}}}))"
    server = spec.deploy.prometheus_url or (f"http://prometheus-operated.{spec.deploy.monitoring_namespace}.svc:9090")
    start_s = start_budget_s(spec)
    return {
        "apiVersion": KEDA_API,
        "kind": "ScaledObject",
        "metadata": {"name": workload_name(spec, pool), "labels": pool_labels(spec, pool)},
        "spec": {
            "scaleTargetRef": {
                "apiVersion": LWS_API if spec.nodes > 1 else "apps/v1",
                "kind": "LeaderWorkerSet" if spec.nodes > 1 else "Deployment",
                "name": workload_name(spec, pool),
            },
            "minReplicaCount": pool.replicas,
            "maxReplicaCount": spec.deploy.max_replicas,
            "pollingInterval": 30,
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "behavior": {
                        "scaleUp": {"stabilizationWindowSeconds": 60, "policies": [_one_pod_per(300)]},
                        "scaleDown": {"stabilizationWindowSeconds": start_s, "policies": [_one_pod_per(start_s)]},
                    }
                }
            },
            "triggers": [
                _prometheus_trigger("requests-per-replica", server, load, str(capacity)),
                _prometheus_trigger("kv-cache-usage", server, kv, str(KV_CACHE_TARGET)),
            ],
        },
    }


def engine_series_selector(spec: DeploySpec, pool: Pool) -> str:
    """The PromQL label selector of one pool's engine series (the PodMonitor copies these labels on)."""
    return f'component="engine",deepserve_instance="{spec.name}",deepserve_pool="{pool.role}"'


def _one_pod_per(seconds: int) -> dict[str, Any]:
    return {"type": "Pods", "value": 1, "periodSeconds": seconds}


def _prometheus_trigger(name: str, server: str, query: str, threshold: str) -> dict[str, Any]:
    # AverageValue: the HPA divides the query's value by the replicas, so THRESHOLD is a per-replica target.
    return {
        "type": "prometheus",
        "name": name,
        "metricType": "AverageValue",
        "metadata": {"serverAddress": server, "query": query, "threshold": threshold},
    }


# ---- monitoring -------------------------------------------------------------------------------------------------


def monitoring_labels(spec: DeploySpec) -> dict[str, str]:
    """kube-prometheus-stack's Prometheus selects monitors and rules by its Helm release's name (`release`)."""
    release = {"release": spec.deploy.prometheus_release} if spec.deploy.prometheus_release else {}
    return {**instance_labels(spec), **release}


def pod_monitor(spec: DeploySpec) -> dict[str, Any]:
    """Scrapes every pod with an `http` port (engine leaders and gateways; headless workers have none), labelling
    each series with its component, deployment and pool, as the alerts, the dashboard and KEDA's queries expect."""

    def copy(label: str, target: str) -> dict[str, Any]:
        source = "__meta_kubernetes_pod_label_" + "".join(c if c.isalnum() else "_" for c in label)
        return {"sourceLabels": [source], "targetLabel": target, "action": "replace"}

    relabelings = [
        copy("app.kubernetes.io/component", "component"),
        copy("app.kubernetes.io/instance", "deepserve_instance"),
        copy(POOL_LABEL, "deepserve_pool"),
    ]
    return {
        "apiVersion": MONITORING_API,
        "kind": "PodMonitor",
        "metadata": {"name": spec.name, "labels": monitoring_labels(spec)},
        "spec": {
            "selector": {"matchLabels": instance_labels(spec)},
            "podMetricsEndpoints": [
                {"port": "http", "path": "/metrics", "interval": "15s", "relabelings": relabelings}
            ],
        },
    }


def prometheus_rule(spec: DeploySpec) -> dict[str, Any]:
    return {
        "apiVersion": MONITORING_API,
        "kind": "PrometheusRule",
        "metadata": {"name": spec.name, "labels": monitoring_labels(spec)},
        "spec": rule_groups(spec.gateway),
    }


def dashboard_config_map(spec: DeploySpec) -> dict[str, Any]:
    """Picked up by Grafana's dashboard sidecar (kube-prometheus-stack looks for the grafana_dashboard label); its
    GPU panels read the DCGM exporter's series of this deployment's engine pods."""
    gpus = f'pod=~"{spec.name}-(engine|prefill|decode)-.*"'
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": names(spec)["dashboard"],
            "labels": {**instance_labels(spec), "grafana_dashboard": "1"},
        },
        "data": {"deepserve.json": json.dumps(dashboard(f"deepserve: {spec.name}", gpus), indent=2)},
    }
