"""One validated config tree: defaults ← config file ← environment (DEEPSERVE_*) ← CLI flags.

Each section is a pydantic model. CLI flags are derived from the fields (see `deepserve.cli.flags`), environment
variables are named DEEPSERVE_<SECTION>__<FIELD> (e.g. DEEPSERVE_ENGINE__MAX_MODEL_LEN=16384), and a YAML or
JSON file given with --config (or DEEPSERVE_CONFIG) holds the same tree: {"engine": {"max_model_len": 16384}}.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from deepserve.errors import ConfigError, unknown_name

ENV_PREFIX = "DEEPSERVE_"


def deepserve_home() -> Path:
    """Where deepserve keeps its state: cached models, logs, keys, usage ledger, results."""
    return Path(os.environ.get("DEEPSERVE_HOME") or Path.home() / ".deepserve").expanduser()


class Section(BaseModel):
    """A config section: unknown keys are errors, so a typo never silently does nothing."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


DeviceName = Literal["auto", "cpu", "cuda"]
DistributedBackend = Literal["mp", "ray"]
JOIN_PORT_OFFSET = 100  # default join port: master port + 100, clear of the ports vLLM takes near the master port


class EngineConfig(Section):
    """How the inference engine is launched: the flags the seeds tune, in one place."""

    engine: str = Field("vllm", description="inference engine to launch (a name in deepserve.engines.registry)")
    model: str | None = Field(
        None, description="preset name, Hugging Face id or local path (default: the tiny model on CPU)"
    )
    served_model_name: str | None = Field(None, description="model name clients use (default: the model's)")
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=1, le=65535, description="port to listen on")
    device: DeviceName = Field("auto", description="cpu, cuda, or auto (cuda when a GPU is found)")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs each layer is split over")
    pipeline_parallel_size: int = Field(1, ge=1, description="pipeline stages (layers split across GPUs/nodes)")
    data_parallel_size: int = Field(1, ge=1, description="data-parallel replicas (attention DP with --enable-ep)")
    enable_expert_parallel: bool = Field(False, description="shard MoE experts across GPUs instead of splitting")
    max_model_len: int | None = Field(None, ge=16, description="context length (prompt + output) in tokens")
    max_num_seqs: int | None = Field(None, ge=1, description="most sequences in one batch")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="most tokens in one scheduler step")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="fraction of GPU memory the engine may use"
    )
    kv_cache_memory_gib: float | None = Field(
        None, gt=0, description="KV-cache size in GiB (on CPU the default is 1 GiB)"
    )
    block_size: int | None = Field(None, ge=1, description="KV-cache block size in tokens")
    quantization: str | None = Field(None, description="weight quantization method, e.g. fp8, awq, awq_marlin")
    kv_cache_dtype: str | None = Field(None, description="KV-cache dtype: auto, fp8, fp8_e4m3, fp8_e5m2")
    dtype: str | None = Field(None, description="activation dtype: auto, bfloat16, float16")
    enable_chunked_prefill: bool | None = Field(None, description="split long prefills into chunks")
    enable_prefix_caching: bool | None = Field(None, description="reuse KV cache of shared prompt prefixes")
    trust_remote_code: bool = Field(False, description="allow the model repository's own Python code")
    nnodes: int = Field(1, ge=1, description="nodes the engine spans (vLLM's native multi-node runtime)")
    node_rank: int = Field(0, ge=0, description="this node: 0 runs the API and gateway, others headless workers")
    master_addr: str | None = Field(
        None, description="node 0's address, reachable from every node (needed with --nnodes > 1)"
    )
    master_port: int = Field(29501, ge=1, le=65535, description="node 0's port for the engine's rendezvous")
    join_port: int | None = Field(
        None, ge=1, le=65535, description="node 0's port where deepserve's nodes check in (default: master port+100)"
    )
    join_timeout_s: float = Field(900.0, gt=0, description="how long nodes wait for each other to join")
    gpus_per_node: int | None = Field(
        None, ge=1, description="GPUs on each node (default: what this machine has); checks the layout"
    )
    gpu_type: str | None = Field(
        None, description="GPU type of the nodes, from the catalog (default: what nvidia-smi finds); checks the fit"
    )
    data_parallel_size_local: int | None = Field(
        None, ge=1, description="data-parallel ranks on this node (default: --data-parallel-size over --nnodes)"
    )
    data_parallel_address: str | None = Field(None, description="address of data-parallel rank 0 (default: master)")
    data_parallel_rpc_port: int | None = Field(None, ge=1, le=65535, description="data-parallel RPC port on node 0")
    distributed_executor_backend: DistributedBackend | None = Field(
        None, description="mp (vLLM's own processes, across nodes too) or ray (a Ray cluster: `deepserve cluster`)"
    )
    extra_args: list[str] = Field(default_factory=list, description="passed to the engine unchanged (after --)")
    startup_timeout_s: float = Field(1800.0, gt=0, description="give up if the engine is not ready by then")

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, name: str) -> str:
        from deepserve.engines.registry import ENGINES  # the registry imports this module: look it up late

        if name not in ENGINES:  # a ValueError, so that pydantic reports it with the field like every other
            raise ValueError(unknown_name("engine", name, sorted(ENGINES)))
        return name

    @model_validator(mode="after")
    def _check_nodes(self) -> EngineConfig:
        if self.node_rank >= self.nnodes:
            raise ValueError(
                f"--node-rank {self.node_rank} is out of range for --nnodes {self.nnodes}: "
                f"give each node a rank from 0 to {self.nnodes - 1}"
            )
        if self.nnodes > 1 and not self.master_addr:
            raise ValueError(
                f"--nnodes {self.nnodes} needs --master-addr: node 0's address that every node can reach "
                "(e.g. its IP on the cluster network)"
            )
        return self

    @property
    def is_multi_node(self) -> bool:
        return self.nnodes > 1

    @property
    def is_head(self) -> bool:
        """Node 0 runs the engine's API (and the gateway); other nodes run headless workers."""
        return self.node_rank == 0

    @property
    def world_size(self) -> int:
        """Devices the layout needs over all nodes: tensor x pipeline x data parallel."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size

    @property
    def effective_join_port(self) -> int:
        return self.join_port or self.master_port + JOIN_PORT_OFFSET

    def for_node(self, rank: int) -> EngineConfig:
        """The same deployment as node RANK runs it."""
        return self.model_copy(update={"node_rank": rank})


T = TypeVar("T", bound=BaseModel)


def changed_fields(section: BaseModel, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """SECTION's fields whose values differ from their defaults (what a command line or config file must carry)."""
    return {
        name: getattr(section, name)
        for name, field in type(section).model_fields.items()
        if name not in skip and getattr(section, name) != field.get_default(call_default_factory=True)
    }


