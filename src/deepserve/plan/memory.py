"""Per-GPU memory: weights by component (sharded or replicated), the reserve for activations and CUDA graphs,
and what is left for the KV cache.

The budget is what the engine may use: gpu_memory_utilization x device memory (vLLM's and SGLang's meaning). From
it the engine takes the weights, its activation peak and CUDA graphs, and gives the rest to the KV cache. TensorRT-LLM
reads its fraction as a share of what the weights and that reserve leave (`fraction_of="free"`), so the same number
gives it a larger budget.

The KV cache is models/kv_cache.py's layout of the GPU's layers: for MLA and V3.2 a fixed number of bytes per
token; for V4 bytes that grow with the compressed context plus a fixed amount per request (sliding window,
compressor state), drawn from vLLM's pool of blocks. With speculative decoding the engine also loads the draft
modules (MTP layers, or DSpark's draft layers) on the last pipeline stage, and caches their KV.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepserve.engines.base import MemoryFractionOf
from deepserve.hardware.catalog import Accelerator
from deepserve.models.kv_cache import KVCacheLayout, kv_cache_layout
from deepserve.models.spec import COMPONENTS, ModelSpec
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
# Of those, the residual stream and its update: V4's hyper-connections widen both to hc_mult streams.
RESIDUAL_VECTORS_PER_TOKEN = 2
# Sparse attention's prefill workspace (vLLM 0.32, reserved at start-up through its workspace manager): the context a
# prompt chunk attends to is gathered in 16-bit into `factor x max_model_len` rows of 576 values for V3.2
# (vllm/v1/attention/backends/mla/flashmla_sparse.py: get_prefill_workspace_size), with factor 5 up to 256K tokens and
# 2 beyond (vllm/config/vllm.py: sparse_mla_prefill_workspace_factor); the indexer's prefill key buffer is sized to
# fit the same memory (vllm/v1/attention/backends/mla/indexer.py: get_max_prefill_buffer_size). V4 gathers, for
# PREFILL_CHUNK_SIZE prompts at once, each one's compressed context, window and chunk in 16-bit, beside the chunk's
# top-k index buffers (vllm/models/deepseek_v4/nvidia/flashmla.py: the dummy run's reservation).
SPARSE_WORKSPACE_FACTOR = (5, 2)  # up to / beyond 256K tokens of max_model_len
SPARSE_WORKSPACE_LONG_CONTEXT = 256 * 1024
V32_GATHER_BYTES_PER_ROW = 576 * 2
V4_PREFILL_CHUNK_SIZE = 4
INDEXER_BUFFER_ROWS_PER_FACTOR = 576 * 2 // 132  # indexer keys (132 B) that fit in the gather's 16-bit rows
DRAFT_COMPONENT = "draft_modules"


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
    kv_bytes_per_token: int  # the whole model, one more token of context (what a single GPU would hold)
    kv_bytes_per_token_per_gpu: int  # what one GPU holds per token it caches
    kv_placement: str
    kv_cache_tokens: int  # tokens the deployment caches (all data-parallel replicas together), as vLLM reports it
    max_model_len: int
    sequence_len: int  # input + output of the planned workload
    prompt_len: int = 0  # input of the planned workload (0: the whole sequence_len)
    # What a request holds whatever its length on one GPU: V4's sliding windows and compressor state (0 for MLA).
    kv_fixed_bytes_per_sequence: int = 0
    kv_layout: KVCacheLayout | None = None  # the cache of the GPU's layers, for bytes at any context length
    kv_sequences: int | None = None  # requests of sequence_len the cache holds (set where bytes are not linear)
    draft_modules: str | None = None  # "mtp" / "dspark" when speculative decoding loads them
    draft_bytes_per_gpu: int = 0  # their weights on the fullest GPU (included in weights_bytes_per_gpu)
    in_flight_tokens: int = 16384  # tokens steps in flight may write (in_flight_tokens()): V4's admission reserve
    data_parallel: int = 1  # ranks with a cache of their own (kv_cache_tokens counts all of them)
    workspace_bytes_per_gpu: int = 0  # sparse attention's prefill workspace (in reserve_bytes_per_gpu)
    # V4: what the windowed caches hold beyond their windows while a step's prompt tokens are unsettled
    kv_prompt_in_flight_bytes: int = 0

    @property
    def fits(self) -> bool:
        """The weights fit and the cache holds at least one sequence of max_model_len (engines refuse otherwise).
        vLLM checks each data-parallel rank's cache on its own; the planner checks all ranks' together, because its
        reserve (activations, CUDA graphs) is an upper estimate that would refuse published DP layouts of V4 whose
        ranks keep well under a GB for their caches (docs/PLANNING.md, section 2)."""
        return self.kv_cache_bytes_per_gpu > 0 and self.kv_cache_tokens >= self.max_model_len

    @property
    def max_concurrent_sequences(self) -> int:
        if self.kv_sequences is not None:
            return self.kv_sequences
        return max(self.kv_cache_tokens, 0) // max(self.sequence_len, 1)

    @property
    def free_bytes_per_gpu(self) -> int:
        return self.kv_cache_bytes_per_gpu

    def kv_bytes_per_sequence(self, context_len: int) -> int:
        """Bytes one GPU holds for a request at CONTEXT_LEN tokens (whole pool blocks)."""
        if self.kv_layout is None:
            return self.kv_bytes_per_token_per_gpu * context_len
        return self.kv_layout.bytes_per_sequence(context_len)

    def longest_context(self) -> int:
        """The longest max_model_len whose one request the cache admits (what to lower --max-model-len to)."""
        if self.kv_layout is None or self.kv_layout.is_linear:
            return max(self.kv_cache_tokens, 0)
        low, high = 0, max(self.max_model_len, 1)
        while high - low > 1:
            middle = (low + high) // 2
            needed = self.kv_layout.admission_bytes_per_sequence(middle, self.in_flight_tokens)
            low, high = (middle, high) if needed <= self.kv_cache_bytes_per_gpu else (low, middle)
        return low

    @property
    def kv_block_tokens(self) -> int:
        """Tokens per block of the growing cache (the engine's --block-size for this model)."""
        if self.kv_layout is None or not self.kv_layout.groups:
            return 0
        return min(g.block_tokens for g in self.kv_layout.groups if g.window is None)

    @property
    def kv_pool_blocks(self) -> int:
        """Blocks of the engine's pool on one GPU (every group's block is one of these)."""
        if self.kv_layout is None or not self.kv_layout.block_bytes:
            return 0
        return max(self.kv_cache_bytes_per_gpu, 0) // self.kv_layout.block_bytes

    @property
    def kv_state_blocks_per_sequence(self) -> int:
        """Pool blocks a decoding request holds besides its context's: windows and compressor state."""
        if self.kv_layout is None or not self.kv_layout.block_bytes:
            return 0
        return self.kv_layout.fixed_bytes_per_sequence // self.kv_layout.block_bytes


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
    fp4_indexer_cache: bool = False,
    prompt_len: int | None = None,
    fraction_of: MemoryFractionOf = "device",
) -> MemoryPlan:
    """DRAFT_MODULES: speculative decoding is on, so the engine loads the checkpoint's MTP or DSpark modules and
    caches their KV. FP4_INDEXER_CACHE: V4's lightning-indexer keys in MXFP4 (Blackwell's recipe). PROMPT_LEN: the
    planned prompts (default: the whole SEQUENCE_LEN), whose steps in flight V4's windowed caches hold pages for.
    FRACTION_OF: what GPU_MEMORY_UTILIZATION is a share of, the engine's meaning (Engine.memory_fraction_of)."""
    draft_layers = spec.num_mtp_layers if draft_modules and spec.draft_method else 0
    components = weights_per_gpu(spec, fmt, layout, draft_layers)
    weights = sum(c.bytes_per_gpu for c in components)
    workspace = sparse_workspace_bytes(spec, max_model_len, max_num_batched_tokens)
    reserve = activation_reserve_bytes(spec, fmt, layout, max_num_batched_tokens) + workspace
    budget = _budget_bytes(accelerator.memory_bytes, gpu_memory_utilization, weights + reserve, fraction_of)
    kv_bytes = budget - weights - reserve
    cache = gpu_kv_cache(spec, layout, kv_dtype, draft_layers, fp4_indexer_cache)
    whole = kv_cache_layout(spec, kv_dtype, draft_layers=draft_layers, fp4_indexer_cache=fp4_indexer_cache)
    per_token_gpu, placement = kv_bytes_per_token_per_gpu(spec, layout, kv_dtype, cache)
    in_flight = in_flight_tokens(max_num_batched_tokens, layout.pp)
    prompts_held = _prompts_in_flight_bytes(cache, kv_bytes, prompt_len or sequence_len, sequence_len, in_flight)
    if cache.is_linear:
        tokens = max(kv_bytes, 0) // per_token_gpu * layout.dp
        sequences = None
    else:
        tokens = cache.engine_reported_tokens(kv_bytes, max_model_len, in_flight) * layout.dp
        sequences = cache.sequences(kv_bytes - prompts_held, sequence_len) * layout.dp
    draft = next((c.bytes_per_gpu for c in components if c.component == DRAFT_COMPONENT), 0)
    return MemoryPlan(
        components=components,
        weights_bytes_per_gpu=weights,
        reserve_bytes_per_gpu=reserve,
        budget_bytes_per_gpu=budget,
        kv_cache_bytes_per_gpu=kv_bytes,
        kv_bytes_per_token=round(whole.bytes_per_token),
        kv_bytes_per_token_per_gpu=per_token_gpu,
        kv_placement=placement,
        kv_cache_tokens=tokens,
        max_model_len=max_model_len,
        sequence_len=sequence_len,
        prompt_len=prompt_len or sequence_len,
        kv_fixed_bytes_per_sequence=cache.fixed_bytes_per_sequence,
        kv_layout=cache,
        kv_sequences=sequences,
        draft_modules=spec.draft_method if draft_layers else None,
        draft_bytes_per_gpu=draft,
        in_flight_tokens=in_flight,
        data_parallel=layout.dp,
        workspace_bytes_per_gpu=workspace,
        kv_prompt_in_flight_bytes=prompts_held,
    )


