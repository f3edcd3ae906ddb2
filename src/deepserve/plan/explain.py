"""Why a plan is what it is: the weight format, the parallel layout, the KV-cache size, the speed figures.

Each explanation is a short topic and a sentence or two with the numbers that decided it, printed by `deepserve
plan` and listed under `explanations` in its JSON.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepserve.engines.registry import memory_fraction_of
from deepserve.errors import ConfigError
from deepserve.models.spec import dtype_bytes
from deepserve.plan.commands import checkpoint_to_load
from deepserve.plan.formats import FORMATS, WeightFormat, checkpoint_format, format_support
from deepserve.plan.kernels import KernelRates
from deepserve.plan.layout import stage_layers
from deepserve.plan.memory import (
    CUDA_GRAPH_RESERVE_BYTES,
    NON_TORCH_RESERVE_BYTES,
    MemoryPlan,
    plan_memory,
)
from deepserve.plan.profiles import SelectedFactors
from deepserve.plan.types import Deployment, PlanConfig

GB = 1e9


@dataclass(frozen=True)
class Explanation:
    topic: str  # quantization, layout, kv_cache, performance
    text: str

    def to_json(self) -> dict[str, str]:
        return {"topic": self.topic, "text": self.text}


def explain(
    config: PlanConfig,
    deployment: Deployment,
    selected: SelectedFactors,
    rates: KernelRates,
    smallest_fitting_gpus: int | None,
) -> tuple[Explanation, ...]:
    return (
        Explanation("quantization", explain_format(config, deployment)),
        Explanation("layout", explain_layout(config, deployment, smallest_fitting_gpus)),
        Explanation("kv_cache", explain_kv_cache(config, deployment)),
        Explanation("performance", explain_performance(deployment, selected, rates)),
    )


def explain_format(config: PlanConfig, deployment: Deployment) -> str:
    fmt, memory, acc = deployment.fmt, deployment.memory, deployment.accelerator
    try:
        checkpoint = checkpoint_format(deployment.spec).name
    except ConfigError:
        checkpoint = "a format the planner does not model"
    if config.weights is None:
        text = f"weights {fmt.name} ({fmt.description}): the checkpoint's own format, as the engine loads it"
    elif fmt.name == checkpoint:
        text = f"weights {fmt.name} ({fmt.description}): as asked (--weights), the checkpoint's own format"
    else:
        text = f"weights {fmt.name} ({fmt.description}): as asked (--weights); the checkpoint is stored as {checkpoint}"
        if fmt.vllm_quantization:
            text += f", which vLLM quantizes while loading (--quantization {fmt.vllm_quantization})"
        choice = checkpoint_to_load(deployment, config)
        if choice.why:
            text += f"; {choice.why}"
    per_gpu = f"{memory.weights_bytes_per_gpu / GB:,.1f} GB of weights per GPU"
    if memory.kv_cache_bytes_per_gpu > 0:
        text += f"; {per_gpu} leave {memory.kv_cache_bytes_per_gpu / GB:,.1f} GB for the KV cache"
    else:
        text += f"; {per_gpu} plus the reserve exceed the {memory.budget_bytes_per_gpu / GB:,.1f} GB budget"
        fitting = _formats_that_fit(deployment, config.gpu_memory_utilization)
        if fitting:
            text += f" (on these GPUs {', '.join(fitting)} would fit)"
    if fmt.compute_dtype not in acc.dense_tflops:
        text += (
            f". {acc.name} has no {fmt.compute_dtype.upper()} units: the GEMMs dequantize the weights and run at its "
            "16-bit rate"
        )
    elif fmt.compute_dtype == "fp16" and fmt.quantized_bytes_per_param < 1:
        text += ". 4-bit weights are dequantized inside the GEMM (W4A16): compute runs at the 16-bit rate"
    if fmt.expert_format:
        support = format_support(fmt, acc)
        text += f". {fmt.expert_format.upper()} experts on {acc.name}: {support.kind} ({support.kernel}"
        text += f"; {support.source})" if support.source else ")"
        if support.kind == "unsupported":
            text += "; use an FP8-expert checkpoint (--weights fp8) on this GPU"
    return text


def _formats_that_fit(deployment: Deployment, gpu_memory_utilization: float) -> list[str]:
    """Other formats whose weights and KV cache would fit on this deployment's GPUs and layout."""
    names = []
    for fmt in FORMATS.values():
        if fmt.name == deployment.fmt.name:
            continue
        memory = _memory_with(deployment, fmt, gpu_memory_utilization)
        if memory.fits:
            names.append(f"{fmt.name} ({memory.weights_bytes_per_gpu / GB:,.1f} GB/GPU)")
    return names


