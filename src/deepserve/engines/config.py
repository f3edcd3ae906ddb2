"""The engine's section of the config tree: how the inference engine is launched, on one node or many."""

from __future__ import annotations

import json
import shlex
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from deepserve.config import Section, changed_flags
from deepserve.engines.speculative import (
    Speculation,
    SpeculativeMethod,
    check_consistent,
    requested,
    resolve_speculation,
)
from deepserve.errors import ConfigError, unknown_name
from deepserve.models.spec import ModelSpec

DeviceName = Literal["auto", "cpu", "cuda", "rocm"]
DistributedBackend = Literal["mp", "ray"]
Role = Literal["prefill", "decode"]
JOIN_PORT_OFFSET = 100  # default join port: master port + 100, clear of the ports vLLM takes near the master port


DEFAULT_KV_CONNECTOR = "NixlConnector"  # vLLM's P/D connector on GPUs (llm-d's and vLLM's P/D guides use it)


class EngineConfig(Section):
    """How the inference engine is launched: the flags the seeds tune, in one place."""

    engine: str = Field("vllm", description="inference engine to launch (a name in deepserve.engines.registry)")
    model: str | None = Field(
        None, description="preset name, Hugging Face id or local path (default: the tiny model on CPU)"
    )
    served_model_name: str | None = Field(None, description="model name clients use (default: the model's)")
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=1, le=65535, description="port to listen on")
    device: DeviceName = Field(
        "auto",
        description="cpu, cuda (NVIDIA GPUs), rocm (AMD Instinct GPUs), or auto (what nvidia-smi or amd-smi finds)",
    )
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs each layer is split over")
    pipeline_parallel_size: int = Field(1, ge=1, description="pipeline stages (layers split across GPUs/nodes)")
    data_parallel_size: int = Field(1, ge=1, description="data-parallel replicas (attention DP with --enable-ep)")
    enable_expert_parallel: bool = Field(False, description="shard MoE experts across GPUs instead of splitting")
    max_model_len: int | None = Field(None, ge=16, description="context length (prompt + output) in tokens")
    max_num_seqs: int | None = Field(
        None, ge=1, description="most sequences running at once per data-parallel rank (vLLM's meaning)"
    )
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
    stream_interval: int | None = Field(
        None, ge=1, description="tokens per streamed chunk (fewer, larger SSE events; the engine's default is 1)"
    )
    trust_remote_code: bool = Field(False, description="allow the model repository's own Python code")
    speculative_method: SpeculativeMethod | None = Field(
        None,
        description="speculative decoding: mtp or dspark (the model's own draft module), ngram (drafts from the "
        "prompt), draft_model (--speculative-draft-model), auto (the vendor's recommendation for the model), none "
        "(off; the default unless --num-speculative-tokens is given)",
    )
    num_speculative_tokens: int | None = Field(
        None, ge=0, description="draft tokens per step (0: off; alone: the model's own module; default: vendor's)"
    )
    speculative_draft_model: str | None = Field(
        None, description="the draft model's weights for --speculative-method draft_model (path or hub id)"
    )
    prompt_lookup_min: int | None = Field(None, ge=1, description="n-gram speculation: shortest prompt match")
    prompt_lookup_max: int | None = Field(None, ge=1, description="n-gram speculation: longest prompt match")
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
    role: Role | None = Field(
        None,
        description="prefill or decode: one side of a disaggregated pair joined by --kv-connector (default: an "
        "engine that serves whole requests)",
    )
    kv_connector: str | None = Field(
        None,
        description="vLLM's KV-transfer connector between prefill and decode engines, e.g. NixlConnector (GPUs) or "
        "ExampleConnector (shared storage)",
    )
    kv_connector_config: list[str] = Field(
        default_factory=list,
        description="KEY=VALUE of the connector's own settings (kv_connector_extra_config), e.g. "
        "shared_storage_path=/mnt/kv; repeat for several",
    )
    reasoning_parser: str | None = Field(
        None, description="reasoning parser (default: the model's, e.g. deepseek_r1 for R1; none: off)"
    )
    tool_call_parser: str | None = Field(
        None, description="tool-call parser (default: the model's, e.g. deepseek_v3 for V3; none: off)"
    )
    enable_auto_tool_choice: bool | None = Field(
        None, description="parse the model's tool calls (default: on wherever the model has a tool-call parser)"
    )
    tokenizer_mode: str | None = Field(
        None, description="tokenizer mode, e.g. deepseek_v4 (default: the model's, or the engine's choice)"
    )
    chat_template: str | None = Field(None, description="a Jinja chat template file to use instead of the model's")
    default_chat_template_kwargs: dict[str, Any] | None = Field(
        None, description='chat-template options for requests that give none, as JSON, e.g. {"thinking": false}'
    )
    extra_args: list[str] = Field(default_factory=list, description="passed to the engine unchanged (after --)")
    startup_timeout_s: float = Field(1800.0, gt=0, description="give up if the engine is not ready by then")

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, name: str) -> str:
        from deepserve.engines.registry import ENGINES  # the registry's engines import this module: look it up late

        if name not in ENGINES:  # a ValueError, so that pydantic reports it with the field like every other
            raise ValueError(unknown_name("engine", name, sorted(ENGINES)))
        return name

    @field_validator("default_chat_template_kwargs", mode="before")
    @classmethod
    def _json_object(cls, value: Any) -> Any:
        """From the command line it arrives as JSON text."""
        if not isinstance(value, str):
            return value
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f'not valid JSON ({exc}): give an object, e.g. {{"thinking": false}}') from None

    @model_validator(mode="after")
    def _check_nodes(self) -> EngineConfig:
        if self.node_rank >= self.nnodes:
            raise ValueError(
                f"--node-rank {self.node_rank} is out of range for --nnodes {self.nnodes}: "
                f"give each node a rank from 0 to {self.nnodes - 1}"
            )
        try:
            check_consistent(self.speculative_method, self.num_speculative_tokens)
        except ConfigError as exc:  # as a ValueError, pydantic reports it with the other problems
            raise ValueError(str(exc)) from None
        if self.nnodes > 1 and not self.master_addr:
            raise ValueError(
                f"--nnodes {self.nnodes} needs --master-addr: node 0's address that every node can reach "
                "(e.g. its IP on the cluster network)"
            )
        if self.role is not None and not self.kv_connector:
            raise ValueError(
                f"--role {self.role} needs --kv-connector: the connector that moves the KV cache between the prefill "
                "and decode engines (NixlConnector on GPUs; ExampleConnector through a shared directory)"
            )
        return self

    @field_validator("kv_connector_config")
    @classmethod
    def _key_values(cls, pairs: list[str]) -> list[str]:
        for pair in pairs:
            key, sep, _ = pair.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"connector setting {pair!r} must look like KEY=VALUE, e.g. shared_storage_path=/kv")
        return pairs

    @property
    def kv_connector_settings(self) -> dict[str, object]:
        """--kv-connector-config as the connector reads it: JSON values where they parse (numbers, booleans),
        else strings."""
        settings: dict[str, object] = {}
        for pair in self.kv_connector_config:
            key, _, raw = pair.partition("=")
            try:
                settings[key.strip()] = json.loads(raw)
            except json.JSONDecodeError:
                settings[key.strip()] = raw
        return settings

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

    @property
    def speculation_requested(self) -> bool:
        return requested(self.speculative_method, self.num_speculative_tokens)

    def speculation(
        self, spec: ModelSpec | None, on_cpu: bool, hardware_class: str | None = None
    ) -> Speculation | None:
        """Speculative decoding as the engine will run it on SPEC (the vendor's recommendation filling what is not
        given), None when off; a ConfigError when this model or device cannot run it (engines/speculative.py)."""
        return resolve_speculation(
            self.speculative_method,
            self.num_speculative_tokens,
            spec,
            engine=self.engine,
            on_cpu=on_cpu,
            hardware_class=hardware_class,
            draft_model=self.speculative_draft_model,
            prompt_lookup_min=self.prompt_lookup_min,
            prompt_lookup_max=self.prompt_lookup_max,
            max_model_len=self.max_model_len,
        )

    def with_speculation(self, speculation: Speculation | None) -> EngineConfig:
        """This config with SPECULATION written out (method and token count explicit, as launchers need them)."""
        if speculation is None:
            off = "none" if self.speculative_method is not None or self.num_speculative_tokens else None
            return self.model_copy(update={"speculative_method": off, "num_speculative_tokens": None})
        return self.model_copy(
            update={"speculative_method": speculation.method, "num_speculative_tokens": speculation.num_tokens}
        )

    def explicit_speculation(self) -> Speculation | None:
        """The speculation a launcher writes: only explicit settings (`auto`, or a token count without a method,
        needs the model's config: `with_speculation(speculation(spec, ...))` first, as serve does)."""
        if not self.speculation_requested:
            return None
        if self.speculative_method in (None, "auto"):
            raise ConfigError(
                "speculative decoding settings are not resolved for this model (method "
                f"{self.speculative_method or 'unset'}): give --speculative-method and --num-speculative-tokens"
            )
        return self.speculation(None, on_cpu=False)


def serve_command(config: EngineConfig, extra_flags: list[str] | tuple[str, ...] = ()) -> str:
    """The `deepserve serve` line that runs CONFIG on a node, with EXTRA_FLAGS (serve's own settings) added."""
    argv = ["deepserve", "serve", *changed_flags(config, skip=("extra_args",)), *extra_flags]
    if config.extra_args:
        argv += ["--", *config.extra_args]
    return shlex.join(argv)
