"""The simulator listening on HOST:PORT in the running event loop: the engine and the app (app.py) built, each
connection served by http.py's protocol. `running_simulator` serves it for a block of async code; thread.py's
SimulatorThread runs it beside sync code."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from deepserve.simulate.app import SimulatorApp
from deepserve.simulate.clock import LoopClock, SimClock
from deepserve.simulate.config import SimulateConfig
from deepserve.simulate.http import Connection
from deepserve.simulate.send_log import KernelStampedServer
from deepserve.simulate.setup import SimulatedDeployment, build_engine


class SimulatorServer:
    """The simulator listening on HOST:PORT in the running event loop (PORT 0: any free port)."""

    def __init__(self, deployment: SimulatedDeployment, config: SimulateConfig) -> None:
        self.deployment = deployment
        self.config = config
        self._app: SimulatorApp | None = None
        self._server: asyncio.AbstractServer | None = None
        self._stamped: KernelStampedServer | None = None
        self._connections: set[Connection] = set()  # open now: close() drops them
        self.host = "127.0.0.1"
        self.port = 0

    async def start(self, host: str = "127.0.0.1", port: int = 0, clock: SimClock | None = None) -> SimulatorApp:
        """Listen on HOST:PORT (0: any free port), the engine timed by CLOCK (default: the loop's, scaled by
        time_scale; a ManualClock lets a test move time by hand)."""
        clock = clock or LoopClock(self.config.time_scale)
        engine = build_engine(self.deployment, self.config, clock)
        app = SimulatorApp(self.deployment, self.config, engine, clock)

        def connection() -> Connection:
            return Connection(app, self._connections)

        if self.config.log_sends:  # kernel receive times: connections on the raw-socket transport
            self._stamped = KernelStampedServer(connection, host, port)
            self.port = self._stamped.port
        else:
            loop = asyncio.get_running_loop()
            self._server = await loop.create_server(connection, host, port, backlog=4096)
            self.port = int(self._server.sockets[0].getsockname()[1])
        self.host = host
        self._app = app
        return app

    @property
    def app(self) -> SimulatorApp:
        """The running simulator's state (stats, controls, engine): there once start() has returned."""
        if self._app is None:
            raise RuntimeError("the simulator has not started: call start() (or use running_simulator) first")
        return self._app

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (…/v1), as `deepserve serve` prints it."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    @property
    def root_url(self) -> str:
        return self.base_url.removesuffix("/v1")

    async def close(self) -> None:
        """Stop listening and drop every connection (streams in flight and hung requests end as cut off)."""
        if self._stamped is not None:
            self._stamped.close()
            self._stamped = None
        if self._server is not None:
            self._server.close()
            self._server = None
        for conn in list(self._connections):
            conn.abort()
        await asyncio.sleep(0)  # let the aborted connections' connection_lost run


@contextlib.asynccontextmanager
async def running_simulator(
    deployment: SimulatedDeployment,
    config: SimulateConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    clock: SimClock | None = None,
) -> AsyncIterator[SimulatorServer]:
    """The simulator serving in this event loop until the block ends (CLOCK: as SimulatorServer.start)."""
    server = SimulatorServer(deployment, config)
    await server.start(host, port, clock)
    try:
        yield server
    finally:
        await server.close()


def __getattr__(name: str) -> Any:
    """SimulatorThread lives in thread.py now. TEMPORARY: tests/integration/simulate/ (being changed on another branch
    as this is written) still imports it from here; the lead moves that import and removes this after the merge."""
    if name == "SimulatorThread":
        from deepserve.simulate.thread import SimulatorThread

        return SimulatorThread
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
