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
from deepserve.config import load_section, parse_key_values
from deepserve.deploy.config import DeployConfig
from deepserve.engines.base import Engine, LaunchSpec
from deepserve.engines.config import DEFAULT_KV_CONNECTOR, EngineConfig
from deepserve.engines.platform import ROCM, gpu_platform
from deepserve.engines.registry import get_engine
from deepserve.engines.topology import check_layout_fits_nodes
from deepserve.errors import ConfigError, ModelError
from deepserve.gateway.config import GatewayConfig, gateway_argv
from deepserve.hardware.catalog import Accelerator, get_accelerator
from deepserve.hardware.network import NetworkConfig, NetworkProfile, get_network
from deepserve.models.presets import canonical_preset_name
from deepserve.models.resolve import ResolvedModel, load_spec
from deepserve.models.tiny import is_tiny_model
from deepserve.plan.admission import check_gpu_fit
from deepserve.plan.commands import engine_config as planned_engine_config
from deepserve.plan.formats import checkpoint_format, get_format, loads_as, published_export
from deepserve.plan.memory import checkpoint_bytes
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
# Engine fields the planner takes under another name.
_ENGINE_TO_PLAN = {
    "tensor_parallel_size": "tp",
    "pipeline_parallel_size": "pp",
    "data_parallel_size": "dp",
    "enable_expert_parallel": "ep",
    "kv_cache_dtype": "kv_dtype",
}


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


ROLES = ("engine", "prefill", "decode")
SHARED_KV_CONNECTOR = "ExampleConnector"  # moves KV through a directory both pools mount
KV_SHARED_PATH = "/var/cache/deepserve/kv-transfer"  # that directory, inside the engine containers
# Connectors that move KV over the nodes' network (RDMA where there is one): the pools need the network profile.
LOCAL_KV_CONNECTORS = frozenset({SHARED_KV_CONNECTOR, "OffloadingConnector", "SimpleCPUOffloadConnector"})


@dataclass(frozen=True)
class Pool:
    """Engine replicas of one role: whole requests (engine), prompts (prefill) or outputs (decode)."""

    role: str
    config: EngineConfig  # with its --role and connector for prefill and decode
    replicas: int


