"""Per-GPU memory: weights by component (sharded or replicated), the reserve for activations and CUDA graphs,
and what is left for the KV cache.

The budget is what the engine may use: gpu_memory_utilization x device memory (vLLM's and SGLang's meaning). From
it the engine takes the weights, its activation peak and CUDA graphs, and gives the rest to the KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepserve.hardware.catalog import Accelerator
from deepserve.models.spec import COMPONENTS, ModelSpec, dtype_bytes
from deepserve.plan.formats import WeightFormat
from deepserve.plan.layout import Layout, stage_layers

GIB = 1024**3
# CUDA context, NCCL buffers and the allocator's slack, which vLLM counts as "non-torch" memory (typical: 0.5-1.5 GiB).
NON_TORCH_RESERVE_BYTES = 1 * GIB
# CUDA graphs for decode batch sizes up to 512 (vLLM's default capture list), typically 0.5-2 GiB for DeepSeek-V3.
CUDA_GRAPH_RESERVE_BYTES = 1 * GIB
# Live hidden-size activations during one forward pass of a prefill chunk (residual, norm output, attention
# output, MoE input/output and the fused-MoE cache of top-k expert outputs), counted in hidden-size vectors.
LIVE_HIDDEN_VECTORS_PER_TOKEN = 6
DRAFT_COMPONENT = "draft_modules"  # the MTP/DSpark layers speculative decoding loads


@dataclass(frozen=True)
class ComponentMemory:
    component: str
    params_per_gpu: int
    bytes_per_gpu: int
    placement: str  # "sharded / N", "replicated", "absent"


@dataclass(frozen=True)
class MemoryPlan:
    components: tuple[ComponentMemory, ...]
    weights_bytes_per_gpu: int
    reserve_bytes_per_gpu: int
    budget_bytes_per_gpu: int
    kv_cache_bytes_per_gpu: int  # negative when the weights do not fit
    kv_bytes_per_token: int  # the whole model, one token (what a single GPU would hold)
    kv_bytes_per_token_per_gpu: int  # what one GPU holds per token it caches
    kv_placement: str
    kv_cache_tokens: int  # tokens the deployment caches (all data-parallel replicas together)
    max_model_len: int
    sequence_len: int  # input + output of the planned workload

    @property
    def fits(self) -> bool:
        """The weights fit and the cache holds at least one sequence of max_model_len (engines refuse otherwise)."""
        return self.kv_cache_bytes_per_gpu > 0 and self.kv_cache_tokens >= self.max_model_len

    @property
    def max_concurrent_sequences(self) -> int:
        return max(self.kv_cache_tokens, 0) // max(self.sequence_len, 1)

    @property
    def free_bytes_per_gpu(self) -> int:
        return self.kv_cache_bytes_per_gpu


def plan_memory(
    spec: ModelSpec,
    fmt: WeightFormat,
    layout: Layout,
    accelerator: Accelerator,
    kv_dtype: str,
    gpu_memory_utilization: float,
    max_model_len: int,
    sequence_len: int,
    max_num_batched_tokens: int,
    draft_modules: bool = False,
) -> MemoryPlan:
    """DRAFT_MODULES: speculative decoding loads the checkpoint's MTP (or DSpark) layers, each with its own weights
    and its own KV cache."""
    draft_layers = spec.num_mtp_layers if draft_modules else 0
    components = weights_per_gpu(spec, fmt, layout) + mtp_weights_per_gpu(spec, fmt, layout, draft_layers)
    weights = sum(c.bytes_per_gpu for c in components)
    reserve = activation_reserve_bytes(spec, fmt, layout, max_num_batched_tokens)
    budget = int(gpu_memory_utilization * accelerator.memory_bytes)
    kv_bytes = budget - weights - reserve
    per_token_gpu, placement = kv_bytes_per_token_per_gpu(spec, layout, kv_dtype, draft_layers)
    tokens = max(kv_bytes, 0) // per_token_gpu * layout.dp
    return MemoryPlan(
        components=components,
        weights_bytes_per_gpu=weights,
        reserve_bytes_per_gpu=reserve,
        budget_bytes_per_gpu=budget,
        kv_cache_bytes_per_gpu=kv_bytes,
        kv_bytes_per_token=spec.kv_bytes_per_token(kv_dtype) // spec.num_layers * (spec.num_layers + draft_layers),
        kv_bytes_per_token_per_gpu=per_token_gpu,
        kv_placement=placement,
        kv_cache_tokens=tokens,
        max_model_len=max_model_len,
        sequence_len=sequence_len,
    )


def shard_count(component: str, spec: ModelSpec, layout: Layout) -> int:
    """Over how many GPUs of a stage one copy of COMPONENT is split (1 = every GPU holds all of it)."""
    if component == "routed_experts":
        return layout.expert_shards
    if component in ("attention_heads", "dense_mlp", "shared_experts", "embedding", "lm_head"):
        return layout.tp  # heads, intermediate columns and vocabulary rows split; DP replicas each hold a copy
    return 1  # MLA's latent down-projections (q_a, kv_a), norms and the router are replicated


def weights_per_gpu(spec: ModelSpec, fmt: WeightFormat, layout: Layout) -> tuple[ComponentMemory, ...]:
    """Weights on the fullest GPU: stage by stage (the first holds the embedding, the last the output head)."""
    stages = stage_layers(spec, layout.pp)
    best: dict[str, int] | None = None
    best_bytes = -1.0
    for number, layers in enumerate(stages):
        params = dict.fromkeys(COMPONENTS, 0)
        for index in layers:
            for key, count in spec.layer_parameter_breakdown(index).items():
                params[key] += count
        whole = spec.parameter_breakdown()
        params["embedding"] = whole["embedding"] if number == 0 else 0
        params["lm_head"] = whole["lm_head"] if number == len(stages) - 1 else 0
        if number == len(stages) - 1:
            params["norms"] += spec.hidden_size
        stage_bytes = sum(params[k] / shard_count(k, spec, layout) * fmt.bytes_per_param(k) for k in params)
        if stage_bytes > best_bytes:
            best, best_bytes = params, stage_bytes
    assert best is not None
    rows = []
    for key in COMPONENTS:
        shards = shard_count(key, spec, layout)
        per_gpu = best[key] // shards
        placement = "absent" if best[key] == 0 else "replicated" if shards == 1 else f"sharded / {shards}"
        rows.append(ComponentMemory(key, per_gpu, int(per_gpu * fmt.bytes_per_param(key)), placement))
    return tuple(rows)


def kv_bytes_per_token_per_gpu(
    spec: ModelSpec, layout: Layout, kv_dtype: str, draft_layers: int = 0
) -> tuple[int, str]:
    """Bytes one GPU holds per cached token. MLA's latent vector has no head dimension to split, so every TP rank
    holds all of it; grouped-query attention splits its KV heads over TP ranks (replicating when TP > KV heads).
    Draft layers (MTP) cache their own latent on the last stage, which holds the output head they share."""
    stages = stage_layers(spec, layout.pp)
    layers = max(len(r) + (draft_layers if number == len(stages) - 1 else 0) for number, r in enumerate(stages))
    per_layer = spec.kv_values_per_token_per_layer * dtype_bytes(kv_dtype)
    if spec.is_mla:
        return layers * per_layer, "latent cache replicated on every TP rank"
    split = min(layout.tp, spec.num_kv_heads)
    return layers * per_layer // split, f"KV heads split over {split} ranks"


def mtp_weights_per_gpu(
    spec: ModelSpec, fmt: WeightFormat, layout: Layout, draft_layers: int
) -> tuple[ComponentMemory, ...]:
    """The MTP module as vLLM loads it (vllm/model_executor/models/deepseek_mtp.py): per draft layer a decoder
    layer (MoE, split like the main layers), `eh_proj` (2 x hidden -> hidden, an unquantized nn.Linear on every
    rank) and three norms; the embedding and output head are the main model's, shared (llm_base_proposer.py).
    Added to the fullest GPU's weights (with PP it sits on the last stage: an upper bound). Nothing when
    DRAFT_LAYERS is 0."""
    if draft_layers == 0:
        return ()
    params = 0.0
    nbytes = 0.0
    for key, count in spec.layer_parameter_breakdown(spec.num_layers).items():
        share = count / shard_count(key, spec, layout)
        params += share
        nbytes += share * fmt.bytes_per_param(key)
    own = 2 * spec.hidden_size * spec.hidden_size + 3 * spec.hidden_size  # eh_proj and enorm/hnorm/shared_head.norm
    params += own
    nbytes += own * fmt.bytes_per_param("norms")  # 16-bit, as the norms
    placement = f"{draft_layers} layer(s), split as the main layers; eh_proj replicated"
    return (ComponentMemory(DRAFT_COMPONENT, int(params * draft_layers), int(nbytes * draft_layers), placement),)


def activation_reserve_bytes(spec: ModelSpec, fmt: WeightFormat, layout: Layout, max_num_batched_tokens: int) -> int:
    """Peak activations of the largest prefill chunk, plus CUDA graphs and non-torch memory.

    Per token: a few hidden-size vectors in 16-bit, the MoE intermediate of the top-k experts on this GPU, and the
    attention's up-projected keys/values of the chunk (MLA prefill decompresses the latent per head)."""
    hidden = spec.hidden_size
    act = 2  # 16-bit activations, whatever the weight format
    per_token = LIVE_HIDDEN_VECTORS_PER_TOKEN * hidden * act
    if spec.is_moe:
        top_k = spec.num_experts_per_tok
        per_token += top_k * hidden * act  # fused-MoE output cache, one hidden vector per chosen expert
        per_token += top_k * 2 * spec.moe_intermediate_size // layout.tp * act
    heads = spec.num_attention_heads // layout.tp
    per_token += heads * (spec.qk_nope_head_dim + spec.qk_rope_head_dim + spec.v_head_dim) * act
    activations = max_num_batched_tokens * per_token
    return activations + CUDA_GRAPH_RESERVE_BYTES + NON_TORCH_RESERVE_BYTES
