"""vLLM on Ray: what `serve` refuses before anything starts, the wait (with progress) until the Ray cluster has the
GPUs the layout needs, and how `deepserve cluster start` resolves a node's settings. The cluster itself runs for real
in tests/integration/deploy/test_ray_cluster.py."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from deepserve.deploy.netif import Interface
from deepserve.deploy.ray_backend import CPU_REFUSAL, check_ray_backend, wait_for_ray_gpus
from deepserve.deploy.ray_cluster import (
    ClusterError,
    ClusterStatus,
    RayNode,
    RayNodeRecord,
    _forget_ray_address,
    cluster_address,
    cluster_status,
    node_from_ray,
    ray_address_file,
    ray_node_settings,
    read_record,
    record_path,
    stop_node,
    where,
)
from deepserve.engines.config import EngineConfig
from deepserve.errors import ConfigError, EngineError
from deepserve.net import free_port
from deepserve.serve import service_plan as service
from deepserve.serve.service_plan import plan_service
from tests.helpers import FakeClock

RAY = {"model": "deepseek-ai/DeepSeek-V3", "tensor_parallel_size": 8, "pipeline_parallel_size": 2}
INTERFACES = (
    Interface("lo", ("127.0.0.1",), True),
    Interface("eth0", ("10.0.0.5",), True),
    Interface("ib0", ("192.168.1.5",), True),
)


def ray_config(**fields: Any) -> EngineConfig:
    return EngineConfig.model_validate({**RAY, "distributed_executor_backend": "ray", **fields})


def node(gpus: float, alive: bool = True, head: bool = False) -> RayNode:
    return RayNode("id", "10.0.0.5", "host", alive, head, gpus, 8, 0)


def test_ray_on_cpu_is_refused_with_vllms_reason() -> None:
    with pytest.raises(ConfigError, match=CPU_REFUSAL):
        check_ray_backend(ray_config(), on_cpu=True)
    check_ray_backend(ray_config(), on_cpu=False)
    check_ray_backend(EngineConfig(), on_cpu=True)  # not Ray: nothing to say


def test_serve_refuses_ray_on_cpu_before_anything_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service, "has_gpu", lambda: False)
    with pytest.raises(ConfigError, match=CPU_REFUSAL):
        plan_service(EngineConfig(distributed_executor_backend="ray"))


def test_ray_with_nnodes_is_refused() -> None:
    with pytest.raises(ConfigError, match="without --nnodes"):
        check_ray_backend(ray_config(nnodes=2, master_addr="10.0.0.1"), on_cpu=False)


def test_a_ray_layout_may_exceed_this_nodes_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """TP 8 x PP 2 on a head with 8 GPUs: Ray places the second stage on another node."""
    monkeypatch.setattr(service, "has_gpu", lambda: False)
    plan = plan_service(ray_config(device="cuda", gpus_per_node=8), on_this_machine=False)
    assert "--distributed-executor-backend ray" in plan.launch.shell_line()
    assert "--nnodes" not in plan.launch.argv
    with pytest.raises(ConfigError, match="needs 16 GPUs per node"):
        plan_service(EngineConfig.model_validate({**RAY, "device": "cuda", "gpus_per_node": 8}), on_this_machine=False)


def test_wait_returns_once_the_cluster_has_the_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "")  # restored (unset) after the test, whatever the wait sets
    monkeypatch.delenv("RAY_ADDRESS")
    answers: list[Any] = [
        ClusterError("connection refused"),
        ClusterStatus("10.0.0.5:6379", (node(8, head=True),)),
        ClusterStatus("10.0.0.5:6379", (node(8, head=True), node(8, alive=False))),
        ClusterStatus("10.0.0.5:6379", (node(8, head=True), node(8))),
    ]
    asked: list[str] = []

    def read(address: str) -> ClusterStatus:
        asked.append(address)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    progress: list[str] = []
    clock = FakeClock(0.0)
    status = wait_for_ray_gpus(
        ray_config(), lambda phase, elapsed: progress.append(phase), read, clock, clock.sleep, "10.0.0.5:6379"
    )
    assert status is not None and status.gpus == 16
    assert asked == ["10.0.0.5:6379"] * 4
    assert progress == [
        "waiting for the Ray cluster at 10.0.0.5:6379: not reachable yet",
        "waiting for the Ray cluster at 10.0.0.5:6379: 8 of 16 GPUs on 1 node(s)",
        "waiting for the Ray cluster at 10.0.0.5:6379: 8 of 16 GPUs on 1 node(s)",  # a dead node counts for nothing
    ]
    assert os.environ["RAY_ADDRESS"] == "10.0.0.5:6379"  # so that vLLM's ray.init() joins this cluster


def test_wait_gives_up_after_the_join_timeout_saying_what_is_missing() -> None:
    clock = FakeClock(0.0)
    config = ray_config(join_timeout_s=60)
    lonely = ClusterStatus("10.0.0.5:6379", (node(8, head=True),))
    with pytest.raises(EngineError) as raised:
        wait_for_ray_gpus(config, lambda *a: None, lambda address: lonely, clock, clock.sleep, "10.0.0.5:6379")
    message = str(raised.value)
    assert "has 8 GPUs after 60 s" in message and "needs 16" in message
    assert "deepserve cluster start --address 10.0.0.5:6379" in message
    assert clock.now_s <= 60 + 2 * 5.0


def test_wait_does_nothing_without_ray() -> None:
    def never(address: str) -> ClusterStatus:
        raise AssertionError("asked the cluster")

    assert wait_for_ray_gpus(EngineConfig(), lambda *a: None, never) is None


def test_node_settings_pin_vllm_and_the_collectives_to_the_nodes_interface() -> None:
    settings = ray_node_settings(head=True, node_ip="192.168.1.5", num_gpus=8, interfaces=INTERFACES, environ={})
    assert settings.interface == "ib0"
    assert settings.environment == {
        "VLLM_HOST_IP": "192.168.1.5",
        "NCCL_SOCKET_IFNAME": "ib0",
        "GLOO_SOCKET_IFNAME": "ib0",
    }
    assert settings.head_address == "192.168.1.5:6379"
    assert settings.argv("ray") == [
        "ray", "start", "--head", "--port", "6379", "--node-ip-address", "192.168.1.5", "--num-gpus", "8",
        "--disable-usage-stats", "--block",
    ]  # fmt: skip


def test_node_settings_keep_variables_the_user_set() -> None:
    settings = ray_node_settings(
        head=True, node_ip="10.0.0.5", num_gpus=8, interfaces=INTERFACES, environ={"NCCL_SOCKET_IFNAME": "=ib0"}
    )
    assert settings.environment["NCCL_SOCKET_IFNAME"] == "=ib0"
    assert settings.environment["GLOO_SOCKET_IFNAME"] == "eth0"


def test_worker_settings_join_the_head() -> None:
    settings = ray_node_settings(
        head=False, address="127.0.0.1:6400", node_ip="127.0.0.1", num_cpus=1, num_gpus=1, temp_dir="/tmp/r"
    )
    assert settings.interface == "lo"
    argv = settings.argv("ray")
    assert argv[:4] == ["ray", "start", "--address", "127.0.0.1:6400"]
    assert argv[argv.index("--temp-dir") + 1] == "/tmp/r" and argv[argv.index("--num-cpus") + 1] == "1"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"head": True, "address": "10.0.0.1:6379"}, "either --head"),
        ({"head": False}, "either --head"),
        ({"head": False, "address": "10.0.0.1"}, "HOST:PORT"),
        ({"head": True, "node_ip": "10.9.9.9"}, "not an address of this machine"),
        ({"head": True, "port": 0}, "--port 0 is not a TCP port"),
        ({"head": False, "address": "10.0.0.1:6379", "port": 7000}, "a worker joins the port given in --address"),
        ({"head": True, "num_gpus": -1}, "--num-gpus -1 cannot be negative"),
        ({"head": True, "num_cpus": -2}, "--num-cpus -2 cannot be negative"),
    ],
)
def test_node_settings_refuse_what_cannot_work(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ray_node_settings(interfaces=INTERFACES, **{"num_gpus": 1, **kwargs})


def test_a_record_that_does_not_parse_names_the_file_to_remove(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPSERVE_HOME", str(tmp_path))
    record_path().parent.mkdir(parents=True)
    record_path().write_text('{"pid": 12')  # cut short
    with pytest.raises(ClusterError, match="remove that file"):
        read_record()
    with pytest.raises(ClusterError, match="remove that file"):
        stop_node()


def test_auto_fails_fast_on_the_address_ray_recorded_for_a_cluster_that_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("DEEPSERVE_HOME", str(tmp_path / "home"))
    ray_address_file(None).parent.mkdir()
    ray_address_file(None).write_text(f"127.0.0.1:{free_port()}")
    with pytest.raises(ClusterError, match=r"recorded in .*ray_current_cluster: that cluster is gone"):
        cluster_status()


def test_stopping_a_node_forgets_rays_record_of_its_cluster_only(tmp_path: Path) -> None:
    record = RayNodeRecord(1, 0.0, "head", "10.0.0.5:6379", "10.0.0.5", "log", ["ray", "--temp-dir", str(tmp_path)], {})
    ray_address_file(str(tmp_path)).write_text("10.0.0.9:6400\n")  # another cluster: kept
    _forget_ray_address(record)
    assert ray_address_file(str(tmp_path)).exists()
    ray_address_file(str(tmp_path)).write_text("192.168.1.5:6379\n")  # Ray may record another of the head's IPs
    _forget_ray_address(record)
    assert not ray_address_file(str(tmp_path)).exists()


def test_messages_say_where_rays_own_discovery_looks() -> None:
    assert where("10.0.0.1:6379") == "at 10.0.0.1:6379"
    assert "on this machine" in where("auto")


def test_cluster_address_prefers_the_flag_then_ray_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.9:6379")
    assert cluster_address("10.0.0.1:1") == "10.0.0.1:1"
    assert cluster_address() == "10.0.0.9:6379"
    monkeypatch.delenv("RAY_ADDRESS")
    assert cluster_address() == "auto"  # no node started here: Ray's own discovery


def test_nodes_are_read_from_rays_api() -> None:
    entry = {
        "NodeID": "abc",
        "Alive": True,
        "NodeManagerAddress": "10.0.0.5",
        "NodeManagerHostname": "gpu-1",
        "Resources": {"GPU": 8.0, "CPU": 104.0, "memory": 1e12, "node:__internal_head__": 1.0},
    }
    assert node_from_ray(entry) == RayNode("abc", "10.0.0.5", "gpu-1", True, True, 8.0, 104.0, 10**12)
    assert node_from_ray({"NodeID": "x", "Alive": False}).gpus == 0
