"""The performance model: step times from bytes and FLOPs per kind of work, continuous batching per concurrency.

One engine step on one GPU of the first pipeline stage, with b decode tokens and p prefill tokens, takes

    t_step = t_engine + sum over kinds [ floor + max(bytes / (BW * e_mem), FLOPs / (peak * e_compute)) ] + t_comm

The kinds are dense GEMMs, grouped MoE GEMMs, MLA decode attention and MLA prefill attention; their efficiencies
and floors come from public kernel measurements (data/kernels.json, plan/kernels.py). t_comm is TP all-reduces, EP
all-to-alls (or the all-gather and reduce-scatter of data-parallel attention with split experts) and the PP
hand-over, at NCCL's and DeepEP's measured bandwidths and latencies. t_engine is the engine's own cost per step
(data/engine_profiles.json, plan/profiles.py): small kernels per layer, each one launch in the engine's launch mode.
Prompt tokens' GEMM FLOPs run at the profile's prefill efficiency times the table's rates; prompt attention runs at
the table's own attention rate. With data-parallel attention, attention and the dense layers run per rank (the
busiest rank sets the step), the routed experts see every rank's tokens. Speculative decoding is plan/speculative.py's
SpeculativeModel: each decoding sequence verifies K + 1 tokens per step (`queries_per_sequence`), the draft module runs
K passes, and a step yields `tokens_per_step` tokens per sequence.
docs/PLANNING.md derives every term; this module is their only implementation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from deepserve.hardware.catalog import Accelerator, Link
from deepserve.models.spec import ModelSpec, dtype_bytes
from deepserve.plan.attention_cost import SPARSE_ATTENTION_KINDS, decode_step_cost, prefill_step_cost
from deepserve.plan.formats import WeightFormat, format_support
from deepserve.plan.kernels import KernelRates, KindRate
from deepserve.plan.layout import Layout, Links, stage_layers
from deepserve.plan.memory import shard_count
from deepserve.plan.profiles import SelectedFactors

ACTIVATION_BYTES = 2  # hidden states cross the links in 16-bit
DISPATCH_BYTES = 1  # DeepEP dispatches FP8 activations (its README's configuration), combines in BF16
ATTENTION_DTYPE = "bf16"  # attention kernels compute in 16-bit whatever the weights
MAX_PREFILL_UTILISATION = 0.95  # queueing formula's guard: prefill demand at or above capacity means unbounded waits
NVLINK_KINDS = frozenset({"nvlink3", "nvlink4", "nvlink5", "xgmi"})
# DeepSeek-V3's node-limited routing: a token's 8 experts lie in at most 4 of 8 groups, which deployments place on
# at most 4 nodes (DeepSeek-V3 technical report, arXiv 2412.19437, section 2.1.2: M = 4; config topk_group 4).
MAX_NODES_PER_TOKEN = 4


def expected_distinct_experts(experts: int, top_k: int, tokens: float) -> float:
    """E[distinct experts] a batch of TOKENS touches when each picks top_k of EXPERTS uniformly:
    E * (1 - (1 - k/E)^tokens)."""
    if experts == 0 or tokens <= 0:
        return 0.0
    return experts * (1 - (1 - top_k / experts) ** tokens)


def expected_max_poisson(mean: float, draws: int) -> float:
    """E[max of DRAWS independent Poisson(MEAN) counts]: how many prompts the busiest of DRAWS data-parallel ranks
    prefills in a step when the step's prompts land on ranks at random (= MEAN for one rank)."""
    if draws <= 1 or mean <= 0:
        return max(mean, 0.0)
    total, k, cdf, term = 0.0, 0, 0.0, math.exp(-mean)
    while k < 10_000:
        cdf += term
        tail = 1 - cdf**draws  # P(max > k)
        total += tail
        if tail < 1e-9:
            break
        k += 1
        term *= mean / k
    return total


@dataclass(frozen=True)
class WorkCost:
    """One kind of work in one step on one GPU, summed over the stage's layers."""

    kind: str
    memory_s: float
    compute_s: float
    floor_s: float = 0.0

    @property
    def time_s(self) -> float:
        return self.floor_s + max(self.memory_s, self.compute_s)

    @property
    def bound(self) -> str:
        if self.floor_s >= max(self.memory_s, self.compute_s):
            return "launch"
        return "memory" if self.memory_s >= self.compute_s else "compute"


