"""docker compose: the engine in its official image with GPUs reserved, the gateway, Prometheus scraping both, and
Grafana with the dashboard provisioned.

One host: a single `docker-compose.yaml` on compose's own network, where only the gateway publishes a port (the
engines answer the gateway and Prometheus, nothing else); several replicas that fit on the host's GPUs become one
engine service each, on GPUs of their own, and so do a prefill and a decode pool. Several hosts (a replica spanning
nodes): one file per node (`docker-compose.node<R>.yaml`), every service on the host's network, because the engine's
collectives and rendezvous need the nodes to reach each other directly; node 0's engine API listens on loopback
only, behind the gateway, and node 0's file also holds the gateway and monitoring. A running vLLM rendezvous does
not take back one node restarted alone: the engines of several hosts never restart on their own, and
`restart-group.sh` restarts the whole group, node 0 first."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import yaml

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
    substitute,
)
from deepserve.engines.base import LaunchSpec
from deepserve.engines.vllm import SYMMETRIC_CONNECTORS
from deepserve.errors import ConfigError

MODEL_CACHE = "~/.cache/huggingface:/root/.cache/huggingface"  # the host's Hugging Face cache, as seed 001 mounts it
GATEWAY_HOME = "/var/lib/deepserve"
PROMETHEUS_IMAGE = "prom/prometheus:v2.53.2"
GRAFANA_IMAGE = "grafana/grafana:11.2.0"
MASTER_VARIABLE = "${MASTER_ADDR:?set MASTER_ADDR to node 0's address, in .env beside this file or the environment}"
NETWORK_ENV = "network.env"
NETWORK_ENV_TEXT = """\
# The interface that carries the collectives between the nodes (`deepserve deploy check` names it on each node).
# Uncomment and set these, on every node, when the host has more than one network interface:
# NCCL_SOCKET_IFNAME=eth0
# GLOO_SOCKET_IFNAME=eth0
# NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=eth0
"""
RESTART_SCRIPT = "restart-group.sh"
ENGINE_KEY_FILE = "engine-api-key"  # the engines' API key, which the gateway sends (--engine-api-key)
ENGINE_KEY_SECRET = "/run/secrets/engine-api-key"
ENGINE_KEY_VARIABLE = "${ENGINE_API_KEY:?set ENGINE_API_KEY (the contents of engine-api-key) in .env beside this file}"
VOLUMES: dict[str, dict[str, Any]] = {"prometheus-data": {}, "grafana-data": {}}


@dataclass(frozen=True)
class _Network:
    """Compose's own network (services by name) or the host's (everything on this host's ports)."""

    host: bool
    engine_port: int
    gateway_port: int

    def engine_address(self, service: str) -> str:
        return f"127.0.0.1:{self.engine_port}" if self.host else f"{service}:{self.engine_port}"

    @property
    def gateway_address(self) -> str:
        return f"127.0.0.1:{self.gateway_port}" if self.host else f"gateway:{self.gateway_port}"

    @property
    def prometheus_url(self) -> str:
        return "http://127.0.0.1:9090" if self.host else "http://prometheus:9090"


def network_of(spec: DeploySpec) -> _Network:
    if spec.nodes == 1:
        return _Network(host=False, engine_port=ENGINE_PORT, gateway_port=GATEWAY_PORT)
    public = spec.config.port  # on the host's network the gateway holds the public port; the engine the next one
    return _Network(host=True, engine_port=public + 1, gateway_port=public)


def compose_files(spec: DeploySpec) -> dict[str, dict[str, Any]]:
    """File name → compose document."""
    if spec.nodes == 1:
        return {"docker-compose.yaml": single_host(spec)}
    if spec.replicas > 1 or spec.deploy.disaggregated:
        raise ConfigError(
            f"compose renders one replica over {spec.nodes} hosts; for several replicas or prefill and decode pools "
            "of a multi-node layout use --target kubernetes (LeaderWorkerSets), or one Slurm job per replica"
        )
    return {f"docker-compose.node{rank}.yaml": node_file(spec, rank) for rank in range(spec.nodes)}


def service_names(spec: DeploySpec) -> list[tuple[Pool, int, str]]:
    """(pool, replica, service name) of every engine on the host: engine, engine-1, … or prefill…, decode…."""
    result = []
    for pool in spec.pools:
        for replica in range(pool.replicas):
            result.append((pool, replica, pool.role if replica == 0 else f"{pool.role}-{replica}"))
    return result


def config_files(spec: DeploySpec) -> dict[str, str]:
    """Prometheus's and Grafana's files, which node 0's compose file mounts (and, over several hosts, the network
    settings every node's engine reads, and the script that restarts the group)."""
    network = network_of(spec)
    engines = [network.engine_address(name) for _, _, name in service_names(spec)]
    prometheus = {
        "global": {"scrape_interval": "15s", "evaluation_interval": "15s"},
        "rule_files": ["alerts.yml"],  # beside prometheus.yml, in the container as on disk
        "scrape_configs": [
            {
                "job_name": "deepserve-engine",
                "static_configs": [{"targets": engines, "labels": {"component": "engine"}}],
            },
            {
                "job_name": "deepserve-gateway",
                "static_configs": [{"targets": [network.gateway_address], "labels": {"component": "gateway"}}],
            },
        ],
    }
    datasources = {
        "apiVersion": 1,
        "datasources": [
            {"name": "Prometheus", "type": "prometheus", "uid": "prometheus", "url": network.prometheus_url}
        ],
    }
    providers = {
        "apiVersion": 1,
        "providers": [{"name": "deepserve", "type": "file", "options": {"path": "/var/lib/grafana/dashboards"}}],
    }
    files = {
        "prometheus.yml": _yaml(prometheus),
        "alerts.yml": _yaml(rule_groups(spec.gateway)),
        "grafana/provisioning/datasources/prometheus.yaml": _yaml(datasources),
        "grafana/provisioning/dashboards/deepserve.yaml": _yaml(providers),
        "grafana/dashboards/deepserve.json": json.dumps(dashboard(f"deepserve: {spec.name}"), indent=2),
    }
    if network.host:
        files[NETWORK_ENV] = NETWORK_ENV_TEXT
        files[RESTART_SCRIPT] = restart_script(spec)
    return files


def _yaml(data: dict[str, Any]) -> str:
    return yaml.safe_dump(data, sort_keys=False, width=1000)


# ---- one host ---------------------------------------------------------------------------------------------------


def single_host(spec: DeploySpec) -> dict[str, Any]:
    network = network_of(spec)
    per_replica = spec.gpus_per_node
    engines = service_names(spec)
    if spec.node_gpus is not None and len(engines) * per_replica > spec.node_gpus:
        raise ConfigError(
            f"compose runs every replica on one host: {len(engines)} replicas x {per_replica} GPUs need "
            f"{len(engines) * per_replica}, and the host has {spec.node_gpus}; lower --replicas, or use --target "
            "kubernetes to spread replicas over nodes"
        )
    services: dict[str, Any] = {}
    for index, (pool, _, name) in enumerate(engines):
        gpus = [str(gpu) for gpu in range(index * per_replica, (index + 1) * per_replica)]
        service = engine_service(
            spec, spec.launch(0, pool=pool), network.engine_port, gpus if len(engines) > 1 else None
        )
        if pool.config.kv_connector in SYMMETRIC_CONNECTORS:  # NIXL's handshake address: this service's name
            service["environment"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] = name
        services[name] = service
    upstreams = [f"http://{network.engine_address(name)}/v1" for pool, _, name in engines if pool.role != "prefill"]
    prefill = [f"http://{network.engine_address(name)}/v1" for pool, _, name in engines if pool.role == "prefill"]
    services["gateway"] = gateway_service(spec, network, upstreams, depends_on=list(services), prefill=prefill)
    services["gateway"]["ports"] = [f"{spec.config.port}:{GATEWAY_PORT}"]
    services.update(monitoring_services(host_network=False))
    document: dict[str, Any] = {"services": services, "volumes": dict(VOLUMES)}
    if spec.shares_kv_directory:  # ExampleConnector: prefill writes KV files that decode reads
        document["volumes"]["kv-transfer"] = {}
    if spec.deploy.engine_api_key:
        document["secrets"] = {ENGINE_KEY_FILE: {"file": f"./{ENGINE_KEY_FILE}"}}
    return document


def engine_service(spec: DeploySpec, launch: LaunchSpec, port: int, device_ids: list[str] | None) -> dict[str, Any]:
    gpus = gpu_access(spec).compose_settings(spec.gpus_per_node, device_ids)
    # A command that reads files of its own (TensorRT-LLM's options) writes them first, in one shell script.
    command = ["/bin/sh", "-c", launch.shell_script()] if launch.files else launch.argv
    environment = {"HF_TOKEN": "${HF_TOKEN:-}", **launch.env, **gpus.pop("environment", {})}
    if spec.deploy.engine_api_key:  # vLLM requires it on /v1 (not on /health and /metrics)
        environment["VLLM_API_KEY"] = ENGINE_KEY_VARIABLE
    volumes = [MODEL_CACHE]
    if spec.shares_kv_directory:
        volumes.append(f"kv-transfer:{KV_SHARED_PATH}")
    service: dict[str, Any] = {
        "image": spec.engine_image,
        # The whole command, as the engine's launcher writes it: it replaces the image's entrypoint.
        "entrypoint": _compose_words(command),
        "environment": environment,
        "ipc": "host",  # shared memory for NCCL and vLLM's worker processes, as vLLM's docs run the image
        "volumes": volumes,
        **gpus,
        "healthcheck": {
            "test": _http_check(f"http://127.0.0.1:{port}{launch.health_path}", "python3"),
            "interval": "30s",
            "timeout": "10s",
            "retries": 3,
            # Loading hundreds of GB takes tens of minutes: failures before this do not count.
            "start_period": f"{int(spec.config.startup_timeout_s)}s",
        },
        "restart": "unless-stopped",
    }
    return service


def gateway_service(
    spec: DeploySpec, network: _Network, upstreams: list[str], depends_on: list[str], prefill: list[str] | None = None
) -> dict[str, Any]:
    argv = gateway_command(
        spec,
        upstreams,
        network.gateway_port,
        prefill_upstream=prefill or [],
        upstream_api_key_file=ENGINE_KEY_SECRET if spec.deploy.engine_api_key else None,
    )
    service: dict[str, Any] = {
        "image": spec.gateway_image,
        "entrypoint": _compose_words(argv),
        "environment": {"DEEPSERVE_HOME": GATEWAY_HOME},
        # Keys and the usage ledger: `DEEPSERVE_HOME=./deepserve-home deepserve keys create NAME` beside this file.
        "volumes": [f"./deepserve-home:{GATEWAY_HOME}"],
        "depends_on": depends_on,
        "healthcheck": {
            "test": _http_check(f"http://127.0.0.1:{network.gateway_port}/health", "python"),
            "interval": "15s",
            "timeout": "5s",
            "retries": 3,
        },
        "restart": "unless-stopped",
    }
    if spec.deploy.engine_api_key:
        service["secrets"] = [{"source": ENGINE_KEY_FILE, "target": ENGINE_KEY_FILE}]
    return service


def _http_check(url: str, python: str) -> list[str]:
    return ["CMD", python, "-c", f"import urllib.request; urllib.request.urlopen({url!r}, timeout=5)"]


def monitoring_services(host_network: bool) -> dict[str, Any]:
    prometheus: dict[str, Any] = {
        "image": PROMETHEUS_IMAGE,
        "command": [
            "--config.file=/etc/prometheus/prometheus.yml",
            "--storage.tsdb.path=/prometheus",
            "--storage.tsdb.retention.time=15d",
        ],
        "volumes": [
            "./prometheus.yml:/etc/prometheus/prometheus.yml:ro",
            "./alerts.yml:/etc/prometheus/alerts.yml:ro",
            "prometheus-data:/prometheus",
        ],
        "restart": "unless-stopped",
    }
    grafana: dict[str, Any] = {
        "image": GRAFANA_IMAGE,
        "volumes": [
            "./grafana/provisioning:/etc/grafana/provisioning:ro",
            "./grafana/dashboards:/var/lib/grafana/dashboards:ro",
            "grafana-data:/var/lib/grafana",
        ],
        "depends_on": ["prometheus"],
        "restart": "unless-stopped",
    }
    if host_network:  # no port mapping on the host's network: listen on loopback only
        prometheus["network_mode"] = "host"
        prometheus["command"].append("--web.listen-address=127.0.0.1:9090")
        grafana["network_mode"] = "host"
        grafana["environment"] = {"GF_SERVER_HTTP_ADDR": "127.0.0.1"}
    else:  # dashboards are for the operator's machine: published on loopback only
        prometheus["ports"] = ["127.0.0.1:9090:9090"]
        grafana["ports"] = ["127.0.0.1:3000:3000"]
    return {"prometheus": prometheus, "grafana": grafana}


def _compose_words(argv: list[str]) -> list[str]:
    """Compose interpolates ${VAR} in every string; $$ keeps a literal $."""
    return [word.replace("$", "$$") for word in argv]


# ---- several hosts ----------------------------------------------------------------------------------------------


def node_file(spec: DeploySpec, rank: int) -> dict[str, Any]:
    network = network_of(spec)
    given = spec.config.master_addr if spec.config.master_addr != MASTER_PLACEHOLDER else None
    # Node 0's API on loopback: on the host's network 0.0.0.0 would open the unauthenticated engine API to every
    # machine that reaches the host, next to the gateway that enforces keys.
    node = spec.node_config(rank).model_copy(update={"port": network.engine_port, "host": "127.0.0.1"})
    launch = spec.engine.launch_spec(node, spec.model, None)
    engine = engine_service(spec, launch, network.engine_port, None)
    engine["entrypoint"] = substitute(engine["entrypoint"], {MASTER_PLACEHOLDER: given or MASTER_VARIABLE})
    engine["network_mode"] = "host"  # the nodes' collectives and rendezvous need each other's addresses and ports
    # On the host's network every interface of the host is visible: NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME in
    # network.env name the one that reaches the other nodes (commented out there until set: an empty value would
    # name no interface). The profile's other settings (HCAs, GID index, IB on or off) are the same on every node.
    engine["env_file"] = [NETWORK_ENV]
    engine["environment"].update(spec.network.env())
    engine.update(_rdma_access(spec))
    # One node restarted alone cannot rejoin a running rendezvous: restart-group.sh restarts every node together.
    engine["restart"] = "no"
    if rank > 0:
        del engine["healthcheck"]  # a headless node serves no HTTP
        return {"services": {"engine": engine}}
    upstreams = [f"http://{network.engine_address('engine')}/v1"]
    gateway = gateway_service(spec, network, upstreams, depends_on=["engine"])
    gateway["network_mode"] = "host"
    document: dict[str, Any] = {
        "services": {"engine": engine, "gateway": gateway, **monitoring_services(host_network=True)},
        "volumes": VOLUMES,
    }
    if spec.deploy.engine_api_key:
        document["secrets"] = {ENGINE_KEY_FILE: {"file": f"./{ENGINE_KEY_FILE}"}}
    return document


def _rdma_access(spec: DeploySpec) -> dict[str, Any]:
    """What an RDMA profile needs in a container: the verbs devices, IPC_LOCK and an unlimited memlock for
    registered memory (NCCL's and TensorRT-LLM's multi-node docker examples run with --ulimit memlock=-1)."""
    if not spec.network.rdma:
        return {}
    return {
        "devices": ["/dev/infiniband:/dev/infiniband"],
        "cap_add": ["IPC_LOCK"],
        "ulimits": {"memlock": {"soft": -1, "hard": -1}},
    }


def restart_script(spec: DeploySpec) -> str:
    """Restart every node of the group together: stop all engines (the surviving nodes hold a rendezvous that a
    restarted node cannot join), then start node 0 (it owns the rendezvous) and the others. Each node is reached
    over ssh, in this directory at the same path."""
    nodes = spec.nodes
    return f"""#!/bin/sh
# Usage: ./{RESTART_SCRIPT} NODE0_HOST NODE1_HOST ...   (the {nodes} hosts in node-rank order, reachable by ssh)
# Restarts the whole group: a running vLLM rendezvous does not take back one node restarted alone.
set -eu
if [ "$#" -ne {nodes} ]; then
    echo "usage: $0 NODE0_HOST ... (the {nodes} hosts, node 0 first)" >&2
    exit 2
fi
dir="$(cd "$(dirname "$0")" && pwd)"
rank=0
for host in "$@"; do
    ssh "$host" "cd '$dir' && docker compose -f docker-compose.node$rank.yaml stop engine"
    rank=$((rank + 1))
done
master="$1"
rank=0
for host in "$@"; do
    ssh "$host" "cd '$dir' && MASTER_ADDR='$master' docker compose -f docker-compose.node$rank.yaml up -d"
    rank=$((rank + 1))
done
"""
