"""Speculative decoding in the step model: what a step costs when it verifies K draft tokens per sequence and
drafts the next K, and how many tokens it yields.

One step of a decoding sequence with K drafts (vLLM V1, DeepSeek's MTP as its EAGLE-style proposer runs it):

    verification   the target model over K+1 tokens per sequence (the last token and K drafts): the weights and
                   each sequence's cache are read once, the FLOPs are K+1 times a decode token's, and the MoE
                   touches the experts of b(K+1) tokens. At a small batch that is nearly free (memory-bound); at a
                   large batch the step becomes compute-bound and verification costs K+1 decode steps' compute.
    drafting       K passes of the draft module: the first over every token of the step (b(K+1), plus the tokens
                   of prompts, whose MTP-layer cache it fills), then K-1 over one token per sampled sequence. A
                   pass is a step of a one-layer model (the MTP layer: a MoE decoder layer, its eh_proj, the shared
                   output head) under the same engine profile: its launches, its engine overhead, its roofline
                   work. n-gram drafts come from the prompt on the host: no pass.
    tokens         each step yields 1 + a tokens, a the accepted drafts. With r_i the probability that draft i is
                   accepted (i.e. drafts 1..i all are: vLLM's per-position rate, accepted_per_pos[i] / drafts),
                   E[tokens per step] = 1 + sum_i r_i = 1 + sum_i prod_{j<=i} alpha_j, alpha_j the acceptance of
                   draft j given the ones before it.

TPOT is the step time over the tokens per step; a request needs (O-1)/E[tokens] steps after its first token
(`PerformanceModel.predict`). docs/PLANNING.md, section 11, has the equations and the checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import pairwise

from deepserve.errors import ConfigError
from deepserve.models.spec import ModelSpec
from deepserve.plan.perf import PerformanceModel, RankLoad, StepCost, WorkCost

EH_PROJ_BYTES_PER_PARAM = 2  # vLLM's eh_proj is an unquantized nn.Linear (vllm/model_executor/models/deepseek_mtp.py)

# Per-position acceptance when none is given, from published runs:
# - DeepSeek's MTP: TensorRT-LLM's R1 ablation (NVIDIA/TensorRT-LLM docs/source/blogs/
#   Best_perf_practice_on_DeepSeek-R1_in_TensorRT-LLM.md, B200, 1K/2K, batch 1) measured mean acceptance lengths
#   1.92, 2.58, 2.82, 2.99, 3.01 with 1..5 MTP drafts; each added draft's share is that position's rate. The first,
#   0.92, is near DeepSeek's own "85-90%" for the second token (DeepSeek-V3 technical report, section 5.4.3).
# - DSpark: vLLM's blog on DeepSeek-V4-Pro-0813 ("the 1st drafted token survives >70%, the 7th <10%",
#   vllm-project.github.io _posts/2026-08-14-dspark-adaptive-verification.md), geometric between the two.
MTP_PUBLISHED_ACCEPTANCE = (0.92, 0.66, 0.24, 0.17, 0.02)
MTP_ACCEPTANCE_SOURCE = "TensorRT-LLM's DeepSeek-R1 MTP ablation (acceptance lengths 1.92-3.01 with 1-5 drafts)"
DSPARK_FIRST, DSPARK_SEVENTH = 0.70, 0.10
DSPARK_ACCEPTANCE_SOURCE = "vLLM's DSpark blog (V4-Pro-0813: 1st draft >70% accepted, 7th <10%)"


@dataclass(frozen=True)
class SpeculativeDecoding:
    """Speculation as the step model sees it: K drafts a step, accepted with per-position rates."""

    method: str  # mtp, dspark, ngram
    num_tokens: int  # K
    acceptance: tuple[float, ...]  # r_1..r_K: draft i accepted (with every draft before it), vLLM's per-position rate
    draft_layers: int  # layers of the draft module run per pass (0: n-gram, drafted on the host)
    acceptance_source: str = "given"

    @property
    def expected_accepted(self) -> float:
        return sum(self.acceptance)

    @property
    def tokens_per_step(self) -> float:
        """Mean acceptance length: the bonus token plus the accepted drafts."""
        return 1.0 + self.expected_accepted

    def conditional_acceptance(self) -> tuple[float, ...]:
        """alpha_i: draft i accepted given drafts 1..i-1 were (what a sampler draws position by position)."""
        rates, previous = [], 1.0
        for rate in self.acceptance:
            rates.append(rate / previous if previous > 0 else 0.0)
            previous = rate
        return tuple(rates)

    def describe(self) -> str:
        rates = ", ".join(f"{rate:.2f}" for rate in self.acceptance)
        return (
            f"{self.method}, {self.num_tokens} draft token(s) a step accepted at {rates} per position "
            f"({self.acceptance_source}): {self.tokens_per_step:.2f} tokens per step"
        )


def parse_acceptance(text: str | Sequence[float] | None) -> tuple[float, ...]:
    """ "0.8,0.6,0.4" or [0.8, 0.6, 0.4] as rates, each in [0, 1]; empty for None."""
    if text is None:
        return ()
    if isinstance(text, str):
        try:
            values = tuple(float(part) for part in text.replace(" ", "").split(",") if part)
        except ValueError:
            raise ConfigError(
                f"acceptance {text!r} must be comma-separated rates in [0, 1], e.g. 0.8,0.6,0.4"
            ) from None
    else:
        values = tuple(float(value) for value in text)
    if any(not 0.0 <= value <= 1.0 for value in values):
        raise ConfigError(f"acceptance rates must lie in [0, 1]; got {', '.join(map(str, values))}")
    return values


def acceptance_per_position(values: Sequence[float], num_tokens: int) -> tuple[float, ...]:
    """VALUES for K=NUM_TOKENS drafts: one rate a means each draft is accepted with probability a given the ones
    before it (r_i = a^i, geometric); several are vLLM's per-position rates r_1 >= r_2 >= ... (the first K are
    used: a chain's position i does not depend on how many follow)."""
    if len(values) == 1:
        return tuple(values[0] ** (i + 1) for i in range(num_tokens))
    if len(values) < num_tokens:
        raise ConfigError(
            f"{len(values)} acceptance rates for {num_tokens} draft tokens: give one rate per position (or one "
            "rate, applied to each draft given the ones before it)"
        )
    rates = tuple(values[:num_tokens])
    if any(later > earlier for earlier, later in pairwise(rates)):
        raise ConfigError(
            f"per-position acceptance {', '.join(map(str, rates))} must not increase: position i counts drafts "
            "whose first i tokens were all accepted (vLLM's vllm:spec_decode_num_accepted_tokens_per_pos)"
        )
    return rates


