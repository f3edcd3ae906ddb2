"""SGLang: `python -m sglang.launch_server`. Its flag names differ from vLLM's; the mapping lives here."""

from __future__ import annotations

from deepserve.config import EngineConfig
from deepserve.engines.base import LaunchSpec, LoadMetricNames, ResolvedModel, flag_args, unless_one, url_host

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
    # token_usage: the fraction of the KV-cache token pool in use, SGLang's counterpart of vLLM's KV-cache usage
    load_metrics = LoadMetricNames(
        waiting=("sglang:num_queue_reqs",),
        running=("sglang:num_running_reqs",),
        kv_cache_usage=("sglang:token_usage",),
    )
    install_hint = (
        'install SGLang into deepserve\'s environment on a GPU machine: `pip install "sglang[all]"` '
        "(it has no build for a CPU-only machine like this one; `--dry-run` still prints its command line)"
    )

    def launch_spec(self, config: EngineConfig, model: ResolvedModel, python: str) -> LaunchSpec:
        argv = [python, "-m", "sglang.launch_server", "--model-path", model.source]
        kv_fraction = config.gpu_memory_utilization
        argv += flag_args(
            [
                ("--served-model-name", model.served_name),
                ("--host", config.host),
                ("--port", config.port),
                ("--tp-size", unless_one(config.tensor_parallel_size)),
                ("--pp-size", unless_one(config.pipeline_parallel_size)),
                ("--dp-size", unless_one(config.data_parallel_size)),
                # SGLang serves DeepSeek's data-parallel attention + expert parallelism as one switch pair.
                (
                    "--enable-dp-attention",
                    (config.data_parallel_size > 1 and config.enable_expert_parallel) or None,
                ),
                ("--ep-size", config.tensor_parallel_size if config.enable_expert_parallel else None),
                ("--context-length", config.max_model_len),
                ("--max-running-requests", config.max_num_seqs),
                ("--chunked-prefill-size", _chunked_prefill_size(config)),
                ("--mem-fraction-static", kv_fraction),
                ("--page-size", config.block_size),
                ("--quantization", config.quantization),
                ("--kv-cache-dtype", config.kv_cache_dtype),
                ("--dtype", config.dtype),
                ("--disable-radix-cache", True if config.enable_prefix_caching is False else None),
                ("--trust-remote-code", config.trust_remote_code or None),
                ("--device", "cpu" if model.on_cpu else None),
            ]
        )
        argv += config.extra_args
        return LaunchSpec(
            argv=argv,
            ready_path="/v1/models",
            served_model_name=model.served_name,
            base_url=f"http://{url_host(config.host)}:{config.port}/v1",
        )

    def phase_of(self, log_line: str) -> str | None:
        return next((phase for marker, phase in _PHASES if marker in log_line), None)


def _chunked_prefill_size(config: EngineConfig) -> int | None:
    """SGLang's chunk size: -1 disables chunking; otherwise vLLM's batched-token budget is the nearest match."""
    if config.enable_chunked_prefill is False:
        return -1
    return config.max_num_batched_tokens