def _memory_with(deployment: Deployment, fmt: WeightFormat, gpu_memory_utilization: float) -> MemoryPlan:
    memory = deployment.memory
    return plan_memory(
        deployment.spec,
        fmt,
        deployment.layout,
        deployment.accelerator,
        deployment.kv_dtype,
        gpu_memory_utilization,
        memory.max_model_len,
        memory.sequence_len,
        deployment.max_num_batched_tokens,
        fraction_of=memory_fraction_of(deployment.engine),
    )


def explain_layout(config: PlanConfig, deployment: Deployment, smallest_fitting_gpus: int | None) -> str:
    layout, acc, nodes = deployment.layout, deployment.accelerator, deployment.nodes
    asked = config.tp is not None or config.pp is not None or config.dp > 1 or config.ep
    text = f"{layout.describe()} on {layout.gpus} GPU(s) in {nodes} node(s)" + (
        " (as asked)" if asked else " (the default: TP inside a node, PP across nodes)"
    )
    parts = []
    if layout.tp > 1:
        link = acc.intra_node.kind if layout.tp <= layout.gpus // nodes else "the network between nodes"
        parts.append(
            f"TP={layout.tp} splits every attention head group, expert and the vocabulary {layout.tp} ways; it "
            f"all-reduces the activations twice per layer, so it stays inside a node ({link})"
            if layout.tp <= layout.gpus // nodes
            else f"TP={layout.tp} spans nodes: its two all-reduces per layer cross {link}, the slowest choice"
        )
    if layout.pp > 1:
        parts.append(
            f"PP={layout.pp} puts {len(stage_layers(deployment.spec, layout.pp)[0])} layers per stage "
            f"{'on each node' if layout.pp == nodes else 'in consecutive groups'}: only one activation per "
            f"micro-batch crosses {deployment.network.name} between stages"
        )
    if layout.dp > 1:
        parts.append(
            f"DP attention={layout.dp}: each replica holds all attention weights and caches only its own sequences, "
            f"so the KV cache holds {layout.dp} times as many tokens"
        )
    if layout.ep:
        parts.append(
            f"EP={layout.expert_shards}: each GPU holds "
            f"{deployment.spec.n_routed_experts // max(layout.expert_shards, 1)} whole experts and tokens travel to "
            "them in two all-to-alls per MoE layer"
        )
    if layout.gpus == 1:
        parts.append("one device: no parallelism")
    if parts:
        text += ": " + "; ".join(parts)
    if not deployment.memory.fits and smallest_fitting_gpus:
        text += (
            f". It does not fit: {smallest_fitting_gpus} x {acc.name} "
            f"({fitting_layout_text(smallest_fitting_gpus, acc.devices_per_node)}) would"
        )
    return text


def fitting_layout_text(gpus: int, per_node: int) -> str:
    """How the planner lays out GPUS when it names the smallest deployment that fits."""
    if gpus <= per_node:
        return f"1 node, TP={gpus}"
    return f"{-(-gpus // per_node)} node(s), TP in a node, PP across"


def budget_words(fraction: float, deployment: Deployment) -> str:
    """How the engine's memory FRACTION makes its budget, in its own meaning (Engine.memory_fraction_of)."""
    memory, acc = deployment.memory, deployment.accelerator
    if memory_fraction_of(deployment.engine) == "free":
        taken = memory.weights_bytes_per_gpu + memory.reserve_bytes_per_gpu
        left_gb = (acc.memory_bytes - taken) / GB
        return f"weights + reserve + {fraction:g} x the {left_gb:,.1f} GB they leave ({deployment.engine}'s meaning)"
    return f"{fraction:g} x {acc.memory_gib:g} GiB"


