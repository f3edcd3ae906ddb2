"""Helpers for gateway integration tests: simulated upstreams and gateways, in this event loop or as processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import sqlite3
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvloop

from deepserve.gateway.app import GatewayApp
from deepserve.gateway.config import GatewayConfig
from deepserve.gateway.ledger import default_ledger_path
from deepserve.gateway.server import running_gateway
from deepserve.gateway.validation import CHAT_COMPLETIONS, parse_request
from deepserve.net import free_port
from deepserve.simulate.server import SimulatorServer
from tests.helpers import Child, simulator, start_simulator
from tests.helpers import start_gateway as start_gateway  # the gateway tests' own, now shared with e2e

# Test modules whose tests run on both event loops: the upstream client's protocol code meets uvloop's transports
# in the gateway process and asyncio's in tests elsewhere, and they differ (pause/resume, close, errors).
BOTH_LOOPS_MODULES = ("test_http_client.py",)
UPSTREAM_MAX_MODEL_LEN = 4096  # the upstreams' context: a request for 5000 tokens is beyond it


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    if item.path.name in BOTH_LOOPS_MODULES:
        return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop}  # one factory: test ids are unchanged


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


def upstream(
    ttft_ms: float = 0.0, itl_ms: float = 0.0, **options: Any
) -> contextlib.AbstractAsyncContextManager[SimulatorServer]:
    """A simulated upstream in this event loop, with fixed timings (options: deepserve.simulate.fixed_timing's),
    a context of UPSTREAM_MAX_MODEL_LEN, and the request bodies it received kept (app.stats.bodies)."""
    options.setdefault("engine", {"max_model_len": UPSTREAM_MAX_MODEL_LEN})
    options.setdefault("record_bodies", True)
    return simulator(ttft_ms, itl_ms, **options)


def start_upstream(*flags: str) -> Child:
    """`deepserve simulate` as its own process, with fixed timings (FLAGS add --fixed-ttft-ms, --fixed-itl-ms, …)."""
    context = ("--max-model-len", str(UPSTREAM_MAX_MODEL_LEN))
    timing = () if any(flag.startswith("--fixed-") for flag in flags) else ("--fixed-itl-ms", "0")
    return start_simulator(*context, *timing, *flags)


@pytest.fixture
def children() -> Iterator[list[Child]]:
    """Processes a test starts; all are stopped at the end, whatever happens."""
    started: list[Child] = []
    yield started
    for child in started:
        child.kill()


@contextlib.asynccontextmanager
async def upstream_and_gateway(
    clock: Callable[[], float] | None = None, upstream_options: dict[str, Any] | None = None, **fields: object
) -> AsyncIterator[tuple[SimulatorServer, GatewayApp, httpx.AsyncClient]]:
    """An in-process simulated upstream (UPSTREAM_OPTIONS: upstream's), a gateway in front of it (timed by CLOCK
    when given), and a client of the gateway (base URL …/v1)."""
    async with upstream(**(upstream_options or {})) as served:
        config = gateway_config(served.base_url, **fields)
        app = GatewayApp(config, clock=clock) if clock is not None else None
        async with (
            running_gateway(config, app) as (app, url),
            httpx.AsyncClient(base_url=url, timeout=30) as client,
        ):
            yield served, app, client


# ---- a real Redis for the shared limits ----------------------------------------------------------------------------


@dataclass
class RedisServer:
    """A redis-server of our own on a free loopback port (nothing persisted)."""

    process: subprocess.Popen[bytes]
    port: int
    password: str | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def flush(self) -> None:
        import redis

        client = redis.Redis(port=self.port, password=self.password, socket_timeout=5)
        try:
            client.flushall()
        finally:
            client.close()


def start_redis_server(
    port: int | None = None, *, password: str | None = None, args: tuple[str, ...] = ()
) -> RedisServer:
    """A redis-server on PORT (a free one by default) asking for PASSWORD, with ARGS added to its command line."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip(
            "redis-server is not installed (Debian: `apt-get install -y redis-server`; ./run-tests installs it where "
            "it may); the shared-limits tests need a real Redis"
        )
    port = port or free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--protected-mode", "no", "--loglevel", "warning", *args]  # fmt: skip
    if password:
        argv += ["--requirepass", password]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    server = RedisServer(process, port, password)
    import redis

    deadline = time.monotonic() + 30  # a bound for a loaded machine: it answers in milliseconds when idle
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"redis-server exited: {process.stderr.read().decode() if process.stderr else ''}")
        client = redis.Redis(port=port, password=password, socket_timeout=1, socket_connect_timeout=1)
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
