"""`deepserve plan search`: every layout the engines support for a model on so many GPUs, ranked for an objective.

The space: engines (vLLM, SGLang); tensor, pipeline and data-parallel attention layouts with experts split by TP or
spread whole (EP), wide EP across nodes; the weight formats the checkpoint allows (its own, what an engine
quantizes it to while loading, and its published exports: DeepSeek-V3's AWQ, V4's NVFP4 and FP8); speculative
decoding off or on (the model's MTP module, at published acceptance, where the format's checkpoint has it);
and prefill/decode disaggregation (a prefill pool and a decode pool in whole nodes, the KV cache crossing the stated
network). Each candidate that fits is predicted at concurrency levels 1, 2, 4, ... up to what it can run, by the
steady closed-loop formula (perf.closed_loop; disaggregated pools by their phases, plan/phases.py). The frontier is
the set of points no other point beats on both tokens/s per GPU and tokens/s per user; the ranking takes each
candidate's best point for the objective: most output tokens/s per GPU within the SLOs, least cost per million
output tokens within them, or the fastest single stream.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import Field, field_validator

from deepserve.config import Section
from deepserve.engines.config import DEFAULT_KV_CONNECTOR, Role
from deepserve.errors import DeepserveError
from deepserve.hardware.catalog import get_accelerator, get_network
from deepserve.models.presets import exports_of, preset_spec
from deepserve.models.resolve import load_spec
from deepserve.models.spec import ModelSpec
from deepserve.plan.commands import launch_lines
from deepserve.plan.cost import usd_per_million_output_tokens
from deepserve.plan.formats import checkpoint_format, get_format, loads_as, published_export
from deepserve.plan.layout import Layout, check_layout
from deepserve.plan.perf import PerformanceModel, Prediction, RequestLengths
from deepserve.plan.phases import kv_transfer_s
from deepserve.plan.planner import build_deployment, make_plan
from deepserve.plan.speculative import SpeculativeDecoding, speculative_decoding
from deepserve.plan.types import Deployment, PlanConfig

Objective = Literal["throughput", "cost", "latency"]
SEARCH_ENGINES = ("vllm", "sglang")
# Speculative decoding with the model's MTP module: 1 and 3 draft tokens, each at plan/speculative.py's published
# per-position acceptance (MTP_PUBLISHED_ACCEPTANCE).
MTP_DRAFT_TOKENS = (1, 3)
HEAD_DIVISORS = (1, 2, 4, 8, 16, 32)
MAX_POOL_REPLICAS = 4


class SearchConfig(Section):
    """What `deepserve plan search` is asked (section `search` of the config file)."""

    model: str = Field("deepseek-ai/DeepSeek-V3", description="preset name or model directory")
    gpu: str = Field("h100", description="GPU type from the catalog")
    gpus: int = Field(8, ge=1, description="total GPUs (all nodes)")
    network: str = Field("infiniband-ndr", description="between nodes: infiniband-ndr, roce-400g, ethernet-100g")
    input_len: int = Field(1024, ge=1, description="prompt tokens per request")
    output_len: int = Field(256, ge=2, description="output tokens per request")
    objective: Objective = Field("throughput", description="rank by: throughput (per GPU), cost, latency")
    slo_itl_ms: float | None = Field(50.0, gt=0, description="inter-token latency objective (mean, ms)")
    slo_ttft_ms: float | None = Field(None, gt=0, description="time-to-first-token objective (mean, ms)")
    gpu_hour_usd: float | None = Field(None, gt=0, description="price of one GPU-hour, for cost per 1M tokens")
    engines: list[str] = Field(default_factory=lambda: list(SEARCH_ENGINES), description="engines to consider")
    weights: list[str] = Field(default_factory=list, description="formats to consider (default: the checkpoint's)")
    kv_dtypes: list[str] = Field(default_factory=lambda: ["auto"], description="KV-cache dtypes: auto, fp8")
    speculative: bool = Field(True, description="also consider MTP speculative decoding")
    disaggregation: bool = Field(True, description="also consider prefill/decode pools (two nodes or more)")
    max_concurrency: int = Field(4096, ge=1, description="highest concurrency level evaluated")
    max_model_len: int | None = Field(None, ge=16, description="context length (default: 32768 or the model's)")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="fraction of GPU memory the engine uses")
    top: int = Field(10, ge=1, description="candidates shown")

    @field_validator("engines", "weights", "kv_dtypes", mode="before")
    @classmethod
    def _comma_lists(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list):
            return [part.strip() for item in value for part in str(item).split(",") if part.strip()]
        return value


@dataclass(frozen=True)
class Pools:
    """Prefill/decode disaggregation: PREFILL_REPLICAS engines of PREFILL's layout, DECODE_REPLICAS of DECODE's."""

    prefill: Layout
    prefill_replicas: int
    decode: Layout
    decode_replicas: int

    @property
    def gpus(self) -> int:
        return self.prefill.gpus * self.prefill_replicas + self.decode.gpus * self.decode_replicas

    def describe(self) -> str:
        return (
            f"{self.prefill_replicas}P x ({self.prefill.describe()}) + {self.decode_replicas}D x "
            f"({self.decode.describe()})"
        )


@dataclass(frozen=True)
class Candidate:
    engine: str
    layout: Layout  # the whole deployment's (colocated) or the decode pool's
    weights: str
    kv_dtype: str = "auto"
    speculation: SpeculativeDecoding | None = None
    pools: Pools | None = None

    @property
    def kind(self) -> str:
        base = "pd-disaggregated" if self.pools else self.layout.kind
        return base + ("+mtp" if self.speculation else "")

    def describe(self) -> str:
        layout = self.pools.describe() if self.pools else self.layout.describe()
        spec = f", MTP {self.speculation.num_tokens}" if self.speculation else ""
        kv = f", KV {self.kv_dtype}" if self.kv_dtype != "auto" else ""
        return f"{self.engine} {self.weights} {layout}{kv}{spec}"


@dataclass(frozen=True)
class SearchPoint:
    candidate: Candidate
    concurrency: int
    output_tok_s: float
    tok_s_per_gpu: float
    tpot_ms: float
    ttft_ms: float
    usd_per_million: float | None
    meets_slo: bool

    @property
    def tok_s_per_user(self) -> float:
        return 1e3 / self.tpot_ms

    def to_json(self) -> dict[str, Any]:
        return {
            "candidate": self.candidate.describe(),
            "kind": self.candidate.kind,
            "concurrency": self.concurrency,
            "output_tok_s": round(self.output_tok_s, 1),
            "tok_s_per_gpu": round(self.tok_s_per_gpu, 1),
            "tok_s_per_user": round(self.tok_s_per_user, 1),
            "tpot_ms": round(self.tpot_ms, 2),
            "ttft_ms": round(self.ttft_ms, 1),
            "usd_per_million_output_tokens": None if self.usd_per_million is None else round(self.usd_per_million, 4),
            "meets_slo": self.meets_slo,
        }


@dataclass(frozen=True)
class SearchResult:
    config: SearchConfig
    points: tuple[SearchPoint, ...]
    refused: tuple[tuple[Candidate, str], ...]
    candidates: int
    seconds: float

    @property
    def frontier(self) -> list[SearchPoint]:
        return pareto_frontier(self.points)

    def ranked(self) -> list[SearchPoint]:
        """Each candidate's best point for the objective, best candidate first (those meeting the SLOs first)."""
        best: dict[Candidate, SearchPoint] = {}
        for point in self.points:
            held = best.get(point.candidate)
            if held is None or _score(point, self.config.objective) > _score(held, self.config.objective):
                best[point.candidate] = point
        return sorted(best.values(), key=lambda p: _score(p, self.config.objective), reverse=True)

    @property
    def chosen(self) -> SearchPoint | None:
        ranked = self.ranked()
        return ranked[0] if ranked and ranked[0].meets_slo else None

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config.model_dump(),
            "candidates": self.candidates,
            "seconds": round(self.seconds, 2),
            "ranked": [p.to_json() for p in self.ranked()[: self.config.top]],
            "frontier": [p.to_json() for p in self.frontier],
            "chosen": self.chosen.to_json() if self.chosen else None,
            "refused": [{"candidate": c.describe(), "reason": reason} for c, reason in self.refused],
        }