def explain_kv_cache(config: PlanConfig, deployment: Deployment) -> str:
    memory, spec, layout = deployment.memory, deployment.spec, deployment.layout
    fixed = CUDA_GRAPH_RESERVE_BYTES + NON_TORCH_RESERVE_BYTES
    activations = memory.reserve_bytes_per_gpu - fixed - memory.workspace_bytes_per_gpu
    workspace = memory.workspace_bytes_per_gpu
    sparse = f", sparse attention's prefill workspace {workspace / GB:,.2f} GB" if workspace else ""
    text = (
        f"per GPU: budget {budget_words(config.gpu_memory_utilization, deployment)} = "
        f"{memory.budget_bytes_per_gpu / GB:,.1f} GB, minus weights {memory.weights_bytes_per_gpu / GB:,.1f} GB, "
        f"minus reserve {memory.reserve_bytes_per_gpu / GB:,.1f} GB (activations of a "
        f"{deployment.max_num_batched_tokens:,}-token chunk {activations / GB:,.1f} GB, CUDA graphs and non-torch "
        f"memory {fixed / GB:,.1f} GB{sparse}) = {memory.kv_cache_bytes_per_gpu / GB:,.1f} GB of KV cache"
    )
    layers = len(stage_layers(spec, layout.pp)[0])
    values = spec.kv_values_per_token_per_layer
    width = dtype_bytes(deployment.kv_dtype)
    if spec.attention_kind != "mla" and memory.kv_layout is not None:
        text += _nonlinear_kv_text(memory, layout.tp)
    elif spec.is_mla:
        text += (
            f"; a token costs {values} values (kv_lora_rank {spec.kv_lora_rank} + rope {spec.qk_rope_head_dim}) "
            f"x {layers} layers x {width} B = {memory.kv_bytes_per_token_per_gpu:,} B on every GPU: MLA's latent has "
            f"no head dimension, so each of the {layout.tp} TP ranks holds all of it (TP does not divide the cache)"
        )
    else:
        text += f"; a token costs {memory.kv_bytes_per_token_per_gpu:,} B per GPU ({memory.kv_placement})"
    if memory.kv_cache_bytes_per_gpu <= 0:
        return text + "; nothing is left, so it does not fit"
    if memory.kv_prompt_in_flight_bytes:
        text += (
            f"; {memory.kv_prompt_in_flight_bytes / GB:,.1f} GB of it stay with the prompts of the "
            f"{memory.in_flight_tokens:,} tokens in flight (two engine steps) until their steps settle: each prompt "
            "token writes its window entry and compressor state, pages of 4-8 tokens in the pool's blocks"
        )
    text += f"; {memory.kv_cache_tokens:,} tokens" + (f" (x DP {layout.dp})" if layout.dp > 1 else "")
    text += (
        f" = {memory.max_concurrent_sequences:,} sequences of {memory.sequence_len:,} tokens "
        f"({config.input_len} in + {config.output_len} out)"
    )
    if memory.kv_cache_tokens < memory.max_model_len:
        text += f", fewer than one max_model_len of {memory.max_model_len:,}: the engine would refuse to start"
    cap = deployment.running_cap
    pool = deployment.engine_pool_sequences_per_rank
    if pool is not None and cap == pool * layout.dp and cap < memory.max_concurrent_sequences:
        text += (
            f"; {deployment.engine}'s own pool for {deployment.spec.architecture} caps the running batch at {cap}: "
            f"its sliding-window pool, a fixed share of its cache in uncompressed entries of every layer, keeps "
            f"each running request's prompt ({memory.prompt_len:,} tokens) until the request ends"
        )
    elif deployment.max_num_seqs is not None and cap < memory.max_concurrent_sequences:
        text += f"; max_num_seqs {deployment.max_num_seqs} caps the running batch at {cap}"
    elif deployment.max_num_seqs_in_effect is not None and cap < memory.max_concurrent_sequences:
        default = deployment.engine_default_running_requests
        text += (
            f"; {deployment.engine}'s own default for {deployment.spec.architecture} ({default} running requests, "
            f"shared out over the data-parallel ranks) caps the running batch at {cap}"
        )
    else:
        text += f"; the running batch is limited by the KV cache at {cap} sequences"
    return text + _max_num_seqs_words(deployment)


