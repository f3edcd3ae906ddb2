"""SGLang: `python -m sglang.launch_server`. Its flag names differ from vLLM's; the mapping lives here. Over several
nodes every node runs the same command with its --node-rank and node 0's --dist-init-addr; node 0 serves the API."""

from __future__ import annotations

from deepserve.engines.base import (
    LaunchSpec,
    MemoryFractionOf,
    ResolvedModel,
    flag_args,
    gpu_only_flags,
    unless_one,
    url_host,
)
from deepserve.engines.chat_defaults import SGLANG_DEFAULTS, ChatFlags, chat_flags, sglang_chat_args
from deepserve.engines.config import EngineConfig
from deepserve.engines.metrics import SGLANG_METRICS
from deepserve.engines.platform import ROCM, SGLANG_ROCM_ATTENTION_BACKEND, SGLANG_ROCM_ENV, gpu_platform
from deepserve.engines.speculative import sglang_speculative_flags
from deepserve.errors import ConfigError, unknown_name
from deepserve.models.chat_format import model_chat_format

# SGLang moves KV between its prefill and decode servers with its own transfer backends
# (--disaggregation-transfer-backend, sglang/srt/server_args.py); the vLLM connectors they correspond to.
TRANSFER_BACKENDS = {"NixlConnector": "nixl", "MooncakeConnector": "mooncake"}

_PHASES = (
    ("Load weight begin", "loading weights"),
    ("Load weight end", "allocating KV cache"),
    ("KV Cache is allocated", "allocating KV cache"),
    ("Capture cuda graph begin", "capturing CUDA graphs"),
    ("Capture cuda graph end", "starting API server"),
    ("Uvicorn running", "starting API server"),
    ("The server is fired up", "warming up"),
)


class SglangEngine:
    name = "sglang"
    package = "sglang"
    metric_names = SGLANG_METRICS
    memory_fraction_of: MemoryFractionOf = "device"  # --mem-fraction-static
    install_hint = (
        'install SGLang into deepserve\'s environment on a GPU machine: `pip install "sglang[all]"` '
        "(it has no build for a CPU-only machine like this one; `--dry-run` still prints its command line)"
    )
    image = "lmsysorg/sglang:latest"  # SGLang's official image; pin a release with --engine-image
    # SGLang's ROCm images are tagged <version>-rocm<NNN>-mi30x (MI300X/MI325X; MI355X images end in -mi35x), built
    # from docker/Dockerfile.rocm (sglang docs/platforms/amd_gpu.md); this tag as seen in use, pin with --engine-image.
    rocm_image: str | None = "lmsysorg/sglang:v0.5.7-rocm700-mi30x"

    def launch_spec(self, config: EngineConfig, model: ResolvedModel, python: str | None) -> LaunchSpec:
        argv = [python or "python3", "-m", "sglang.launch_server", "--model-path", model.source]
        kv_fraction = config.gpu_memory_utilization
        tp = _tp_size(config)
        rocm = not model.on_cpu and gpu_platform(config) == ROCM
        argv += flag_args(
            [
                ("--served-model-name", model.served_name),
                ("--host", config.host),
                ("--port", config.port),
                ("--tp-size", unless_one(tp)),
                ("--pp-size", unless_one(config.pipeline_parallel_size)),
                ("--dp-size", unless_one(config.data_parallel_size)),
                ("--enable-dp-attention", _dp_attention(config) or None),
                ("--ep-size", tp if config.enable_expert_parallel else None),
                ("--context-length", config.max_model_len),
                ("--max-running-requests", _max_running_requests(config)),
                ("--chunked-prefill-size", _chunked_prefill_size(config)),
                ("--mem-fraction-static", kv_fraction),
                ("--page-size", config.block_size),
                ("--quantization", config.quantization),
                ("--kv-cache-dtype", config.kv_cache_dtype),
                ("--dtype", config.dtype),
                ("--disable-radix-cache", True if config.enable_prefix_caching is False else None),
                ("--stream-interval", config.stream_interval),
                ("--attention-backend", SGLANG_ROCM_ATTENTION_BACKEND if rocm else None),
                ("--trust-remote-code", config.trust_remote_code or None),
                ("--device", "cpu" if model.on_cpu else None),
                ("--nnodes", unless_one(config.nnodes)),
                ("--node-rank", config.node_rank if config.is_multi_node else None),
                ("--dist-init-addr", f"{config.master_addr}:{config.master_port}" if config.is_multi_node else None),
                ("--disaggregation-mode", config.role),
                ("--disaggregation-transfer-backend", _transfer_backend(config)),
                *_chat_flags(config, model),
                *_speculative_flags(config),
            ]
        )
        argv += config.extra_args
        return LaunchSpec(
            argv=argv,
            env=dict(SGLANG_ROCM_ENV) if rocm else {},
            ready_path="/v1/models" if config.is_head else "",
            served_model_name=model.served_name,
            base_url=f"http://{url_host(config.host)}:{config.port}/v1" if config.is_head else "",
        )

    def phase_of(self, log_line: str) -> str | None:
        return next((phase for marker, phase in _PHASES if marker in log_line), None)

    def cpu_refusals(self, config: EngineConfig) -> list[str]:
        return gpu_only_flags(config)


