"""`deepserve serve`: resolve the model and device, check everything that can be checked before starting, launch
the engine (and, by default, the gateway in front of it) under supervision, report progress, and stop cleanly."""

from __future__ import annotations

import importlib.util
import json
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import psutil

from deepserve.config import EngineConfig, ServeConfig, deepserve_home, serve_command
from deepserve.deploy.ray_backend import check_ray_backend, wait_for_ray_gpus
from deepserve.engines.base import Engine, LaunchSpec, ResolvedModel
from deepserve.engines.nodes import CheckIn, RollCall
from deepserve.engines.registry import get_engine
from deepserve.engines.supervisor import SupervisedProcess
from deepserve.engines.topology import check_layout_fits_nodes, check_master_address, nodes_share_this_host
from deepserve.errors import ConfigError, EngineError
from deepserve.gateway.config import GatewayConfig, gateway_argv
from deepserve.gateway.config import base_url as gateway_base_url
from deepserve.hardware.detect import has_gpu, local_gpus
from deepserve.models.resolve import resolve_model
from deepserve.net import ensure_port_free, free_port
from deepserve.plan.admission import FitCheck, accelerator_for, check_cpu_fit, check_gpu_fit


@dataclass(frozen=True)
class ServicePlan:
    """Everything decided before anything starts; `--dry-run` prints it."""

    config: EngineConfig  # as the engine runs it (behind the gateway: on loopback, on an internal port)
    engine: Engine
    model: ResolvedModel
    launch: LaunchSpec
    gateway: LaunchSpec | None = None  # the front door, when there is one
    gateway_config: GatewayConfig | None = None
    notes: tuple[str, ...] = ()  # worth saying before starting (e.g. GPUs the layout leaves idle)
    python: str = sys.executable
    fit: FitCheck | None = None  # the memory plan's verdict on this deployment
    force: bool = False  # start even when it says the model cannot fit

    @property
    def device(self) -> str:
        return "cpu" if self.model.on_cpu else "cuda"

    @property
    def role(self) -> str:
        """single (one node), head (node 0 of several: API and gateway) or worker (a headless node)."""
        if not self.config.is_multi_node:
            return "single"
        return "head" if self.config.is_head else "worker"

    @property
    def public(self) -> LaunchSpec:
        """What clients talk to: the gateway if there is one, else the engine."""
        return self.gateway or self.launch


def plan_service(
    config: EngineConfig,
    serve: ServeConfig | None = None,
    gateway: GatewayConfig | None = None,
    python: str = sys.executable,
    on_this_machine: bool = True,
) -> ServicePlan:
    """SERVE.gateway puts GATEWAY in front: it takes the public host and port, and the engine moves to loopback.
    A worker node (--node-rank > 0) runs the engine headless and nothing else. ON_THIS_MACHINE False plans for
    another machine (`--dry-run` with any --device): nothing about this one is looked at."""
    serve = serve or ServeConfig(gateway=False)
    on_cpu = _uses_cpu(config, on_this_machine)
    check_ray_backend(config, on_cpu)
    if on_cpu:
        _reject_gpu_only_flags(config)
    notes = tuple(check_layout_fits_nodes(config, None if on_cpu else _gpus_per_node(config, on_this_machine)))
    engine = get_engine(config.engine)
    model = resolve_model(config.model, on_cpu)
    if config.served_model_name:
        model = ResolvedModel(model.source, config.served_model_name, model.on_cpu)
    fit = check_fit(config, model, on_this_machine)
    # GPU commands planned on a machine without one are for another machine: print them as users type them there.
    engine_python = python if on_cpu or has_gpu() else None
    if not serve.gateway or not config.is_head:
        launch = engine.launch_spec(config, model, engine_python)
        return ServicePlan(config, engine, model, launch, notes=notes, python=python, fit=fit, force=serve.force)
    engine_config = config.model_copy(update={"host": "127.0.0.1", "port": serve.engine_port or free_port()})
    launch = engine.launch_spec(engine_config, model, engine_python)
    front = (gateway or GatewayConfig()).model_copy(
        update={"upstream": [launch.base_url], "host": config.host, "port": config.port}
    )
    front.check_startable()
    gateway_launch = LaunchSpec(
        argv=gateway_argv(front, python),
        ready_path="/health",
        served_model_name=model.served_name,
        base_url=gateway_base_url(front),
    )
    return ServicePlan(engine_config, engine, model, launch, gateway_launch, front, notes, python, fit, serve.force)


