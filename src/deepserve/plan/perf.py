"""The performance model: step times from bytes and FLOPs per kind of work, continuous batching per concurrency.

One engine step on one GPU of the first pipeline stage, with b decode tokens and p prefill tokens, takes

    t_step = t_engine + sum over kinds [ floor + max(bytes / (BW * e_mem), FLOPs / (peak * e_compute)) ] + t_comm

The kinds are dense GEMMs, grouped MoE GEMMs, MLA decode attention and MLA prefill attention; their efficiencies
and floors come from public kernel measurements (data/kernels.json, plan/kernels.py). t_comm is TP all-reduces, EP
all-to-alls and the PP hand-over, at NCCL's measured bus bandwidths. t_engine is the engine's own cost per step
(data/engine_profiles.json, plan/profiles.py): small kernels per layer, each one launch in the engine's launch mode,
plus CPU time per step and per sequence. The prompt tokens' FLOPs run at the profile's prefill efficiency times
the table's rates. docs/PLANNING.md derives every term; this module is their only implementation.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from deepserve.hardware.catalog import Accelerator, Link
from deepserve.models.spec import ModelSpec, dtype_bytes
from deepserve.plan.attention_cost import SPARSE_ATTENTION_KINDS, decode_step_cost, prefill_step_cost
from deepserve.plan.formats import WeightFormat
from deepserve.plan.kernels import KernelRates, KindRate
from deepserve.plan.layout import Layout, Links, stage_layers
from deepserve.plan.memory import shard_count
from deepserve.plan.profiles import SelectedFactors

ACTIVATION_BYTES = 2  # hidden states cross the links in 16-bit
ATTENTION_DTYPE = "bf16"  # attention kernels compute in 16-bit whatever the weights
MAX_PREFILL_UTILISATION = 0.95  # queueing formula's guard: prefill demand at or above capacity means unbounded waits
NVLINK_KINDS = frozenset({"nvlink3", "nvlink4", "nvlink5", "xgmi"})


def expected_distinct_experts(experts: int, top_k: int, tokens: float) -> float:
    """E[distinct experts] a batch of TOKENS touches when each picks top_k of EXPERTS uniformly:
    E * (1 - (1 - k/E)^tokens)."""
    if experts == 0 or tokens <= 0:
        return 0.0
    return experts * (1 - (1 - top_k / experts) ** tokens)


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
    comm: tuple[tuple[str, float], ...] = ()  # (all_reduce | all_to_all | pipeline, seconds)

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
    def total_s(self) -> float:
        return self.overhead_s + sum(w.time_s for w in self.work) + self.comm_s

    def kind(self, name: str) -> WorkCost:
        return next(w for w in self.work if w.kind == name)

    def breakdown_s(self) -> dict[str, float]:
        """Seconds by kind of work, communication and engine overhead; sums to total_s."""
        parts = {"engine_overhead": self.overhead_s}
        parts.update({w.kind: w.time_s for w in self.work})
        parts.update(dict(self.comm))
        return parts


@dataclass(frozen=True)
class Workload:
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
    ) -> None:
        self.spec = spec
        self.fmt = fmt
        self.layout = layout
        self.accelerator = accelerator
        self.links = links
        self.rates = rates
        self.engine = engine
        self.kv_dtype = kv_dtype
        self._shape = _stage_shape(spec, fmt, layout)
        facts = engine.facts
        self.launch_mode = facts.step_launch(rates.family)
        self.per_expert_moe = facts.moe_per_expert.get(rates.family)

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
        queries_per_sequence: float = 1.0,
    ) -> StepCost:
        """One step of the first stage: DECODE_TOKENS sequences at CONTEXT_LEN, plus PREFILL_TOKENS of prompt
        (a chunk whose sequence already has PREFILL_CONTEXT tokens cached), counted over the whole stage (all
        data-parallel ranks together). A step that prefills several prompts gives PREFILL_MEAN_POSITION, the mean
        over its prompt tokens of the positions each attends to: attention is per sequence, so several short
        prompts cost far less than one prompt of their summed length. QUERIES_PER_SEQUENCE: tokens each decoding
        sequence computes (speculative decoding verifies K drafts and the last token: K+1, plan/speculative.py);
        they share one read of the weights and of the sequence's cache."""
        queries = decode_tokens * queries_per_sequence
        work = (
            self._dense(queries, prefill_tokens),
            self._moe(queries, prefill_tokens),
            self._decode_attention(decode_tokens, context_len, queries_per_sequence),
            self._prefill_attention(prefill_tokens, prefill_context, prefill_mean_position),
        )
        return StepCost(self._overhead_s(decode_tokens, prefill_tokens), work, self._comm(queries + prefill_tokens))

    @property
    def tokens_per_step(self) -> float:
        """Output tokens a decoding sequence gains per step: 1 here; more with speculative decoding."""
        return 1.0

    def _launch_s(self, mode: str | None = None) -> float:
        mode = mode or self.launch_mode
        if mode == "cpu_eager":  # operator dispatch on a CPU is part of the CPU profile's fitted step overhead
            return 0.0
        return self.rates.launch_us[mode] * 1e-6

    def _overhead_s(self, decode_tokens: float, prefill_tokens: float) -> float:
        p = self.engine.parameters
        sequences = decode_tokens + (1 if prefill_tokens else 0)
        small_kernels = self._shape.layers * p.kernels_per_layer * self._launch_s()
        return p.step_overhead_ms * 1e-3 + small_kernels + p.per_sequence_us * 1e-6 * sequences

    def _compute_s(self, decode_flops: float, prefill_flops: float, rate: KindRate, dtype: str) -> float:
        peak = self.accelerator.peak_tflops(dtype) * 1e12 * rate.compute_efficiency
        return (decode_flops + prefill_flops / self.engine.parameters.prefill_efficiency) / peak

    def _memory_s(self, nbytes: float, rate: KindRate) -> float:
        return nbytes / (self.accelerator.memory_bandwidth_gb_s * 1e9 * rate.memory_efficiency)

    def _dense(self, decode_tokens: float, prefill_tokens: float) -> WorkCost:
        """Every non-expert linear layer reads its weights once per step; the output head runs for the sampled
        tokens (every decode token, one per prompt)."""
        shape, dp = self._shape, self.layout.dp
        rate = self.rates.rate("dense_gemm")
        decode = 2 * decode_tokens / dp * (shape.layer_params + shape.head_params)
        prefill = 2 * prefill_tokens / dp * shape.layer_params + (2 * shape.head_params / dp if prefill_tokens else 0)
        return WorkCost(
            "dense_gemm",
            self._memory_s(shape.static_bytes, rate),
            self._compute_s(decode, prefill, rate, self.fmt.compute_dtype),
            shape.gemm_calls * self._launch_s() if decode_tokens + prefill_tokens else 0.0,
        )

    def _moe(self, decode_tokens: float, prefill_tokens: float) -> WorkCost:
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
            flops_per_token * decode_tokens, flops_per_token * prefill_tokens, rate, self.fmt.compute_dtype
        )
        if self.per_expert_moe is not None:  # one launch per touched expert and GEMM, from the host
            experts_here = touched / layout.dp if layout.ep else touched
            launches = shape.moe_layers * experts_here * self.per_expert_moe.launches_per_expert
            floor = launches * self._launch_s(self.per_expert_moe.launch)
        else:
            floor = shape.moe_layers * rate.floor_us * 1e-6
        return WorkCost("moe_gemm", self._memory_s(nbytes, rate), compute, floor)

    def _decode_attention(
        self, decode_tokens: float, context_len: float, queries_per_sequence: float = 1.0
    ) -> WorkCost:
        """Each decode token reads its sequence's cache on every layer of the stage; under TP every rank reads the
        whole MLA latent (it is replicated), under DP attention a rank reads only its own sequences. Several query
        tokens of one sequence (verification) read its cache once and each compute their scores."""
        spec, layout, layers = self.spec, self.layout, self._shape.layers
        if not decode_tokens:
            return WorkCost("mla_decode", 0.0, 0.0)
        rate = self.rates.rate("mla_decode")
        if spec.attention_kind in SPARSE_ATTENTION_KINDS:  # V3.2 / V4: attended and indexed entries, not ctx
            stage = stage_layers(spec, layout.pp)[0]
            cost = decode_step_cost(spec, stage, self.kv_dtype, layout.tp, layout.dp, decode_tokens, context_len)
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
        sequences = decode_tokens / layout.dp
        nbytes = sequences * context_len * per_layer * layers
        flops = sequences * queries_per_sequence * context_len * flops_per_position * layers
        return WorkCost(
            "mla_decode",
            self._memory_s(nbytes, rate),
            self._compute_s(flops, 0.0, rate, ATTENTION_DTYPE),
            layers * self._launch_s(),
        )

    def _prefill_attention(
        self, prefill_tokens: float, prefill_context: float, mean_position: float | None = None
    ) -> WorkCost:
        """Prompt tokens attend to the cached context and, causally, to each other: MLA's prefill runs in the
        decompressed form, (qk_nope + qk_rope) + v_head per head and position."""
        spec, layout, layers = self.spec, self.layout, self._shape.layers
        if not prefill_tokens:
            return WorkCost("mla_prefill", 0.0, 0.0)
        rate = self.rates.rate("mla_prefill")
        if spec.attention_kind in SPARSE_ATTENTION_KINDS:  # V3.2 / V4: top-k and compressed entries, the indexer
            stage = stage_layers(spec, layout.pp)[0]
            cost = prefill_step_cost(
                spec, stage, self.kv_dtype, layout.tp, layout.dp, prefill_tokens, prefill_context, mean_position
            )
            compute = self._compute_s(0.0, cost.flops, rate, ATTENTION_DTYPE)
            return WorkCost("mla_prefill", self._memory_s(cost.bytes, rate), compute, layers * self._launch_s())
        heads = spec.num_attention_heads / layout.tp
        if spec.is_mla:
            per_position = 2 * heads * (spec.qk_nope_head_dim + spec.qk_rope_head_dim + spec.v_head_dim)
        else:
            per_position = 4 * heads * spec.head_dim
        positions = prefill_context + prefill_tokens / 2 if mean_position is None else mean_position
        flops = prefill_tokens / layout.dp * positions * per_position * layers
        cached = prefill_context * spec.kv_values_per_token_per_layer * dtype_bytes(self.kv_dtype) * layers
        return WorkCost(
            "mla_prefill",
            self._memory_s(cached, rate),
            self._compute_s(0.0, flops, rate, ATTENTION_DTYPE),
            layers * self._launch_s(),
        )

    def _comm(self, tokens: float) -> tuple[tuple[str, float], ...]:
        """TP: two all-reduces per layer (after attention and after the MLP/MoE); EP: a dispatch and a combine
        all-to-all per MoE layer; PP: one activation transfer to the next stage."""
        spec, layout = self.spec, self.layout
        message = tokens / layout.dp * spec.hidden_size * ACTIVATION_BYTES
        parts: list[tuple[str, float]] = []
        if layout.tp > 1 and tokens:
            per = _all_reduce_s(
                message, layout.tp, self.links.tensor, self.rates.all_reduce_bus_gb_s(self.links.tensor)
            )
            parts.append(("all_reduce", 2 * self._shape.layers * per))
        if layout.ep and layout.expert_shards > 1 and tokens:
            shards = layout.expert_shards
            volume = message * spec.num_experts_per_tok * (shards - 1) / shards
            link = self.links.tensor
            efficiency = (
                self.rates.all_to_all_efficiency if link.kind in NVLINK_KINDS else self.rates.network_efficiency
            )
            parts.append(("all_to_all", 2 * self._shape.moe_layers * _transfer_s(volume, link, efficiency)))
        if layout.pp > 1 and tokens:
            parts.append(("pipeline", _transfer_s(message, self.links.pipeline, self.rates.network_efficiency)))
        return tuple(parts)

    # ---- continuous batching ----------------------------------------------------------------------------------

    def predict(self, concurrency: int, workload: Workload, running_cap: int) -> Prediction:
        """Closed loop of CONCURRENCY clients, each sending the next request when the last one ends; the engine
        runs at most RUNNING_CAP of them (KV cache, or max_num_seqs per micro-batch), the rest queue.

        Pipeline parallelism keeps pp micro-batches in flight; a token of one micro-batch passes every stage, so
        the token interval is pp stage steps. Other requests' prompts are prefilled inside the decode steps (one
        per finished request), which is where TPOT grows with concurrency beyond the weight reads."""
        pp = self.layout.pp
        running = max(1, min(concurrency, running_cap))
        micro = running / pp if running >= pp else 1.0
        inp, out = workload.input_len, workload.output_len
        context = inp + out / 2
        decode = self.step(micro, 0, context).total_s
        with_prompt = self.step(micro, inp, context).total_s
        prompt_extra = max(with_prompt - decode, 0.0)
        decode_steps = max(out - 1, 1) / self.tokens_per_step  # a request's steps after its first token
        prompts_per_step = (micro - 1) / decode_steps  # other requests' prompts arriving during my decode
        stage_step = decode + prompts_per_step * prompt_extra
        tpot_s = pp * stage_step / self.tokens_per_step
        busy = min(prompts_per_step * prompt_extra / stage_step, MAX_PREFILL_UTILISATION)
        prefill_wait = busy / (2 * (1 - busy)) * prompt_extra + 0.5 * stage_step * (micro - 1) / micro
        solo = self.step(micro - 1, inp, context).total_s if micro > 1 else self.step(0, inp, inp / 2).total_s
        ttft_s = prefill_wait + pp * solo
        e2e_s = ttft_s + (out - 1) * tpot_s
        throughput = running * out / e2e_s
        slot_wait = max(concurrency - running, 0) / running * e2e_s
        return Prediction(
            concurrency=concurrency,
            running=running,
            output_throughput_tok_s=throughput,
            tpot_ms=tpot_s * 1e3,
            ttft_ms=(ttft_s + slot_wait) * 1e3,
            e2el_ms=(e2e_s + slot_wait) * 1e3,
        )


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


def _all_reduce_s(message_bytes: float, ranks: int, link: Link, bus_gb_s: float) -> float:
    """Ring all-reduce: 2 (n-1)/n of the message at the collective's bus bandwidth, plus one collective latency."""
    return link.collective_latency_us * 1e-6 + 2 * (ranks - 1) / ranks * message_bytes / (bus_gb_s * 1e9)


def _transfer_s(message_bytes: float, link: Link, efficiency: float) -> float:
    return link.collective_latency_us * 1e-6 + message_bytes / (link.bandwidth_gb_s * 1e9 * efficiency)