def _chat_flags(config: EngineConfig, model: ResolvedModel) -> list[tuple[str, object]]:
    """The model's reasoning and tool-call parsers (engines/chat_defaults.py)."""
    defaults = SGLANG_DEFAULTS.get(model_chat_format(model.source), ChatFlags())
    return sglang_chat_args(chat_flags(defaults, config), config)


def _speculative_flags(config: EngineConfig) -> list[tuple[str, object]]:
    speculation = config.explicit_speculation()
    return [] if speculation is None else sglang_speculative_flags(speculation)


def _dp_attention(config: EngineConfig) -> bool:
    """SGLang serves DeepSeek's data-parallel attention + expert parallelism as one switch pair."""
    return config.data_parallel_size > 1 and config.enable_expert_parallel


def _tp_size(config: EngineConfig) -> int:
    """SGLang counts data-parallel attention ranks inside its TP size (tp = every GPU of a stage, dp = attention
    replicas among them); our config, like vLLM, counts TP per replica and DP separately."""
    if _dp_attention(config):
        return config.tensor_parallel_size * config.data_parallel_size
    return config.tensor_parallel_size


def _transfer_backend(config: EngineConfig) -> str | None:
    if config.role is None:
        return None
    connector = config.kv_connector or ""
    if connector not in TRANSFER_BACKENDS:
        raise ConfigError(
            unknown_name("SGLang KV transfer (as a vLLM connector name)", connector, list(TRANSFER_BACKENDS))
        )
    return TRANSFER_BACKENDS[connector]


def _max_running_requests(config: EngineConfig) -> int | None:
    """SGLang's cap counts every DP-attention rank together (its CUDA-graph runner shares it out:
    `server_args.max_running_requests // server_args.dp_size`, sglang/srt/model_executor/cuda_graph_runner.py);
    --max-num-seqs is per rank, as vLLM applies it."""
    if config.max_num_seqs is None:
        return None
    return config.max_num_seqs * config.data_parallel_size if _dp_attention(config) else config.max_num_seqs


# SGLang's --chunked-prefill-size when the command sets none, by the GPU's memory (server_args.py in the wheels on
# PyPI): for each era, from its first version, (below GiB, tokens) tiers and the tokens above the last. 0.4.6 and
# before: 2,048 below 25,000 MiB, else 8,192; 0.4.7 added 16,384 for the largest GPUs (B200, MI300X: above 180,000
# MiB in 0.4.7 and 0.4.8, from 160 GiB in 0.4.9); 0.5.4 a 4,096 tier (0.5.15's _handle_gpu_memory_settings). With
# DP attention each rank gets a share (engine_profiles.json, dp_attention_prefill_chunk).
CHUNKED_PREFILL_DEFAULTS: tuple[tuple[tuple[int, ...], tuple[tuple[float, int], ...], int], ...] = (
    ((0, 5, 4), ((35.0, 2048), (60.0, 4096), (160.0, 8192)), 16384),
    ((0, 4, 7), ((35.0, 2048), (160.0, 8192)), 16384),
    ((0,), ((24.4, 2048),), 8192),
)


def default_chunked_prefill_size(gpu_memory_gib: float, version: tuple[int, ...] | None = None) -> int:
    """SGLang's own prompt-token budget per step on a GPU of GPU_MEMORY_GIB where the command sets none, in VERSION
    (a release number as a tuple; None: the current one)."""
    for since, tiers, largest in CHUNKED_PREFILL_DEFAULTS:
        if version is None or version >= since:
            return next((tokens for below_gib, tokens in tiers if gpu_memory_gib < below_gib), largest)
    raise AssertionError("the last era starts at version 0")


def _chunked_prefill_size(config: EngineConfig) -> int | None:
    """SGLang's chunk size: -1 disables chunking; otherwise vLLM's batched-token budget is the nearest match."""
    if config.enable_chunked_prefill is False:
        return -1
    return config.max_num_batched_tokens
