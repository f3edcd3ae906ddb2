"""Helpers for gateway integration tests: fake upstreams and gateways, in this event loop or as processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import uvloop

from deepserve._compat import timeout
from deepserve.gateway.app import GatewayApp
from deepserve.gateway.config import GatewayConfig, gateway_argv
from deepserve.gateway.fake_upstream import FakeBehaviour, FakeUpstream, running_fake_upstream
from deepserve.gateway.ledger import default_ledger_path
from deepserve.gateway.server import running_gateway
from deepserve.gateway.validation import CHAT_COMPLETIONS, parse_request
from deepserve.net import free_port

# Test modules whose tests run on both event loops: the upstream client's protocol code meets uvloop's transports
# in the gateway process and asyncio's in tests elsewhere, and they differ (pause/resume, close, errors).
BOTH_LOOPS_MODULES = ("test_http_client.py",)


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    if item.path.name in BOTH_LOOPS_MODULES:
        return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop}  # one factory: test ids are unchanged


class FakeClock:
    """A clock that moves only when the test moves it (`now_s += …`)."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


async def until(condition: Callable[[], bool], timeout_s: float = 10.0, interval_s: float = 0.005) -> None:
    """Wait for CONDITION, something the network, another task or another process brings about (looking every
    INTERVAL_S); fail after TIMEOUT_S, a bound for a machine under heavy load, not a measurement."""
    async with timeout(timeout_s):
        while not condition():
            await asyncio.sleep(interval_s)


def prompt_estimate(body: dict[str, Any]) -> int:
    """The tokens the gateway estimates for BODY's prompt (what it charges besides max_tokens) on a chat request."""
    models = {str(body["model"]): None}
    return parse_request(CHAT_COMPLETIONS, json.dumps(body).encode(), models, {}).prompt_tokens_estimate


def ledger_rows(columns: str = "*") -> list[tuple[Any, ...]]:
    """The rows of the default usage ledger, oldest first (flush the gateway's ledger first)."""
    with contextlib.closing(sqlite3.connect(default_ledger_path())) as db:
        return db.execute(f"SELECT {columns} FROM usage ORDER BY rowid").fetchall()


def gateway_config(*upstreams: str, **fields: object) -> GatewayConfig:
    values = {"upstream": list(upstreams), "port": 0, "health_check_interval_s": 0.2, **fields}
    return GatewayConfig.model_validate(values)


@dataclass
class Child:
    """A process that announces its URL with a READY line on stdout."""

    process: subprocess.Popen[str]
    url: str = ""
    output: list[str] = field(default_factory=list)
    pump: threading.Thread | None = None  # reads the process's output into `output`

    @property
    def pid(self) -> int:
        return self.process.pid

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.wait()

    def wait(self) -> int:
        """The exit code, once the process ended and all of its output is in `output` (killed after 90 s: a bound
        for a loaded machine, where a drain and the ledger's last writes take seconds instead of milliseconds)."""
        try:
            code = self.process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait(timeout=5)
        if self.pump is not None:
            self.pump.join(timeout=10)
        return code


def start_child(argv: list[str], ready_prefix: str, timeout_s: float = 30) -> Child:
    process = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL, env=os.environ
    )
    child = Child(process)
    ready = threading.Event()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            child.output.append(line.rstrip())
            if line.startswith(ready_prefix):
                child.url = line.split()[-1]
                ready.set()
        ready.set()

    child.pump = threading.Thread(target=pump, daemon=True)
    child.pump.start()
    if not ready.wait(timeout_s) or not child.url:
        child.kill()
        raise AssertionError(f"{argv} did not become ready:\n" + "\n".join(child.output[-30:]))
    return child


def start_fake(*args: str) -> Child:
    argv = [sys.executable, "-m", "deepserve.gateway.fake_upstream", "--port", str(free_port()), *args]
    return start_child(argv, "FAKE READY")


def start_gateway(config: GatewayConfig) -> Child:
    return start_child(gateway_argv(config, sys.executable), "GATEWAY READY")


@pytest.fixture
def children() -> Iterator[list[Child]]:
    """Processes a test starts; all are stopped at the end, whatever happens."""
    started: list[Child] = []
    yield started
    for child in started:
        child.kill()


@contextlib.asynccontextmanager
async def fake_and_gateway(
    behaviour: FakeBehaviour | None = None, clock: Callable[[], float] | None = None, **fields: object
) -> AsyncIterator[tuple[FakeUpstream, GatewayApp, httpx.AsyncClient]]:
    """An in-process fake upstream, a gateway in front of it (timed by CLOCK when given), and a client of the
    gateway (base URL …/v1)."""
    async with running_fake_upstream(behaviour) as (fake, upstream):
        config = gateway_config(upstream, **fields)
        app = GatewayApp(config, clock=clock) if clock is not None else None
        async with (
            running_gateway(config, app) as (app, url),
            httpx.AsyncClient(base_url=url, timeout=30) as client,
        ):
            yield fake, app, client


# ---- a real Redis for the shared limits ----------------------------------------------------------------------------


@dataclass
class RedisServer:
    """A redis-server of our own on a free loopback port (nothing persisted)."""

    process: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def flush(self) -> None:
        import redis

        client = redis.Redis(port=self.port, socket_timeout=5)
        try:
            client.flushall()
        finally:
            client.close()


def start_redis_server(port: int | None = None) -> RedisServer:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip(
            "redis-server is not installed (Debian: `apt-get install -y redis-server`; ./run-tests installs it where "
            "it may); the shared-limits tests need a real Redis"
        )
    port = port or free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--protected-mode", "no", "--loglevel", "warning"]  # fmt: skip
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    server = RedisServer(process, port)
    import redis

    deadline = time.monotonic() + 30  # a bound for a loaded machine: it answers in milliseconds when idle
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"redis-server exited: {process.stderr.read().decode() if process.stderr else ''}")
        client = redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1)
        try:
            if client.ping():
                return server
        except redis.exceptions.ConnectionError:
            time.sleep(0.05)
        finally:
            client.close()
    process.kill()
    raise AssertionError("redis-server did not answer PING within 30 s")


def stop_redis_server(server: RedisServer) -> None:
    if server.process.poll() is None:
        server.process.terminate()
        try:
            server.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()


@pytest.fixture(scope="session")
def redis_session() -> Iterator[RedisServer]:
    """One redis-server for the whole test session."""
    server = start_redis_server()
    yield server
    stop_redis_server(server)


@pytest.fixture
def redis_server(redis_session: RedisServer) -> RedisServer:
    """The session's Redis, emptied for this test."""
    redis_session.flush()
    return redis_session