def _budget_bytes(device_bytes: int, fraction: float, taken_bytes: int, fraction_of: MemoryFractionOf) -> int:
    """What the engine may use: FRACTION of the whole device, or ("free") the TAKEN_BYTES of weights and reserve
    plus FRACTION of what they leave (TensorRT-LLM's kv_cache_free_gpu_memory_fraction)."""
    if fraction_of == "free":
        return taken_bytes + int(fraction * max(device_bytes - taken_bytes, 0))
    return int(fraction * device_bytes)


def _prompts_in_flight_bytes(
    cache: KVCacheLayout, kv_bytes: int, prompt_len: int, sequence_len: int, in_flight: int
) -> int:
    """The pages prompts in flight hold (KVCacheLayout.prompt_in_flight_bytes); where the cache cannot spare that
    beside one decoding request, the engine admits one prompt at a time (it waits until a prompt's pages are free)."""
    held = cache.prompt_in_flight_bytes(prompt_len, in_flight)
    if kv_bytes - held >= cache.bytes_per_sequence(sequence_len):
        return held
    return cache.prompt_in_flight_bytes(prompt_len, min(prompt_len, in_flight))


def sparse_workspace_bytes(spec: ModelSpec, max_model_len: int, max_num_batched_tokens: int) -> int:
    """Sparse attention's prefill workspace on each GPU (see SPARSE_WORKSPACE_FACTOR): about 0.9 GB for V3.2 at
    its 163,840-token context, 0.05 GB for V4 at 9K and 1.1 GB at 1M tokens; 0 for MLA and GQA."""
    factor = SPARSE_WORKSPACE_FACTOR[0 if max_model_len <= SPARSE_WORKSPACE_LONG_CONTEXT else 1]
    indexer_keys = max_model_len * INDEXER_BUFFER_ROWS_PER_FACTOR * factor * 132
    if spec.attention_kind == "mla_sparse":
        return max(factor * max_model_len * V32_GATHER_BYTES_PER_ROW, indexer_keys)
    if spec.attention_kind != "compressed_sparse":
        return 0
    window = spec.sliding_window or 128
    ratio = min((r for r in spec.compress_ratios if r > 1), default=4)
    rows = -(-max_model_len // ratio) + window + max_num_batched_tokens
    gather = V4_PREFILL_CHUNK_SIZE * rows * spec.head_dim * 2
    topk = max_num_batched_tokens * (-(-(spec.index_topk + window) // 128) * 128 + 1) * 4
    return max(gather + topk, indexer_keys // ratio)


def in_flight_tokens(max_num_batched_tokens: int, pp: int) -> int:
    """Tokens scheduled but not yet settled, which V4's windowed caches reserve for: a step's worth per batch in
    flight, two with vLLM 0.32's default async scheduling, PP with pipeline parallelism (where its V1 model runner
    turns async scheduling off) (vllm/config/vllm.py: max_concurrent_batches, max_in_flight_tokens)."""
    return max_num_batched_tokens * (2 if pp == 1 else pp)


def shard_count(component: str, spec: ModelSpec, layout: Layout) -> int:
    """Over how many GPUs of a stage one copy of COMPONENT is split (1 = every GPU holds all of it)."""
    if component == "routed_experts":
        return layout.expert_shards
    if component in ("attention_heads", "dense_mlp", "shared_experts", "embedding", "lm_head"):
        return layout.tp  # heads, intermediate columns and vocabulary rows split; DP replicas each hold a copy
    # MLA's latent down-projections (q_a, kv_a), V4's wq_a/wkv, the indexers, compressors, hyper-connections,
    # norms and the router are replicated
    return 1


def checkpoint_bytes(spec: ModelSpec, fmt: WeightFormat) -> int:
    """What the checkpoint's weights take on disk (a download, a volume): the main model and its draft modules, each
    component at FMT's width with its scales (the published V4 checkpoint sizes within 1%, V3's ~685 GB)."""
    return int(sum(part.bytes_per_gpu for part in weights_per_gpu(spec, fmt, Layout(tp=1), spec.num_mtp_layers)))


def weights_per_gpu(
    spec: ModelSpec, fmt: WeightFormat, layout: Layout, draft_layers: int = 0
) -> tuple[ComponentMemory, ...]:
    """Weights on the fullest GPU: stage by stage (the first holds the embedding, the last the output head and the
    DRAFT_LAYERS speculative-decoding layers, which vLLM runs on the last pipeline rank)."""
    stages = stage_layers(spec, layout.pp)
    best: dict[str, int] | None = None
    best_draft: dict[str, int] = {}
    best_bytes = -1.0
    for number, layers in enumerate(stages):
        last = number == len(stages) - 1
        params = dict.fromkeys(COMPONENTS, 0)
        for index in layers:
            for key, count in spec.layer_parameter_breakdown(index).items():
                params[key] += count
        whole = spec.parameter_breakdown()
        params["embedding"] = whole["embedding"] if number == 0 else 0
        params["lm_head"] = whole["lm_head"] if last else 0
        if last:
            params["norms"] += spec.hidden_size
            params["hyper_connections"] += whole["hyper_connections"] - sum(
                spec.layer_parameter_breakdown(i)["hyper_connections"] for i in range(spec.num_layers)
            )
        draft = draft_parameter_breakdown(spec, draft_layers) if last else {}
        stage_bytes = _bytes(params, spec, fmt, layout) + _bytes(draft, spec, fmt, layout)
        if stage_bytes > best_bytes:
            best, best_draft, best_bytes = params, draft, stage_bytes
    assert best is not None
    rows = []
    for key in COMPONENTS:
        shards = shard_count(key, spec, layout)
        per_gpu = best[key] // shards
        placement = "absent" if best[key] == 0 else "replicated" if shards == 1 else f"sharded / {shards}"
        rows.append(ComponentMemory(key, per_gpu, int(per_gpu * fmt.bytes_per_param(key)), placement))
    if draft_layers:
        params_here = sum(count // shard_count(key, spec, layout) for key, count in best_draft.items())
        placement = f"{draft_layers} {spec.draft_method} layer(s)" + (" on the last stage" if layout.pp > 1 else "")
        rows.append(
            ComponentMemory(DRAFT_COMPONENT, params_here, int(_bytes(best_draft, spec, fmt, layout)), placement)
        )
    return tuple(rows)


def draft_parameter_breakdown(spec: ModelSpec, draft_layers: int) -> dict[str, int]:
    """The speculative-decoding layers' parameters by component: decoder layers (MoE; V4: window attention) plus
    MTP's input projections (V3: eh_proj from 2 x hidden; V4: e_proj and h_proj) and norms. They share the main
    model's embedding and output head."""
    if not draft_layers:
        return {}
    parts = {key: count * draft_layers for key, count in spec.layer_parameter_breakdown(spec.num_layers).items()}
    parts["attention_latent"] += draft_layers * 2 * spec.hidden_size * spec.hidden_size  # replicated projections
    parts["norms"] += draft_layers * 3 * spec.hidden_size
    return parts


def _bytes(params: dict[str, int], spec: ModelSpec, fmt: WeightFormat, layout: Layout) -> float:
    return sum(count / shard_count(key, spec, layout) * fmt.bytes_per_param(key) for key, count in params.items())


def gpu_kv_cache(
    spec: ModelSpec, layout: Layout, kv_dtype: str, draft_layers: int = 0, fp4_indexer_cache: bool = False
) -> KVCacheLayout:
    """The KV cache of the pipeline stage that needs most per request (the last one holds the draft layers)."""
    stages = stage_layers(spec, layout.pp)
    caches = [
        kv_cache_layout(
            spec,
            kv_dtype,
            layers=layers,
            draft_layers=draft_layers if number == len(stages) - 1 else 0,
            fp4_indexer_cache=fp4_indexer_cache,
        )
        for number, layers in enumerate(stages)
    ]
    return max(caches, key=lambda cache: (cache.bytes_per_sequence(spec.max_position_embeddings), cache.block_bytes))


def kv_bytes_per_token_per_gpu(
    spec: ModelSpec, layout: Layout, kv_dtype: str, cache: KVCacheLayout | None = None
) -> tuple[int, str]:
    """Bytes one GPU holds per cached token. MLA's latent vector (and V4's compressed entries) have no head
    dimension to split, so every TP rank holds all of it; grouped-query attention splits its KV heads over TP
    ranks (replicating when TP > KV heads)."""
    cache = cache or gpu_kv_cache(spec, layout, kv_dtype)
    per_token = round(cache.bytes_per_token)
    if cache.replicated_over_tp:
        what = "compressed cache" if spec.attention_kind == "compressed_sparse" else "latent cache"
        return per_token, f"{what} replicated on every TP rank"
    split = min(layout.tp, spec.num_kv_heads)
    return per_token // split, f"KV heads split over {split} ranks"


def activation_reserve_bytes(spec: ModelSpec, fmt: WeightFormat, layout: Layout, max_num_batched_tokens: int) -> int:
    """Peak activations of the largest prefill chunk, plus CUDA graphs and non-torch memory.

    Per token: a few hidden-size vectors in 16-bit (V4's residual stream is hc_mult of them), the MoE intermediate
    of the top-k experts on this GPU, and the attention's per-head vectors of the chunk (MLA prefill decompresses
    the latent per head; V4 holds a 512-wide query and output per head)."""
    hidden = spec.hidden_size
    act = 2  # 16-bit activations, whatever the weight format
    streams = max(spec.hc_mult, 1)
    per_token = (LIVE_HIDDEN_VECTORS_PER_TOKEN + RESIDUAL_VECTORS_PER_TOKEN * (streams - 1)) * hidden * act
    if spec.is_moe:
        top_k = spec.num_experts_per_tok
        per_token += top_k * hidden * act  # fused-MoE output cache, one hidden vector per chosen expert
        per_token += top_k * 2 * spec.moe_intermediate_size // layout.tp * act
    heads = spec.num_attention_heads // layout.tp
    if spec.compress_ratios:
        per_token += heads * 2 * spec.head_dim * act
    else:
        per_token += heads * (spec.qk_nope_head_dim + spec.qk_rope_head_dim + spec.v_head_dim) * act
    activations = max_num_batched_tokens * per_token
    return activations + CUDA_GRAPH_RESERVE_BYTES + NON_TORCH_RESERVE_BYTES
