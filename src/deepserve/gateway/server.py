"""Run the gateway: its own HTTP/1.1 server (http_server.py, httptools' parser) on a uvloop event loop, in one
process or, with `--workers N`, in N processes sharing the port (workers.py; each worker is what one process is here).

`GATEWAY READY <base URL>` is printed on stdout once the socket accepts connections and the first round of upstream
health checks is done; `config.gateway_argv` is the command line that runs the gateway as its own process (what
`deepserve serve` supervises next to the engine).

Client connections get the guard's header and body deadlines, header size limit and connection limit
(connections.py). SIGTERM drains: the listening socket closes, requests in flight get `shutdown_grace_s` to finish,
then the app cuts what is left (`GatewayApp.cut_in_flight`: streams end with an error event and their terminator),
the usage ledger is flushed, and the exit code says whether every usage row was written."""

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

from deepserve.errors import ConfigError
from deepserve.gateway.app import GatewayApp, access_log
from deepserve.gateway.config import GatewayConfig, base_url
from deepserve.gateway.http_server import HttpServer
from deepserve.gateway.keys import key_source
from deepserve.gateway.scheduling import request_time_slice

READY_PREFIX = "GATEWAY READY"
# After the app cut what was left at the end of the grace period, the server waits this much longer for the cut
# requests to write their last bytes before it cancels whatever still runs.
_CUT_MARGIN_S = 2.0
# The exit code when usage rows were lost (the ledger could not be written).
EXIT_LEDGER_ROWS_LOST = 3


async def _drain(server: HttpServer, app: GatewayApp) -> None:
    """The graceful stop: no new connections, GRACE for what is in flight, then the app cuts what is left."""
    grace_s = app.config.shutdown_grace_s
    reason = f"its {grace_s:g} s shutdown grace period ended first"
    await server.shutdown(grace_s, lambda: app.cut_in_flight(reason), _CUT_MARGIN_S)


@contextlib.contextmanager
def _stop_on_signals(stop: asyncio.Event) -> Iterator[None]:
    """SIGINT/SIGTERM start a graceful stop (in the main thread; elsewhere the caller stops the server itself)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        yield
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


async def serve(
    config: GatewayConfig, on_ready: Callable[[str], None], sockets: list[socket.socket] | None = None
) -> int:
    """Serve until SIGINT/SIGTERM (on SOCKETS when given: a worker of `--workers N`, see workers.py); return the
    number of usage rows that could not be written (0 normally)."""
    app = GatewayApp(config)
    stop = asyncio.Event()
    with _stop_on_signals(stop):  # until the end: a second signal while the ledger is flushed must not kill it
        await app.start()
        try:
            server = HttpServer(app, app.connections)
            port = await _listen(server, config, sockets)
            freeze_startup_heap()
            on_ready(base_url(config, port))
            await stop.wait()
            await _drain(server, app)
        finally:
            await app.close()
    return app.lost_ledger_rows


def freeze_startup_heap() -> None:
    """Put every object alive once the gateway listens (modules, the app and its config, the HTTP server, pydantic's
    schemas: about 50,000 long-lived objects) out of the cyclic garbage collector's reach.

    Without this each full (generation 2) collection under load walks all of them while every stream waits: at 256
    streams on the benchmark's fake upstream, 7 full collections in one run paused the event loop for up to 66 ms
    (321 ms in all). Frozen, a full collection walks only what requests allocated: at most 2 ms. Only for
    the gateway's own process (`serve`), not for `running_gateway`, whose host process (a test) keeps allocating."""
    gc.collect()  # garbage made while starting is freed, not frozen
    gc.freeze()


async def _listen(server: HttpServer, config: GatewayConfig, sockets: list[socket.socket] | None = None) -> int:
    try:
        return await server.listen(config.host, config.port, sockets)
    except OSError as exc:
        raise ConfigError(
            f"cannot listen on {config.host}:{config.port} ({exc}); choose another --port or stop what uses it"
        ) from exc


@contextlib.asynccontextmanager
async def running_gateway(
    config: GatewayConfig, app: GatewayApp | None = None
) -> AsyncIterator[tuple[GatewayApp, str]]:
    """The gateway serving in this event loop until the block ends; yields the app and its base URL (for tests and
    benchmarks; port 0 picks a free port)."""
    app = app or GatewayApp(config)
    await app.start()
    try:
        server = HttpServer(app, app.connections)
        port = await _listen(server, config)
        try:
            yield app, base_url(config, port)
        finally:
            await _drain(server, app)
    finally:
        await app.close()


def run_gateway(config: GatewayConfig) -> int:
    """Blocking entry point for the CLI: 0 after a clean stop, EXIT_LEDGER_ROWS_LOST when usage rows were lost."""
    config.check_startable()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s gateway %(levelname)s %(message)s")
    if config.keys_required():
        _warn_if_no_keys(config)

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
    _ask_for_time_slice(config)
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


def _ask_for_time_slice(config: GatewayConfig) -> None:
    """The short scheduler slice (scheduling.py), asked for before any thread starts so that all inherit it; a
    slice that cannot be had is said on stderr when it was asked for, and left unsaid when it was the default."""
    why_not = request_time_slice(config.sched_slice_us)
    if why_not is not None and "sched_slice_us" in config.model_fields_set:
        print(
            f"deepserve gateway: --sched-slice-us {config.sched_slice_us} not applied: {why_not}; the kernel's "
            "default slice stays",
            file=sys.stderr,
            flush=True,
        )


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


def _warn_if_no_keys(config: GatewayConfig) -> None:
    source = key_source(config.keys_file)
    try:
        active = [stored for stored in source.load() if stored.key.revoked_at is None]
    finally:
        source.close()
    if not active:
        where = f"in {config.keys_file}" if config.keys_file else "yet"
        print(
            f"deepserve gateway: API keys are required (non-loopback bind or --require-keys) and none exist {where}; "
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