@dataclass(frozen=True)
class StepCost:
    """One step of one stage on one GPU, in seconds, by kind of work."""

    overhead_s: float  # the engine's own time (small kernels' launches, CPU per step and per sequence)
    work: tuple[WorkCost, ...]
    comm: tuple[tuple[str, float], ...] = ()  # (all_reduce | all_to_all | all_gather | pipeline, seconds)
    overlap_comm: bool = False  # two micro-batches: one's communication runs while the other computes

    @property
    def comm_s(self) -> float:
        return sum(seconds for _, seconds in self.comm)

    @property
    def memory_s(self) -> float:
        return sum(w.memory_s for w in self.work)

    @property
    def compute_s(self) -> float:
        return sum(w.compute_s for w in self.work)

    @property
    def work_s(self) -> float:
        return sum(w.time_s for w in self.work)

    @property
    def hidden_comm_s(self) -> float:
        """Communication that runs under the other micro-batch's computation (two-batch overlap)."""
        return min(self.comm_s, self.work_s) if self.overlap_comm else 0.0

    @property
    def total_s(self) -> float:
        return self.overhead_s + self.work_s + self.comm_s - self.hidden_comm_s

    def kind(self, name: str) -> WorkCost:
        return next(w for w in self.work if w.kind == name)

    def breakdown_s(self) -> dict[str, float]:
        """Seconds by kind of work, communication and engine overhead; sums to total_s."""
        parts = {"engine_overhead": self.overhead_s}
        parts.update({w.kind: w.time_s for w in self.work})
        parts.update(dict(self.comm))
        if self.overlap_comm:
            parts["overlapped_comm"] = -self.hidden_comm_s
        return parts


@dataclass(frozen=True)
class RankLoad:
    """The busiest data-parallel rank's share of a step: its decoding sequences and prompt tokens. Attention, the
    dense layers and their communication run per rank; the step waits for the slowest rank."""

    decode_tokens: float
    prefill_tokens: float
    prefill_context: float = 0.0
    prefill_mean_position: float | None = None


@dataclass(frozen=True)
class RequestLengths:
    input_len: int
    output_len: int


@dataclass(frozen=True)
class Prediction:
    concurrency: int
    running: int  # requests in the running batch (the rest wait for a slot)
    output_throughput_tok_s: float
    tpot_ms: float
    ttft_ms: float
    e2el_ms: float

    def to_json(self) -> dict[str, float | int]:
        return {
            "concurrency": self.concurrency,
            "running": self.running,
            "output_throughput_tok_s": round(self.output_throughput_tok_s, 1),
            "tpot_ms": round(self.tpot_ms, 2),
            "ttft_ms": round(self.ttft_ms, 1),
            "e2el_ms": round(self.e2el_ms, 1),
        }


@dataclass(frozen=True)
class _StageShape:
    layers: int
    moe_layers: int
    layer_params: float  # non-expert parameters per GPU over the stage's layers
    head_params: float  # output head parameters per GPU
    static_bytes: float  # bytes every step reads whatever the batch
    gemm_calls: int  # non-expert GEMM launches over the stage's layers


@dataclass(frozen=True)
class StepOptions:
    """How the engine runs the step model's kinds of work beyond the kernels: two-batch overlap of communication
    (SGLang's --enable-two-batch-overlap, vLLM's --enable-dbo) and, where CUDA graphs are off (SGLang's
    --disable-cuda-graph, vLLM's --enforce-eager), the launch mode of every kernel of every step. Speculative decoding
    is a model of its own (plan/speculative.py: SpeculativeModel), not an option here."""

    overlap_comm: bool = False
    launch_mode: str | None = None  # a kernels.json launch_us mode for every step (None: the engine version's)
    # the MLA decode kernel where the engine is made to run a slower one than the class's best (kernels.json's
    # mla_decode entries; None: the best). vLLM with --block-size 1 on Blackwell runs Triton's, the only MLA
    # backend that accepts that block size.
    mla_decode_backend: str | None = None
    # the dense GEMM kernel where the engine is made to run a slower one (kernels.json's "<family>_<backend>" dense
    # entries; None: the best). SGLang with SGL_ENABLE_JIT_DEEPGEMM=0 runs its Triton FP8 block-scaled GEMM.
    dense_gemm_backend: str | None = None