def _score(point: SearchPoint, objective: Objective) -> tuple[bool, float]:
    """Points within the SLOs first; then the objective's figure (cost: the cheaper per token, i.e. the more tokens
    per GPU-hour, which is tokens/s per GPU at one price)."""
    figure = point.tok_s_per_user if objective == "latency" else point.tok_s_per_gpu
    return point.meets_slo, figure


def pareto_frontier(points: tuple[SearchPoint, ...] | list[SearchPoint]) -> list[SearchPoint]:
    """The points no other point beats on both tokens/s per user and tokens/s per GPU, fastest per user first."""
    ordered = sorted(points, key=lambda p: (-p.tok_s_per_user, -p.tok_s_per_gpu))
    frontier, best_per_gpu = [], 0.0
    for point in ordered:
        if point.tok_s_per_gpu > best_per_gpu:
            frontier.append(point)
            best_per_gpu = point.tok_s_per_gpu
    return frontier


# ---- the search ---------------------------------------------------------------------------------------------


def search(config: SearchConfig) -> SearchResult:
    started = time.monotonic()
    spec = load_spec(config.model)
    points: list[SearchPoint] = []
    refused: list[tuple[Candidate, str]] = []
    candidates = list(enumerate_candidates(config, spec))
    for candidate in candidates:
        try:
            points += evaluate(candidate, config, spec)
        except _Refused as exc:
            refused.append((candidate, str(exc)))
    return SearchResult(config, tuple(points), tuple(refused), len(candidates), time.monotonic() - started)


