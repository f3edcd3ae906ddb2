"""`deepserve serve`, running: start the engine (then the gateway) under supervision, report progress while they
start, keep the roll call of the other nodes, and stop everything cleanly (gateway first) on Ctrl-C or SIGTERM."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import FrameType

from deepserve.config import deepserve_home
from deepserve.deploy.ray_backend import wait_for_ray_gpus
from deepserve.engines.base import LaunchSpec
from deepserve.engines.config import serve_command
from deepserve.engines.nodes import CheckIn, RollCall
from deepserve.engines.supervisor import SupervisedProcess
from deepserve.errors import EngineError
from deepserve.gateway.config import GatewayConfig
from deepserve.serve.service_plan import ServicePlan


def log_path(name: str, port: int) -> Path:
    return deepserve_home() / "logs" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{port}.log"


ProgressCallback = Callable[[str, float], None]
ReadyCallback = Callable[[float, list[SupervisedProcess]], None]
GATEWAY_STARTUP_TIMEOUT_S = 120.0


def run_service(plan: ServicePlan, on_progress: ProgressCallback, on_ready: ReadyCallback) -> int:
    """Start the engine (then the gateway), wait until they are ready, then until one exits or we are told to stop
    (SIGINT/SIGTERM). Returns 0 after a requested stop; raises ProcessDied if a child exits on its own. Children
    stop in reverse order: the gateway before the engine. Over several nodes, node 0 also keeps the roll call of
    the others (and stops when one leaves); a worker node stops when node 0 goes."""
    with stop_on_sigterm():
        try:
            if plan.role == "worker":
                _run_worker(plan, on_progress, on_ready)
            else:
                _run_head(plan, on_progress, on_ready)
        except KeyboardInterrupt:
            return 0
    return 0


@contextmanager
def started_service(
    plan: ServicePlan, on_progress: ProgressCallback | None = None, engine_log: Path | None = None
) -> Iterator[list[SupervisedProcess]]:
    """The service of PLAN, started and ready, for the length of a `with` block (`deepserve tune` runs one per
    point); leaving the block, by any way, stops every child (gateway first). ENGINE_LOG replaces the engine's
    log file under DEEPSERVE_HOME/logs."""
    with ExitStack() as children:
        running = [children.enter_context(_engine_process(plan, engine_log))]
        running[0].wait_ready(plan.config.startup_timeout_s, on_progress)
        if plan.gateway is not None and plan.gateway_config is not None:
            running.append(children.enter_context(_gateway_process(plan.gateway, plan.gateway_config)))
            running[-1].wait_ready(GATEWAY_STARTUP_TIMEOUT_S, on_progress)
        yield running


def _run_head(plan: ServicePlan, on_progress: ProgressCallback, on_ready: ReadyCallback) -> None:
    started = time.monotonic()
    wait_for_ray_gpus(plan.config, on_progress)  # returns at once unless the engine runs on a Ray cluster
    roll = RollCall(plan.config, bind_host=plan.config.master_addr or "").start() if plan.role == "head" else None
    with ExitStack() as children:
        try:
            progress = _with_nodes(on_progress, roll)
            running = [children.enter_context(_engine_process(plan))]
            running[0].wait_ready(plan.config.startup_timeout_s, progress, _join_deadline(plan, roll))
            if plan.gateway is not None and plan.gateway_config is not None:
                running.append(children.enter_context(_gateway_process(plan.gateway, plan.gateway_config)))
                running[-1].wait_ready(GATEWAY_STARTUP_TIMEOUT_S, on_progress)
            if roll is not None:
                roll.announce_ready(plan.public.base_url)
            on_ready(time.monotonic() - started, running)
            _wait_until_one_exits(running, roll.raise_if_one_left if roll else None)
        finally:
            if roll is not None:  # tell the workers before our engine goes, so they stop rather than crash
                roll.stop("node 0 is stopping")


def _with_nodes(on_progress: ProgressCallback, roll: RollCall | None) -> ProgressCallback:
    if roll is None:
        return on_progress

    def progress(phase: str, elapsed_s: float) -> None:
        missing = roll.missing()
        if missing:
            joined = roll.config.nnodes - len(missing)
            phase = f"{phase}; {joined} of {roll.config.nnodes} nodes joined, waiting for node(s) {_ranks(missing)}"
        on_progress(phase, elapsed_s)

    return progress


def _join_deadline(plan: ServicePlan, roll: RollCall | None) -> Callable[[float], None] | None:
    if roll is None:
        return None

    def check(elapsed_s: float) -> None:
        roll.raise_if_one_left()
        missing = roll.missing()
        if missing and elapsed_s > plan.config.join_timeout_s:
            starts = "; ".join(f"node {rank}: {serve_command(plan.config.for_node(rank))}" for rank in missing)
            raise EngineError(
                f"node(s) {_ranks(missing)} never joined within {plan.config.join_timeout_s:.0f} s. Start them "
                f"({starts}) and check that they reach {plan.config.master_addr}:{plan.config.effective_join_port} "
                "and the master port; raise --join-timeout-s for slow starts"
            )

    return check


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(rank) for rank in ranks)


def _run_worker(plan: ServicePlan, on_progress: ProgressCallback, on_ready: ReadyCallback) -> None:
    """Join node 0 first (a refused node starts nothing), then run the headless engine until node 0 says the
    service is ready, and on until node 0 or the engine goes."""
    started = time.monotonic()
    check_in = CheckIn(plan.config)
    check_in.join(on_progress)
    try:
        with _engine_process(plan) as engine:
            engine.wait_until(
                lambda: check_in.ready_url is not None,
                plan.config.startup_timeout_s,
                on_progress,
                lambda _elapsed: check_in.raise_if_head_gone(),
            )
            on_ready(time.monotonic() - started, [engine])
            _wait_until_one_exits([engine], check_in.raise_if_head_gone)
    finally:
        check_in.close()


def _engine_process(plan: ServicePlan, log_file: Path | None = None) -> SupervisedProcess:
    log_file = log_file or log_path("engine", plan.config.port)
    return SupervisedProcess("engine", plan.launch, plan.engine.phase_of, log_file)


def _gateway_process(launch: LaunchSpec, config: GatewayConfig) -> SupervisedProcess:
    return SupervisedProcess("gateway", launch, _gateway_phase, log_path("gateway", config.port))


def _gateway_phase(line: str) -> str | None:
    return "starting gateway"


def _wait_until_one_exits(running: list[SupervisedProcess], check: Callable[[], None] | None = None) -> None:
    """CHECK (the other nodes) goes first: a worker whose head stopped also sees its engine fail soon after."""
    while True:
        if check:
            check()
        for process in running:
            process.raise_if_died()
        time.sleep(0.5)


@contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """Treat SIGTERM like Ctrl-C, so both unwind through the same clean stop."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
