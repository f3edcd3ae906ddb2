"""`deepserve gateway --workers N`: N gateway processes on one host, one listening port.

Each worker is a whole gateway (its own event loop, upstream pool and health checks) with its own listening socket
bound to the same address with SO_REUSEPORT, so that the kernel spreads incoming connections over the workers (by a
hash of the connection's addresses) instead of waking them all for each one. The supervisor (this process) holds a
bound, non-listening socket of the same group, which keeps the port reserved (and picks it for `--port 0`), starts the
workers, prints `GATEWAY READY` once every worker listens, restarts a worker that dies, and on SIGTERM/SIGINT stops
them all gracefully: each drains as one gateway process does (server.py: `--shutdown-grace-s`, then cut streams end
with an error event), and the supervisor exits 3 (server.EXIT_LEDGER_ROWS_LOST) when any worker lost usage rows.

Each worker applies the client connection limits and deadlines itself (connections.py): `--max-connections` is per
worker, the header and body deadlines are the same in every one.

What the workers share: the limits, in a table every worker maps (host_limits.py: a file the supervisor creates in
its temporary directory and removes, whose column for a worker it zeroes before restarting that worker), or through
Redis with `--redis-url` (shared with gateways on other hosts too); the key database and the usage ledger, SQLite
files in WAL mode that each worker opens itself (a writer that finds the file locked waits up to a second, then
keeps its rows for its next pass: ledger.py); Prometheus metrics, through prometheus_client's multiprocess mode
(metrics.py), in a directory the supervisor creates and removes."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from deepserve.errors import ConfigError
from deepserve.gateway.config import GatewayConfig, base_url
from deepserve.gateway.host_limits import WORKER_INDEX_ENV, ZONE_PATH_ENV, LimitZone
from deepserve.gateway.keys import KeyStore
from deepserve.gateway.ledger import UsageLedger
from deepserve.gateway.metrics import MULTIPROCESS_DIR_ENV
from deepserve.gateway.server import EXIT_LEDGER_ROWS_LOST

log = logging.getLogger(__name__)

# How long the supervisor waits for every worker to listen, and for workers to stop after SIGTERM beyond their
# shutdown grace period (the cut requests' last bytes, the ledger's last rows, the releases to Redis).
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
# A worker that dies is restarted, but not more often than this (a worker that cannot start must not spin).
RESTART_MIN_INTERVAL_S = 1.0
# How often a worker checks that its supervisor is still alive.
ORPHAN_CHECK_S = 0.5


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to HOST:PORT in a SO_REUSEPORT group (not listening yet)."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise ConfigError("--workers above 1 needs SO_REUSEPORT, which this platform lacks; run one worker")
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        where = f"{host}:{port}"
        raise ConfigError(f"cannot listen on {where} ({exc}); choose another --port or stop what uses it") from exc
    sock.set_inheritable(False)
    return sock


def _worker_main(config_json: str, port: int, index: int, ready: Any, supervisor_pid: int) -> None:
    """One worker process: a whole gateway on its own SO_REUSEPORT socket; tells the supervisor when it listens."""
    from deepserve.gateway.server import serve_process

    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s gateway[{index}] %(levelname)s %(message)s")
    config = GatewayConfig.model_validate_json(config_json)
    os.environ[WORKER_INDEX_ENV] = str(index)  # its column in the limit zone (make_limiter reads it)
    sock = reuseport_socket(config.host, port)
    _stop_when_orphaned(supervisor_pid)
    sys.exit(serve_process(config, lambda url: ready.put(index), sockets=[sock]))


def _create_databases(config: GatewayConfig) -> None:
    """Create the key store and the usage ledger (in WAL mode) once, before the workers start, so that no two
    workers create or convert the same SQLite file at the same moment (one got "database is locked" and exited)."""
    if config.keys_file is None:
        KeyStore().close()
    UsageLedger(config.ledger_path, start_writer=False).close()


def _stop_when_orphaned(supervisor_pid: int) -> None:
    """A supervisor killed outright (SIGKILL) cannot stop its workers: each worker notices that its parent is gone
    (even before the worker got this far) and stops itself gracefully, so that none keeps the port."""

    def watch() -> None:
        while os.getppid() == supervisor_pid:
            time.sleep(ORPHAN_CHECK_S)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="orphan-watch", daemon=True).start()


class _Supervisor:
    def __init__(self, config: GatewayConfig, port: int, zone: LimitZone | None) -> None:
        self.config = config
        self.port = port
        self.zone = zone  # the workers' shared limits (None: they are in Redis)
        self.context = multiprocessing.get_context("spawn")  # a fresh interpreter: no inherited loop or threads
        self.ready = self.context.SimpleQueue()
        self.workers: dict[int, BaseProcess] = {}
        self.started_at: dict[int, float] = {}
        self.listening: set[int] = set()  # workers that said they listen (a replacement starts outside it)
        self.stopping = False
        self.rows_lost = False  # a worker exited saying it lost usage rows

    def start(self, index: int) -> None:
        worker = self.context.Process(
            target=_worker_main,
            args=(self.config.model_dump_json(), self.port, index, self.ready, os.getpid()),
            name=f"deepserve-gateway-worker-{index}",
            daemon=False,
        )
        self.listening.discard(index)
        worker.start()
        self.workers[index] = worker
        self.started_at[index] = time.monotonic()

    def wait_ready(self) -> None:
        waiting = set(self.workers)
        deadline = time.monotonic() + START_TIMEOUT_S
        while waiting:
            dead = [index for index in waiting if not self.workers[index].is_alive()]
            if dead:
                raise ConfigError(f"gateway worker {dead[0]} exited while starting (see its log above)")
            if time.monotonic() > deadline:
                raise ConfigError(f"gateway workers {sorted(waiting)} did not listen within {START_TIMEOUT_S:g} s")
            self.note_ready()
            waiting -= self.listening
            time.sleep(0.05)

    def watch(self) -> None:
        """Until asked to stop: restart any worker that dies."""
        while not self.stopping:
            sentinels = [worker.sentinel for worker in self.workers.values()]
            multiprocessing.connection.wait(sentinels, timeout=0.5)
            for index, worker in list(self.workers.items()):
                if worker.is_alive() or self.stopping:
                    continue
                _forget_metrics_of(worker.pid)
                self.rows_lost = self.rows_lost or worker.exitcode == EXIT_LEDGER_ROWS_LOST
                log.warning("gateway worker %d (pid %s) exited with %s; starting another", index, worker.pid,
                            worker.exitcode)  # fmt: skip
                time.sleep(max(0.0, self.started_at[index] + RESTART_MIN_INTERVAL_S - time.monotonic()))
                if self.zone is not None:
                    self.zone.forget_worker(index)  # the dead worker's requests give their capacity back
                self.start(index)
            self.note_ready()

    def note_ready(self) -> None:
        while not self.ready.empty():
            self.listening.add(self.ready.get())

    def stop(self) -> int:
        """SIGTERM every worker (each drains gracefully), then wait; 0 when all stopped cleanly, EXIT_LEDGER_ROWS_LOST
        when any worker (this time or an earlier one that died) lost usage rows, else the first other failure."""
        self.stopping = True
        for worker in self.workers.values():
            if worker.is_alive() and worker.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.config.shutdown_grace_s + STOP_TIMEOUT_S
        code = 0
        for index, worker in self.workers.items():
            worker.join(max(0.1, deadline - time.monotonic()))
            if worker.is_alive():
                worker.kill()
                worker.join()
            self.note_ready()
            self.rows_lost = self.rows_lost or worker.exitcode == EXIT_LEDGER_ROWS_LOST
            code = code or self._exit_code(index, worker)
        return EXIT_LEDGER_ROWS_LOST if self.rows_lost else code

    def _exit_code(self, index: int, worker: BaseProcess) -> int:
        """WORKER's exit code, where a replacement that SIGTERM stopped before it listened (its interpreter had not
        yet set its handler) counts as a clean stop: it held no request."""
        if worker.exitcode == -signal.SIGTERM and index not in self.listening:
            return 0
        return worker.exitcode or 0


def _forget_metrics_of(pid: int | None) -> None:
    if pid is not None and os.environ.get(MULTIPROCESS_DIR_ENV):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)


def run_workers(config: GatewayConfig, announce: Callable[[str], None]) -> int:
    """Supervise config.workers gateway processes until SIGTERM/SIGINT (see the module docstring)."""
    reserved = reuseport_socket(config.host, config.port)
    port = int(reserved.getsockname()[1])
    metrics_dir = tempfile.mkdtemp(prefix="deepserve-gateway-metrics-")
    os.environ[MULTIPROCESS_DIR_ENV] = metrics_dir  # inherited by the workers (read when they import prometheus)
    _create_databases(config)
    zone = None
    if not config.redis_url:
        zone = LimitZone.create(Path(metrics_dir) / "limits.zone", config.workers, config.limit_zone_keys)
        os.environ[ZONE_PATH_ENV] = str(zone.path)
    supervisor = _Supervisor(config, port, zone)

    def stop_on_signal(signum: int, frame: Any) -> None:
        supervisor.stopping = True

    previous = {sig: signal.signal(sig, stop_on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for index in range(config.workers):
            supervisor.start(index)
        supervisor.wait_ready()
        announce(base_url(config, port))
        supervisor.watch()
        return supervisor.stop()
    except ConfigError:
        supervisor.stop()
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        reserved.close()
        if zone is not None:
            zone.close()
            os.environ.pop(ZONE_PATH_ENV, None)
        shutil.rmtree(metrics_dir, ignore_errors=True)
        print(f"deepserve gateway: {config.workers} workers stopped", file=sys.stderr, flush=True)
