"""One real `deepserve serve` (vLLM's CPU build, tiny model) for the whole test session.

Tests that need the live service take the `served_tiny` fixture. It is started once, on a free port, in a
session-scoped DEEPSERVE_HOME, and stopped with SIGTERM at the end; `served_tiny.engine_pids` lets a test check
that nothing was left running.
"""

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

from deepserve.net import free_port

STARTUP_TIMEOUT_S = 600


@dataclass
class ServedTiny:
    base_url: str  # http://127.0.0.1:PORT/v1, what clients use (the gateway)
    model: str  # the served model name
    process: subprocess.Popen[str]
    home: Path
    engine_url: str = ""  # the engine's own base URL behind the gateway (its /metrics are vLLM's)
    output: list[str] = field(default_factory=list)

    @property
    def root_url(self) -> str:
        return self.base_url.removesuffix("/v1")

    def process_tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.process.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []


def start_deepserve(home: Path, *args: str) -> ServedTiny:
    """Start `deepserve serve ARGS` and block until it prints its READY line."""
    port = free_port()
    env = {**os.environ, "DEEPSERVE_HOME": str(home)}
    command = [sys.executable, "-m", "deepserve.cli.main", "serve", "--port", str(port), *args]
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL
    )
    served = ServedTiny(base_url="", model="", process=process, home=home)
    ready = threading.Event()
    threading.Thread(target=_pump, args=(served, ready), daemon=True).start()
    try:
        became_ready = ready.wait(STARTUP_TIMEOUT_S) and bool(served.base_url)
    except BaseException:  # Ctrl-C while waiting: never leave the service running on its own
        stop_deepserve(served)
        raise
    if not became_ready:
        stop_deepserve(served)
        pytest.fail("deepserve serve did not become ready:\n" + "\n".join(served.output[-40:]))
    return served


def _pump(served: ServedTiny, ready: threading.Event) -> None:
    assert served.process.stdout is not None
    for line in served.process.stdout:
        served.output.append(line.rstrip())
        if line.startswith("READY "):
            _, served.base_url, served.model, served.engine_url = line.split()
            ready.set()
    ready.set()  # the process ended: wake the waiter, which sees no base_url


def stop_deepserve(served: ServedTiny, timeout_s: float = 60) -> int:
    if served.process.poll() is None:
        served.process.send_signal(signal.SIGTERM)
    try:
        return served.process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for proc in served.process_tree():
            proc.kill()
        raise


@pytest.fixture(scope="session")
def served_tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedTiny]:
    served = start_deepserve(tmp_path_factory.mktemp("served-home"))
    yield served
    stop_and_wait(served)


@pytest.fixture(scope="session")
def served_tiny_stream_interval_4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedTiny]:
    """A second instance, without the gateway, whose vLLM sends one SSE event per 4 tokens (--stream-interval 4),
    as MTP or speculative decoding would: started once, only for the tests that take it."""
    served = start_deepserve(
        tmp_path_factory.mktemp("served-interval-4"), "--no-gateway", "--", "--stream-interval", "4"
    )
    yield served
    stop_and_wait(served)


def stop_and_wait(served: ServedTiny, timeout_s: float = 30) -> None:
    """Stop the service, then wait for its engine processes to be gone."""
    engine_pids = [proc.pid for proc in served.process_tree()]
    stop_deepserve(served)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(psutil.pid_exists(pid) for pid in engine_pids[1:]):
        time.sleep(0.5)
