"""Will this engine config fit on these machines? `deepserve serve` asks the memory plan before it starts anything,
so that a deployment that cannot fit fails in a second with the plan's numbers and the nearest layout that would,
instead of after minutes of weight loading (or, on a CPU machine, not at all until the kernel kills it).

GPUs: the planner's per-GPU memory plan (weights by component, activation reserve, KV cache) for the GPU type found
by nvidia-smi or given with --gpu-type, the layout of the engine config, and the format its --quantization or
checkpoint implies. CPU: the weights of the workers on this host, their KV caches and a per-process overhead
against the RAM available now.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from deepserve.engines.config import EngineConfig
from deepserve.engines.vllm import DEFAULT_GPU_MEMORY_UTILIZATION, cpu_default_kv_cache_gib, default_batch_limits
from deepserve.errors import ConfigError, ModelError
from deepserve.hardware.catalog import Accelerator, get_accelerator, match_device_name
from deepserve.models.resolve import load_spec
from deepserve.models.spec import ModelSpec
from deepserve.plan.formats import FORMATS, WeightFormat, checkpoint_format, get_format
from deepserve.plan.layout import Layout
from deepserve.plan.memory import weights_per_gpu
from deepserve.plan.planner import build_deployment, check_context_length, smallest_fitting_gpus
from deepserve.plan.speculative import SpeculativeDecoding, speculative_decoding
from deepserve.plan.types import PlanConfig

GB = 1e9
GIB = 1024**3
CPU_PROCESS_OVERHEAD_BYTES = 2 * GIB  # Python, torch and vLLM's own buffers in each engine process (measured ~1.8)


@dataclass(frozen=True)
class FitCheck:
    fits: bool | None  # None: not checked (an unknown GPU, a model whose config.json is not here)
    summary: str  # one line with the numbers
    suggestion: str = ""  # the nearest deployment that would fit, when it does not

    def describe(self) -> str:
        return self.summary + (f"; {self.suggestion}" if self.suggestion else "")


def check_gpu_fit(config: EngineConfig, model_source: str, accelerator: Accelerator | None) -> FitCheck:
    spec = spec_or_none(model_source)
    if spec is None or accelerator is None:
        return FitCheck(None, _unchecked(spec is None, "the GPU type is unknown (give --gpu-type)"))
    fmt = weight_format(config, spec)
    layout = _layout(config)
    context = config.max_model_len or spec.max_position_embeddings
    speculation, uncounted = _speculation(config, spec)
    deployment = build_deployment(
        spec,
        accelerator.name,
        layout.gpus,
        nodes=config.nnodes,
        weights=fmt.name if fmt.name in FORMATS else None,
        layout=layout,
        kv_dtype=config.kv_cache_dtype or "auto",
        gpu_memory_utilization=config.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION,
        max_model_len=context,
        max_num_batched_tokens=config.max_num_batched_tokens or _default_batched_tokens(accelerator),
        draft_modules=draft_modules_loaded(config),
        fp4_indexer_cache=fp4_indexer_cache(config),
        speculation=speculation,
    )
    memory = deployment.memory
    where = f"{spec.name} ({fmt.name}) on {layout.gpus} x {accelerator.name}, {layout.describe()}{uncounted}"
    numbers = (
        f"weights {memory.weights_bytes_per_gpu / GB:.1f} GB + reserve {memory.reserve_bytes_per_gpu / GB:.1f} GB "
        f"per GPU of a {memory.budget_bytes_per_gpu / GB:.1f} GB budget"
    )
    if memory.draft_modules:
        numbers += f" (with {memory.draft_bytes_per_gpu / GB:.1f} GB of {memory.draft_modules} draft weights)"
    if memory.fits:
        return FitCheck(True, f"{where}: fits; {numbers}, KV cache {memory.kv_cache_tokens:,} tokens")
    if memory.kv_cache_bytes_per_gpu <= 0:
        why = f"does not fit: {numbers}"
    else:
        why = (
            f"the KV cache holds {memory.kv_cache_tokens:,} tokens, fewer than --max-model-len {context:,} "
            f"({numbers}); lower --max-model-len to {memory.longest_context():,} or less"
        )
    return FitCheck(False, f"{where}: {why}", _nearest_fit(config, spec, fmt, accelerator, context))


def check_cpu_fit(config: EngineConfig, model_source: str, available_bytes: int, nodes_on_this_host: int) -> FitCheck:
    spec = spec_or_none(model_source)
    if spec is None:
        return FitCheck(None, _unchecked(True, ""))
    check_context_length(spec, config.max_model_len)
    fmt = weight_format(config, spec)
    layout = _layout(config)
    speculation, uncounted = _speculation(config, spec)
    loads_drafts = draft_modules_loaded(config) or (speculation is not None and speculation.draft_layers > 0)
    draft_layers = spec.num_mtp_layers if loads_drafts and spec.draft_method else 0
    per_worker = sum(c.bytes_per_gpu for c in weights_per_gpu(spec, fmt, layout, draft_layers))
    workers = layout.gpus // config.nnodes * nodes_on_this_host
    kv_bytes = (config.kv_cache_memory_gib or cpu_default_kv_cache_gib(model_source)) * GIB * workers
    need = per_worker * workers + kv_bytes + CPU_PROCESS_OVERHEAD_BYTES * workers
    numbers = (
        f"{spec.name} ({fmt.name}) needs {need / GB:,.1f} GB of RAM on this host ({per_worker * workers / GB:,.1f} "
        f"GB of weights{' with its MTP module' if draft_layers else ''}, {kv_bytes / GB:.1f} GB of KV cache, "
        f"{workers} engine process(es)); {available_bytes / GB:,.1f} GB is available{uncounted}"
    )
    if need <= available_bytes:
        return FitCheck(True, "fits: " + numbers)
    return FitCheck(
        False,
        "does not fit: " + numbers,
        f"serve it on GPUs (`deepserve plan --model {model_source}` says how many), or spread it over more nodes",
    )


def _speculation(config: EngineConfig, spec: ModelSpec) -> tuple[SpeculativeDecoding | None, str]:
    """Speculative decoding as the memory plan counts it (the MTP/DSpark layers and their KV cache; acceptance
    does not matter here), and a note when something it loads is not counted (a separate draft model)."""
    speculation = config.explicit_speculation() if config.speculation_requested else None
    if speculation is None:
        return None, ""
    if speculation.method == "draft_model":
        return None, f"; the draft model {speculation.draft_model} is not counted"
    return speculative_decoding(speculation.method, speculation.num_tokens, (0.0,), spec), ""


def weight_format(config: EngineConfig, spec: ModelSpec) -> WeightFormat:
    """What the engine will load: the checkpoint's own format, or FP8 quantized at load for --quantization fp8 on
    a 16-bit checkpoint (other --quantization values name the checkpoint's own method)."""
    native = checkpoint_format(spec)
    if config.quantization and config.quantization.lower() == "fp8" and not native.name.startswith("fp8"):
        return get_format("fp8-dynamic")
    return native


def _nearest_fit(
    config: EngineConfig, spec: ModelSpec, fmt: WeightFormat, accelerator: Accelerator, context: int
) -> str:
    plan = PlanConfig(
        model=spec.name,
        gpu=accelerator.name,
        gpus=accelerator.devices_per_node,
        weights=fmt.name if fmt.name in FORMATS else None,
        kv_dtype=config.kv_cache_dtype or "auto",
        max_model_len=context,
        gpu_memory_utilization=config.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION,
    )
    try:
        gpus = smallest_fitting_gpus(plan)
    except (ConfigError, ModelError):
        gpus = None
    if gpus is None:
        return f"no layout of up to 8 nodes of {accelerator.name} holds it at this context; lower --max-model-len"
    nodes = max(-(-gpus // accelerator.devices_per_node), 1)
    layout = f"--tensor-parallel-size {gpus // nodes}"
    if nodes > 1:
        layout += f" --pipeline-parallel-size {nodes} --nnodes {nodes} --master-addr NODE0_ADDRESS"
    return f"it fits on {gpus} x {accelerator.name} ({nodes} node(s)): {layout} (or pass --force to try anyway)"


SPECULATIVE_FLAGS = ("--speculative-config", "--speculative_config")
FP4_INDEXER_FLAG = "--attention_config.use_fp4_indexer_cache"
DRAFT_METHODS = ("mtp", "dspark", "deepseek_mtp")  # methods that load the checkpoint's own draft modules


def draft_modules_loaded(config: EngineConfig) -> bool:
    """Whether the engine will load the checkpoint's MTP / DSpark modules: a --speculative-config (passed through
    to vLLM) whose method is one of them. Other methods (n-gram, a separate draft model) load none."""
    args = config.extra_args
    for index, arg in enumerate(args):
        for flag in SPECULATIVE_FLAGS:
            if arg == flag and index + 1 < len(args):
                return _speculative_method(args[index + 1]) in DRAFT_METHODS
            if arg.startswith(flag + "="):
                return _speculative_method(arg.split("=", 1)[1]) in DRAFT_METHODS
    return False


def fp4_indexer_cache(config: EngineConfig) -> bool:
    """V4's indexer keys in MXFP4: vLLM's --attention_config.use_fp4_indexer_cache (passed through)."""
    args = config.extra_args
    for index, arg in enumerate(args):
        if arg == FP4_INDEXER_FLAG:
            following = args[index + 1].lower() if index + 1 < len(args) else "true"
            return following not in ("false", "0")
        if arg.startswith(FP4_INDEXER_FLAG + "="):
            return arg.split("=", 1)[1].lower() not in ("false", "0")
    return False


def _speculative_method(value: str) -> str:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return ""
    return str(parsed.get("method", "")).lower() if isinstance(parsed, dict) else ""


def _default_batched_tokens(accelerator: Accelerator) -> int:
    """vLLM's token budget per step when none is given (it sizes the activation reserve)."""
    return default_batch_limits(accelerator)[1]


def _layout(config: EngineConfig) -> Layout:
    return Layout(
        tp=config.tensor_parallel_size,
        pp=config.pipeline_parallel_size,
        dp=config.data_parallel_size,
        ep=config.enable_expert_parallel,
    )


def spec_or_none(model_source: str) -> ModelSpec | None:
    """The model's architecture from a preset or a local config.json; None for a hub id we have no preset for."""
    try:
        return load_spec(model_source)
    except ModelError:
        return None  # a hub id that is not a preset: its config.json is not here, and we never download


def _unchecked(no_spec: bool, other: str) -> str:
    reason = "the model's config.json is not on this machine (a hub id we have no preset for)" if no_spec else other
    return f"memory fit not checked: {reason}"


def accelerator_for(gpu_type: str | None, reported_name: str | None) -> Accelerator | None:
    """The catalog entry for --gpu-type, else for the name nvidia-smi reports; None when neither is known."""
    if gpu_type:
        return get_accelerator(gpu_type)
    return match_device_name(reported_name) if reported_name else None
