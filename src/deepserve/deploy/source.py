"""What a rendered deployment runs, decided once for every target: the engine config (from flags and files like
`serve`, or from a plan: `--gpu h100 --gpus 16`), the model, the gateway's settings, and each node's engine command
line, built by the engine's own launcher (`engine.launch_spec`), never formatted here. What the tests start on
loopback is therefore what a cluster runs."""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import Field

from deepserve import __version__
from deepserve.config import load_section, parse_key_values, validate_section
from deepserve.engines.base import Engine, LaunchSpec
from deepserve.engines.config import EngineConfig
from deepserve.engines.registry import get_engine
from deepserve.engines.topology import check_layout_fits_nodes
from deepserve.errors import ConfigError, ModelError
from deepserve.gateway.config import GatewayConfig
from deepserve.hardware.catalog import Accelerator, get_accelerator
from deepserve.models.presets import canonical_preset_name
from deepserve.models.resolve import ResolvedModel, load_spec
from deepserve.models.spec import ModelSpec
from deepserve.models.tiny import is_tiny_model
from deepserve.plan.commands import engine_config as planned_engine_config
from deepserve.plan.formats import WeightFormat, checkpoint_format
from deepserve.plan.planner import Plan, make_plan
from deepserve.plan.types import PlanConfig

GIB = 1024**3
ENGINE_PORT = 8000  # inside the engine's container or pod
GATEWAY_PORT = 8000  # inside the gateway's container or pod
GATEWAY_IMAGE = f"deepserve:{__version__}"  # built from the repository's Dockerfile
# Stands for node 0's address in rendered command lines until each target puts its own variable there
# (LWS_LEADER_ADDRESS on Kubernetes, the first host of the Slurm allocation, MASTER_ADDR with compose).
MASTER_PLACEHOLDER = "__DEEPSERVE_MASTER_ADDR__"
# Fields a plan decides; given on the command line too, they win over the plan's.
_PLAN_FIELDS = frozenset(PlanConfig.model_fields) & frozenset(EngineConfig.model_fields)


class _UnplacedEngineConfig(EngineConfig):
    """An engine config whose node 0 is not known yet: each target fills it in from its environment."""

    master_addr: str | None = Field(MASTER_PLACEHOLDER, description="node 0's address (default: from the target)")


def load_engine_config(file: Path | None, overrides: dict[str, Any]) -> EngineConfig:
    """The engine section as `serve` loads it (file, environment, flags), except that several nodes need no
    --master-addr: each target takes node 0's address from its own environment."""
    loaded = load_section(_UnplacedEngineConfig, "engine", file, overrides)
    values = {name: getattr(loaded, name) for name in loaded.model_fields_set}
    if loaded.is_multi_node:
        values["master_addr"] = loaded.master_addr
    return EngineConfig.model_validate(values)


@dataclass(frozen=True)
class DeploySpec:
    config: EngineConfig  # the deployment as node 0's `deepserve serve` takes it (public host and port)
    gateway: GatewayConfig  # limits and keys; each target sets its upstreams, host and port
    model: ResolvedModel
    command: str  # the `deepserve deploy render …` line that made it
    replicas: int = 1
    name: str = "deepserve"
    engine_image: str = ""
    gateway_image: str = GATEWAY_IMAGE
    checkpoint_bytes: int | None = None  # what the weights take on disk (volume sizes); None when unknown
    node_gpus: int | None = None  # GPUs each node has (--gpus-per-node, or --gpu-type's node); None when unknown
    plan: Plan | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    runtime_class: str | None = None  # Kubernetes: e.g. nvidia, where GPUs need the NVIDIA container runtime
    node_selector: dict[str, str] = field(default_factory=dict)  # Kubernetes: which nodes the engine pods go to

    @property
    def engine(self) -> Engine:
        return get_engine(self.config.engine)

    @property
    def nodes(self) -> int:
        return self.config.nnodes

    @property
    def gpus_per_node(self) -> int:
        return self.config.world_size // self.config.nnodes

    def node_config(self, rank: int, master_addr: str = MASTER_PLACEHOLDER) -> EngineConfig:
        """Node RANK's engine config inside a container: listening on every interface at ENGINE_PORT."""
        update: dict[str, object] = {"host": "0.0.0.0", "port": ENGINE_PORT}
        if self.config.is_multi_node:
            update["master_addr"] = master_addr
        return self.config.for_node(rank).model_copy(update=update)

    def launch(self, rank: int, master_addr: str = MASTER_PLACEHOLDER) -> LaunchSpec:
        """Node RANK's engine command as users type it where the engine is installed (the engine's image)."""
        return self.engine.launch_spec(self.node_config(rank, master_addr), self.model, None)

    def describe(self) -> str:
        c = self.config
        layout = f"TP {c.tensor_parallel_size} x PP {c.pipeline_parallel_size} x DP {c.data_parallel_size}"
        nodes = f"{self.nodes} node(s) x {self.gpus_per_node} GPU(s)"
        return f"{self.model.served_name} on {nodes} ({layout}), {self.replicas} replica(s), {c.engine}"


