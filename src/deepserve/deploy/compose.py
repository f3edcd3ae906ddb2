"""docker compose: the engine in its official image with GPUs reserved, the gateway, Prometheus scraping both, and
Grafana with the dashboard provisioned.

One host: a single `docker-compose.yaml` on compose's own network; several replicas that fit on the host's GPUs
become one engine service each, on GPUs of their own. Several hosts (a replica spanning nodes): one file per node
(`docker-compose.node<R>.yaml`), every service on the host's network, because the engine's collectives and
rendezvous need the nodes to reach each other directly; node 0's file also holds the gateway and monitoring."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import yaml

from deepserve.deploy.accelerators import gpu_access
from deepserve.deploy.monitoring import dashboard, rule_groups
from deepserve.deploy.source import ENGINE_PORT, GATEWAY_PORT, MASTER_PLACEHOLDER, DeploySpec, substitute
from deepserve.engines.base import LaunchSpec
from deepserve.errors import ConfigError
from deepserve.gateway.config import gateway_argv

MODEL_CACHE = "~/.cache/huggingface:/root/.cache/huggingface"  # the host's Hugging Face cache, as seed 001 mounts it
GATEWAY_HOME = "/var/lib/deepserve"
PROMETHEUS_IMAGE = "prom/prometheus:v2.53.2"
GRAFANA_IMAGE = "grafana/grafana:11.2.0"
MASTER_VARIABLE = "${MASTER_ADDR:?set MASTER_ADDR to node 0's address, in .env beside this file or the environment}"
NETWORK_ENV = "network.env"
NETWORK_ENV_TEXT = """\
# The interface that carries the collectives between the nodes (`deepserve deploy check` names it on each node).
# Uncomment and set both, on every node, when the host has more than one network interface:
# NCCL_SOCKET_IFNAME=eth0
# GLOO_SOCKET_IFNAME=eth0
"""
VOLUMES: dict[str, dict[str, Any]] = {"prometheus-data": {}, "grafana-data": {}}


@dataclass(frozen=True)
class _Network:
    """Compose's own network (services by name) or the host's (everything on this host's ports)."""

    host: bool
    engine_port: int
    gateway_port: int

    def engine_address(self, replica: int) -> str:
        return f"127.0.0.1:{self.engine_port}" if self.host else f"{_engine_name(replica)}:{self.engine_port}"

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
    if spec.replicas > 1:
        raise ConfigError(
            f"compose renders one replica over {spec.nodes} hosts; for {spec.replicas} replicas of a multi-node "
            "layout use --target kubernetes (a LeaderWorkerSet) or one Slurm job per replica"
        )
    return {f"docker-compose.node{rank}.yaml": node_file(spec, rank) for rank in range(spec.nodes)}


def config_files(spec: DeploySpec) -> dict[str, str]:
    """Prometheus's and Grafana's files, which node 0's compose file mounts (and, over several hosts, the network
    settings every node's engine reads)."""
    network = network_of(spec)
    engines = [network.engine_address(replica) for replica in range(spec.replicas)]
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
    return files


def _yaml(data: dict[str, Any]) -> str:
    return yaml.safe_dump(data, sort_keys=False, width=1000)


def _engine_name(replica: int) -> str:
    return "engine" if replica == 0 else f"engine-{replica}"


# ---- one host ---------------------------------------------------------------------------------------------------


def single_host(spec: DeploySpec) -> dict[str, Any]:
    network = network_of(spec)
    per_replica = spec.gpus_per_node
    if spec.node_gpus is not None and spec.replicas * per_replica > spec.node_gpus:
        raise ConfigError(
            f"compose runs every replica on one host: {spec.replicas} replicas x {per_replica} GPUs need "
            f"{spec.replicas * per_replica}, and the host has {spec.node_gpus}; lower --replicas, or use --target "
            "kubernetes to spread replicas over nodes"
        )
    services: dict[str, Any] = {}
    for replica in range(spec.replicas):
        gpus = [str(gpu) for gpu in range(replica * per_replica, (replica + 1) * per_replica)]
        services[_engine_name(replica)] = engine_service(
            spec, spec.launch(0), network.engine_port, gpus if spec.replicas > 1 else None
        )
    upstreams = [f"http://{network.engine_address(replica)}/v1" for replica in range(spec.replicas)]
    services["gateway"] = gateway_service(spec, network, upstreams, depends_on=list(services))
    services["gateway"]["ports"] = [f"{spec.config.port}:{GATEWAY_PORT}"]
    services.update(monitoring_services(host_network=False))
    return {"services": services, "volumes": VOLUMES}


def engine_service(spec: DeploySpec, launch: LaunchSpec, port: int, device_ids: list[str] | None) -> dict[str, Any]:
    gpus = gpu_access(spec).compose_settings(spec.gpus_per_node, device_ids)
    # A command that reads files of its own (TensorRT-LLM's options) writes them first, in one shell script.
    command = ["/bin/sh", "-c", launch.shell_script()] if launch.files else launch.argv
    return {
        "image": spec.engine_image,
        # The whole command, as the engine's launcher writes it: it replaces the image's entrypoint.
        "entrypoint": _compose_words(command),
        "environment": {"HF_TOKEN": "${HF_TOKEN:-}", **launch.env, **gpus.pop("environment", {})},
        "ipc": "host",  # shared memory for NCCL and vLLM's worker processes, as vLLM's docs run the image
        "volumes": [MODEL_CACHE],
        **gpus,
        "healthcheck": {
            "test": _http_check(f"http://127.0.0.1:{port}{launch.ready_path}", "python3"),
            "interval": "30s",
            "timeout": "10s",
            "retries": 3,
            # Loading hundreds of GB takes tens of minutes: failures before this do not count.
            "start_period": f"{int(spec.config.startup_timeout_s)}s",
        },
        "restart": "unless-stopped",
    }


def gateway_service(spec: DeploySpec, network: _Network, upstreams: list[str], depends_on: list[str]) -> dict[str, Any]:
    front = spec.gateway.model_copy(update={"upstream": upstreams, "host": "0.0.0.0", "port": network.gateway_port})
    return {
        "image": spec.gateway_image,
        "entrypoint": _compose_words(gateway_argv(front, "python")),
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
    node = spec.node_config(rank).model_copy(update={"port": network.engine_port})
    launch = spec.engine.launch_spec(node, spec.model, None)
    engine = engine_service(spec, launch, network.engine_port, None)
    engine["entrypoint"] = substitute(engine["entrypoint"], {MASTER_PLACEHOLDER: given or MASTER_VARIABLE})
    engine["network_mode"] = "host"  # the nodes' collectives and rendezvous need each other's addresses and ports
    # On the host's network every interface of the host is visible: NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME in
    # network.env name the one that reaches the other nodes (commented out there until set: an empty value would
    # name no interface).
    engine["env_file"] = [NETWORK_ENV]
    if rank > 0:
        del engine["healthcheck"]  # a headless node serves no HTTP
        return {"services": {"engine": engine}}
    upstreams = [f"http://{network.engine_address(0)}/v1"]
    gateway = gateway_service(spec, network, upstreams, depends_on=["engine"])
    gateway["network_mode"] = "host"
    return {
        "services": {"engine": engine, "gateway": gateway, **monitoring_services(host_network=True)},
        "volumes": VOLUMES,
    }