def changed_flags(section: BaseModel, skip: tuple[str, ...] = ()) -> list[str]:
    """The command-line flags that reproduce SECTION's non-default fields (the inverse of the flags derived from
    the fields in `deepserve.cli.flags`): `--field-name VALUE`, `--flag`/`--no-flag` for booleans."""
    argv: list[str] = []
    for name, value in changed_fields(section, skip).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            for item in value:
                argv += [flag, str(item)]
        else:
            argv += [flag, str(value)]
    return argv


def load_section(model: type[T], section: str, file: Path | None = None, overrides: dict[str, Any] | None = None) -> T:
    """Build SECTION of the tree: defaults, then the file, then DEEPSERVE_<SECTION>__* variables, then OVERRIDES
    (the CLI flags the user actually gave; None values mean "not given")."""
    values: dict[str, Any] = {}
    values.update(_file_values(file).get(section, {}))
    values.update(_env_values(section, model))
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return validate_section(model, section, values)


def validate_section(model: type[T], section: str, values: dict[str, Any]) -> T:
    """MODEL from VALUES, or a ConfigError naming each field of SECTION that is wrong (for sections built in code
    from the user's flags, as well as loaded ones)."""
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        raise ConfigError(_describe_validation_error(section, exc)) from exc


def _file_values(file: Path | None) -> dict[str, Any]:
    file = file or (Path(os.environ[ENV_PREFIX + "CONFIG"]) if os.environ.get(ENV_PREFIX + "CONFIG") else None)
    if file is None:
        return {}
    if not file.is_file():
        raise ConfigError(f"config file {file} does not exist; pass an existing YAML or JSON file")
    try:
        text = file.read_text()
        data = json.loads(text) if file.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"config file {file} does not parse: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {file} must hold a mapping of sections, e.g. engine: {{port: 8000}}")
    return data


def _env_values(section: str, model: type[BaseModel]) -> dict[str, Any]:
    prefix = f"{ENV_PREFIX}{section.upper()}__"
    values: dict[str, Any] = {}
    for key, raw in os.environ.items():
        if not key.startswith(prefix):
            continue
        field = key[len(prefix) :].lower()
        if field not in model.model_fields:
            valid = ", ".join(prefix + name.upper() for name in model.model_fields)
            raise ConfigError(f"unknown environment variable {key}; valid: {valid}")
        values[field] = _parse_env_value(raw)
    return values


def _parse_env_value(raw: str) -> Any:
    """JSON where it parses (numbers, booleans, lists), else the plain string."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _describe_validation_error(section: str, exc: ValidationError) -> str:
    problems = []
    for error in exc.errors():
        where = ".".join([section, *(str(part) for part in error["loc"])])
        message = error["msg"].removeprefix("Value error, ")
        if error["loc"]:
            message += f" (got {error.get('input')!r})"
        # else a check across fields: its input is the whole section, and its message names the flags involved
        problems.append(f"{where}: {message}")
    return "invalid configuration: " + "; ".join(problems)


def parse_key_values(flag: str, pairs: list[str], example: str) -> dict[str, str]:
    """Repeated `FLAG KEY=VALUE` arguments as a dict; one without `=` or a key is refused with EXAMPLE."""
    parsed = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{flag} {pair!r} must look like KEY=VALUE, e.g. {flag} {example}")
        parsed[key.strip()] = value
    return parsed


class ServeConfig(Section):
    """How `deepserve serve` arranges its processes: the engine alone, or behind the gateway."""

    gateway: bool = Field(True, description="put the gateway (keys, limits, metrics) in front of the engine")
    engine_port: int | None = Field(
        None, ge=1, le=65535, description="the engine's internal port behind the gateway (default: a free one)"
    )
    force: bool = Field(False, description="start even when the memory plan says the model cannot fit")


def serve_command(config: EngineConfig, serve: ServeConfig | None = None) -> str:
    """The `deepserve serve` line that runs CONFIG (and SERVE's non-default settings) on a node."""
    argv = ["deepserve", "serve", *changed_flags(config, skip=("extra_args",))]
    if serve is not None:
        argv += changed_flags(serve)
    if config.extra_args:
        argv += ["--", *config.extra_args]
    return shlex.join(argv)
