"""SimulatorThread: the simulator on its own loop for synchronous tests, and no thread left behind when it cannot
start."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest

from deepserve.engines.config import EngineConfig
from deepserve.simulate.config import SimulateConfig
from deepserve.simulate.server import SimulatorThread
from deepserve.simulate.setup import resolve

pytestmark = pytest.mark.timeout(60)
CONFIG = SimulateConfig(fixed_ttft_ms=0, fixed_itl_ms=0)
DEPLOYMENT = resolve(EngineConfig(model="fake"), CONFIG)


def _simulator_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "deepserve-simulate"]


def test_a_sync_test_talks_to_the_thread_and_reads_its_state() -> None:
    with SimulatorThread(DEPLOYMENT, CONFIG) as simulator:
        reply = httpx.post(
            simulator.base_url + "/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 3}, timeout=10
        )
        assert reply.json()["usage"]["completion_tokens"] == 3
        assert simulator.call(lambda: simulator.app.stats.completed) == 1
    assert _simulator_threads() == []


def test_a_port_in_use_fails_the_start_and_leaves_no_thread() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError), SimulatorThread(DEPLOYMENT, CONFIG, port=port):
            pass
    assert _simulator_threads() == []
