"""`deepserve serve`: resolve the model and device, check everything that can be checked before starting, launch
the engine under supervision, report progress, and stop it cleanly."""

from __future__ import annotations

import importlib.util
import json
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from deepserve.config import EngineConfig, deepserve_home
from deepserve.engines.base import Engine, LaunchSpec, ResolvedModel
from deepserve.engines.registry import get_engine
from deepserve.engines.supervisor import EngineProcess
from deepserve.errors import ConfigError, EngineError
from deepserve.hardware.detect import has_gpu
from deepserve.models.resolve import resolve_model

_GPU_ONLY_QUANTIZATIONS = {"fp8", "awq", "awq_marlin", "gptq", "gptq_marlin", "marlin", "compressed-tensors"}


@dataclass(frozen=True)
class ServicePlan:
    """Everything decided before anything starts; `--dry-run` prints it."""

    config: EngineConfig
    engine: Engine
    model: ResolvedModel
    launch: LaunchSpec

    @property
    def device(self) -> str:
        return "cpu" if self.model.on_cpu else "cuda"


def plan_service(config: EngineConfig, python: str = sys.executable) -> ServicePlan:
    on_cpu = _uses_cpu(config)
    if on_cpu:
        _reject_gpu_only_flags(config)
    engine = get_engine(config.engine)
    model = resolve_model(config.model, on_cpu)
    if config.served_model_name:
        model = ResolvedModel(model.source, config.served_model_name, model.on_cpu)
    return ServicePlan(config, engine, model, engine.launch_spec(config, model, python))


def preflight(plan: ServicePlan) -> None:
    """The checks that need the machine but start nothing: engine installed, port free."""
    if importlib.util.find_spec(plan.engine.package) is None:
        raise EngineError(f"{plan.engine.name} is not installed in {sys.prefix}: {plan.engine.install_hint}")
    ensure_port_free(plan.config.host, plan.config.port)


def ensure_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ConfigError(
                f"port {port} on {host} is already in use ({exc.strerror}); stop what listens there "
                f"(`ss -ltnp 'sport = :{port}'` shows it) or choose another with --port"
            ) from None


def dry_run_text(plan: ServicePlan) -> str:
    env = json.dumps(plan.launch.env, sort_keys=True) if plan.launch.env else "{}"
    return "\n".join(
        [
            f"# engine: {plan.engine.name} on {plan.device}; model {plan.model.source}",
            f"# environment added: {env}",
            plan.launch.shell_line(),
        ]
    )


def engine_log_path(port: int) -> Path:
    return deepserve_home() / "logs" / f"engine-{time.strftime('%Y%m%d-%H%M%S')}-{port}.log"


ProgressCallback = Callable[[str, float], None]


def run_service(
    plan: ServicePlan, on_progress: ProgressCallback, on_ready: Callable[[float, EngineProcess], None]
) -> int:
    """Start the engine, wait until it is ready, then until it exits or we are told to stop (SIGINT/SIGTERM).
    Returns 0 after a requested stop; raises EngineDied if the engine exits on its own."""
    process = EngineProcess(plan.launch, plan.engine, engine_log_path(plan.config.port))
    with _stop_on_sigterm(), process:
        try:
            ready_s = process.wait_ready(plan.config.startup_timeout_s, on_progress)
            on_ready(ready_s, process)
            process.wait()
            process.raise_if_died()
        except KeyboardInterrupt:
            return 0
    return 0


@contextmanager
def _stop_on_sigterm() -> Iterator[None]:
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
