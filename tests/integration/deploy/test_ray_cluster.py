"""A real two-node Ray cluster on loopback, run as a user runs it: `deepserve cluster start --head`, then `deepserve
cluster start --address` for the second node (its own DEEPSERVE_HOME and Ray temp dir, as a second machine would
have), `deepserve cluster status` listing both nodes and their GPUs, serve's wait for the GPUs a layout needs, and
`deepserve cluster stop` leaving no Ray process behind. (Ray counts GPUs it is told about: `--num-gpus 1` on this
CPU machine gives each node one logical GPU, which is all the wait looks at.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from deepserve.deploy.ray_backend import wait_for_ray_gpus
from deepserve.engines.config import EngineConfig
from deepserve.errors import EngineError
from deepserve.net import free_port

pytest.importorskip("ray", reason="Ray is not installed: `pip install ray` (it is in the dev extra)")


@dataclass
class Node:
    home: Path
    temp_dir: Path

    def cli(self, *args: str, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "deepserve.cli.main", *args],
            env={**os.environ, "DEEPSERVE_HOME": str(self.home), "RAY_USAGE_STATS_ENABLED": "0"},
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )

    def record(self) -> dict[str, Any] | None:
        path = self.home / "cluster" / "ray-node.json"
        return json.loads(path.read_text()) if path.exists() else None


def ray_processes(sessions: set[int], temp_dirs: list[Path]) -> list[psutil.Process]:
    """Processes of the sessions `ray start` ran in, or mentioning our temp dirs: what our nodes started."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            line = " ".join(process.info["cmdline"] or [])
            if process.status() == psutil.STATUS_ZOMBIE:
                continue
            if os.getsid(process.pid) in sessions or any(str(temp) in line for temp in temp_dirs):
                found.append(process)
        except (psutil.Error, OSError):
            continue
    return found


@pytest.fixture
def two_nodes(tmp_path: Path) -> Iterator[tuple[Node, Node, int]]:
    # Ray's socket paths must stay short: a temp dir of our own directly under /tmp.
    head = Node(tmp_path / "head-home", Path(f"/tmp/dsray-{os.getpid()}-h"))
    worker = Node(tmp_path / "worker-home", Path(f"/tmp/dsray-{os.getpid()}-w"))
    port = free_port()
    sessions: set[int] = set()
    try:
        yield head, worker, port
    finally:
        for node in (worker, head):
            record = node.record()
            if record:
                sessions.add(record["pid"])
                node.cli("cluster", "stop")
        for process in ray_processes(sessions, [head.temp_dir, worker.temp_dir]):  # only if a stop failed
            process.kill()
        for node in (head, worker):
            shutil.rmtree(node.temp_dir, ignore_errors=True)


def test_two_node_cluster_status_wait_and_stop(two_nodes: tuple[Node, Node, int]) -> None:
    head, worker, port = two_nodes
    common = ["--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--num-gpus", "1"]
    started = head.cli("cluster", "start", "--head", "--port", str(port), *common, "--temp-dir", str(head.temp_dir))
    assert started.returncode == 0, started.stderr + started.stdout
    assert "VLLM_HOST_IP=127.0.0.1" in started.stdout and "NCCL_SOCKET_IFNAME=lo" in started.stdout
    assert f"deepserve cluster start --address 127.0.0.1:{port}" in started.stdout
    address = f"127.0.0.1:{port}"
    joined = worker.cli("cluster", "start", "--address", address, *common, "--temp-dir", str(worker.temp_dir))
    assert joined.returncode == 0, joined.stderr + joined.stdout

    status = worker.cli("cluster", "status", "--address", address, "--json")
    assert status.returncode == 0, status.stderr
    nodes = json.loads(status.stdout)["nodes"]
    assert len(nodes) == 2 and all(node["alive"] for node in nodes)
    assert sorted(node["is_head"] for node in nodes) == [False, True]
    assert sum(node["gpus"] for node in nodes) == 2
    table = head.cli("cluster", "status")  # the head's own record gives the address
    assert "2 node(s) alive, 2 GPU(s)" in table.stdout, table.stderr

    progress: list[str] = []
    ray_layout = EngineConfig(tensor_parallel_size=2, distributed_executor_backend="ray", join_timeout_s=1)
    ready = wait_for_ray_gpus(ray_layout, lambda phase, s: progress.append(phase), address=address)
    assert ready is not None and ready.gpus == 2 and progress == []
    too_big = ray_layout.model_copy(update={"tensor_parallel_size": 4})
    with pytest.raises(EngineError, match="has 2 GPUs after 1 s"):
        wait_for_ray_gpus(too_big, lambda phase, s: progress.append(phase), address=address, sleep=lambda s: None)
    assert progress and set(progress) == {f"waiting for the Ray cluster at {address}: 2 of 4 GPUs on 2 node(s)"}

    sessions = {record["pid"] for record in (head.record(), worker.record()) if record}
    assert len(sessions) == 2
    assert ray_processes(sessions, [head.temp_dir, worker.temp_dir])
    assert (head.temp_dir / "ray_current_cluster").read_text().strip().endswith(f":{port}")
    for node in (worker, head):
        stopped = node.cli("cluster", "stop")
        assert stopped.returncode == 0 and "stopped the Ray" in stopped.stdout, stopped.stderr
        assert node.record() is None
        # as after `ray stop`: Ray's own discovery (`auto`) no longer finds a cluster that is gone
        assert not (node.temp_dir / "ray_current_cluster").exists()
    assert ray_processes(sessions, [head.temp_dir, worker.temp_dir]) == []