def acceptance_from_length(num_tokens: int, accept_length: float) -> tuple[float, ...]:
    """Per-position rates of NUM_TOKENS drafts whose mean acceptance length (tokens per step, what engines log and
    published runs report) is ACCEPT_LENGTH, each draft accepted with one probability p given the ones before it
    (r_i = p^i, as `acceptance_per_position` reads one rate): p solves p + p^2 + ... + p^K = ACCEPT_LENGTH - 1."""
    target = min(max(accept_length - 1.0, 0.0), float(num_tokens))
    low, high = 0.0, 1.0
    for _ in range(60):
        p = (low + high) / 2
        low, high = (p, high) if sum(p**i for i in range(1, num_tokens + 1)) < target else (low, p)
    return acceptance_per_position(((low + high) / 2,), num_tokens)


def published_acceptance(method: str, num_tokens: int) -> tuple[tuple[float, ...], str] | None:
    """The default per-position acceptance for METHOD from published runs, or None where there is none."""
    if method == "mtp":
        rates = MTP_PUBLISHED_ACCEPTANCE + (0.0,) * max(num_tokens - len(MTP_PUBLISHED_ACCEPTANCE), 0)
        return rates[:num_tokens], MTP_ACCEPTANCE_SOURCE
    if method == "dspark":
        decay = (DSPARK_SEVENTH / DSPARK_FIRST) ** (1 / 6)
        return tuple(DSPARK_FIRST * decay**i for i in range(num_tokens)), DSPARK_ACCEPTANCE_SOURCE
    return None


