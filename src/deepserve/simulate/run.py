"""`deepserve simulate` as a process: start-up lines like vLLM's (so a supervisor sees its phases), the READY line
`deepserve serve` prints, and a clean stop on SIGINT/SIGTERM or after --max-seconds. With --engine-core-process it
also starts a child process, as vLLM's API server starts its engine core, so that a supervisor's clean-up of the
whole process group can be tested; the child only waits (ignoring SIGTERM too with --ignore-sigterm) and is stopped
when the simulator stops cleanly, left to the supervisor when it is killed."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
from typing import TextIO

from deepserve._compat import run
from deepserve.simulate.config import SimulateConfig
from deepserve.simulate.server import SimulatorServer
from deepserve.simulate.setup import SimulatedDeployment

ENGINE_CORE_LIFETIME_S = 600.0  # an engine core child left behind by a killed simulator ends by itself after this


def ready_line(server: SimulatorServer) -> str:
    """`READY <public base URL> <served model name> <engine base URL>`, the format of `deepserve serve` (here the
    public URL and the engine's are the same: there is no gateway in front)."""
    return f"READY {server.base_url} {server.deployment.served_model_name} {server.base_url}"


def serve_simulator(
    deployment: SimulatedDeployment,
    config: SimulateConfig,
    host: str,
    port: int,
    metric_overrides: dict[str, float] | None = None,
    log: TextIO = sys.stderr,
    out: TextIO = sys.stdout,
) -> int:
    """Serve until told to stop; 0 on a requested stop, 1 for --fail-startup."""
    loop_factory = None
    with contextlib.suppress(ImportError):
        import uvloop

        loop_factory = uvloop.new_event_loop
    with contextlib.suppress(KeyboardInterrupt):
        try:
            run(_serve(deployment, config, host, port, metric_overrides or {}, log, out), loop_factory)
        except SystemExit as exc:
            return int(exc.code or 0)
    return 0


async def _serve(
    deployment: SimulatedDeployment,
    config: SimulateConfig,
    host: str,
    port: int,
    metric_overrides: dict[str, float],
    log: TextIO,
    out: TextIO,
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    if config.ignore_sigterm:
        loop.add_signal_handler(signal.SIGTERM, lambda: None)
    else:
        loop.add_signal_handler(signal.SIGTERM, stop.set)
    print("INFO simulate: Initializing a V1 LLM engine (simulated by deepserve)", file=log, flush=True)
    print(f"INFO simulate: {deployment.describe()}", file=log, flush=True)
    core = _start_engine_core(config, log) if config.engine_core_process else None
    try:
        await _serve_ready(deployment, config, host, port, metric_overrides, log, out, stop)
    finally:
        if core is not None:
            core.kill()
            core.wait()


def _start_engine_core(config: SimulateConfig, log: TextIO) -> subprocess.Popen[bytes]:
    lifetime_s = min(config.max_seconds or ENGINE_CORE_LIFETIME_S, ENGINE_CORE_LIFETIME_S)
    ignore = "signal.signal(signal.SIGTERM, signal.SIG_IGN); " if config.ignore_sigterm else ""
    code = f"import signal, time; {ignore}time.sleep({lifetime_s!r})"
    core = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL)
    print(f"INFO simulate: Started the engine core process (pid {core.pid})", file=log, flush=True)
    return core


async def _serve_ready(
    deployment: SimulatedDeployment,
    config: SimulateConfig,
    host: str,
    port: int,
    metric_overrides: dict[str, float],
    log: TextIO,
    out: TextIO,
    stop: asyncio.Event,
) -> None:
    if config.startup_delay_s:
        print(f"INFO simulate: Loading weights (simulated: {config.startup_delay_s:g} s)", file=log, flush=True)
        with contextlib.suppress(asyncio.TimeoutError):  # a stop while loading ends the start (as vLLM's does)
            await asyncio.wait_for(stop.wait(), config.startup_delay_s)
        if stop.is_set():
            return
    if config.fail_startup is not None:
        print(config.fail_startup, file=log, flush=True)
        raise SystemExit(1)
    print(
        f"INFO simulate: GPU KV cache size: {deployment.num_blocks * deployment.block_size:,} tokens",
        file=log,
        flush=True,
    )
    server = SimulatorServer(deployment, config)
    app = await server.start(host, port)
    app.controls.metric_overrides.update(metric_overrides)
    print("INFO:     Application startup complete.", file=log, flush=True)
    print(ready_line(server), file=out, flush=True)
    try:
        if config.max_seconds is None:
            await stop.wait()
        else:
            with contextlib.suppress(asyncio.TimeoutError):  # on 3.10 not the builtin TimeoutError
                await asyncio.wait_for(stop.wait(), config.max_seconds)
    finally:
        await server.close()
