"""Run the gateway: uvicorn (httptools parser) on a uvloop event loop, in one process or, with `--workers N`, in N
processes sharing the port (workers.py; each worker is what one process is here).

`GATEWAY READY <base URL>` is printed on stdout once the socket accepts connections and the first round of upstream
health checks is done; `config.gateway_argv` is the command line that runs the gateway as its own process (what
`deepserve serve` supervises next to the engine).

Client connections are served by `connections.GuardedHttpProtocol` (uvicorn's httptools protocol with header and
body deadlines, a header size limit and a connection limit). SIGTERM drains: the listening socket closes, requests
in flight get `shutdown_grace_s` to finish, then the app cuts what is left (`GatewayApp.cut_in_flight`: streams end
with an error event and their terminator), the usage ledger is flushed, and the exit code says whether every usage
row was written."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import logging.handlers
import queue
import signal
import socket
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import uvicorn

from deepserve.gateway.app import GatewayApp, access_log
from deepserve.gateway.config import GatewayConfig, base_url
from deepserve.gateway.keys import KeyStore

READY_PREFIX = "GATEWAY READY"
# After the app cut what was left at the end of the grace period, uvicorn waits this much longer for the cut
# requests to write their last bytes before it cancels whatever still runs.
_CUT_MARGIN_S = 2.0
# The exit code when usage rows were lost (the ledger could not be written).
EXIT_LEDGER_ROWS_LOST = 3


class _Server(uvicorn.Server):
    """uvicorn's server, with a hook once the listening sockets are open, and a drain that ends what is still in
    flight when the grace period is over (uvicorn would only cancel it, cutting streams mid-chunk)."""

    def __init__(
        self,
        config: uvicorn.Config,
        app: GatewayApp,
        on_listening: Callable[[int], None],
        own_signals: bool = True,
    ) -> None:
        super().__init__(config)
        self._app = app
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

    async def shutdown(self, sockets: Any = None) -> None:
        grace_s = self._app.config.shutdown_grace_s
        reason = f"its {grace_s:g} s shutdown grace period ended first"
        cut = asyncio.get_running_loop().call_later(grace_s, self._app.cut_in_flight, reason)
        try:
            await super().shutdown(sockets)
        finally:
            cut.cancel()


def _uvicorn_config(app: GatewayApp, config: GatewayConfig) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        loop="none",  # we run the loop (uvloop) ourselves
        http=app.connections.protocol_class(),  # httptools, with the gateway's deadlines and limits
        lifespan="off",  # the app is started before the server, so READY means upstreams were checked
        access_log=False,  # the app writes its own access log (with key, model, upstream and tokens)
        log_level="warning",
        server_header=False,
        date_header=False,
        proxy_headers=False,  # the gateway is the edge: X-Forwarded-* from clients are not trusted
        timeout_keep_alive=30,
        timeout_graceful_shutdown=config.shutdown_grace_s + _CUT_MARGIN_S,  # type: ignore[arg-type]
        backlog=4096,
    )


async def serve(
    config: GatewayConfig, on_ready: Callable[[str], None], sockets: list[socket.socket] | None = None
) -> int:
    """Serve until SIGINT/SIGTERM (on SOCKETS when given: a worker of `--workers N`, see workers.py); return the
    number of usage rows that could not be written (0 normally)."""
    app = GatewayApp(config)
    await app.start()

    def listening(port: int) -> None:
        freeze_startup_heap()
        on_ready(base_url(config, port))

    try:
        server = _Server(_uvicorn_config(app, config), app, listening)
        await server.serve(sockets=sockets)
    finally:
        await app.close()
    return app.lost_ledger_rows


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
    server = _Server(_uvicorn_config(app, config), app, bound.append, own_signals=False)
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
    """Blocking entry point for the CLI: 0 after a clean stop, EXIT_LEDGER_ROWS_LOST when usage rows were lost."""
    config.check_startable()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s gateway %(levelname)s %(message)s")
    if config.keys_required():
        _warn_if_no_keys()

    def announce(url: str) -> None:
        print(f"{READY_PREFIX} {url}", flush=True)

    if config.workers > 1:
        from deepserve.gateway.workers import run_workers

        return run_workers(config, announce)
    return serve_process(config, announce)


def serve_process(
    config: GatewayConfig, on_ready: Callable[[str], None], sockets: list[socket.socket] | None = None
) -> int:
    """One gateway process until SIGINT/SIGTERM (the whole gateway, or one of `--workers N`), with its access log,
    on uvloop; its exit code: 0 after a clean stop, EXIT_LEDGER_ROWS_LOST when usage rows were lost."""
    with _access_log_to_stderr(config.access_log):
        lost = _run(serve(config, on_ready, sockets))
    if lost:
        print(
            f"deepserve gateway: {lost} usage rows could not be written to the ledger (see the errors above)",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_LEDGER_ROWS_LOST
    return 0


@contextlib.contextmanager
def _access_log_to_stderr(enabled: bool) -> Iterator[None]:
    """When ENABLED, access-log lines go to stderr from a thread of their own: the event loop only puts a record on
    a queue, and a slow terminal or pipe never stalls requests."""
    if not enabled:
        yield
        return
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    to_stderr = logging.StreamHandler(sys.stderr)
    to_stderr.setFormatter(logging.Formatter("%(asctime)s access %(message)s"))
    listener = logging.handlers.QueueListener(records, to_stderr)
    handler = logging.handlers.QueueHandler(records)
    access_log.addHandler(handler)
    access_log.setLevel(logging.INFO)
    access_log.propagate = False  # not also through the root logger's format
    listener.start()
    try:
        yield
    finally:
        listener.stop()  # writes what is queued
        access_log.removeHandler(handler)
        access_log.propagate = True
        access_log.setLevel(logging.NOTSET)


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


def _run(main: Any) -> Any:
    try:
        import uvloop
    except ImportError:  # uvloop is Linux/macOS only; asyncio's loop works, only slower
        return asyncio.run(main)
    return uvloop.run(main)
