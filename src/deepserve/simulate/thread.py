"""The simulator on its own event loop in a background thread, for tests and tools whose code is synchronous."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from deepserve.simulate.app import SimulatorApp
from deepserve.simulate.config import SimulateConfig
from deepserve.simulate.server import SimulatorServer
from deepserve.simulate.setup import SimulatedDeployment


class SimulatorThread:
    """The simulator on its own event loop in a background thread, for tests and tools that call sync code."""

    def __init__(self, deployment: SimulatedDeployment, config: SimulateConfig, host: str = "127.0.0.1", port: int = 0):
        self.server = SimulatorServer(deployment, config)
        self.server.host, self.server.port = host, port  # the URL is known before the start (when PORT is given)
        self._host, self._port = host, port
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="deepserve-simulate")

    @property
    def app(self) -> SimulatorApp:
        return self.server.app

    @property
    def base_url(self) -> str:
        return self.server.base_url

    @property
    def root_url(self) -> str:
        return self.server.root_url

    def control(self, changes: dict[str, Any]) -> None:
        """Apply CHANGES as POST /simulate/control does (faults, health, metric values), on the simulator's loop."""
        self.call(lambda: self.app.controls.apply(changes))

    def call(self, function: Callable[[], Any]) -> Any:
        """Run FUNCTION on the simulator's loop (its state is not thread-safe) and return its result."""

        async def run() -> Any:
            return function()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def __enter__(self) -> SimulatorThread:
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self.server.start(self._host, self._port), self._loop).result(30)
        except BaseException:
            self._stop_loop()  # a port in use must not leave the thread and its loop running
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self.server.close(), self._loop).result(10)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