def _max_num_seqs_words(deployment: Deployment) -> str:
    """--max-num-seqs as the engines apply it: per data-parallel rank, over all pipeline micro-batches together
    (vLLM V1, SGLang's --max-running-requests per rank) or per micro-batch (vLLM V0)."""
    layout = deployment.layout
    per_rank = deployment.max_num_seqs_per_rank
    if per_rank is None:  # not one sequence fits: there is nothing to cap
        return ""
    scope = "each pipeline micro-batch" if deployment.micro_batches_capped() > 1 else "all its pipeline micro-batches"
    words = f"; the commands pass --max-num-seqs {per_rank}: "
    if layout.dp > 1:
        return words + f"each of the {layout.dp} data-parallel ranks runs up to {per_rank} of them ({scope})"
    return words + f"the engine runs up to {per_rank} over {scope}"


def _nonlinear_kv_text(memory: MemoryPlan, tp: int) -> str:
    """V3.2 (latent + indexer key per token) and V4 (compressed entries, windows, compressor state)."""
    cache = memory.kv_layout
    assert cache is not None
    text = (
        f"; in {cache.kv_dtype} a token adds {memory.kv_bytes_per_token_per_gpu:,} B on every GPU "
        f"({cache.content_bytes_per_token:,.0f} B of entries, the rest page padding)"
    )
    if memory.kv_fixed_bytes_per_sequence:
        text += (
            f" and every request holds {memory.kv_fixed_bytes_per_sequence / 1e6:,.1f} MB whatever its length "
            f"(sliding windows and compressor state): {memory.kv_bytes_per_sequence(memory.sequence_len) / 1e6:,.1f} "
            f"MB at {memory.sequence_len:,} tokens, {memory.kv_bytes_per_sequence(memory.max_model_len) / 1e6:,.1f} "
            f"MB at max_model_len {memory.max_model_len:,}"
        )
    return text + f"; the cache has no head dimension, so each of the {tp} TP ranks holds all of it"


def explain_performance(deployment: Deployment, selected: SelectedFactors, rates: KernelRates) -> str:
    facts = selected.facts
    launch = facts.step_launch(rates.family)
    unmeasured = [kind for kind, rate in rates.kinds.items() if not rate.measured]
    text = (
        f"speeds from {rates.provenance}"
        + (f"; not measured for this class, carried over: {', '.join(unmeasured)}" if unmeasured else "")
        + f"; engine profile {selected.profile} {selected.version} ({selected.provenance}), kernels launched as "
        f"{launch.replace('_', ' ')}"
    )
    per_expert = facts.moe_per_expert.get(rates.family)
    if per_expert is not None:
        text += (
            f"; this version's {rates.family} MoE kernel launches {per_expert.launches_per_expert} GEMMs per touched "
            "expert from the host, so every step pays host-synchronised launches"
        )
    return text + _prefill_share_words(deployment)


def _prefill_share_words(deployment: Deployment) -> str:
    share, budget = deployment.prefill_tokens_per_rank_step, deployment.max_num_batched_tokens
    if share >= budget:
        return ""
    prompt = deployment.memory.prompt_len
    steps = f", so a {prompt:,}-token prompt takes {-(-prompt // share)} prefill steps" if prompt else ""
    return (
        f"; with DP attention the engine divides its {budget:,}-token prefill chunk over the {deployment.layout.dp} "
        f"ranks: each prefills at most {share:,} prompt tokens a step{steps}"
    )