class PerformanceModel:
    """Step times and per-concurrency predictions for one model on one layout of one device, one engine."""

    def __init__(
        self,
        spec: ModelSpec,
        fmt: WeightFormat,
        layout: Layout,
        accelerator: Accelerator,
        links: Links,
        rates: KernelRates,
        engine: SelectedFactors,
        kv_dtype: str,
        options: StepOptions | None = None,
    ) -> None:
        self.spec = spec
        self.fmt = fmt
        self.layout = layout
        self.accelerator = accelerator
        self.links = links
        self.rates = rates
        self.engine = engine
        self.kv_dtype = kv_dtype
        self.options = options or StepOptions()
        self._shape = _stage_shape(spec, fmt, layout)
        facts = engine.facts
        self.launch_mode = self.options.launch_mode or facts.step_launch(rates.family)
        self.prefill_launch_mode = self.options.launch_mode or facts.prefill_launch or self.launch_mode
        self.per_expert_moe = facts.moe_per_expert.get(rates.family)
        self.mixed_prefill = facts.mixed_prefill
        self.version_step_s = facts.step_overhead_ms * 1e-3
        # FP4 experts compute natively on Blackwell (NVFP4 at the FP4 rate, MXFP4 x MXFP8 at FP8's) and weight-only
        # elsewhere (Hopper's Marlin: 4-bit weights dequantized in a 16-bit GEMM): plan/formats.format_support
        self.expert_dtype = format_support(fmt, accelerator).expert_compute_dtype

    @property
    def factors(self) -> SelectedFactors:
        return self.engine

    # ---- one step ---------------------------------------------------------------------------------------------

    def step(
        self,
        decode_tokens: float,
        prefill_tokens: float,
        context_len: float,
        prefill_context: float = 0.0,
        prefill_mean_position: float | None = None,
        rank: RankLoad | None = None,
        queries_per_sequence: float = 1.0,
    ) -> StepCost:
        """One step of the first stage: DECODE_TOKENS sequences at CONTEXT_LEN, plus PREFILL_TOKENS of prompt
        (a chunk whose sequence already has PREFILL_CONTEXT tokens cached), counted over the whole stage (all
        data-parallel ranks together). A step that prefills several prompts gives PREFILL_MEAN_POSITION, the mean
        over its prompt tokens of the positions each attends to: attention is per sequence, so several short
        prompts cost far less than one prompt of their summed length. RANK is the busiest data-parallel rank's
        share (default: the step spread evenly over the ranks). QUERIES_PER_SEQUENCE: tokens each decoding
        sequence computes (speculative decoding verifies K drafts and the last token: K+1, plan/speculative.py);
        they share one read of the weights and of the sequence's cache."""
        rank = rank or self.balanced(decode_tokens, prefill_tokens, prefill_context, prefill_mean_position)
        verify = queries_per_sequence if decode_tokens else 1.0
        work = (
            self._dense(rank.decode_tokens * verify, rank.prefill_tokens),
            self._moe(decode_tokens * verify, prefill_tokens),
            self._decode_attention(rank.decode_tokens, context_len, verify),
            self._prefill_attention(rank.prefill_tokens, rank.prefill_context, rank.prefill_mean_position),
        )
        return StepCost(
            self._overhead_s(rank.decode_tokens, rank.prefill_tokens),
            work,
            self._comm(
                decode_tokens * verify + prefill_tokens,
                rank.decode_tokens * verify + rank.prefill_tokens,
                rank.prefill_tokens,
            ),
            overlap_comm=self.options.overlap_comm,
        )

    @property
    def tokens_per_step(self) -> float:
        """Output tokens a decoding sequence gains per step: 1 here; more with speculative decoding
        (plan/speculative.py's SpeculativeModel)."""
        return 1.0

    def balanced(
        self, decode_tokens: float, prefill_tokens: float, prefill_context: float = 0.0, mean: float | None = None
    ) -> RankLoad:
        dp = self.layout.dp
        return RankLoad(decode_tokens / dp, prefill_tokens / dp, prefill_context, mean)

    def _launch_s(self, mode: str | None = None) -> float:
        mode = mode or self.launch_mode
        if mode == "cpu_eager":  # operator dispatch on a CPU is part of the CPU profile's fitted step overhead
            return 0.0
        return self.rates.launch_us[mode] * 1e-6

    def _step_launch_s(self, prefill_tokens: float) -> float:
        """A step with prompt tokens runs in the engine's prefill launch mode (outside CUDA graphs where the engine
        captures decode batches only)."""
        return self._launch_s(self.prefill_launch_mode if prefill_tokens else self.launch_mode)

    def _overhead_s(self, decode_tokens: float, prefill_tokens: float) -> float:
        """The engine's own time: small kernels per layer, CPU time per step and per sequence of the busiest rank
        (each data-parallel rank runs its own scheduler)."""
        p = self.engine.parameters
        sequences = decode_tokens + (1 if prefill_tokens else 0)
        small_kernels = self._shape.layers * p.kernels_per_layer * self._step_launch_s(prefill_tokens)
        fixed_s = p.step_overhead_ms * 1e-3 + self.version_step_s
        return fixed_s + small_kernels + p.per_sequence_us * 1e-6 * sequences

    def _compute_s(self, decode_flops: float, prefill_flops: float, rate: KindRate, dtype: str) -> float:
        peak = self.accelerator.peak_tflops(dtype) * 1e12 * rate.compute_efficiency
        return (decode_flops + prefill_flops / self.engine.parameters.prefill_efficiency) / peak

    def _memory_s(self, nbytes: float, rate: KindRate) -> float:
        return nbytes / (self.accelerator.memory_bandwidth_gb_s * 1e9 * rate.memory_efficiency)

    def _dense(self, decode_tokens: float, prefill_tokens: float) -> WorkCost:
        """Every non-expert linear layer reads its weights once per step; the output head runs for the sampled
        tokens (every decode token, one per prompt). Tokens are this rank's."""
        shape = self._shape
        rate = self.rates.rate("dense_gemm")
        decode = 2 * decode_tokens * (shape.layer_params + shape.head_params)
        prefill = 2 * prefill_tokens * shape.layer_params + (2 * shape.head_params if prefill_tokens else 0)
        tokens = decode_tokens + prefill_tokens
        return WorkCost(
            "dense_gemm",
            self._memory_s(shape.static_bytes, rate),
            self._compute_s(decode, prefill, rate, self.fmt.compute_dtype),
            shape.gemm_calls * self._step_launch_s(prefill_tokens) if tokens else 0.0,
        )

    def _moe(self, decode_tokens: float, prefill_tokens: float) -> WorkCost:
        """The routed experts see every rank's tokens; each GPU holds 1/S of them (whole experts under EP, a slice
        of every expert otherwise) and reads the touched ones."""
        spec, layout, shape = self.spec, self.layout, self._shape
        tokens = decode_tokens + prefill_tokens
        if not shape.moe_layers or not tokens:
            return WorkCost("moe_gemm", 0.0, 0.0)
        rate = self.rates.rate("moe_gemm")
        touched = expected_distinct_experts(spec.n_routed_experts, spec.num_experts_per_tok, tokens)
        per_expert = spec.expert_params / layout.expert_shards
        nbytes = shape.moe_layers * touched * per_expert * self.fmt.bytes_per_param("routed_experts")
        flops_per_token = 2 * spec.num_experts_per_tok * per_expert * shape.moe_layers
        compute = self._compute_s(
            flops_per_token * decode_tokens, flops_per_token * prefill_tokens, rate, self.expert_dtype
        )
        return WorkCost("moe_gemm", self._memory_s(nbytes, rate), compute, self._moe_floor_s(touched))

    def _moe_floor_s(self, touched: float) -> float:
        layout, moe_layers = self.layout, self._shape.moe_layers
        if self.per_expert_moe is None:
            return moe_layers * self.rates.rate("moe_gemm").floor_us * 1e-6
        experts_here = touched / layout.dp if layout.ep else touched
        launches = moe_layers * experts_here * self.per_expert_moe.launches_per_expert  # from the host, one by one
        return launches * self._launch_s(self.per_expert_moe.launch)

    def _decode_attention(
        self, decode_tokens: float, context_len: float, queries_per_sequence: float = 1.0
    ) -> WorkCost:
        """Each of this rank's DECODE_TOKENS sequences reads its cache on every layer of the stage; under TP every
        rank reads the whole MLA latent (it is replicated). Several query tokens of one sequence (speculative
        verification) read its cache once and each compute their scores."""
        spec, layout, layers = self.spec, self.layout, self._shape.layers
        if not decode_tokens:
            return WorkCost("mla_decode", 0.0, 0.0)
        rate = self.rates.rate("mla_decode")
        if spec.attention_kind in SPARSE_ATTENTION_KINDS:  # V3.2 / V4: attended and indexed entries, not ctx
            stage = stage_layers(spec, layout.pp)[0]
            cost = decode_step_cost(
                spec, stage, self.kv_dtype, layout.tp, decode_tokens, context_len, queries_per_sequence
            )
            compute = self._compute_s(cost.flops, 0.0, rate, ATTENTION_DTYPE)
            return WorkCost("mla_decode", self._memory_s(cost.bytes, rate), compute, layers * self._launch_s())
        per_layer = float(spec.kv_values_per_token_per_layer * dtype_bytes(self.kv_dtype))
        heads = spec.num_attention_heads / layout.tp
        if spec.is_mla:
            kv_lora = spec.kv_lora_rank or 0
            flops_per_position = 2 * heads * (kv_lora + spec.qk_rope_head_dim + kv_lora)  # absorbed: scores + values
        else:
            per_layer /= min(layout.tp, spec.num_kv_heads)
            flops_per_position = 4 * heads * spec.head_dim
        nbytes = decode_tokens * context_len * per_layer * layers
        flops = decode_tokens * queries_per_sequence * context_len * flops_per_position * layers
        return WorkCost(
            "mla_decode",
            self._memory_s(nbytes, rate),
            self._compute_s(flops, 0.0, rate, rate.compute_dtype or ATTENTION_DTYPE),
            layers * (rate.floor_us * 1e-6 + self._launch_s()),
        )

    def _prefill_attention(
        self, prefill_tokens: float, prefill_context: float, mean_position: float | None = None
    ) -> WorkCost:
        """Prompt tokens attend to the cached context and, causally, to each other: MLA's prefill runs in the
        decompressed form, (qk_nope + qk_rope) + v_head per head and position, at the attention kernel's own
        rate (not the engine's prefill efficiency, which is the GEMM path's)."""
        spec, layout, layers = self.spec, self.layout, self._shape.layers
        if not prefill_tokens:
            return WorkCost("mla_prefill", 0.0, 0.0)
        rate = self.rates.rate("mla_prefill")
        if spec.attention_kind in SPARSE_ATTENTION_KINDS:  # V3.2 / V4: top-k and compressed entries, the indexer
            stage = stage_layers(spec, layout.pp)[0]
            cost = prefill_step_cost(
                spec, stage, self.kv_dtype, layout.tp, prefill_tokens, prefill_context, mean_position
            )
            compute = self._compute_s(0.0, cost.flops, rate, ATTENTION_DTYPE)
            return WorkCost("mla_prefill", self._memory_s(cost.bytes, rate), compute, layers * self._launch_s())
        heads = spec.num_attention_heads / layout.tp
        if spec.is_mla:
            per_position = 2 * heads * (spec.qk_nope_head_dim + spec.qk_rope_head_dim + spec.v_head_dim)
        else:
            per_position = 4 * heads * spec.head_dim
        positions = prefill_context + prefill_tokens / 2 if mean_position is None else mean_position
        flops = prefill_tokens * positions * per_position * layers
        cached = prefill_context * spec.kv_values_per_token_per_layer * dtype_bytes(self.kv_dtype) * layers
        peak = self.accelerator.peak_tflops(ATTENTION_DTYPE) * 1e12 * rate.compute_efficiency
        return WorkCost(
            "mla_prefill",
            self._memory_s(cached, rate),
            flops / peak,
            layers * (rate.floor_us * 1e-6 + self._step_launch_s(prefill_tokens)),
        )

    def _comm(self, tokens: float, rank_tokens: float, rank_prefill: float = 0.0) -> tuple[tuple[str, float], ...]:
        """TP: two all-reduces per layer of this rank's tokens; the routed experts' exchange per MoE layer (an
        all-to-all dispatch and combine under EP, an all-gather and reduce-scatter of every rank's tokens when
        data-parallel attention feeds split experts); PP: one activation transfer to the next stage."""
        layout, hidden = self.layout, self.spec.hidden_size
        parts: list[tuple[str, float]] = []
        if layout.tp > 1 and rank_tokens:
            message = rank_tokens * hidden * ACTIVATION_BYTES
            parts.append(("all_reduce", 2 * self._shape.layers * self._all_reduce_s(message, layout.tp)))
        if layout.expert_shards > layout.tp and tokens and self._shape.moe_layers:
            parts.append(self._expert_exchange(tokens, rank_tokens, rank_prefill))
        if layout.pp > 1 and tokens:
            message = rank_tokens * hidden * ACTIVATION_BYTES
            parts.append(("pipeline", _transfer_s(message, self.links.pipeline, self.rates.network_efficiency)))
        return tuple(parts)

    def _all_reduce_s(self, message_bytes: float, ranks: int) -> float:
        """NCCL's all-reduce; inside one node, the engine's own kernel where that is faster: vLLM, SGLang and
        TensorRT-LLM dispatch small messages (a decode step's) to it (kernels.json, collectives.custom_all_reduce)."""
        link = self.links.tensor
        two_node_us = self.engine.parameters.cross_node_latency_us
        latency_s = self.rates.all_reduce_latency_us(link, self.links.tensor_nodes, two_node_us) * 1e-6
        nccl_s = latency_s + 2 * (ranks - 1) / ranks * message_bytes / (self._all_reduce_bus_gb_s(ranks) * 1e9)
        custom_s = self.rates.custom_all_reduce_s(link, ranks, message_bytes) if self.links.tensor_nodes <= 1 else None
        return nccl_s if custom_s is None else min(nccl_s, custom_s)

    def _all_reduce_bus_gb_s(self, ranks: int) -> float:
        """Bus bandwidth (NCCL's convention) of the TP group's all-reduce. Over N nodes of g GPUs the collective is
        hierarchical: inside each node over its fabric, across nodes each GPU sends 2 (N-1)/N of its 1/g share over
        its own NIC; the slower of the two sets the bus bandwidth (NCCL's tuning model takes the intra-node speed
        for two nodes)."""
        links, rates = self.links, self.rates
        nodes = links.tensor_nodes
        if nodes <= 1 or links.node_link is None:
            return rates.all_reduce_bus_gb_s(links.tensor)
        per_node = ranks / nodes
        nic = links.tensor.bandwidth_gb_s * rates.network_efficiency
        across = nic * per_node * nodes / (nodes - 1) * (ranks - 1) / ranks
        return min(rates.all_reduce_bus_gb_s(links.node_link), across)

    def _expert_exchange(self, tokens: float, rank_tokens: float, rank_prefill: float) -> tuple[str, float]:
        """Each rank sends its tokens to the experts and gets their outputs back, per MoE layer: under EP an
        all-to-all (DeepEP: FP8 dispatch, BF16 combine), otherwise every rank's tokens gathered to every GPU and
        the outputs reduce-scattered back."""
        layout, spec, link = self.layout, self.spec, self.links.experts
        efficiency = self.rates.all_to_all_efficiency if link.kind in NVLINK_KINDS else self.rates.network_efficiency
        layers = self._shape.moe_layers
        if not layout.ep:
            remote = (layout.expert_shards - 1) / layout.expert_shards
            gathered = tokens * spec.hidden_size * ACTIVATION_BYTES * remote  # every rank's tokens, to every GPU
            return "all_gather", 2 * layers * _transfer_s(gathered, link, efficiency)
        copies = self._remote_copies(rank_tokens - rank_prefill, rank_prefill) * spec.hidden_size
        dispatch = _transfer_s(copies * DISPATCH_BYTES, link, efficiency)
        combine = _transfer_s(copies * ACTIVATION_BYTES, link, efficiency)
        return "all_to_all", layers * (dispatch + combine)

    def _remote_copies(self, decode_tokens: float, prefill_tokens: float) -> float:
        """Token copies a rank sends off its GPU per MoE layer. Decode (DeepEP's low-latency kernels) sends one
        copy per chosen expert on another GPU; prefill (its normal kernels) sends a token once to each other node
        holding one of its experts and forwards it inside the node over NVLink, and DeepSeek routes a token to at
        most MAX_NODES_PER_TOKEN nodes, so across nodes the network carries those copies."""
        layout, spec = self.layout, self.spec
        k, shards = spec.num_experts_per_tok, layout.expert_shards
        per_decode = k * (shards - 1) / shards
        nodes = self.links.expert_nodes
        if nodes <= 1:
            return (decode_tokens + prefill_tokens) * per_decode
        touched_nodes = min(nodes * (1 - (1 - 1 / nodes) ** k), MAX_NODES_PER_TOKEN)
        return decode_tokens * per_decode + prefill_tokens * touched_nodes * (nodes - 1) / nodes

    # ---- continuous batching ----------------------------------------------------------------------------------

    def predict(self, concurrency: int, workload: RequestLengths, running_cap: int) -> Prediction:
        """Closed loop of CONCURRENCY clients, each sending the next request when the last one ends; the engine
        runs at most RUNNING_CAP of them (KV cache, max_num_seqs), the rest queue. See `closed_loop`."""
        return closed_loop(self, concurrency, workload, running_cap)

    @property
    def request_overhead_s(self) -> float:
        return self.engine.parameters.request_overhead_ms * 1e-3