def speculative_decoding(
    method: str, num_tokens: int, acceptance: Sequence[float], spec: ModelSpec
) -> SpeculativeDecoding:
    """The step model's view of METHOD with NUM_TOKENS drafts on SPEC; ACCEPTANCE empty takes the published
    default for the method (MTP, DSpark), which n-gram has none of (it depends on how much of the output the
    prompt holds)."""
    if method == "draft_model":
        raise ConfigError(
            "the plan models the checkpoint's own draft module (mtp, dspark) and n-gram drafts; a separate draft "
            "model's cost is not modelled: plan without it, or with --speculative-method mtp"
        )
    if method not in ("mtp", "dspark", "ngram"):
        raise ConfigError(f"unknown speculative method {method!r}; the plan models mtp, dspark and ngram")
    if num_tokens < 1:
        raise ConfigError("speculative decoding needs at least one draft token per step")
    if acceptance:
        rates, source = acceptance_per_position(acceptance, num_tokens), "given"
    else:
        published = published_acceptance(method, num_tokens)
        if published is None:
            raise ConfigError(
                f"{method} acceptance depends on the workload and has no published default: give it, e.g. "
                "--spec-acceptance 0.5 (each draft given the ones before) or 0.6,0.4,0.2 (per position)"
            )
        rates, source = published
    draft_layers = max(spec.num_mtp_layers, 1) if method in ("mtp", "dspark") else 0
    return SpeculativeDecoding(method, num_tokens, rates, draft_layers, source)


class SpeculativeModel(PerformanceModel):
    """The step model with speculative decoding: `step` is a verification step plus its drafting, and each step
    yields `tokens_per_step` tokens per sequence (which `predict` divides the step time by)."""

    def __init__(self, target: PerformanceModel, speculation: SpeculativeDecoding) -> None:
        super().__init__(
            target.spec,
            target.fmt,
            target.layout,
            target.accelerator,
            target.links,
            target.rates,
            target.engine,
            target.kv_dtype,
            target.options,
        )
        self.speculation = speculation
        self.drafter = _draft_model(target, speculation.draft_layers) if speculation.draft_layers else None

    @property
    def tokens_per_step(self) -> float:
        return self.speculation.tokens_per_step

    def step(
        self,
        decode_tokens: float,
        prefill_tokens: float,
        context_len: float,
        prefill_context: float = 0.0,
        prefill_mean_position: float | None = None,
        rank: RankLoad | None = None,
        queries_per_sequence: float | None = None,
    ) -> StepCost:
        """A step whose DECODE_TOKENS sequences each verify QUERIES_PER_SEQUENCE tokens (default K+1: the last
        token and K drafts; the simulator gives what its batch holds), then drafts for every sequence that sampled.
        RANK: the busiest data-parallel rank's share, as for the plain step."""
        queries = 1.0 + self.speculation.num_tokens if queries_per_sequence is None else queries_per_sequence
        rank = rank or self.balanced(decode_tokens, prefill_tokens, prefill_context, prefill_mean_position)
        verify = super().step(
            decode_tokens, prefill_tokens, context_len, prefill_context, prefill_mean_position, rank, queries
        )
        if self.drafter is None or not decode_tokens + prefill_tokens:
            return verify
        passes = self._draft_passes(decode_tokens, prefill_tokens, context_len, rank, queries)
        work, comm = _combine(passes, "draft_")
        return StepCost(verify.overhead_s, verify.work + work, verify.comm + comm, verify.overlap_comm)

    def _draft_passes(
        self, decode_tokens: float, prefill_tokens: float, context_len: float, rank: RankLoad, queries: float
    ) -> list[StepCost]:
        """K passes of the draft module: the first over every token of the step, the rest over one token per
        sampled sequence (each decode, and the prompt that completed)."""
        assert self.drafter is not None
        first = self.drafter.step(decode_tokens, prefill_tokens, context_len, rank=rank, queries_per_sequence=queries)
        passes = [_with_eh_proj(first, self.drafter, rank.decode_tokens * queries + rank.prefill_tokens)]
        sampled = decode_tokens + (1 if prefill_tokens else 0)
        sampled_here = RankLoad(rank.decode_tokens + (1 if rank.prefill_tokens else 0), 0)
        later = self.drafter.step(sampled, 0, context_len + 1, rank=sampled_here)
        passes += [_with_eh_proj(later, self.drafter, sampled_here.decode_tokens)] * (self.speculation.num_tokens - 1)
        return passes


