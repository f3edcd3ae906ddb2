"""docker compose for one host (one file; replicas on disjoint GPUs) and for two hosts (one file per node on the
host's network): the engine's entrypoint is the launcher's command, GPUs are reserved, Prometheus scrapes the engine
and the gateway with the labels the alerts use, Grafana gets the dashboard. (`docker-compose config` and promtool
run on these files in tests/integration/deploy.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from deepserve.deploy import compose
from deepserve.deploy.render import render
from deepserve.deploy.source import MASTER_PLACEHOLDER, DeploySpec
from deepserve.errors import ConfigError


def interpolated(words: list[str], master: str) -> list[str]:
    """What compose passes to the container: ${MASTER_ADDR:?…} set, $$ unescaped."""
    return [word.replace(compose.MASTER_VARIABLE, master).replace("$$", "$") for word in words]


def test_one_host_runs_the_launchers_command_with_gpus_shm_and_cache(make: Any) -> None:
    spec = make("one-node", fields={"extra_args": ["--speculative-config", '{"method": "mtp", "x": "$HOME"}']})
    document = compose.compose_files(spec)["docker-compose.yaml"]
    engine = document["services"]["engine"]
    assert interpolated(engine["entrypoint"], "") == spec.launch(0).argv  # the $ survives compose's interpolation
    assert engine["image"] == "vllm/vllm-openai:v0.32.0"
    assert engine["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "capabilities": ["gpu"], "count": 8}
    ]
    assert engine["ipc"] == "host"
    assert engine["volumes"] == ["~/.cache/huggingface:/root/.cache/huggingface"]
    assert engine["environment"]["HF_TOKEN"] == "${HF_TOKEN:-}"
    health = engine["healthcheck"]
    assert "http://127.0.0.1:8000/health" in health["test"][-1]
    assert int(health["start_period"].removesuffix("s")) >= spec.config.startup_timeout_s
    assert "network_mode" not in engine and "ports" not in engine  # only the gateway is published


def test_one_host_gateway_prometheus_and_grafana(make: Any) -> None:
    spec = make("one-node", fields={"port": 9000})
    services = compose.compose_files(spec)["docker-compose.yaml"]["services"]
    assert list(services) == ["engine", "gateway", "prometheus", "grafana"]
    gateway = services["gateway"]
    words = gateway["entrypoint"]
    assert words[:4] == ["python", "-m", "deepserve.cli.main", "gateway"]
    assert words[words.index("--upstream") + 1] == "http://engine:8000/v1"
    assert gateway["ports"] == ["9000:8000"]  # the public port, as `serve --port`
    assert gateway["volumes"] == ["./deepserve-home:/var/lib/deepserve"]
    assert services["prometheus"]["ports"] == ["127.0.0.1:9090:9090"]
    config = yaml.safe_load(compose.config_files(spec)["prometheus.yml"])
    jobs = {job["job_name"]: job["static_configs"][0] for job in config["scrape_configs"]}
    assert jobs["deepserve-engine"] == {"targets": ["engine:8000"], "labels": {"component": "engine"}}
    assert jobs["deepserve-gateway"] == {"targets": ["gateway:8000"], "labels": {"component": "gateway"}}
    assert config["rule_files"] == ["alerts.yml"]
    mounts = services["grafana"]["volumes"]
    assert "./grafana/dashboards:/var/lib/grafana/dashboards:ro" in mounts
    providers = yaml.safe_load(compose.config_files(spec)["grafana/provisioning/dashboards/deepserve.yaml"])
    assert providers["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"


def test_replicas_on_one_host_get_gpus_of_their_own(make: Any) -> None:
    spec = make("one-node", fields={"tensor_parallel_size": 4}, replicas=2)
    services = compose.compose_files(spec)["docker-compose.yaml"]["services"]
    devices = [services[name]["deploy"]["resources"]["reservations"]["devices"][0] for name in ("engine", "engine-1")]
    assert [device["device_ids"] for device in devices] == [["0", "1", "2", "3"], ["4", "5", "6", "7"]]
    words = services["gateway"]["entrypoint"]
    upstreams = [words[i + 1] for i, word in enumerate(words) if word == "--upstream"]
    assert upstreams == ["http://engine:8000/v1", "http://engine-1:8000/v1"]
    targets = yaml.safe_load(compose.config_files(spec)["prometheus.yml"])["scrape_configs"][0]["static_configs"]
    assert targets[0]["targets"] == ["engine:8000", "engine-1:8000"]


def test_more_replicas_than_the_host_holds_are_refused(make: Any) -> None:
    with pytest.raises(ConfigError, match="2 replicas x 8 GPUs need 16, and the host has 8"):
        compose.compose_files(make("one-node", fields={"gpu_type": "h200"}, replicas=2))
    fits = make("one-node", fields={"tensor_parallel_size": 4, "gpus_per_node": 8}, replicas=2)
    assert "engine-1" in compose.compose_files(fits)["docker-compose.yaml"]["services"]


@pytest.mark.parametrize("name", ["two-nodes-pp", "two-nodes-dp"])
def test_two_hosts_get_one_file_each_with_their_ranks_command(name: str, make: Any) -> None:
    spec: DeploySpec = make(name)
    files = compose.compose_files(spec)
    assert list(files) == ["docker-compose.node0.yaml", "docker-compose.node1.yaml"]
    for rank, document in enumerate(files.values()):
        engine = document["services"]["engine"]
        expected = spec.engine.launch_spec(
            spec.node_config(rank, "10.0.0.7").model_copy(update={"port": 8001, "host": "127.0.0.1"}), spec.model, None
        ).argv
        assert interpolated(engine["entrypoint"], "10.0.0.7") == expected
        assert MASTER_PLACEHOLDER not in json.dumps(document)
        assert engine["network_mode"] == "host"
        assert engine["env_file"] == ["network.env"]
    node0, node1 = files.values()
    assert list(node0["services"]) == ["engine", "gateway", "prometheus", "grafana"]
    assert list(node1["services"]) == ["engine"]  # a headless node: no API, no gateway
    assert "healthcheck" not in node1["services"]["engine"]
    words = node0["services"]["gateway"]["entrypoint"]
    assert words[words.index("--upstream") + 1] == "http://127.0.0.1:8001/v1"
    assert words[words.index("--port") + 1] == "8000"
    assert "#   GLOO_SOCKET_IFNAME" not in compose.config_files(spec)["network.env"]  # commented out, not empty


def test_a_given_master_address_is_written_as_is(make: Any) -> None:
    spec = make("two-nodes-pp", fields={"master_addr": "10.1.1.1"})
    entrypoint = compose.compose_files(spec)["docker-compose.node1.yaml"]["services"]["engine"]["entrypoint"]
    assert entrypoint[entrypoint.index("--master-addr") + 1] == "10.1.1.1"


def test_two_hosts_with_several_replicas_point_to_kubernetes(make: Any) -> None:
    with pytest.raises(ConfigError, match="--target kubernetes"):
        compose.compose_files(make("two-nodes-pp", replicas=2))


def test_files_start_with_how_they_were_made_and_how_to_apply_them(make: Any, tmp_path: Path) -> None:
    spec = make("two-nodes-pp")
    written = render(spec, "compose", tmp_path, "out")
    names = sorted(str(path.relative_to(tmp_path)) for path in written)
    assert names == [
        "alerts.yml",
        "docker-compose.node0.yaml",
        "docker-compose.node1.yaml",
        "grafana/dashboards/deepserve.json",
        "grafana/provisioning/dashboards/deepserve.yaml",
        "grafana/provisioning/datasources/prometheus.yaml",
        "network.env",
        "prometheus.yml",
        "restart-group.sh",
    ]
    for path in written:
        text = path.read_text().removeprefix("#!/bin/sh\n")
        if path.suffix == ".json":
            comment = json.loads(text)["__comment"]
            assert comment[0] == f"Made by deepserve 0.1.0: {spec.command}"
            continue
        assert text.startswith(f"# Made by deepserve 0.1.0: {spec.command}\n"), path
        assert "docker compose -f out/docker-compose.nodeR.yaml up -d" in text
        if path.suffix in (".yaml", ".yml"):
            yaml.safe_load(text)


def test_two_hosts_keep_the_engine_api_on_loopback_and_never_restart_one_node_alone(make: Any) -> None:
    files = compose.compose_files(make("two-nodes-pp"))
    for document in files.values():
        assert document["services"]["engine"]["restart"] == "no"
    node0 = files["docker-compose.node0.yaml"]["services"]["engine"]
    assert node0["entrypoint"][node0["entrypoint"].index("--host") + 1] == "127.0.0.1"  # not 0.0.0.0 on the host
    assert "127.0.0.1:8001/health" in node0["healthcheck"]["test"][-1]


def test_two_hosts_get_the_network_profile(make: Any) -> None:
    engine = compose.compose_files(make("two-nodes-pp", network={"ib_hca": "mlx5"}))["docker-compose.node1.yaml"]
    service = engine["services"]["engine"]
    assert service["devices"] == ["/dev/infiniband:/dev/infiniband"]
    assert service["cap_add"] == ["IPC_LOCK"]
    assert service["ulimits"] == {"memlock": {"soft": -1, "hard": -1}}
    assert service["environment"]["NCCL_IB_HCA"] == "mlx5"
    assert "NCCL_SOCKET_IFNAME" not in service["environment"]  # per host, in network.env
    tcp = compose.compose_files(make("two-nodes-pp", network={"network": "tcp"}))["docker-compose.node1.yaml"]
    assert "devices" not in tcp["services"]["engine"]
    assert tcp["services"]["engine"]["environment"]["NCCL_IB_DISABLE"] == "1"


def test_the_group_restart_stops_every_node_then_starts_node_0_first(make: Any, recorder: Any, tmp_path: Path) -> None:
    spec = make("two-nodes-pp")
    render(spec, "compose", tmp_path / "out", "out")
    script = tmp_path / "out" / compose.RESTART_SCRIPT
    assert script.stat().st_mode & 0o111  # executable
    recorder.programs("ssh")
    ran = recorder.run([str(script), "10.0.0.1", "10.0.0.2"])
    commands = [(call["argv"][0], call["argv"][1]) for call in ran]
    assert [host for host, _ in commands] == ["10.0.0.1", "10.0.0.2", "10.0.0.1", "10.0.0.2"]
    assert "docker-compose.node0.yaml stop engine" in commands[0][1]
    assert "docker-compose.node1.yaml stop engine" in commands[1][1]
    assert "MASTER_ADDR='10.0.0.1' docker compose -f docker-compose.node0.yaml up -d" in commands[2][1]
    assert "docker-compose.node1.yaml up -d" in commands[3][1]
    with pytest.raises(AssertionError):  # the wrong number of hosts is refused
        recorder.run([str(script), "10.0.0.1"])


def kv_transfer_config(service: dict[str, Any]) -> dict[str, Any]:
    """The JSON after --kv-transfer-config in a rendered engine's command."""
    words = interpolated(service["entrypoint"], "")
    parsed: dict[str, Any] = json.loads(words[words.index("--kv-transfer-config") + 1])
    return parsed