@dataclass(frozen=True)
class _Cycle:
    """The average engine step a request sees while it decodes, and what one other prompt adds to it."""

    micro: float  # sequences per pipeline micro-batch
    decode_s: float  # a step of decodes only
    prompt_extra_s: float  # one prompt's cost to the step it joins (or its own step, where prefill is not mixed)
    prompts_per_step: float  # other requests' prompts arriving per step of one micro-batch
    busiest_prompts: float  # prompts the busiest data-parallel rank prefills per step
    stage_s: float  # the average step


def closed_loop(model: PerformanceModel, concurrency: int, workload: RequestLengths, running_cap: int) -> Prediction:
    """Pipeline parallelism keeps pp micro-batches in flight; a token of one micro-batch passes every stage, so the
    token interval is pp stage steps. Other requests' prompts are prefilled inside the decode steps (one per
    finished request), or in steps of their own where the engine does not mix them, which is where TPOT grows
    with concurrency beyond the weight reads. With data-parallel attention each prompt runs on one rank, and
    prompts on different ranks run in the same step."""
    pp = model.layout.pp
    running = max(1, min(concurrency, running_cap))
    cycle = _cycle(model, running, workload)
    tokens_per_step = model.tokens_per_step
    tpot_s = pp * cycle.stage_s / tokens_per_step
    ttft_s = model.request_overhead_s + _prefill_wait_s(cycle, model.layout.dp)
    ttft_s += pp * _solo_prefill_s(model, cycle, workload)
    out = workload.output_len
    e2e_s = ttft_s + (out - 1) * tpot_s
    slot_wait = max(concurrency - running, 0) / running * e2e_s
    return Prediction(
        concurrency=concurrency,
        running=running,
        output_throughput_tok_s=running * out / e2e_s,
        tpot_ms=tpot_s * 1e3,
        ttft_ms=(ttft_s + slot_wait) * 1e3,
        e2el_ms=(e2e_s + slot_wait) * 1e3,
    )


