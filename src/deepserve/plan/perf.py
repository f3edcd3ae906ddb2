"""The performance model: step times from bytes and FLOPs per GPU, continuous batching per concurrency level.

One engine step on one GPU of one pipeline stage, with b decode tokens and p prefill tokens, takes

    t_step = L_s * t_layer + max(bytes / (BW * eff_mem), flops / (peak * eff_compute)) + t_comm

where L_s is the stage's layer count and t_layer, eff_mem and eff_compute are the fitted efficiency factors. The
equations and the meaning of every factor are in docs/PLANNING.md; this module is their only implementation.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from deepserve.hardware.catalog import Accelerator, Link
from deepserve.models.spec import ModelSpec, dtype_bytes
from deepserve.plan.factors import EfficiencyFactors
from deepserve.plan.formats import WeightFormat
from deepserve.plan.layout import Layout, Links, stage_layers
from deepserve.plan.memory import shard_count

ACTIVATION_BYTES = 2  # hidden states cross the links in 16-bit
MAX_PREFILL_UTILISATION = 0.95  # queueing formula's guard: prefill demand at or above capacity means unbounded waits


def expected_distinct_experts(experts: int, top_k: int, tokens: float) -> float:
    """E[distinct experts] a batch of TOKENS touches when each picks top_k of EXPERTS uniformly:
    E * (1 - (1 - k/E)^tokens)."""
    if experts == 0 or tokens <= 0:
        return 0.0
    return experts * (1 - (1 - top_k / experts) ** tokens)


@dataclass(frozen=True)
class StepCost:
    """One step of one stage on one GPU, in seconds, by cause."""

    overhead_s: float
    memory_s: float
    compute_s: float
    comm_s: float

    @property
    def total_s(self) -> float:
        return self.overhead_s + max(self.memory_s, self.compute_s) + self.comm_s


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


class PerformanceModel:
    """Step times and per-concurrency predictions for one model on one layout of one accelerator."""

    def __init__(
        self,
        spec: ModelSpec,
        fmt: WeightFormat,
        layout: Layout,
        accelerator: Accelerator,
        links: Links,
        factors: EfficiencyFactors,
        kv_dtype: str,
    ) -> None:
        self.spec = spec
        self.fmt = fmt
        self.layout = layout
        self.accelerator = accelerator
        self.links = links
        self.factors = factors
        self.kv_dtype = kv_dtype
        self._stage = stage_layers(spec, layout.pp)[0]  # the first stage is the largest and holds the dense layers
        self._moe_layers, self._layer_params, self._head_params, self._static_bytes = _stage_weights(spec, fmt, layout)

    # ---- one step ---------------------------------------------------------------------------------------------

    def step(self, decode_tokens: float, prefill_tokens: float, context_len: float) -> StepCost:
        """One step of the first stage: DECODE_TOKENS sequences at CONTEXT_LEN plus one prompt chunk of
        PREFILL_TOKENS, counted over the whole stage (all data-parallel ranks together)."""
        f = self.factors
        layers = len(self._stage)
        bytes_gpu = self._weight_bytes(decode_tokens + prefill_tokens) + self._kv_read_bytes(decode_tokens, context_len)
        flops_gpu = self._flops(decode_tokens, prefill_tokens, context_len)
        peak = self.accelerator.peak_tflops(self.fmt.compute_dtype) * 1e12
        return StepCost(
            overhead_s=layers * f.layer_overhead_us * 1e-6,
            memory_s=bytes_gpu / (self.accelerator.memory_bandwidth_gb_s * 1e9 * f.memory_efficiency),
            compute_s=flops_gpu / (peak * f.compute_efficiency),
            comm_s=self._comm_s(decode_tokens + prefill_tokens),
        )

    def _weight_bytes(self, tokens: float) -> float:
        spec = self.spec
        experts = expected_distinct_experts(spec.n_routed_experts, spec.num_experts_per_tok, tokens)
        per_expert = spec.expert_params * self.fmt.bytes_per_param("routed_experts") / self.layout.expert_shards
        return self._static_bytes + self._moe_layers * experts * per_expert

    def _kv_read_bytes(self, decode_tokens: float, context_len: float) -> float:
        """Each decode token reads its sequence's cache on every layer of the stage; under TP every rank reads the
        whole MLA latent (it is replicated), under DP attention a rank reads only its own sequences."""
        per_layer = float(self.spec.kv_values_per_token_per_layer * dtype_bytes(self.kv_dtype))
        if not self.spec.is_mla:
            per_layer /= min(self.layout.tp, self.spec.num_kv_heads)
        return decode_tokens / self.layout.dp * context_len * per_layer * len(self._stage)

    def _flops(self, decode_tokens: float, prefill_tokens: float, context_len: float) -> float:
        spec, layout = self.spec, self.layout
        tokens = decode_tokens + prefill_tokens
        rank_tokens = tokens / layout.dp
        # The output head runs for the tokens that are sampled: every decode token, one per prompt.
        head_tokens = (decode_tokens + (1 if prefill_tokens else 0)) / layout.dp
        linear = 2 * rank_tokens * self._layer_params + 2 * head_tokens * self._head_params
        routed = 2 * tokens * spec.num_experts_per_tok * spec.expert_params / layout.expert_shards
        linear += routed * self._moe_layers
        heads = spec.num_attention_heads / layout.tp
        layers = len(self._stage)
        if spec.is_mla:
            latent = (spec.kv_lora_rank or 0) + spec.qk_rope_head_dim
            decode_attn = 2 * heads * (latent + (spec.kv_lora_rank or 0)) * context_len  # absorbed MLA
            qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
            prefill_attn = 2 * heads * (qk + spec.v_head_dim) * prefill_tokens / 2  # causal, average half prompt
        else:
            decode_attn = 4 * heads * spec.head_dim * context_len
            prefill_attn = 4 * heads * spec.head_dim * prefill_tokens / 2
        attention = (decode_tokens * decode_attn + prefill_tokens * prefill_attn) / layout.dp * layers
        return linear + attention

    def _comm_s(self, tokens: float) -> float:
        """TP: two all-reduces per layer (after attention and after the MLP/MoE); EP: a dispatch and a combine
        all-to-all per MoE layer; PP: one activation transfer to the next stage."""
        spec, layout = self.spec, self.layout
        rank_tokens = tokens / layout.dp
        message = rank_tokens * spec.hidden_size * ACTIVATION_BYTES
        total = 0.0
        if layout.tp > 1:
            per = _all_reduce_s(message, layout.tp, self.links.tensor)
            total += 2 * len(self._stage) * per
        if layout.ep and layout.expert_shards > 1:
            shards = layout.expert_shards
            volume = message * spec.num_experts_per_tok * (shards - 1) / shards
            total += 2 * self._moe_layers * _transfer_s(volume, self.links.tensor)
        if layout.pp > 1:
            total += _transfer_s(message, self.links.pipeline)
        return total

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
        prompts_per_step = (micro - 1) / max(out - 1, 1)  # other requests' prompts arriving during my decode
        stage_step = decode + prompts_per_step * prompt_extra
        tpot_s = pp * stage_step
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
def _stage_weights(spec: ModelSpec, fmt: WeightFormat, layout: Layout) -> tuple[int, float, float, float]:
    """For one GPU of the first stage: its MoE layers, its non-expert layer params, its output-head params, and the
    bytes every step reads there whatever the batch (everything but the routed experts, plus the output head, read
    once per step on the last stage)."""
    stage = stage_layers(spec, layout.pp)[0]
    moe_layers, params, total = 0, 0.0, 0.0
    for index in stage:
        for key, count in spec.layer_parameter_breakdown(index).items():
            if key == "routed_experts":
                moe_layers += 1 if count else 0
                continue
            share = count / shard_count(key, spec, layout)
            params += share
            total += share * fmt.bytes_per_param(key)
    head = spec.parameter_breakdown()["lm_head"] / layout.tp
    return moe_layers, params, head, total + head * fmt.bytes_per_param("lm_head")


def _all_reduce_s(message_bytes: float, ranks: int, link: Link) -> float:
    """Ring all-reduce: 2 (n-1)/n of the message crosses each link, plus one collective latency."""
    return link.collective_latency_us * 1e-6 + 2 * (ranks - 1) / ranks * message_bytes / (link.bandwidth_gb_s * 1e9)


def _transfer_s(message_bytes: float, link: Link) -> float:
    return link.collective_latency_us * 1e-6 + message_bytes / (link.bandwidth_gb_s * 1e9)