def deploy_spec(
    config: EngineConfig,
    gateway: GatewayConfig,
    command: str,
    replicas: int = 1,
    name: str = "deepserve",
    engine_image: str | None = None,
    gateway_image: str | None = None,
    plan: Plan | None = None,
    runtime_class: str | None = None,
    node_selector: list[str] | None = None,
) -> DeploySpec:
    """Check CONFIG as something to run on GPU nodes and resolve what every target needs."""
    if replicas < 1:
        raise ConfigError(f"--replicas {replicas} must be at least 1")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,40}[a-z0-9])?", name):
        raise ConfigError(f"--name {name!r} must be a DNS label: lower-case letters, digits and '-', at most 42")
    if config.device == "cpu":
        raise ConfigError(
            "rendered deployments run the engine's GPU image; drop --device cpu (serve on CPU with `deepserve serve`)"
        )
    if config.distributed_executor_backend == "ray":
        raise ConfigError(
            "rendered deployments use vLLM's own multi-node runtime (--nnodes), which needs no Ray cluster; drop "
            "--distributed-executor-backend ray (`deepserve cluster` sets up Ray by hand)"
        )
    node_gpus = _node_gpus(config)
    per_node = node_gpus or max(config.world_size // config.nnodes, 1)
    notes = tuple(check_layout_fits_nodes(config, per_node, on_this_machine=False))
    notes += (_plan_note(plan),) if plan else ()
    model = render_model(config)
    engine = get_engine(config.engine)
    return DeploySpec(
        config=config,
        gateway=gateway,
        model=model,
        command=command,
        replicas=replicas,
        name=name,
        engine_image=engine_image or engine.image,
        gateway_image=gateway_image or GATEWAY_IMAGE,
        checkpoint_bytes=_checkpoint_bytes_of(config.model or ""),
        node_gpus=node_gpus,
        plan=plan,
        notes=notes,
        runtime_class=runtime_class,
        node_selector=parse_key_values("--node-selector", node_selector or [], "nvidia.com/gpu.product=H100"),
    )


def _node_gpus(config: EngineConfig) -> int | None:
    """GPUs on each node: as given, else a node of the GPU type the deployment is for (8 x H100), else unknown."""
    if config.gpus_per_node is not None:
        return config.gpus_per_node
    return get_accelerator(config.gpu_type).devices_per_node if config.gpu_type else None


def _plan_note(plan: Plan) -> str:
    d, memory = plan.deployment, plan.deployment.memory
    return (
        f"planned on {d.layout.gpus} x {d.accelerator.name} ({d.fmt.name} weights): the KV cache holds "
        f"{memory.kv_cache_tokens:,} tokens, {memory.max_concurrent_sequences:,} sequences of "
        f"{plan.config.input_len}+{plan.config.output_len} tokens (`deepserve plan` for speed and cost)"
    )


def render_model(config: EngineConfig) -> ResolvedModel:
    """The model as the nodes load it: a preset's or a hub id, or a path that must exist on the nodes (it is not
    looked up here, where the deployment is only written)."""
    if not config.model:
        raise ConfigError("name the model to deploy with --model, e.g. --model deepseek-ai/DeepSeek-V3-0324")
    if is_tiny_model(config.model):
        raise ConfigError(
            "the tiny model is generated on this machine and exists to test deepserve on CPU; deploy a real model "
            "(presets: `deepserve model list`)"
        )
    source = canonical_preset_name(config.model) or config.model.rstrip("/")
    return ResolvedModel(source, config.served_model_name or source, on_cpu=False)


def checkpoint_bytes(spec: ModelSpec, fmt: WeightFormat) -> int:
    """Bytes the checkpoint's weights take on disk: each component at its format's width, plus the MTP module that
    DeepSeek's own releases ship (at the quantized width)."""
    breakdown = spec.parameter_breakdown()
    weights = sum(count * fmt.bytes_per_param(component) for component, count in breakdown.items())
    return int(weights + spec.mtp_params() * fmt.quantized_bytes_per_param)


def _checkpoint_bytes_of(model: str) -> int | None:
    try:
        spec = load_spec(model)
        return checkpoint_bytes(spec, checkpoint_format(spec))
    except (ModelError, ConfigError):
        return None  # a hub id that is no preset: its size is not known offline


def deployment_config(
    file: Path | None, overrides: dict[str, Any], gpu: str | None, gpus: int | None, weights: str | None
) -> tuple[EngineConfig, Plan | None]:
    """The engine config to render: loaded as `serve` loads it, then, with GPU and GPUS (`--gpu h100 --gpus 16`),
    laid out by the planner."""
    config = load_engine_config(file, overrides)
    if gpu is None and gpus is None:
        if weights is not None:
            raise ConfigError("--weights chooses the plan's weight format: give it with --gpu and --gpus")
        return config, None
    if gpu is None or gpus is None:
        raise ConfigError("--gpu and --gpus go together: the GPU type and the total GPU count to plan for")
    return planned_config(config, gpu, gpus, weights)


def planned_config(config: EngineConfig, gpu: str, gpus: int, weights: str | None = None) -> tuple[EngineConfig, Plan]:
    """CONFIG's model laid out by the planner on GPUS GPUs of type GPU (whole nodes: TP inside a node, PP across),
    refused with the plan's numbers when it does not fit. Fields set in CONFIG (flags, file, environment) win over
    the plan's."""
    if not config.model:
        raise ConfigError("--gpu/--gpus plan a model: name it with --model (presets: `deepserve model list`)")
    if gpus < 1:
        raise ConfigError(f"--gpus {gpus}: give the total number of GPUs to plan for, 1 or more")
    accelerator = get_accelerator(gpu)
    given = config.model_fields_set
    if "gpu_type" in given and config.gpu_type and get_accelerator(config.gpu_type).name != accelerator.name:
        raise ConfigError(
            f"--gpu-type {config.gpu_type} and --gpu {gpu} disagree: the plan is made for --gpu, and every node's "
            "serve checks the fit for it; drop --gpu-type"
        )
    plan_config = validate_section(PlanConfig, "plan", _plan_request(config, accelerator, gpus, weights))
    plan = make_plan(plan_config)
    if not plan.fits:
        raise ConfigError(_does_not_fit(plan, config.model, gpus, accelerator))
    planned = planned_engine_config(plan.deployment, plan_config, config.engine).model_dump()
    planned["gpu_type"] = plan.deployment.accelerator.name  # serve on the nodes checks the fit for this type
    planned.update({name: getattr(config, name) for name in given})
    if planned["nnodes"] > 1 and "master_addr" not in given:
        planned["master_addr"] = MASTER_PLACEHOLDER
    return EngineConfig.model_validate(planned), plan


def _plan_request(config: EngineConfig, accelerator: Accelerator, gpus: int, weights: str | None) -> dict[str, object]:
    """What the planner is asked: CONFIG's model and engine, the fields the user set that the planner also takes,
    and the nodes (--nnodes when given, else as few as hold the GPUs)."""
    given = config.model_fields_set
    nodes = config.nnodes if "nnodes" in given else max(math.ceil(gpus / accelerator.devices_per_node), 1)
    if gpus % nodes:
        raise ConfigError(f"--gpus {gpus} does not split evenly over --nnodes {nodes}: give a multiple of {nodes}")
    request: dict[str, object] = {
        "model": config.model,
        "gpu": accelerator.name,
        "gpus": gpus,
        "nodes": nodes,
        "engine": config.engine,
    }
    if weights:
        request["weights"] = weights
    for name in _PLAN_FIELDS - {"model", "engine"}:
        if name in given and getattr(config, name) is not None:
            request[name] = getattr(config, name)
    layout = {"tensor_parallel_size": "tp", "pipeline_parallel_size": "pp", "data_parallel_size": "dp"}
    for field_name, plan_name in layout.items():
        if field_name in given:
            request[plan_name] = getattr(config, field_name)
    if "enable_expert_parallel" in given:
        request["ep"] = config.enable_expert_parallel
    return request


def _does_not_fit(plan: Plan, model: str, gpus: int, accelerator: Accelerator) -> str:
    memory = plan.deployment.memory
    fits = f"; it fits on {plan.smallest_fitting_gpus} x {accelerator.name}" if plan.smallest_fitting_gpus else ""
    return (
        f"{model} does not fit on {gpus} x {accelerator.name} ({plan.deployment.layout.describe()}): "
        f"{memory.weights_bytes_per_gpu / GIB:.1f} GiB of weights and {memory.reserve_bytes_per_gpu / GIB:.1f} GiB "
        f"reserve per GPU leave {memory.kv_cache_bytes_per_gpu / GIB:.1f} GiB for the KV cache{fits} "
        "(`deepserve plan` shows the details)"
    )


# ---- command lines with variables -------------------------------------------------------------------------------


def shell_line(argv: list[str], variables: dict[str, str], env: dict[str, str] | None = None) -> str:
    """ARGV as one shell line, each word quoted, where a placeholder inside a word becomes a double-quoted shell
    variable: {MASTER_PLACEHOLDER: "LWS_LEADER_ADDRESS"} turns `--master-addr __…__` into
    `--master-addr "${LWS_LEADER_ADDRESS}"`."""
    words = [f"{key}={_shell_word(value, variables)}" for key, value in sorted((env or {}).items())]
    return " ".join(words + [_shell_word(word, variables) for word in argv])


def _shell_word(word: str, variables: dict[str, str]) -> str:
    if not variables:
        return shlex.quote(word)
    pieces = re.split("(" + "|".join(map(re.escape, variables)) + ")", word)
    quoted = [f'"${{{variables[piece]}}}"' if piece in variables else shlex.quote(piece) for piece in pieces if piece]
    return "".join(quoted) or "''"


def substitute(argv: list[str], replacements: dict[str, str]) -> list[str]:
    """ARGV with each placeholder replaced inside its words (for list-form commands that a tool, not a shell,
    expands: compose's ${VAR})."""
    result = []
    for word in argv:
        for placeholder, value in replacements.items():
            word = word.replace(placeholder, value)
        result.append(word)
    return result