class _Refused(Exception):
    """A candidate that cannot run (does not fit, a layout the engine refuses)."""


def enumerate_candidates(config: SearchConfig, spec: ModelSpec) -> Iterator[Candidate]:
    per_node = get_accelerator(config.gpu).devices_per_node
    formats = config.weights or formats_allowed(spec, config.model)
    speculations: list[SpeculativeDecoding | None] = [None]
    if config.speculative and spec.mtp_params():
        speculations += [speculative_decoding("mtp", k, (), spec) for k in MTP_DRAFT_TOKENS]
    for engine in config.engines:
        for weights in formats:
            drafts = speculations if _has_draft_module(config.model, spec, weights) else [None]
            for kv_dtype in config.kv_dtypes:
                for layout in layouts(spec, config.gpus, per_node):
                    for speculation in drafts:
                        yield Candidate(engine, layout, weights, kv_dtype, speculation)
                if config.disaggregation:
                    for pools in pool_splits(spec, config.gpus, per_node):
                        yield Candidate(engine, pools.decode, weights, kv_dtype, None, pools)


def formats_allowed(spec: ModelSpec, model: str) -> list[str]:
    """The checkpoint's own format, what an engine makes of it while loading (a 16-bit checkpoint: FP8 on the fly),
    and the formats of MODEL's published exports (an AWQ or NVFP4 repack: the plan's commands load that checkpoint);
    any other format needs a checkpoint the user names with --model."""
    own = checkpoint_format(spec).name
    allowed = [own, "fp8-dynamic"] if own in ("bf16", "fp16") else [own]
    exported = [checkpoint_format(preset_spec(name)).name for name in exports_of(model)]
    return [*allowed, *(fmt for fmt in exported if fmt not in allowed)]


def _has_draft_module(model: str, spec: ModelSpec, weights: str) -> bool:
    """Whether the checkpoint that runs WEIGHTS holds MODEL's MTP module (the AWQ exports dropped it)."""
    fmt = get_format(weights)
    if loads_as(checkpoint_format(spec), fmt):
        return True
    export = published_export(model, fmt)
    return export is None or bool(preset_spec(export).mtp_params())