@dataclass(frozen=True)
class DeploySpec:
    config: EngineConfig  # the deployment as node 0's `deepserve serve` takes it (public host and port)
    gateway: GatewayConfig  # limits and keys; each target sets its upstreams, host and port
    model: ResolvedModel
    command: str  # the `deepserve deploy render …` line that made it
    deploy: DeployConfig = field(default_factory=DeployConfig)
    network: NetworkProfile = field(default_factory=lambda: get_network("ib"))
    engine_image: str = ""
    gateway_image: str = GATEWAY_IMAGE
    checkpoint_bytes: int | None = None  # what the weights take on disk (volume sizes); None when unknown
    node_gpus: int | None = None  # GPUs each node has (--gpus-per-node, or --gpu-type's node); None when unknown
    plan: Plan | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def engine(self) -> Engine:
        return get_engine(self.config.engine)

    @property
    def replicas(self) -> int:
        return self.deploy.replicas

    @property
    def name(self) -> str:
        return self.deploy.name

    @property
    def runtime_class(self) -> str | None:
        return self.deploy.runtime_class

    @property
    def node_selector(self) -> dict[str, str]:
        return parse_key_values("--node-selector", self.deploy.node_selector, "nvidia.com/gpu.product=H100")

    @property
    def nodes(self) -> int:
        return self.config.nnodes

    @property
    def gpus_per_node(self) -> int:
        return self.config.world_size // self.config.nnodes

    @property
    def pools(self) -> tuple[Pool, ...]:
        """One pool of engines, or with --prefill-replicas a prefill pool and a decode pool joined by the
        connector."""
        if not self.deploy.disaggregated:
            return (Pool("engine", self.config, self.replicas),)
        return (
            Pool("prefill", self._role_config("prefill"), self.deploy.prefill_replicas),
            Pool("decode", self._role_config("decode"), self.replicas),
        )

    @property
    def serving_pool(self) -> Pool:
        """The pool whose engines answer the client (the gateway's --upstream): the engines, or the decode pool."""
        return self.pools[-1]

    @property
    def kv_connector(self) -> str | None:
        return self.serving_pool.config.kv_connector

    @property
    def shares_kv_directory(self) -> bool:
        return self.kv_connector == SHARED_KV_CONNECTOR

    @property
    def uses_network(self) -> bool:
        """Traffic between nodes: a replica over several nodes, or KV moving between the prefill and decode pods."""
        return self.nodes > 1 or (self.deploy.disaggregated and self.kv_connector not in LOCAL_KV_CONNECTORS)

    def _role_config(self, role: str) -> EngineConfig:
        connector = self.config.kv_connector or DEFAULT_KV_CONNECTOR
        settings = list(self.config.kv_connector_config)
        if connector == SHARED_KV_CONNECTOR and not any(s.startswith("shared_storage_path=") for s in settings):
            settings.append(f"shared_storage_path={KV_SHARED_PATH}")
        return self.config.model_copy(update={"role": role, "kv_connector": connector, "kv_connector_config": settings})

    def node_config(self, rank: int, master_addr: str = MASTER_PLACEHOLDER, pool: Pool | None = None) -> EngineConfig:
        """Node RANK's engine config inside a container: listening on every interface at ENGINE_PORT."""
        config = (pool or self.serving_pool).config
        update: dict[str, object] = {"host": "0.0.0.0", "port": ENGINE_PORT}
        if config.is_multi_node:
            update["master_addr"] = master_addr
        return config.for_node(rank).model_copy(update=update)

    def launch(self, rank: int, master_addr: str = MASTER_PLACEHOLDER, pool: Pool | None = None) -> LaunchSpec:
        """Node RANK's engine command as users type it where the engine is installed (the engine's image)."""
        return self.engine.launch_spec(self.node_config(rank, master_addr, pool), self.model, None)

    @property
    def capacity_per_replica(self) -> int | None:
        """Requests one replica serves at its target: --capacity-per-replica, else the plan's highest concurrency
        within its ITL objective (or its running cap), else the engines' own cap (--max-num-seqs per DP rank)."""
        if self.deploy.capacity_per_replica is not None:
            return self.deploy.capacity_per_replica
        if self.plan is not None and self.plan.fits:
            return self.plan.max_concurrency_within_slo or self.plan.deployment.running_cap or None
        if self.config.max_num_seqs is not None:
            return self.config.max_num_seqs * self.config.data_parallel_size
        return None

    def describe(self) -> str:
        c = self.config
        layout = f"TP {c.tensor_parallel_size} x PP {c.pipeline_parallel_size} x DP {c.data_parallel_size}"
        nodes = f"{self.nodes} node(s) x {self.gpus_per_node} GPU(s)"
        replicas = f"{self.replicas} replica(s)"
        if self.deploy.disaggregated:
            pools = f"{self.deploy.prefill_replicas} prefill + {self.replicas} decode"
            replicas = f"{pools} replica(s) ({self.kv_connector})"
        return f"{self.model.served_name} on {nodes} ({layout}), {replicas}, {c.engine}, network {self.network.name}"