def _cycle(model: PerformanceModel, running: int, workload: RequestLengths) -> _Cycle:
    pp, dp = model.layout.pp, model.layout.dp
    micro = running / pp if running >= pp else 1.0
    inp, out = workload.input_len, workload.output_len
    context = inp + out / 2
    tokens_per_step = model.tokens_per_step
    decode = model.step(micro, 0, context).total_s
    extra = _prompt_extra_s(model, micro, inp, context)
    prompts = (micro - 1) / max((out - 1) / tokens_per_step, 1)  # other requests' prompts arriving during my steps
    busiest = expected_max_poisson(prompts / dp, dp) if dp > 1 else prompts
    return _Cycle(micro, decode, extra, prompts, busiest, decode + busiest * extra)


def _prompt_extra_s(model: PerformanceModel, micro: float, inp: int, context: float) -> float:
    """What one prompt of INP tokens adds to a step of MICRO decodes: the difference it makes to the step it joins
    (on one data-parallel rank), or a prefill step of its own where the engine does not mix them."""
    dp = model.layout.dp
    one_prompt = RankLoad(micro / dp, inp)
    if not model.mixed_prefill:
        return model.step(0, inp, 0, rank=RankLoad(0, inp)).total_s
    with_prompt = model.step(micro, inp, context, rank=one_prompt).total_s
    return max(with_prompt - model.step(micro, 0, context).total_s, 0.0)