def layouts(spec: ModelSpec, gpus: int, per_node: int) -> Iterator[Layout]:
    """TP inside a node (or across nodes with nothing else), PP across nodes, data-parallel attention with experts
    split or spread whole, over all the GPUs: each one the engine accepts."""
    nodes = max(-(-gpus // per_node), 1)
    for pp in sorted({1, nodes}):
        if gpus % pp:
            continue
        stage = gpus // pp
        for tp in (d for d in HEAD_DIVISORS if stage % d == 0 and d <= max(stage, 1)):
            dp = stage // tp
            if tp > per_node and (dp > 1 or pp > 1):
                continue  # TP spans nodes only on its own (TP16 over two nodes)
            for ep in (False, True):
                if dp == 1 and ep and tp == 1:
                    continue
                yield from _valid(Layout(tp=tp, pp=pp, dp=dp, ep=ep), spec, gpus)


def _valid(layout: Layout, spec: ModelSpec, gpus: int) -> Iterator[Layout]:
    try:
        check_layout(layout, spec, gpus)
    except DeepserveError:
        return
    yield layout


def pool_splits(spec: ModelSpec, gpus: int, per_node: int) -> Iterator[Pools]:
    """Prefill and decode pools in whole nodes (at least one each), each pool as replicas of one single-stage
    layout."""
    nodes = gpus // per_node
    if nodes < 2 or gpus % per_node:
        return
    for prefill_nodes in range(1, nodes):
        decode_gpus, prefill_gpus = (nodes - prefill_nodes) * per_node, prefill_nodes * per_node
        for prefill, p_replicas in _pool_layouts(spec, prefill_gpus, per_node):
            for decode, d_replicas in _pool_layouts(spec, decode_gpus, per_node):
                yield Pools(prefill, p_replicas, decode, d_replicas)


def _pool_layouts(spec: ModelSpec, gpus: int, per_node: int) -> Iterator[tuple[Layout, int]]:
    for replicas in range(1, MAX_POOL_REPLICAS + 1):
        if gpus % replicas or ((gpus // replicas) % per_node and gpus // replicas > per_node):
            continue
        size = gpus // replicas
        for layout in layouts(spec, size, per_node):
            if layout.pp == 1:
                yield layout, replicas


# ---- one candidate --------------------------------------------------------------------------------------------


def evaluate(candidate: Candidate, config: SearchConfig, spec: ModelSpec) -> list[SearchPoint]:
    if candidate.pools is not None:
        return _evaluate_pools(candidate, candidate.pools, config, spec)
    deployment = _deployment(candidate, candidate.layout, config, spec)
    model = deployment.performance_model()
    workload = RequestLengths(config.input_len, config.output_len)
    cap = deployment.running_cap
    return [
        _point(candidate, model.predict(level, workload, cap), candidate.layout.gpus, config)
        for level in _levels(cap, config.max_concurrency)
    ]


def _deployment(candidate: Candidate, layout: Layout, config: SearchConfig, spec: ModelSpec) -> Deployment:
    per_node = get_accelerator(config.gpu).devices_per_node
    try:
        deployment = build_deployment(
            spec,
            config.gpu,
            layout.gpus,
            nodes=max(-(-layout.gpus // per_node), 1),
            weights=candidate.weights,
            layout=layout,
            engine=candidate.engine,
            kv_dtype=candidate.kv_dtype,
            network=config.network,
            gpu_memory_utilization=config.gpu_memory_utilization,
            max_model_len=config.max_model_len,
            workload=RequestLengths(config.input_len, config.output_len),
            speculation=candidate.speculation,
        )
    except DeepserveError as exc:
        raise _Refused(str(exc)) from None
    if not deployment.memory.fits or deployment.running_cap < 1:
        raise _Refused("does not fit in memory (weights, reserve and one max_model_len sequence)")
    return deployment


def _levels(cap: int, highest: int) -> list[int]:
    top = max(min(cap, highest), 1)
    levels, level = [], 1
    while level < top:
        levels.append(level)
        level *= 2
    return [*levels, top]


def _point(candidate: Candidate, p: Prediction, gpus: int, config: SearchConfig) -> SearchPoint:
    meets = (config.slo_itl_ms is None or p.tpot_ms <= config.slo_itl_ms) and (
        config.slo_ttft_ms is None or p.ttft_ms <= config.slo_ttft_ms
    )
    return SearchPoint(
        candidate,
        p.concurrency,
        p.output_throughput_tok_s,
        p.output_throughput_tok_s / gpus,
        p.tpot_ms,
        p.ttft_ms,
        usd_per_million_output_tokens(p.output_throughput_tok_s, gpus, config.gpu_hour_usd),
        meets,
    )


def _evaluate_pools(candidate: Candidate, pools: Pools, config: SearchConfig, spec: ModelSpec) -> list[SearchPoint]:
    """The decode pool decodes without prompts in its steps; each request's prompt runs on a prefill replica and
    its KV cache crosses the network to a decode replica. Concurrency levels are per the whole deployment."""
    decode = _deployment(candidate, pools.decode, config, spec)
    prefill = _deployment(replace(candidate, speculation=None), pools.prefill, config, spec)
    decode_model, prefill_model = decode.performance_model(), prefill.performance_model()
    per_node = get_accelerator(config.gpu).devices_per_node
    transfer_s = kv_transfer_s(prefill_model, config.input_len, get_network(config.network), per_node)
    prefill_s = prefill_model.step(0, config.input_len, config.input_len / 2).total_s
    cap = decode.running_cap * pools.decode_replicas
    points = []
    for level in _levels(cap, config.max_concurrency):
        prediction = _pools_prediction(level, decode_model, prefill_s, transfer_s, pools, config)
        points.append(_point(candidate, prediction, pools.gpus, config))
    return points


def _pools_prediction(
    concurrency: int,
    decode: PerformanceModel,
    prefill_s: float,
    transfer_s: float,
    pools: Pools,
    config: SearchConfig,
) -> Prediction:
    """Closed loop over the pools: the decode replicas' step at their share of the clients; the prefill replicas
    as an M/D/c queue approximated per replica (M/D/1 at their share of the arrivals), solved for the arrival rate
    by fixed-point iteration."""
    per_replica = concurrency / pools.decode_replicas
    tokens_per_step = decode.tokens_per_step
    context = config.input_len + config.output_len / 2
    tpot_s = decode.step(per_replica, 0, context).total_s / tokens_per_step
    base_ttft_s = decode.request_overhead_s + prefill_s + transfer_s + tpot_s
    ttft_s = base_ttft_s
    for _ in range(20):
        e2e_s = ttft_s + (config.output_len - 1) * tpot_s
        busy = min(concurrency / e2e_s * prefill_s / pools.prefill_replicas, 0.95)
        ttft_s = base_ttft_s + busy / (2 * (1 - busy)) * prefill_s
    e2e_s = ttft_s + (config.output_len - 1) * tpot_s
    return Prediction(
        concurrency=concurrency,
        running=concurrency,
        output_throughput_tok_s=concurrency * config.output_len / e2e_s,
        tpot_ms=tpot_s * 1e3,
        ttft_ms=ttft_s * 1e3,
        e2el_ms=e2e_s * 1e3,
    )


# ---- the chosen candidate's command lines -----------------------------------------------------------------------


@dataclass(frozen=True)
class ChosenCommands:
    serve: tuple[str, ...]  # `deepserve serve` per node (colocated), or per pool replica's first node
    deploy_render: str | None
    notes: tuple[str, ...] = ()


def chosen_commands(result: SearchResult) -> ChosenCommands | None:
    """The `deepserve serve` and `deepserve deploy render` lines of the chosen candidate (for pools: each pool's
    serve line, and what is left to wire by hand)."""
    chosen = result.chosen
    if chosen is None:
        return None
    candidate = chosen.candidate
    if candidate.pools is None:
        plan_config = _plan_config(result.config, candidate, candidate.layout, chosen)
        return _colocated_commands(plan_config, candidate)
    return _pool_commands(result.config, candidate, candidate.pools, chosen)


def _plan_config(config: SearchConfig, candidate: Candidate, layout: Layout, point: SearchPoint) -> PlanConfig:
    return PlanConfig(
        model=config.model,
        gpu=config.gpu,
        gpus=layout.gpus,
        weights=candidate.weights,
        kv_dtype=candidate.kv_dtype,
        max_model_len=config.max_model_len,
        input_len=config.input_len,
        output_len=config.output_len,
        concurrency=[point.concurrency],
        slo_itl_ms=config.slo_itl_ms,
        engine=candidate.engine,
        tp=layout.tp,
        pp=layout.pp,
        dp=layout.dp,
        ep=layout.ep,
        network=config.network,
        gpu_memory_utilization=config.gpu_memory_utilization,
        speculative_method=candidate.speculation.method if candidate.speculation else None,
        num_speculative_tokens=candidate.speculation.num_tokens if candidate.speculation else None,
        spec_acceptance=list(candidate.speculation.acceptance) if candidate.speculation else [],
    )


def _colocated_commands(plan_config: PlanConfig, candidate: Candidate) -> ChosenCommands:
    plan = make_plan(plan_config)
    speculation = candidate.speculation
    notes = [f"MTP needs the checkpoint's MTP module (loaded for {speculation.describe()})"] if speculation else []
    layout = candidate.layout
    if candidate.engine == "sglang" and layout.dp > 1 and not layout.ep:
        notes.append(
            f"SGLang: data-parallel attention with split experts is --tp-size {layout.tp * layout.dp} --dp-size "
            f"{layout.dp} --enable-dp-attention without --ep-size; deepserve's SGLang launcher adds "
            "--enable-dp-attention only with expert parallelism, so add it after `--`"
        )
    return ChosenCommands(plan.serve_commands, plan.deploy_render, tuple(notes))


def _pool_commands(config: SearchConfig, candidate: Candidate, pools: Pools, point: SearchPoint) -> ChosenCommands:
    """Each pool's serve lines with its role (the prefill pool without speculative decoding, as it was evaluated),
    the gateway line that joins them, and a deploy render line where both pools share one layout (render's pools
    do)."""
    lines, plans = [], {}
    roles: tuple[tuple[Role, Layout, int], ...] = (
        ("prefill", pools.prefill, pools.prefill_replicas),
        ("decode", pools.decode, pools.decode_replicas),
    )
    for role, layout, replicas in roles:
        member = candidate if role == "decode" else replace(candidate, speculation=None)
        plan = make_plan(_plan_config(config, member, layout, point))
        serve = launch_lines(plan.deployment, plan.config, role).serve
        lines += [f"# {role} pool, {replicas} replica(s): {line}" for line in serve]
        plans[role] = plan
    notes = [
        "in front of the pools: deepserve gateway --prefill-upstream http://PREFILL_NODE0:8000/v1 --upstream "
        f"http://DECODE_NODE0:8000/v1 (one flag per replica; {DEFAULT_KV_CONNECTOR} moves the KV cache between them)"
    ]
    render = plans["decode"].deploy_render
    if pools.prefill != pools.decode:
        notes.append(
            f"deploy render gives both pools one layout, and these differ ({pools.prefill.describe()} and "
            f"{pools.decode.describe()}): render each pool on its own, or serve them with the lines above"
        )
        return ChosenCommands(tuple(lines), None, tuple(notes))
    if not render.startswith("n/a"):
        render += (
            f" --prefill-replicas {pools.prefill_replicas} --replicas {pools.decode_replicas} "
            f"--kv-connector {DEFAULT_KV_CONNECTOR}"
        )
    return ChosenCommands(tuple(lines), render, tuple(notes))
