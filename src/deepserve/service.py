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

from deepserve.config import EngineConfig, ServeConfig, deepserve_home
from deepserve.engines.base import Engine, LaunchSpec, ResolvedModel
from deepserve.engines.registry import get_engine
from deepserve.engines.supervisor import SupervisedProcess
from deepserve.errors import ConfigError, EngineError
from deepserve.gateway.config import GatewayConfig, gateway_argv
from deepserve.gateway.config import base_url as gateway_base_url
from deepserve.hardware.detect import has_gpu
from deepserve.models.resolve import resolve_model
from deepserve.net import ensure_port_free, free_port

_GPU_ONLY_QUANTIZATIONS = {"fp8", "awq", "awq_marlin", "gptq", "gptq_marlin", "marlin", "compressed-tensors"}


@dataclass(frozen=True)
class ServicePlan:
    """Everything decided before anything starts; `--dry-run` prints it."""

    config: EngineConfig  # as the engine runs it (behind the gateway: on loopback, on an internal port)
    engine: Engine
    model: ResolvedModel
    launch: LaunchSpec
    gateway: LaunchSpec | None = None  # the front door, when there is one
    gateway_config: GatewayConfig | None = None

    @property
    def device(self) -> str:
        return "cpu" if self.model.on_cpu else "cuda"

    @property
    def public(self) -> LaunchSpec:
        """What clients talk to: the gateway if there is one, else the engine."""
        return self.gateway or self.launch


def plan_service(
    config: EngineConfig,
    serve: ServeConfig | None = None,
    gateway: GatewayConfig | None = None,
    python: str = sys.executable,
) -> ServicePlan:
    """SERVE.gateway puts GATEWAY in front: it takes the public host and port, and the engine moves to loopback."""
    serve = serve or ServeConfig(gateway=False)
    on_cpu = _uses_cpu(config)
    if on_cpu:
        _reject_gpu_only_flags(config)
    engine = get_engine(config.engine)
    model = resolve_model(config.model, on_cpu)
    if config.served_model_name:
        model = ResolvedModel(model.source, config.served_model_name, model.on_cpu)
    if not serve.gateway:
        return ServicePlan(config, engine, model, engine.launch_spec(config, model, python))
    engine_config = config.model_copy(update={"host": "127.0.0.1", "port": serve.engine_port or free_port()})
    launch = engine.launch_spec(engine_config, model, python)
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
    return ServicePlan(engine_config, engine, model, launch, gateway_launch, front)


def preflight(plan: ServicePlan) -> None:
    """The checks that need the machine but start nothing: engine installed, port free."""
    if importlib.util.find_spec(plan.engine.package) is None:
        raise EngineError(f"{plan.engine.name} is not installed in {sys.prefix}: {plan.engine.install_hint}")
    ensure_port_free(plan.config.host, plan.config.port)
    if plan.gateway_config is not None:
        ensure_port_free(plan.gateway_config.host, plan.gateway_config.port)


def dry_run_text(plan: ServicePlan) -> str:
    env = json.dumps(plan.launch.env, sort_keys=True) if plan.launch.env else "{}"
    lines = [
        f"# engine: {plan.engine.name} on {plan.device}; model {plan.model.source}",
        f"# environment added: {env}",
        plan.launch.shell_line(),
    ]
    if plan.gateway is not None:
        lines += [f"# gateway in front, serving {plan.gateway.base_url}", plan.gateway.shell_line()]
    return "\n".join(lines)


def log_path(name: str, port: int) -> Path:
    return deepserve_home() / "logs" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{port}.log"


ProgressCallback = Callable[[str, float], None]
ReadyCallback = Callable[[float, list[SupervisedProcess]], None]
GATEWAY_STARTUP_TIMEOUT_S = 120.0


def run_service(plan: ServicePlan, on_progress: ProgressCallback, on_ready: ReadyCallback) -> int:
    """Start the engine (then the gateway), wait until they are ready, then until one exits or we are told to stop
    (SIGINT/SIGTERM). Returns 0 after a requested stop; raises ProcessDied if a child exits on its own. Children
    stop in reverse order: the gateway before the engine."""
    started = time.monotonic()
    with stop_on_sigterm(), ExitStack() as children:
        try:
            running = [children.enter_context(_engine_process(plan))]
            running[0].wait_ready(plan.config.startup_timeout_s, on_progress)
            if plan.gateway is not None and plan.gateway_config is not None:
                running.append(children.enter_context(_gateway_process(plan.gateway, plan.gateway_config)))
                running[-1].wait_ready(GATEWAY_STARTUP_TIMEOUT_S, on_progress)
            on_ready(time.monotonic() - started, running)
            _wait_until_one_exits(running)
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


def _engine_process(plan: ServicePlan, log_file: Path | None = None) -> SupervisedProcess:
    log_file = log_file or log_path("engine", plan.config.port)
    return SupervisedProcess("engine", plan.launch, plan.engine.phase_of, log_file)


def _gateway_process(launch: LaunchSpec, config: GatewayConfig) -> SupervisedProcess:
    return SupervisedProcess("gateway", launch, _gateway_phase, log_path("gateway", config.port))


def _gateway_phase(line: str) -> str | None:
    return "starting gateway"


def _wait_until_one_exits(running: list[SupervisedProcess]) -> None:
    while True:
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


def _uses_cpu(config: EngineConfig) -> bool:
    if config.device == "auto":
        return not has_gpu()
    if config.device == "cuda" and not has_gpu():
        raise ConfigError("--device cuda was given but no NVIDIA GPU was found (nvidia-smi lists none)")
    return config.device == "cpu"


def _reject_gpu_only_flags(config: EngineConfig) -> None:
    given = []
    if config.tensor_parallel_size > 1:
        given.append(f"--tensor-parallel-size {config.tensor_parallel_size}")
    if config.pipeline_parallel_size > 1:
        given.append(f"--pipeline-parallel-size {config.pipeline_parallel_size}")
    if config.data_parallel_size > 1:
        given.append(f"--data-parallel-size {config.data_parallel_size}")
    if config.enable_expert_parallel:
        given.append("--enable-expert-parallel")
    if config.gpu_memory_utilization is not None:
        given.append(f"--gpu-memory-utilization {config.gpu_memory_utilization} (on CPU use --kv-cache-memory-gib)")
    if config.quantization and config.quantization.lower() in _GPU_ONLY_QUANTIZATIONS:
        given.append(f"--quantization {config.quantization}")
    if given:
        raise ConfigError(
            "these flags need a GPU, and this machine has none (nvidia-smi lists no device): "
            + ", ".join(given)
            + ". Remove them to serve on CPU, or run on a GPU machine."
        )
