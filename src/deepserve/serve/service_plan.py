"""`deepserve serve`, decided: resolve the model and device, plan the engine (and, by default, the gateway in front
of it), and check everything that can be checked before anything starts (`--dry-run` prints the result)."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import dataclass

import psutil

from deepserve.config import changed_flags
from deepserve.deploy.ray_backend import check_ray_backend
from deepserve.engines.base import Engine, LaunchSpec, url_host
from deepserve.engines.config import EngineConfig, serve_command
from deepserve.engines.platform import gpu_platform
from deepserve.engines.registry import get_engine
from deepserve.engines.topology import check_layout_fits_nodes, check_master_address, nodes_share_this_host
from deepserve.engines.vllm_workarounds import check_workarounds
from deepserve.errors import ConfigError, EngineError
from deepserve.gateway.config import GatewayConfig, gateway_argv
from deepserve.gateway.config import base_url as gateway_base_url
from deepserve.hardware.catalog import get_accelerator
from deepserve.hardware.detect import has_gpu, local_gpus
from deepserve.models.resolve import ResolvedModel, resolve_model
from deepserve.net import ensure_port_free, free_port
from deepserve.plan.admission import FitCheck, accelerator_for, check_cpu_fit, check_gpu_fit, spec_or_none
from deepserve.serve.config import ServeConfig


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
        return "cpu" if self.model.on_cpu else gpu_platform(self.config)

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
    config = _with_platform(config, on_cpu, on_this_machine)
    check_ray_backend(config, on_cpu)
    if on_cpu:
        _reject_gpu_only_flags(config)
    notes = tuple(check_layout_fits_nodes(config, None if on_cpu else _gpus_per_node(config, on_this_machine)))
    engine = get_engine(config.engine)
    model = resolve_model(config.model, on_cpu)
    if config.served_model_name:
        model = ResolvedModel(model.source, config.served_model_name, model.on_cpu)
    config, speculation_note = resolve_speculation(config, model, on_this_machine)
    notes += speculation_note
    fit = check_fit(config, model, on_this_machine)
    # GPU commands planned on a machine without one are for another machine: print them as users type them there.
    engine_python = python if on_cpu or has_gpu() else None
    if config.role is not None:
        notes += (_pool_note(config),)
    if not serve.gateway or not config.is_head or config.role is not None:
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
        ready_path="/ready",  # 200 once a health check found the engine, where /health answers as soon as it listens
        served_model_name=model.served_name,
        base_url=gateway_base_url(front),
    )
    return ServicePlan(engine_config, engine, model, launch, gateway_launch, front, notes, python, fit, serve.force)


def _pool_note(config: EngineConfig) -> str:
    """A prefill or decode engine is one member of a pool: the gateway in front of both pools sends each request to
    a prefill engine, then to a decode engine, so this serve runs the engine alone."""
    other = "decode" if config.role == "prefill" else "prefill"
    flag = "--prefill-upstream" if config.role == "prefill" else "--upstream"
    return (
        f"a {config.role} engine ({config.kv_connector}) without a gateway of its own: run `deepserve gateway` with "
        f"{flag} http://{url_host(config.host)}:{config.port}/v1 and the {other} engines beside it"
    )


def resolve_speculation(
    config: EngineConfig, model: ResolvedModel, on_this_machine: bool
) -> tuple[EngineConfig, tuple[str, ...]]:
    """CONFIG with its speculative decoding written out for this model and device (the vendor's recommendation
    filling what is not given; engines/speculative.py), and a note saying what was chosen; unchanged when off."""
    if not config.speculation_requested:
        return config, ()
    spec = spec_or_none(model.source)
    hardware_class = "cpu" if model.on_cpu else _gpu_class(config, on_this_machine)
    speculation = config.speculation(spec, model.on_cpu, hardware_class)
    resolved = config.with_speculation(speculation)
    if speculation is None:
        return resolved, ("speculative decoding: off",)
    return resolved, (f"speculative decoding: {speculation.describe()}",)


def _gpu_class(config: EngineConfig, on_this_machine: bool) -> str | None:
    gpus = local_gpus() if on_this_machine else ()
    accelerator = accelerator_for(config.gpu_type, gpus[0].name if gpus else None)
    return accelerator.hardware_class if accelerator else None


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


def check_can_run(plan: ServicePlan) -> None:
    """The checks that need the machine but start nothing: the memory plan (no install fixes a deployment that
    cannot fit), engine installed, ports free, the master address."""
    if plan.fit is not None and plan.fit.fits is False and not plan.force:
        raise ConfigError(f"the memory plan says this cannot run: {plan.fit.describe()}")
    if importlib.util.find_spec(plan.engine.package) is None:
        raise EngineError(f"{plan.engine.name} is not installed in {sys.prefix}: {plan.engine.install_hint}")
    if plan.engine.name == "vllm" and plan.model.on_cpu:
        check_workarounds()  # deepserve's fixes for vLLM's CPU build fit the installed vLLM
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
        flags = changed_flags(serve) if serve is not None and rank == 0 else []
        lines.append("#   " + serve_command(_user_config(node), flags))
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
        *_file_lines(plan.launch),
        plan.launch.shell_line(),
    ]
    if plan.gateway is not None:
        lines += [f"# gateway in front, serving {plan.gateway.base_url}", plan.gateway.shell_line()]
    return lines


def _file_lines(launch: LaunchSpec) -> list[str]:
    """The files the command reads (TensorRT-LLM's options), as comments: written there when serve starts."""
    lines = []
    for path, text in launch.files.items():
        lines.append(f"# file written before the engine starts: {path}")
        lines += [f"#   {line}" for line in text.splitlines()]
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


def _uses_cpu(config: EngineConfig, on_this_machine: bool = True) -> bool:
    if config.device == "auto":
        if not on_this_machine and _names_a_gpu(config.gpu_type):
            return False  # a dry run for the nodes --gpu-type names, whatever this machine has
        return not has_gpu()
    if config.device in ("cuda", "rocm") and not has_gpu() and on_this_machine:  # a dry run may plan for GPUs
        vendor = "NVIDIA" if config.device == "cuda" else "AMD"
        raise ConfigError(
            f"--device {config.device} was given but no {vendor} GPU was found (nvidia-smi and amd-smi/rocm-smi "
            "list none); install the driver, or add --dry-run to print the commands for a GPU machine"
        )
    return config.device == "cpu"


def _names_a_gpu(gpu_type: str | None) -> bool:
    """GPU_TYPE is a GPU of the catalog (the CPU host is not)."""
    return bool(gpu_type) and get_accelerator(str(gpu_type)).vendor in ("nvidia", "amd")


def _with_platform(config: EngineConfig, on_cpu: bool, on_this_machine: bool) -> EngineConfig:
    """--device auto on a machine with AMD GPUs becomes rocm (the launchers write ROCm's settings, and every node's
    serve line carries it); a --device naming the other vendor than this machine's GPUs is refused."""
    gpus = local_gpus() if on_this_machine and not on_cpu else ()
    if not gpus:
        return config
    platform = "rocm" if gpus[0].vendor == "amd" else "cuda"
    if config.device == "auto":
        return config.model_copy(update={"device": platform}) if platform == "rocm" else config
    if config.device != platform:
        raise ConfigError(
            f"--device {config.device} was given, but this machine's GPUs are {gpus[0].name} ({platform}): "
            f"use --device {platform} or auto"
        )
    return config


def _reject_gpu_only_flags(config: EngineConfig) -> None:
    refused = get_engine(config.engine).cpu_refusals(config)
    if refused:
        raise ConfigError(
            "these flags need a GPU, and this machine has none (nvidia-smi and amd-smi list no device): "
            + ", ".join(refused)
            + ". Remove them to serve on CPU, or run on a GPU machine."
        )
