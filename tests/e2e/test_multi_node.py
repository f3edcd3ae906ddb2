"""Two "nodes" on loopback: vLLM's native multi-node runtime, pipeline parallel 2, the tiny model, started by two
`deepserve serve` processes as a cluster's nodes would start them. Node 0 serves the API behind the gateway; node 1
is a headless worker. Stopping node 0 stops both, and no engine process is left on either side."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
from openai import OpenAI

from deepserve.net import free_port

from .conftest import STARTUP_TIMEOUT_S


@dataclass
class Node:
    process: subprocess.Popen[str]
    output: list[str] = field(default_factory=list)
    marker: threading.Event = field(default_factory=threading.Event)
    fields: list[str] = field(default_factory=list)  # of the READY or WORKER line

    def tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.process.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def tail(self) -> str:
        return "\n".join(self.output[-30:])


def start_node(home: Path, rank: int, marker: str, *args: str) -> Node:
    command = [sys.executable, "-m", "deepserve.cli.main", "serve", "--node-rank", str(rank), *args]
    process = subprocess.Popen(
        command,
        env={**os.environ, "DEEPSERVE_HOME": str(home)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    node = Node(process)

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            node.output.append(line.rstrip())
            if line.startswith(marker + " "):
                node.fields = line.split()[1:]
                node.marker.set()
        node.marker.set()

    threading.Thread(target=pump, daemon=True).start()
    return node


def stop(node: Node) -> None:
    if node.process.poll() is None:
        node.process.send_signal(signal.SIGTERM)
    try:
        node.process.wait(timeout=90)
    except subprocess.TimeoutExpired:
        for proc in node.tree():
            proc.kill()


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Node, Node]]:
    home = tmp_path_factory.mktemp("multi-node-home")
    layout = [
        "--pipeline-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
        "--master-port", str(free_port()), "--join-port", str(free_port()), "--max-model-len", "4096",
    ]  # fmt: skip
    head = start_node(home, 0, "READY", "--port", str(free_port()), *layout)
    worker = start_node(home, 1, "WORKER", *layout)
    try:
        for node in (head, worker):
            assert node.marker.wait(STARTUP_TIMEOUT_S) and node.fields, f"node did not start:\n{node.tail()}"
        yield head, worker
    finally:
        stop(head)
        stop(worker)


def test_two_nodes_serve_completions_and_streamed_chat_through_the_gateway(two_nodes: tuple[Node, Node]) -> None:
    head, worker = two_nodes
    base_url, model = head.fields[0], head.fields[1]
    assert any("headless worker" in line for line in worker.output)
    client = OpenAI(base_url=base_url, api_key="unused")
    completion = client.completions.create(model=model, prompt="Hello", max_tokens=8)
    assert completion.usage is not None and completion.usage.completion_tokens == 8
    chunks = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Stream, please"}],
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    usage = [chunk.usage for chunk in chunks if chunk.usage is not None]
    assert usage and usage[-1].completion_tokens == 12


def test_stopping_node_zero_stops_both_and_leaves_no_engine_process(two_nodes: tuple[Node, Node]) -> None:
    head, worker = two_nodes
    pids = [proc.pid for node in (head, worker) for proc in node.tree()]
    assert len(pids) >= 4  # each deepserve with its engine and the engine's own processes
    head.process.send_signal(signal.SIGTERM)
    assert head.process.wait(timeout=90) == 0
    assert worker.process.wait(timeout=90) != 0, worker.tail()
    assert any("node 0 stopped the service" in line for line in worker.output), worker.tail()
    deadline = time.monotonic() + 30
    while left := [pid for pid in pids if running(pid)]:
        assert time.monotonic() < deadline, f"processes left: {left}"
        time.sleep(0.5)


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