def deploy_spec(
    config: EngineConfig,
    gateway: GatewayConfig,
    command: str,
    deploy: DeployConfig | None = None,
    plan: Plan | None = None,
    network: NetworkConfig | None = None,
) -> DeploySpec:
    """Check CONFIG as something to run on GPU nodes and resolve what every target needs."""
    deploy = deploy or DeployConfig()
    if config.device == "cpu":
        raise ConfigError(
            "rendered deployments run the engine's GPU image; drop --device cpu (serve on CPU with `deepserve serve`)"
        )
    if config.distributed_executor_backend == "ray":
        raise ConfigError(
            "rendered deployments use vLLM's own multi-node runtime (--nnodes), which needs no Ray cluster; drop "
            "--distributed-executor-backend ray (`deepserve cluster` sets up Ray by hand)"
        )
    if config.role is not None:
        raise ConfigError(
            f"--role {config.role} is for one engine started by hand; a rendered deployment sets each pool's role: "
            "give --prefill-replicas N (and --kv-connector) for a prefill pool beside the decode pool"
        )
    if deploy.engine_api_key and config.engine != "vllm":
        raise ConfigError(
            f"--engine-api-key sets vLLM's VLLM_API_KEY; {config.engine} would ignore it and serve without a key: "
            "drop --engine-api-key (the NetworkPolicy still keeps the engines to the gateway)"
        )
    node_gpus = _node_gpus(config)
    per_node = node_gpus or max(config.world_size // config.nnodes, 1)
    notes = tuple(check_layout_fits_nodes(config, per_node, on_this_machine=False)) + _nvlink_domain_notes(config)
    model = render_model(config)
    notes += (_plan_note(plan),) if plan else _fit_notes(config, model)
    engine = get_engine(config.engine)
    engine.launch_spec(config, model, None)  # what the engine cannot run on these nodes fails here, with why
    return DeploySpec(
        config=config,
        gateway=gateway,
        model=model,
        command=command,
        deploy=deploy,
        network=(network or NetworkConfig()).profile(),
        engine_image=deploy.engine_image or _engine_image(engine, config),
        gateway_image=deploy.gateway_image or GATEWAY_IMAGE,
        checkpoint_bytes=checkpoint_bytes_of(config.model or ""),
        node_gpus=node_gpus,
        plan=plan,
        notes=notes,
    )


def _nvlink_domain_notes(config: EngineConfig) -> tuple[str, ...]:
    """Machines of one NVLink domain (an NVL72 rack's trays) reach each other over NVLink only inside the rack's
    IMEX domain; without it NCCL falls back to the network between them."""
    accelerator = get_accelerator(config.gpu_type) if config.gpu_type else None
    if accelerator is None or config.nnodes < 2 or accelerator.gpus_per_machine >= accelerator.devices_per_node:
        return ()
    return (
        f"the {config.nnodes} nodes are compute trays of one {accelerator.name} NVLink domain: schedule them in one "
        "rack and give the pods its IMEX channel (NVIDIA's DRA driver: a ComputeDomain claim; Slurm: the rack's IMEX "
        "service), or NCCL talks between them over the network",
    )


def _fit_notes(config: EngineConfig, model: ResolvedModel) -> tuple[str, ...]:
    """Without a plan: the memory plan `serve` checks on the nodes, checked here whenever the GPU type is known
    (--gpu-type), so that a deployment that cannot fit is refused before it is applied."""
    if not config.gpu_type:
        return ("memory fit not checked: give --gpu-type (or plan with --gpu/--gpus)",)
    fit = check_gpu_fit(config, model.source, get_accelerator(config.gpu_type))
    if fit.fits is False:
        raise ConfigError(f"the memory plan says this cannot run: {fit.describe()}")
    return (f"memory plan: {fit.summary}",)


def _engine_image(engine: Engine, config: EngineConfig) -> str:
    """The engine's image for the nodes' GPUs: its ROCm build's on AMD GPUs."""
    if gpu_platform(config) != ROCM:
        return engine.image
    if engine.rocm_image is None:
        raise ConfigError(f"{engine.name} has no ROCm image for AMD GPUs; use --engine vllm or --engine sglang")
    return engine.rocm_image


def _node_gpus(config: EngineConfig) -> int | None:
    """GPUs on each node: as given, else one machine of the GPU type the deployment is for (8 x H100; an NVL72
    rack's compute tray, 4), else unknown."""
    if config.gpus_per_node is not None:
        return config.gpus_per_node
    return get_accelerator(config.gpu_type).gpus_per_machine if config.gpu_type else None


def _plan_note(plan: Plan) -> str:
    d, memory = plan.deployment, plan.deployment.memory
    return (
        f"planned on {d.layout.gpus} x {d.accelerator.name} ({d.fmt.name} weights, KV cache {d.kv_dtype}, network "
        f"{d.network.name}): the KV cache holds {memory.kv_cache_tokens:,} tokens, "
        f"{memory.max_concurrent_sequences:,} sequences of {plan.config.input_len}+{plan.config.output_len} tokens "
        "(`deepserve plan` for speed and cost)"
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


def checkpoint_bytes_of(model: str) -> int | None:
    """What the download of MODEL takes: its checkpoint's own format (an on-the-fly --quantization happens at
    load); None for a hub id that is no preset."""
    try:
        spec = load_spec(model)
        return checkpoint_bytes(spec, checkpoint_format(spec))
    except (ModelError, ConfigError):
        return None  # a hub id that is no preset: its size is not known offline


def deployment_config(
    file: Path | None,
    overrides: dict[str, Any],
    plan_overrides: dict[str, Any] | None = None,
    network: NetworkConfig | None = None,
) -> tuple[EngineConfig, Plan | None]:
    """The engine config to render: loaded as `serve` loads it, then, with --gpu and --gpus in PLAN_OVERRIDES, laid
    out by the planner with the config file's `plan` section (workload lengths, KV dtype, …) and NETWORK, exactly as
    `deepserve plan` would plan it."""
    config = load_engine_config(file, overrides)
    asked = {name: value for name, value in (plan_overrides or {}).items() if value is not None}
    gpu, gpus = asked.pop("gpu", None), asked.pop("gpus", None)
    if gpu is None and gpus is None:
        if asked:
            flags = ", ".join("--" + name.replace("_", "-") for name in sorted(asked))
            raise ConfigError(f"{flags} shape the plan's layout: give them with --gpu and --gpus")
        return config, None
    if gpu is None or gpus is None:
        raise ConfigError("--gpu and --gpus go together: the GPU type and the total GPU count to plan for")
    return planned_config(config, gpu, gpus, file=file, plan_overrides=asked, network=network)


def planned_config(
    config: EngineConfig,
    gpu: str,
    gpus: int,
    weights: str | None = None,
    file: Path | None = None,
    plan_overrides: dict[str, Any] | None = None,
    network: NetworkConfig | None = None,
) -> tuple[EngineConfig, Plan]:
    """CONFIG's model laid out by the planner on GPUS GPUs of type GPU (TP inside a node, PP across, unless the
    layout is given), refused with the plan's numbers when it does not fit, and refused when the checkpoint is not
    stored in the weight format asked for. Fields set in CONFIG (flags, file, environment) win over the plan's."""
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
    asked = dict(plan_overrides or {})
    if weights:
        asked["weights"] = weights
    if network is not None:
        asked["network"] = network.network
    request = {**_plan_request(config, accelerator, gpus), **asked}
    plan_config = load_section(PlanConfig, "plan", file, request)
    check_loadable_format(plan_config)
    plan = make_plan(plan_config)
    if not plan.fits:
        raise ConfigError(_does_not_fit(plan, config.model, gpus, accelerator))
    planned = planned_engine_config(plan.deployment, plan_config, config.engine).model_dump()
    planned["gpu_type"] = plan.deployment.accelerator.name  # serve on the nodes checks the fit for this type
    planned.update({name: getattr(config, name) for name in given})
    if planned["nnodes"] > 1 and "master_addr" not in given:
        planned["master_addr"] = MASTER_PLACEHOLDER
    return EngineConfig.model_validate(planned), plan


def check_loadable_format(plan: PlanConfig) -> None:
    """A rendered engine loads the model's own checkpoint: --weights may only name its format, or FP8 quantized at
    load from a 16-bit checkpoint (vLLM's --quantization fp8); a plan for another format would size the memory for
    weights that never load."""
    if plan.weights is None:
        return
    try:
        spec = load_spec(plan.model)
    except ModelError:
        return  # a hub id we have no preset of: its format is not known here
    stored, asked = checkpoint_format(spec), get_format(plan.weights)
    if not loads_as(stored, asked):
        export = published_export(plan.model, asked)
        instead = (
            f"--model {export} (its export in {asked.name})" if export else f"a checkpoint in {asked.name} with --model"
        )
        raise ConfigError(
            f"{plan.model}'s checkpoint is stored in {stored.name} ({stored.description}); --weights {plan.weights} "
            f"would plan for weights the engine never loads: drop --weights, or name {instead}"
        )


def _plan_request(config: EngineConfig, accelerator: Accelerator, gpus: int) -> dict[str, object]:
    """What the planner is asked: CONFIG's model and engine, the fields the user set that the planner also takes
    (the KV-cache dtype among them), and the nodes (--nnodes when given, else as few as hold the GPUs)."""
    given = config.model_fields_set
    per_node = accelerator.devices_per_node
    nodes = config.nnodes if "nnodes" in given else max(math.ceil(gpus / per_node), 1)
    if gpus % nodes:
        if "nnodes" in given:
            raise ConfigError(f"--gpus {gpus} does not split evenly over --nnodes {nodes}: give a multiple of {nodes}")
        raise ConfigError(
            f"--gpus {gpus} needs {nodes} nodes of {per_node} {accelerator.name} GPUs and does not split evenly over "
            f"them: give a multiple of {nodes} (e.g. {nodes * per_node}), or --nnodes with a count that divides {gpus}"
        )
    request: dict[str, object] = {
        "model": config.model,
        "gpu": accelerator.name,
        "gpus": gpus,
        "nodes": nodes,
        "engine": config.engine,
    }
    for name in _PLAN_FIELDS - {"model", "engine"}:
        if name in given and getattr(config, name) is not None:
            request[name] = getattr(config, name)
    for field_name, plan_name in _ENGINE_TO_PLAN.items():
        if field_name in given and getattr(config, field_name) is not None:
            request[plan_name] = getattr(config, field_name)
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


# ---- the gateway's command line ---------------------------------------------------------------------------------

# Settings of the gateway that issue 21 adds on the gateway's side (replica discovery from a DNS name, prefill
# routing, keys from a file that it reloads, the engines' API key): where GatewayConfig has the field, it is set
# there and written by the gateway's own flag derivation; otherwise the flag is written here, spelled as the gateway
# names it.
GATEWAY_WIRING = ("discover_upstreams", "prefill_upstream", "keys_file", "upstream_api_key_file")


def gateway_command(spec: DeploySpec, upstreams: list[str], port: int, **wiring: Any) -> list[str]:
    """`python -m deepserve.cli.main gateway …` listening on every interface at PORT in front of UPSTREAMS, with
    the config's limits and WIRING (GATEWAY_WIRING's names, plus redis_url)."""
    unknown = set(wiring) - {*GATEWAY_WIRING, "redis_url"}
    if unknown:
        raise ValueError(f"unknown gateway wiring {sorted(unknown)}")
    given = {name: value for name, value in wiring.items() if value not in (None, False, [])}
    fields = {name: value for name, value in given.items() if name in GatewayConfig.model_fields}
    front = spec.gateway.model_copy(update={"upstream": upstreams, "host": "0.0.0.0", "port": port, **fields})
    argv = gateway_argv(front, "python")
    for name, value in given.items():
        if name not in fields:
            argv += _flag_words("--" + name.replace("_", "-"), value)
    return argv


def _flag_words(flag: str, value: Any) -> list[str]:
    if value is True:
        return [flag]
    if isinstance(value, list):
        return [word for item in value for word in (flag, str(item))]
    return [flag, str(value)]