def test_one_host_prefill_and_decode_pools_behind_the_gateway(make: Any) -> None:
    spec = make("one-node", fields={"tensor_parallel_size": 2, "gpus_per_node": 8}, prefill_replicas=1, replicas=2)
    services = compose.compose_files(spec)["docker-compose.yaml"]["services"]
    assert list(services)[:3] == ["prefill", "decode", "decode-1"]
    devices = [services[name]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for name in
               ("prefill", "decode", "decode-1")]  # fmt: skip
    assert devices == [["0", "1"], ["2", "3"], ["4", "5"]]
    assert services["decode"]["environment"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "decode"
    words = services["gateway"]["entrypoint"]
    upstreams = [words[i + 1] for i, word in enumerate(words) if word == "--upstream"]
    prefill = [words[i + 1] for i, word in enumerate(words) if word == "--prefill-upstream"]
    assert upstreams == ["http://decode:8000/v1", "http://decode-1:8000/v1"]
    assert prefill == ["http://prefill:8000/v1"]
    roles = [kv_transfer_config(services[n]) for n in ("prefill", "decode")]
    assert [role["kv_role"] for role in roles] == ["kv_both", "kv_both"]  # NIXL's peers


def test_one_host_shared_directory_pools_and_an_engine_api_key(make: Any) -> None:
    spec = make("one-node", fields={"tensor_parallel_size": 4, "kv_connector": "ExampleConnector"},
                prefill_replicas=1, engine_api_key=True)  # fmt: skip
    document = compose.compose_files(spec)["docker-compose.yaml"]
    prefill, decode = document["services"]["prefill"], document["services"]["decode"]
    assert document["volumes"]["kv-transfer"] == {}
    for service, role in ((prefill, "kv_producer"), (decode, "kv_consumer")):
        assert "kv-transfer:/var/cache/deepserve/kv-transfer" in service["volumes"]
        transfer = kv_transfer_config(service)
        assert transfer["kv_role"] == role
        assert service["environment"]["VLLM_API_KEY"] == compose.ENGINE_KEY_VARIABLE
    gateway = document["services"]["gateway"]
    words = gateway["entrypoint"]
    assert words[words.index("--upstream-api-key-file") + 1] == "/run/secrets/engine-api-key"
    assert gateway["secrets"] == [{"source": "engine-api-key", "target": "engine-api-key"}]
    assert document["secrets"] == {"engine-api-key": {"file": "./engine-api-key"}}
