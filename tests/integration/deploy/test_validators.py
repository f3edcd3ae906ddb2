"""The rendered files through the tools that will read them: `docker-compose config` (Debian's docker-compose, no
daemon needed) for every compose file, with the engine's entrypoint after compose's own interpolation compared with
the launcher's command; `promtool check config` and `promtool check rules` (Debian's prometheus) for the scrape config
and the alert rules of both targets. Each tool is skipped, saying so, where it is not installed (./run-tests installs
both where it runs as root with apt-get)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from deepserve.deploy import compose, kubernetes
from deepserve.deploy.config import DeployConfig
from deepserve.deploy.render import render
from deepserve.deploy.source import MASTER_PLACEHOLDER, DeploySpec, deploy_spec
from deepserve.engines.config import EngineConfig
from deepserve.gateway.config import GatewayConfig

DOCKER_COMPOSE = shutil.which("docker-compose")
PROMTOOL = shutil.which("promtool")
needs_compose = pytest.mark.skipif(
    DOCKER_COMPOSE is None, reason="docker-compose is not installed (apt-get install docker-compose)"
)
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (apt-get install prometheus)")
LAYOUTS: dict[str, dict[str, Any]] = {
    "one-node": {"tensor_parallel_size": 8},
    "two-nodes": {
        "tensor_parallel_size": 8,
        "pipeline_parallel_size": 2,
        "nnodes": 2,
        "master_addr": MASTER_PLACEHOLDER,
    },
}


def make(layout: str, **extra: Any) -> DeploySpec:
    config = EngineConfig.model_validate({"model": "deepseek-ai/DeepSeek-V3-0324", **LAYOUTS[layout]})
    deploy = DeployConfig.model_validate(extra)
    return deploy_spec(config, GatewayConfig(max_queue=1000), command=f"test {layout}", deploy=deploy)


def run(command: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    # Compose interpolates from the environment: keep ours out of it, except what the test sets.
    return subprocess.run(
        command,
        cwd=cwd,
        env={"PATH": os.environ["PATH"], **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@needs_compose
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_docker_compose_accepts_every_file_and_runs_the_launchers_command(layout: str, tmp_path: Path) -> None:
    spec = make(layout)
    render(spec, "compose", tmp_path)
    files = sorted(tmp_path.glob("docker-compose*.yaml"))
    assert len(files) == spec.nodes
    for rank, path in enumerate(files):
        quiet = run([str(DOCKER_COMPOSE), "-f", path.name, "config", "-q"], tmp_path, MASTER_ADDR="10.0.0.7")
        assert quiet.returncode == 0, quiet.stderr
        resolved = run([str(DOCKER_COMPOSE), "-f", path.name, "config"], tmp_path, MASTER_ADDR="10.0.0.7")
        engine = yaml.safe_load(resolved.stdout)["services"]["engine"]
        node = spec.node_config(rank, "10.0.0.7")
        if spec.nodes > 1:  # on the host's network: node 0's API on loopback, behind the gateway
            node = node.model_copy(update={"port": compose.network_of(spec).engine_port, "host": "127.0.0.1"})
        assert engine["entrypoint"] == spec.engine.launch_spec(node, spec.model, None).argv


@needs_compose
def test_docker_compose_refuses_a_node_file_without_node_zeros_address(tmp_path: Path) -> None:
    render(make("two-nodes"), "compose", tmp_path)
    refused = run([str(DOCKER_COMPOSE), "-f", "docker-compose.node1.yaml", "config", "-q"], tmp_path)
    assert refused.returncode != 0 and "set MASTER_ADDR to node 0's address" in refused.stderr


@needs_compose
def test_docker_compose_accepts_replicas_on_one_host(tmp_path: Path) -> None:
    spec = deploy_spec(
        EngineConfig(model="deepseek-ai/DeepSeek-V3-0324", tensor_parallel_size=4),
        GatewayConfig(),
        "x",
        deploy=DeployConfig(replicas=2),
    )
    render(spec, "compose", tmp_path)
    done = run([str(DOCKER_COMPOSE), "-f", "docker-compose.yaml", "config", "-q"], tmp_path)
    assert done.returncode == 0, done.stderr


@needs_compose
def test_docker_compose_accepts_prefill_and_decode_pools_with_an_engine_key(tmp_path: Path) -> None:
    config = EngineConfig(model="deepseek-ai/DeepSeek-V3-0324", tensor_parallel_size=4, kv_connector="ExampleConnector")
    deploy = DeployConfig(prefill_replicas=1, engine_api_key=True)
    render(deploy_spec(config, GatewayConfig(), "x", deploy=deploy), "compose", tmp_path)
    (tmp_path / "engine-api-key").write_text("k")
    refused = run([str(DOCKER_COMPOSE), "-f", "docker-compose.yaml", "config", "-q"], tmp_path)
    assert refused.returncode != 0 and "set ENGINE_API_KEY" in refused.stderr  # the key is required
    done = run([str(DOCKER_COMPOSE), "-f", "docker-compose.yaml", "config"], tmp_path, ENGINE_API_KEY="k")
    assert done.returncode == 0, done.stderr
    services = yaml.safe_load(done.stdout)["services"]
    assert services["prefill"]["environment"]["VLLM_API_KEY"] == "k"
    assert "--prefill-upstream" in services["gateway"]["entrypoint"]


@needs_compose
def test_docker_compose_accepts_rdma_settings_on_several_hosts(tmp_path: Path) -> None:
    spec = make("two-nodes")
    render(spec, "compose", tmp_path)
    done = run([str(DOCKER_COMPOSE), "-f", "docker-compose.node1.yaml", "config"], tmp_path, MASTER_ADDR="10.0.0.7")
    assert done.returncode == 0, done.stderr
    engine = yaml.safe_load(done.stdout)["services"]["engine"]
    assert engine["cap_add"] == ["IPC_LOCK"] and engine["restart"] == "no"
    assert engine["ulimits"]["memlock"] == {"soft": -1, "hard": -1}


@needs_promtool
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_promtool_accepts_the_compose_scrape_config_and_rules(layout: str, tmp_path: Path) -> None:
    render(make(layout), "compose", tmp_path)
    config = run([str(PROMTOOL), "check", "config", "prometheus.yml"], tmp_path)
    assert config.returncode == 0, config.stdout + config.stderr
    assert "SUCCESS: 1 rule files found" in config.stdout + config.stderr
    rules = run([str(PROMTOOL), "check", "rules", "alerts.yml"], tmp_path)
    assert rules.returncode == 0 and "SUCCESS: 6 rules found" in rules.stdout, rules.stdout + rules.stderr


@needs_promtool
def test_promtool_accepts_the_kubernetes_prometheus_rule(tmp_path: Path) -> None:
    spec = make("two-nodes")
    rule = kubernetes.prometheus_rule(spec)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rule["spec"]))
    done = run([str(PROMTOOL), "check", "rules", "rules.yml"], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


@needs_promtool
def test_promtool_catches_a_broken_rule(tmp_path: Path) -> None:
    """The check can fail: a rule with a PromQL syntax error is refused."""
    (tmp_path / "rules.yml").write_text(
        yaml.safe_dump({"groups": [{"name": "x", "rules": [{"alert": "Broken", "expr": "sum(rate(x[5m])"}]}]})
    )
    assert run([str(PROMTOOL), "check", "rules", "rules.yml"], tmp_path).returncode != 0


@needs_promtool
def test_promtool_accepts_kedas_queries(tmp_path: Path) -> None:
    spec = make("two-nodes", max_replicas=4, capacity_per_replica=32)
    triggers = kubernetes.scaled_object(spec)["spec"]["triggers"]
    rules = [{"record": f"deepserve:keda_{n}", "expr": t["metadata"]["query"]} for n, t in enumerate(triggers)]
    (tmp_path / "keda.yml").write_text(yaml.safe_dump({"groups": [{"name": "keda", "rules": rules}]}))
    done = run([str(PROMTOOL), "check", "rules", "keda.yml"], tmp_path)
    assert done.returncode == 0 and "SUCCESS: 2 rules found" in done.stdout, done.stdout + done.stderr


@needs_compose
@pytest.mark.parametrize(
    "fields",
    [
        {"gpu_type": "mi300x"},  # AMD: devices, groups, capabilities, seccomp, vLLM's ROCm image
        {"gpu_type": "mi300x", "tensor_parallel_size": 4, "replicas": 2},
        {"engine": "trtllm", "gpu_type": "h200"},  # the options file written by the entrypoint's script
    ],
)
def test_docker_compose_accepts_amd_and_trtllm_files(fields: dict[str, Any], tmp_path: Path) -> None:
    fields = dict(fields)
    replicas = fields.pop("replicas", 1)
    config = EngineConfig.model_validate({"model": "deepseek-ai/DeepSeek-R1", "tensor_parallel_size": 8, **fields})
    spec = deploy_spec(config, GatewayConfig(), command="test", deploy=DeployConfig(replicas=replicas))
    render(spec, "compose", tmp_path)
    quiet = run([str(DOCKER_COMPOSE), "-f", "docker-compose.yaml", "config", "-q"], tmp_path)
    assert quiet.returncode == 0, quiet.stderr
    resolved = run([str(DOCKER_COMPOSE), "-f", "docker-compose.yaml", "config"], tmp_path)
    engine = yaml.safe_load(resolved.stdout)["services"]["engine"]
    launch = spec.launch(0)
    expected = ["/bin/sh", "-c", launch.shell_script()] if launch.files else launch.argv
    assert engine["entrypoint"] == expected
