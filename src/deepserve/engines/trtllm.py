"""TensorRT-LLM: `trtllm-serve MODEL --backend pytorch …` plus its extra LLM-API options file (YAML), both from the
same EngineConfig as vLLM's and SGLang's commands.

What goes where: the layout, batch limits and KV-cache fraction are `trtllm-serve` flags; what has no flag
(attention data parallelism's balancing, the MoE backend, CUDA graphs, the KV cache's dtype and reuse, MTP, the
streaming interval, iteration statistics) goes in the options file, which the command names with
--extra_llm_api_options. Every flag and key written here exists in TensorRT-LLM's own definitions (its CLI
contract tests/unittest/api_stability/references/trtllm_serve_cli.yaml and tensorrt_llm/llmapi/llm_args.py):
tests/unit/engines/test_trtllm.py checks each against tests/fixtures/trtllm/trtllm_options.json.

Settings follow NVIDIA's DeepSeek-R1 guide (docs/source/deployment-guide/deployment-guide-for-deepseek-r1-on-trtllm.md
@ 03e4d74f) and its recipes (examples/configs/curated/deepseek-r1-throughput.yaml @ 180e9756, the H200 database
config examples/configs/database/deepseek-ai/DeepSeek-R1-0528/H200/1k1k_tp8_conc128.yaml @ 3105370b).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from deepserve.config import deepserve_home
from deepserve.engines.base import LaunchSpec, MemoryFractionOf, ResolvedModel, flag_args, gpu_only_flags, url_host
from deepserve.engines.config import EngineConfig
from deepserve.engines.metrics import TRTLLM_METRICS
from deepserve.engines.platform import ROCM, gpu_platform
from deepserve.errors import ConfigError
from deepserve.hardware.catalog import get_accelerator

NGC_IMAGE = "nvcr.io/nvidia/tensorrt-llm/release:1.2.1"
RENDERED_OPTIONS_DIR = "/tmp/deepserve"  # where a command for another machine (a container) keeps its options file
# trtllm-serve's own step budget where --max_num_tokens is not given (its CLI contract and llm_args.py: 8192), and
# chunked prefill is off unless asked for (llm_args.py: enable_chunked_prefill defaults to False). Without chunking
# the LLM API refuses any prompt longer than max_num_tokens ("The sum of prompt length ..., query length ... should
# not exceed max_num_tokens", tensorrt_llm/llmapi/llm.py _check_arguments; tests/unittest/llmapi/test_llm.py
# test_max_num_token_check), so a context longer than the budget needs chunked prefill.
DEFAULT_MAX_NUM_TOKENS = 8192
# CUDA graphs are captured for batches up to this size (NVIDIA's throughput recipe: max_batch_size 1024, graphs to
# 128); larger batches run without a graph.
CUDA_GRAPH_MAX_BATCH = 128
# MoE backend per GPU class and weights, from the DeepSeek-R1 guide's table: Hopper FP8 → CUTLASS; Blackwell FP8 →
# DEEPGEMM; Blackwell NVFP4 → CUTLASS (or TRTLLM). CUTLASS is every release's choice where nothing is known.
MOE_BACKEND_DEFAULT = "CUTLASS"
# vLLM's parser names where TensorRT-LLM spells them differently (trtllm-serve --reasoning_parser choices).
REASONING_PARSER_NAMES = {"deepseek_r1": "deepseek-r1"}
# TensorRT-LLM's KV-cache dtypes (--kv_cache_dtype choices: auto, fp8, nvfp4) for vLLM's spellings.
KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8", "fp8_e4m3": "fp8", "nvfp4": "nvfp4"}

_PHASES = (
    ("Loading model", "loading weights"),
    ("Loading weights", "loading weights"),
    ("Memory usage when calculating max tokens", "allocating KV cache"),
    ("KV cache", "allocating KV cache"),
    ("CUDA graph", "capturing CUDA graphs"),
    ("autotuner", "warming up (autotuning)"),
    ("Uvicorn running", "starting API server"),
    ("Application startup complete", "starting API server"),
)


class TrtllmEngine:
    name = "trtllm"
    package = "tensorrt_llm"
    metric_names = TRTLLM_METRICS
    memory_fraction_of: MemoryFractionOf = "free"  # --kv_cache_free_gpu_memory_fraction: of what the weights leave
    install_hint = (
        "TensorRT-LLM runs on NVIDIA GPUs only and is easiest to get as NVIDIA's container: "
        f"`docker run --gpus all --ipc=host -p 8000:8000 {NGC_IMAGE}` (NGC; trtllm-serve is on its PATH), or "
        "`pip install tensorrt_llm` on a CUDA machine (NVIDIA's installation guide lists the CUDA and Python it "
        "needs); `--dry-run` prints the command line and options file anywhere"
    )
    image = NGC_IMAGE  # NVIDIA's release image (tags x.y.z; weekly builds carry rcN); pin with --engine-image
    rocm_image: str | None = None

    def launch_spec(self, config: EngineConfig, model: ResolvedModel, python: str | None) -> LaunchSpec:
        _check_supported(config, model)
        options_path = _options_path(config, python)
        argv = [*_program(python), model.source]
        argv += flag_args([*_flags(config, model), ("--extra_llm_api_options", options_path)])
        argv += config.extra_args
        return LaunchSpec(
            argv=argv,
            env={},
            ready_path="/health",  # trtllm-serve's readiness route (the DeepSeek-R1 guide)
            served_model_name=model.served_name,
            base_url=f"http://{url_host(config.host)}:{config.port}/v1",
            files={options_path: options_yaml(config, model)},
        )

    def phase_of(self, log_line: str) -> str | None:
        return next((phase for marker, phase in _PHASES if marker in log_line), None)

    def cpu_refusals(self, config: EngineConfig) -> list[str]:
        return gpu_only_flags(config)


def _check_supported(config: EngineConfig, model: ResolvedModel) -> None:
    """What deepserve cannot express for TensorRT-LLM fails here, with the alternative (nothing is dropped)."""
    if not model.on_cpu and gpu_platform(config) == ROCM:
        raise ConfigError("TensorRT-LLM has no ROCm build: on AMD GPUs use --engine vllm or --engine sglang")
    if config.is_multi_node:
        raise ConfigError(
            f"--nnodes {config.nnodes}: TensorRT-LLM spans nodes under MPI (mpirun or srun with "
            "trtllm-llmapi-launch), which deepserve does not drive; serve it on one node, or use --engine vllm or "
            "--engine sglang across nodes"
        )
    # Prefill/decode disaggregation runs on TensorRT-LLM's own cache transceiver and `trtllm-serve disaggregated`
    # router, which deepserve does not drive.
    if config.role or config.kv_connector:
        raise ConfigError(
            "prefill/decode roles with TensorRT-LLM (its cache_transceiver_config and `trtllm-serve disaggregated`) "
            "are not driven by deepserve; serve prefill and decode with --engine vllm, or drop --role/--kv-connector"
        )
    if config.distributed_executor_backend == "ray":
        raise ConfigError("TensorRT-LLM does not run on Ray: drop --distributed-executor-backend ray")
    if config.quantization:
        raise ConfigError(
            f"--quantization {config.quantization}: TensorRT-LLM takes the weights' format from the checkpoint "
            "(e.g. deepseek-ai/DeepSeek-R1 for FP8, nvidia/DeepSeek-R1-FP4 for NVFP4); drop --quantization"
        )
    if config.kv_cache_dtype and config.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(
            f"--kv-cache-dtype {config.kv_cache_dtype} has no TensorRT-LLM counterpart; use one of "
            f"{', '.join(KV_CACHE_DTYPES)}"
        )


def _program(python: str | None) -> list[str]:
    """`trtllm-serve` as users type it; under a Python, the script beside it when it is there (a virtualenv),
    else the one on PATH (NVIDIA's container installs it in /usr/local/bin)."""
    if python is not None and (Path(python).parent / "trtllm-serve").exists():
        return [str(Path(python).parent / "trtllm-serve")]
    return ["trtllm-serve"]


def _options_path(config: EngineConfig, python: str | None) -> str:
    """On this machine, in deepserve's home; for another machine (a printed plan, a container), under /tmp."""
    name = f"trtllm-extra-options-{config.port}.yaml"
    if python is None:
        return f"{RENDERED_OPTIONS_DIR}/{name}"
    return str(deepserve_home() / "engines" / name)


def attention_dp(config: EngineConfig) -> bool:
    """Data-parallel attention: each of the DP ranks attends to its own requests (enable_attention_dp)."""
    return config.data_parallel_size > 1


def _flags(config: EngineConfig, model: ResolvedModel) -> list[tuple[str, object]]:
    """TensorRT-LLM counts attention-DP ranks inside its TP size (as SGLang does): tp_size is every GPU of a stage
    and enable_attention_dp splits attention over them; experts go over all of them with EP."""
    gpus_per_stage = config.tensor_parallel_size * config.data_parallel_size
    return [
        ("--backend", "pytorch"),
        ("--host", config.host),
        ("--port", config.port),
        ("--served_model_name", model.served_name),
        ("--tp_size", gpus_per_stage),
        ("--ep_size", gpus_per_stage if config.enable_expert_parallel else None),
        ("--pp_size", config.pipeline_parallel_size),
        ("--max_batch_size", config.max_num_seqs),
        ("--max_num_tokens", config.max_num_batched_tokens),
        ("--max_seq_len", config.max_model_len),
        # vLLM's fraction is of the whole GPU's memory, TensorRT-LLM's of what is free once the weights are loaded;
        # the planner reads it TensorRT-LLM's way for this engine (memory_fraction_of, docs/ENGINES.md).
        ("--kv_cache_free_gpu_memory_fraction", config.gpu_memory_utilization),
        ("--trust_remote_code", config.trust_remote_code or None),
        *parser_flags(*_parser_fields(config)),
    ]


def options(config: EngineConfig, model: ResolvedModel) -> dict[str, Any]:
    """The extra LLM-API options, as the YAML file holds them (only what differs from TensorRT-LLM's defaults, or
    what NVIDIA's DeepSeek recipes set)."""
    result: dict[str, Any] = {}
    if attention_dp(config):
        result["enable_attention_dp"] = True
        # the H200 database recipe's balancing of requests over the attention-DP ranks
        result["attention_dp_config"] = {"enable_balance": True, "batching_wait_iters": 0, "timeout_iters": 60}
    result["moe_config"] = {"backend": moe_backend(config, model)}
    result["cuda_graph_config"] = {
        "enable_padding": True,
        "max_batch_size": min(config.max_num_seqs or CUDA_GRAPH_MAX_BATCH, CUDA_GRAPH_MAX_BATCH),
    }
    result["kv_cache_config"] = _kv_cache_config(config)
    if config.dtype:
        result["dtype"] = config.dtype
    if chunked_prefill(config):
        result["enable_chunked_prefill"] = True
    elif config.enable_chunked_prefill is False:
        result["enable_chunked_prefill"] = False
    if config.stream_interval:
        result["stream_interval"] = config.stream_interval
    result.update(speculative_options(*_speculative_fields(config)))
    # /metrics (JSON) reports per-iteration statistics only with this on; the per-iteration log stays off.
    result["enable_iter_perf_stats"] = True
    result["print_iter_log"] = False
    return result


def options_yaml(config: EngineConfig, model: ResolvedModel) -> str:
    header = "# TensorRT-LLM extra LLM-API options, written by deepserve (engines/trtllm.py) for trtllm-serve\n"
    if not chunked_prefill(config) and _prompt_may_exceed_budget(config):
        header += (
            f"# enable_chunked_prefill is off: TensorRT-LLM refuses prompts over {step_token_budget(config)} tokens "
            "(max_num_tokens) with HTTP 400\n"
        )
    return header + yaml.safe_dump(options(config, model), sort_keys=False)


def step_token_budget(config: EngineConfig) -> int:
    """The tokens one step may hold: --max_num_tokens as the config sets it, else trtllm-serve's default."""
    return config.max_num_batched_tokens or DEFAULT_MAX_NUM_TOKENS


def chunked_prefill(config: EngineConfig) -> bool:
    """Whether the engine splits prompts over steps: as the config says, and where it says nothing, whenever a
    prompt may be longer than a step's token budget (an unset context length is the model's, 128K-164K tokens for
    DeepSeek), since TensorRT-LLM would otherwise refuse such prompts while the service promises max_model_len.
    MLA's chunked context runs on Hopper and Blackwell (NVIDIA's DeepSeek-R1 guide, "MLA chunked context")."""
    if config.enable_chunked_prefill is not None:
        return config.enable_chunked_prefill
    return _prompt_may_exceed_budget(config)


def _prompt_may_exceed_budget(config: EngineConfig) -> bool:
    return config.max_model_len is None or config.max_model_len > step_token_budget(config)


def moe_backend(config: EngineConfig, model: ResolvedModel) -> str:
    if not config.gpu_type:
        return MOE_BACKEND_DEFAULT
    hardware_class = get_accelerator(config.gpu_type).hardware_class
    if hardware_class == "blackwell" and "fp4" not in model.source.lower():
        return "DEEPGEMM"
    return MOE_BACKEND_DEFAULT


def _kv_cache_config(config: EngineConfig) -> dict[str, Any]:
    kv: dict[str, Any] = {}
    if config.kv_cache_dtype:
        kv["dtype"] = KV_CACHE_DTYPES[config.kv_cache_dtype]
    if config.enable_prefix_caching is not None:
        kv["enable_block_reuse"] = config.enable_prefix_caching
    if config.block_size:
        kv["tokens_per_block"] = config.block_size
    if config.kv_cache_memory_gib:
        kv["max_gpu_total_bytes"] = int(config.kv_cache_memory_gib * 1024**3)
    return kv


# ---- speculative decoding and parsers ------------------------------------------------------------------------------


def _speculative_fields(config: EngineConfig) -> tuple[str | None, int | None]:
    """(method, draft tokens) of the config's speculative decoding; None for what it leaves out (0 tokens too)."""
    return config.speculative_method or None, config.num_speculative_tokens or None


def _parser_fields(config: EngineConfig) -> tuple[str | None, str | None]:
    """(reasoning parser, tool parser) in vLLM's names; None for what the config leaves out."""
    return config.reasoning_parser or None, config.tool_call_parser or None


def speculative_options(method: str | None, draft_tokens: int | None) -> dict[str, Any]:
    """DeepSeek's MTP as TensorRT-LLM configures it: speculative_config {decoding_type: MTP,
    num_nextn_predict_layers: K} (the throughput recipe; K draft tokens from the model's MTP layer run K times)."""
    if method is None:
        return {}
    if method.lower() not in ("mtp", "deepseek_mtp", "nextn"):
        raise ConfigError(
            f"speculative method {method!r}: deepserve writes TensorRT-LLM's options for DeepSeek's MTP only; use "
            "mtp, or pass TensorRT-LLM's own speculative_config through a file of your own"
        )
    return {"speculative_config": {"decoding_type": "MTP", "num_nextn_predict_layers": draft_tokens or 1}}


def parser_flags(reasoning_parser: str | None, tool_parser: str | None) -> list[tuple[str, object]]:
    """--reasoning_parser and --tool_parser under TensorRT-LLM's names for vLLM's (deepseek_r1 → deepseek-r1)."""
    reasoning = REASONING_PARSER_NAMES.get(reasoning_parser, reasoning_parser) if reasoning_parser else None
    return [("--reasoning_parser", reasoning), ("--tool_parser", tool_parser)]