def speculative_model(target: PerformanceModel, speculation: SpeculativeDecoding | None) -> PerformanceModel:
    return target if speculation is None else SpeculativeModel(target, speculation)


def _draft_model(target: PerformanceModel, layers: int) -> PerformanceModel:
    """The draft module as a model of its own: LAYERS MoE decoder layers shaped as the target's (DeepSeek's MTP
    layer is one), the target's output head (shared), on the same GPUs, kernels and engine profile."""
    spec = replace(
        target.spec,
        name=f"{target.spec.name} (draft module)",
        num_layers=layers,
        first_k_dense_replace=0,
        num_mtp_layers=0,
    )
    return PerformanceModel(
        spec,
        target.fmt,
        replace(target.layout, pp=1),
        target.accelerator,
        target.links,
        target.rates,
        target.engine,
        target.kv_dtype,
        target.options,
    )


def _with_eh_proj(cost: StepCost, drafter: PerformanceModel, tokens: float) -> StepCost:
    """A draft pass also projects [embedding; hidden state] (2 x hidden) back to hidden with eh_proj: a 16-bit
    GEMM read in full by every rank."""
    hidden = drafter.spec.hidden_size
    params = 2 * hidden * hidden * drafter.spec.num_layers
    rate = drafter.rates.rate("dense_gemm")
    projection = WorkCost(
        "eh_proj",
        drafter._memory_s(params * EH_PROJ_BYTES_PER_PARAM, rate),
        drafter._compute_s(2 * params * tokens, 0.0, rate, "bf16"),
        drafter._launch_s() if tokens else 0.0,
    )
    return StepCost(cost.overhead_s, (*cost.work, projection), cost.comm, cost.overlap_comm)


def _combine(passes: list[StepCost], prefix: str) -> tuple[tuple[WorkCost, ...], tuple[tuple[str, float], ...]]:
    """Several passes as one entry per kind of work, whose time is exactly the passes' summed time: memory and
    compute seconds are summed, and what max(sum) misses of sum(max) (passes bound differently) joins the floor."""
    kinds: dict[str, list[WorkCost]] = {}
    for cost in passes:
        for work in cost.work:
            kinds.setdefault(work.kind, []).append(work)
    work_items = [WorkCost(prefix + "engine_overhead", 0.0, 0.0, sum(cost.overhead_s for cost in passes))]
    for kind, items in kinds.items():
        memory = sum(item.memory_s for item in items)
        compute = sum(item.compute_s for item in items)
        total = sum(item.time_s for item in items)
        work_items.append(WorkCost(prefix + kind, memory, compute, total - max(memory, compute)))
    comm: dict[str, float] = {}
    for cost in passes:
        for name, seconds in cost.comm:
            comm[prefix + name] = comm.get(prefix + name, 0.0) + seconds
    return tuple(work_items), tuple(comm.items())