def _prefill_wait_s(cycle: _Cycle, ranks: int) -> float:
    """Waiting for the step in flight, and (M/D/1 on my rank, which gets 1/RANKS of the prompts) for the prompts
    queued ahead of mine."""
    if cycle.micro <= 1:
        return 0.0
    busy = min(cycle.prompts_per_step / ranks * cycle.prompt_extra_s / cycle.stage_s, MAX_PREFILL_UTILISATION)
    return busy / (2 * (1 - busy)) * cycle.prompt_extra_s + 0.5 * cycle.stage_s * (cycle.micro - 1) / cycle.micro


def _solo_prefill_s(model: PerformanceModel, cycle: _Cycle, workload: RequestLengths) -> float:
    """The step that carries my prompt: with the others' decodes where the engine mixes them, alone otherwise."""
    inp = workload.input_len
    others = cycle.micro - 1
    if others <= 0 or not model.mixed_prefill:
        return model.step(0, inp, inp / 2, rank=RankLoad(0, inp)).total_s
    context = inp + workload.output_len / 2
    return model.step(others, inp, context, rank=RankLoad(others / model.layout.dp, inp)).total_s


@lru_cache(maxsize=256)
def _stage_shape(spec: ModelSpec, fmt: WeightFormat, layout: Layout) -> _StageShape:
    """For one GPU of the first stage: its layers and MoE layers, its non-expert layer parameters, its output-head
    parameters, the bytes every step reads there whatever the batch (everything but the routed experts, plus the
    output head), and its non-expert GEMM launches."""
    stage = stage_layers(spec, layout.pp)[0]
    moe_layers, params, total, calls = 0, 0.0, 0.0, 0
    for index in stage:
        parts = spec.layer_parameter_breakdown(index)
        for key, count in parts.items():
            if key == "routed_experts":
                continue
            share = count / shard_count(key, spec, layout)
            params += share
            total += share * fmt.bytes_per_param(key)
        moe_layers += 1 if parts.get("routed_experts") else 0
        calls += _gemm_calls(spec, parts)
    head = spec.parameter_breakdown()["lm_head"] / layout.tp
    return _StageShape(
        layers=len(stage),
        moe_layers=moe_layers,
        layer_params=params,
        head_params=head,
        static_bytes=total + head * fmt.bytes_per_param("lm_head"),
        gemm_calls=calls + 1,  # the output head
    )


def _gemm_calls(spec: ModelSpec, parts: dict[str, int]) -> int:
    """Non-expert GEMM launches of one layer as vLLM runs DeepSeek: MLA's fused q_a/kv_a projection, q_b, the
    absorbed key and value products and o_proj (a GQA layer: qkv and o); gate_up and down of a dense MLP or a
    shared expert; the router."""
    attention = 5 if spec.is_mla else 2
    mlp = 2 if parts.get("dense_mlp") else 0
    shared = 2 if parts.get("shared_experts") else 0
    router = 1 if parts.get("router") else 0
    return attention + mlp + shared + router


def _transfer_s(message_bytes: float, link: Link, efficiency: float) -> float:
    return link.collective_latency_us * 1e-6 + message_bytes / (link.bandwidth_gb_s * 1e9 * efficiency)
