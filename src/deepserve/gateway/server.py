"""Run the gateway: uvicorn (httptools parser) on a uvloop event loop, one process.

`GATEWAY READY <base URL>` is printed on stdout once the socket accepts connections and the first round of upstream
health checks is done; `config.gateway_argv` is the command line that runs the gateway as its own process (what
`deepserve serve` supervises next to the engine)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import uvicorn

from deepserve.gateway.app import GatewayApp
from deepserve.gateway.config import GatewayConfig, base_url
from deepserve.gateway.keys import KeyStore

READY_PREFIX = "GATEWAY READY"
_SHUTDOWN_GRACE_S = 5


class _Server(uvicorn.Server):
    """uvicorn's server, with a hook once the listening sockets are open."""

    def __init__(self, config: uvicorn.Config, on_listening: Callable[[int], None], own_signals: bool = True) -> None:
        super().__init__(config)
        self._on_listening = on_listening
        self._own_signals = own_signals

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGINT/SIGTERM start a graceful stop. Unlike uvicorn's own, the signal is not re-raised afterwards, so the
        caller's clean-up (flushing the usage ledger) still runs."""
        if not self._own_signals or threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started:
            port = self.servers[0].sockets[0].getsockname()[1] if self.servers else self.config.port
            self._on_listening(int(port))


def _uvicorn_config(app: GatewayApp, config: GatewayConfig) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        loop="none",  # we run the loop (uvloop) ourselves
        http="httptools",
        lifespan="off",  # the app is started before the server, so READY means upstreams were checked
        access_log=config.access_log,
        log_level="warning",
        server_header=False,
        date_header=False,
        proxy_headers=False,  # the gateway is the edge: X-Forwarded-* from clients are not trusted
        timeout_keep_alive=30,
        timeout_graceful_shutdown=_SHUTDOWN_GRACE_S,
        backlog=4096,
    )


async def serve(
    config: GatewayConfig, on_ready: Callable[[str], None], sockets: list[socket.socket] | None = None
) -> None:
    """Serve until SIGINT/SIGTERM (on SOCKETS when given: a worker of `--workers N`, see workers.py)."""
    app = GatewayApp(config)
    await app.start()

    def listening(port: int) -> None:
        freeze_startup_heap()
        on_ready(base_url(config, port))

    try:
        server = _Server(_uvicorn_config(app, config), listening)
        await server.serve(sockets=sockets)
    finally:
        await app.close()


def freeze_startup_heap() -> None:
    """Put every object alive once the gateway listens (modules, the app and its config, uvicorn's server, pydantic's
    schemas: about 50,000 long-lived objects) out of the cyclic garbage collector's reach.

    Without this each full (generation 2) collection under load walks all of them while every stream waits: at 256
    streams on the benchmark's fake upstream, 7 full collections in one run paused the event loop for up to 66 ms
    (321 ms in all). Frozen, a full collection walks only what requests allocated: at most 2 ms. Only for
    the gateway's own process (`serve`), not for `running_gateway`, whose host process (a test) keeps allocating."""
    gc.collect()  # garbage made while starting is freed, not frozen
    gc.freeze()


@contextlib.asynccontextmanager
async def running_gateway(
    config: GatewayConfig, app: GatewayApp | None = None
) -> AsyncIterator[tuple[GatewayApp, str]]:
    """The gateway serving in this event loop until the block ends; yields the app and its base URL (for tests and
    benchmarks; port 0 picks a free port)."""
    app = app or GatewayApp(config)
    await app.start()
    bound: list[int] = []
    server = _Server(_uvicorn_config(app, config), bound.append, own_signals=False)
    task = asyncio.create_task(server.serve())
    try:
        while not bound:
            if task.done():
                task.result()
                raise RuntimeError("the gateway stopped before it listened")
            await asyncio.sleep(0.005)
        yield app, base_url(config, bound[0])
    finally:
        server.should_exit = True
        await task
        await app.close()


def run_gateway(config: GatewayConfig) -> int:
    """Blocking entry point for the CLI."""
    config.check_startable()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s gateway %(levelname)s %(message)s")
    if config.keys_required():
        _warn_if_no_keys()

    def announce(url: str) -> None:
        print(f"{READY_PREFIX} {url}", flush=True)

    if config.workers > 1:
        from deepserve.gateway.workers import run_workers

        return run_workers(config, announce)
    _run(serve(config, announce))
    return 0


def _warn_if_no_keys() -> None:
    store = KeyStore()
    try:
        active = [key for key in store.all_keys() if key.revoked_at is None]
    finally:
        store.close()
    if not active:
        print(
            "deepserve gateway: API keys are required (non-loopback bind or --require-keys) and none exist yet; "
            "every request is refused until you run `deepserve keys create NAME`",
            file=sys.stderr,
            flush=True,
        )


def run_event_loop(main: Any) -> None:
    """Run the coroutine MAIN on uvloop (asyncio's loop where uvloop is missing)."""
    _run(main)


def _run(main: Any) -> None:
    try:
        import uvloop
    except ImportError:  # uvloop is Linux/macOS only; asyncio's loop works, only slower
        asyncio.run(main)
        return
    uvloop.run(main)