def check_fit(config: EngineConfig, model: ResolvedModel, on_this_machine: bool) -> FitCheck:
    """The memory plan for this deployment on this machine's GPUs or RAM, or on the GPU type it is told about (a
    CPU deployment is checked against this machine's RAM, in a dry run too)."""
    if model.on_cpu:
        nodes_here = config.nnodes if nodes_share_this_host(config) else 1
        return check_cpu_fit(config, model.source, psutil.virtual_memory().available, nodes_here)
    gpus = local_gpus() if on_this_machine else ()
    return check_gpu_fit(config, model.source, accelerator_for(config.gpu_type, gpus[0].name if gpus else None))


def _gpus_per_node(config: EngineConfig, on_this_machine: bool) -> int | None:
    if config.gpus_per_node is not None:
        return config.gpus_per_node
    return len(local_gpus()) if on_this_machine else None


def preflight(plan: ServicePlan) -> None:
    """The checks that need the machine but start nothing: the memory plan (no install fixes a deployment that
    cannot fit), engine installed, ports free, the master address."""
    if plan.fit is not None and plan.fit.fits is False and not plan.force:
        raise ConfigError(f"the memory plan says this cannot run: {plan.fit.describe()}")
    if importlib.util.find_spec(plan.engine.package) is None:
        raise EngineError(f"{plan.engine.name} is not installed in {sys.prefix}: {plan.engine.install_hint}")
    config = plan.config
    check_master_address(config)
    if config.is_head:
        ensure_port_free(config.host, config.port)
    if plan.role == "head":
        ensure_port_free(config.master_addr or "", config.master_port)
        ensure_port_free(config.master_addr or "", config.effective_join_port)
    if plan.gateway_config is not None:
        ensure_port_free(plan.gateway_config.host, plan.gateway_config.port)


def dry_run_text(plan: ServicePlan, serve: ServeConfig | None = None, gateway: GatewayConfig | None = None) -> str:
    """What this node runs; for a deployment over several nodes, what every node runs and how to start it."""
    if not plan.config.is_multi_node:
        return "\n".join(_node_lines(plan))
    lines = []
    for rank in range(plan.config.nnodes):
        node = plan if rank == plan.config.node_rank else _plan_for_node(plan, rank, serve, gateway)
        lines.append(f"# node {rank} of {plan.config.nnodes}{' (this node)' if node is plan else ''}: start it with")
        lines.append("#   " + serve_command(_user_config(node), serve if rank == 0 else None))
        lines += _node_lines(node)
    return "\n".join(lines)


def _node_lines(plan: ServicePlan) -> list[str]:
    env = json.dumps(plan.launch.env, sort_keys=True) if plan.launch.env else "{}"
    role = {"head": "; node 0: the API", "worker": "; a headless worker (no API, no gateway)"}.get(plan.role, "")
    lines = [
        f"# engine: {plan.engine.name} on {plan.device}; model {plan.model.source}{role}",
        f"# environment added: {env}",
        *(f"# note: {note}" for note in plan.notes),
        *([f"# memory plan: {plan.fit.describe()}"] if plan.fit is not None else []),
        plan.launch.shell_line(),
    ]
    if plan.gateway is not None:
        lines += [f"# gateway in front, serving {plan.gateway.base_url}", plan.gateway.shell_line()]
    return lines


def _plan_for_node(
    plan: ServicePlan, rank: int, serve: ServeConfig | None, gateway: GatewayConfig | None
) -> ServicePlan:
    config = _user_config(plan).for_node(rank)
    return plan_service(config, serve if rank == 0 else None, gateway, plan.python, on_this_machine=False)


def _user_config(node: ServicePlan) -> EngineConfig:
    """The engine config as the user gave it: behind a gateway the plan's engine moved to an internal port."""
    if node.gateway_config is None:
        return node.config
    return node.config.model_copy(update={"host": node.gateway_config.host, "port": node.gateway_config.port})


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


def _uses_cpu(config: EngineConfig, on_this_machine: bool = True) -> bool:
    if config.device == "auto":
        return not has_gpu()
    if config.device == "cuda" and not has_gpu() and on_this_machine:  # a dry run may plan for a GPU machine
        raise ConfigError("--device cuda was given but no NVIDIA GPU was found (nvidia-smi lists none)")
    return config.device == "cpu"


def _reject_gpu_only_flags(config: EngineConfig) -> None:
    refused = get_engine(config.engine).cpu_refusals(config)
    if refused:
        raise ConfigError(
            "these flags need a GPU, and this machine has none (nvidia-smi lists no device): "
            + ", ".join(refused)
            + ". Remove them to serve on CPU, or run on a GPU machine."
        )
