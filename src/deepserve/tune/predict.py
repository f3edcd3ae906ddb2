"""The planner's view of each point, before anything starts: does it fit, and what would it serve under the load
the benchmark will apply? Points it shows cannot fit, or cannot meet an SLO by a wide margin, are skipped with the
reason; the rest run in order of predicted goodput, most promising first.

Only the planner's stable interface is used: `make_plan(PlanConfig)`, the plan's fit and its predictions (output
tokens/s, TPOT, TTFT and E2EL per concurrency level). The planner predicts means, while SLOs are often
percentiles; a P99 is at least the mean for the skewed latencies of serving, so a predicted mean beyond the margin
is a safe reason to skip and a predicted mean within the limit is only a hopeful sign.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from deepserve.bench.config import BenchConfig
from deepserve.engines.config import EngineConfig
from deepserve.engines.vllm import DEFAULT_GPU_MEMORY_UTILIZATION
from deepserve.errors import DeepserveError
from deepserve.hardware.catalog import HOST_NAMES, match_device_name
from deepserve.hardware.detect import local_gpus
from deepserve.plan.planner import Plan, make_plan
from deepserve.plan.types import PlanConfig
from deepserve.results.slo import Slo
from deepserve.tune.goodput import split_metric

GIB = 1024**3
FIXED_LENGTH_DATASETS = ("random",)
PLANNER_DEFAULT_BATCHED_TOKENS: int = PlanConfig.model_fields["max_num_batched_tokens"].default


@dataclass(frozen=True)
class LoadShape:
    """What the planner needs to know of the benchmark: fixed lengths and the load."""

    input_len: int
    output_len: int
    num_prompts: int
    max_concurrency: int | None
    request_rate: float  # inf: everything at once (closed loop at max_concurrency)

    def concurrency_levels(self) -> list[int]:
        """Closed loop: the one level the benchmark holds. Open loop (a finite rate): levels up to the number of
        prompts, among which the rate's steady state is found."""
        ceiling = min(self.max_concurrency or self.num_prompts, self.num_prompts)
        if math.isinf(self.request_rate):
            return [ceiling]
        levels, level = [], 1.0
        while level < ceiling:
            levels.append(int(level))
            level = max(level * 1.25, level + 1)
        return sorted({*levels, ceiling})


@dataclass(frozen=True)
class Forecast:
    """The planner's prediction for one point under the benchmark's load, or why there is none."""

    fits: bool | None  # None: the planner could not say
    output_tok_s: float | None = None
    tpot_ms: float | None = None
    ttft_ms: float | None = None
    e2el_ms: float | None = None
    concurrency: int | None = None  # the level the prediction is for (open loop: where the rate settles)
    saturated: bool = False  # a rate above what the planner predicts the point can complete
    note: str = ""  # why there is no prediction, or the planner's caveat (a transferred profile, ...)

    @property
    def predicted(self) -> bool:
        return self.output_tok_s is not None

    def value_for(self, slo: Slo) -> float | None:
        """The predicted mean of SLO's metric (ITL is TPOT on average); None for a spread (std) or no prediction."""
        stat, metric = split_metric(slo)
        if stat == "std" or not self.predicted:
            return None
        return {"ttft": self.ttft_ms, "tpot": self.tpot_ms, "itl": self.tpot_ms, "e2el": self.e2el_ms}[metric]

    def meets(self, slos: Sequence[Slo]) -> bool:
        return all((value := self.value_for(slo)) is None or value <= slo.max_ms for slo in slos)

    def goodput_output_tok_s(self, slos: Sequence[Slo]) -> float | None:
        """Predicted output tokens/s if every SLO is predicted to hold, else 0; None without a prediction."""
        if self.output_tok_s is None:
            return None
        return self.output_tok_s if self.meets(slos) and not self.saturated else 0.0

    def to_json(self) -> dict[str, Any]:
        return {key: _rounded(value) for key, value in asdict(self).items()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Forecast:
        known = {key: value for key, value in data.items() if key in cls.__dataclass_fields__}
        return cls(**known)


def load_shape(bench: BenchConfig) -> tuple[LoadShape | None, str]:
    """The benchmark's load as the planner sees it, or None and why it cannot."""
    workload, load = bench.workload, bench.load
    if workload.dataset_name not in FIXED_LENGTH_DATASETS:
        return None, f"the planner predicts fixed-length workloads (dataset random), not {workload.dataset_name}"
    if load.ramp_up_s is not None or load.rate_ramp() is not None:
        return None, "the planner predicts a steady load, not a ramp"
    if load.duration_s is not None and math.isinf(load.request_rate):
        num_prompts = load.max_concurrency or 1  # a timed closed loop: the benchmark checks a limit was given
    elif load.duration_s is not None:
        num_prompts = max(1, math.ceil(load.request_rate * load.duration_s))
    else:
        num_prompts = workload.num_prompts or 1000  # the random dataset's default, as vLLM's
    shape = LoadShape(
        input_len=workload.random_input_len,
        output_len=max(workload.random_output_len, 2),
        num_prompts=num_prompts,
        max_concurrency=load.max_concurrency,
        request_rate=load.request_rate,
    )
    return shape, ""


def default_planner_gpu(on_cpu: bool) -> tuple[str | None, str]:
    """The catalog entry the planner models this machine with, or None and why there is none. On CPU that is
    `host`: this machine as deepserve measures it (the first use measures it, a few seconds; then it is cached)."""
    if on_cpu:
        return HOST_NAMES[0], ""
    gpus = local_gpus()
    accelerator = match_device_name(gpus[0].name) if gpus else None
    if accelerator is None:
        found = gpus[0].name if gpus else "no GPU"
        return None, f"the planner's catalog has no entry for {found}; pass --planner-gpu NAME"
    return accelerator.name, ""


def plan_config_for(
    config: EngineConfig, model: str, gpu: str, shape: LoadShape, spec_acceptance: Sequence[float] = ()
) -> PlanConfig:
    """One engine-config point as the planner's question (the one place that maps EngineConfig to PlanConfig).
    SPEC_ACCEPTANCE: the drafts' acceptance per position when the point speculates (default: published)."""
    return PlanConfig(
        model=model,
        gpu=gpu,
        gpus=config.tensor_parallel_size * config.pipeline_parallel_size * config.data_parallel_size,
        weights=_weights(config.quantization),
        kv_dtype="fp8" if (config.kv_cache_dtype or "auto").startswith("fp8") else "auto",
        max_model_len=config.max_model_len,
        input_len=shape.input_len,
        output_len=shape.output_len,
        concurrency=shape.concurrency_levels(),
        slo_itl_ms=None,
        engine=config.engine,
        tp=config.tensor_parallel_size,
        pp=config.pipeline_parallel_size,
        dp=config.data_parallel_size,
        ep=config.enable_expert_parallel,
        gpu_memory_utilization=config.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens or PLANNER_DEFAULT_BATCHED_TOKENS,
        speculative_method=config.speculative_method,
        num_speculative_tokens=config.num_speculative_tokens,
        spec_acceptance=list(spec_acceptance) if config.speculation_requested else [],
    )


def forecast(
    config: EngineConfig,
    model: str,
    gpu: str | None,
    shape: LoadShape | None,
    why_not: str,
    spec_acceptance: Sequence[float] = (),
) -> Forecast:
    """What the planner predicts for CONFIG (serving MODEL on GPU) under SHAPE; WHY_NOT says why there is no GPU
    or shape to predict with."""
    if gpu is None or shape is None:
        return Forecast(fits=None, note=why_not)
    try:
        plan = _plan(plan_config_for(config, model, gpu, shape, spec_acceptance), config)
    except (DeepserveError, ValueError) as exc:
        return Forecast(fits=None, note=f"the planner cannot model this point: {exc}")
    caveat = _caveat(plan)
    if not plan.fits:
        return Forecast(fits=False, note="the planner finds no room for a KV cache of one max_model_len sequence")
    if not plan.predictions:
        return Forecast(fits=True, note="the planner predicts no running sequences (KV cache too small)")
    return _under_load(plan, shape, caveat)


def prune_reason(forecast: Forecast, slos: Sequence[Slo], margin: float | None) -> str | None:
    """Why a point need not run: it cannot fit, or a predicted mean exceeds MARGIN times an SLO's limit."""
    if forecast.fits is False:
        return f"cannot fit: {forecast.note}"
    if not margin or not forecast.predicted:
        return None
    for slo in slos:
        value = forecast.value_for(slo)
        if value is not None and value > margin * slo.max_ms:
            return (
                f"predicted {slo.words.split(' ≤ ')[0]} about {value:,.0f} ms, more than {margin:g} × the SLO's "
                f"{slo.max_ms:g} ms"
            )
    return None


def promise(forecast: Forecast, slos: Sequence[Slo]) -> tuple[int, float]:
    """Sort key, most promising first: predicted to meet the SLOs (by predicted goodput), then not predicted,
    then predicted to miss (by predicted throughput)."""
    goodput = forecast.goodput_output_tok_s(slos)
    if goodput is None:
        return (1, 0.0)
    if goodput > 0:
        return (0, -goodput)
    return (2, -(forecast.output_tok_s or 0.0))


def _plan(question: PlanConfig, config: EngineConfig) -> Plan:
    """make_plan, with a KV cache given in GiB (the CPU build's way) turned into the memory fraction the planner
    models: weights and reserve (from a first plan) plus the cache, over the device's memory."""
    plan = make_plan(question)
    if config.kv_cache_memory_gib is None or config.gpu_memory_utilization is not None:
        return plan
    memory = plan.deployment.memory
    used = memory.weights_bytes_per_gpu + memory.reserve_bytes_per_gpu + config.kv_cache_memory_gib * GIB
    fraction = used / plan.deployment.accelerator.memory_bytes
    return make_plan(question.model_copy(update={"gpu_memory_utilization": min(max(fraction, 1e-3), 1.0)}))


def _under_load(plan: Plan, shape: LoadShape, caveat: str) -> Forecast:
    predictions = list(plan.predictions)
    if math.isinf(shape.request_rate):
        chosen, saturated = predictions[0], False
    else:
        # Little's law: N requests in the system at rate λ take W each, N = λ W. The steady state is the first
        # level whose closed-loop request rate N / W reaches λ; beyond the last level the rate is not sustained.
        sustained = [p for p in predictions if p.concurrency / (p.e2el_ms / 1000.0) >= shape.request_rate]
        chosen, saturated = (sustained[0], False) if sustained else (predictions[-1], True)
    note = caveat
    if saturated:
        capacity = max(p.concurrency / (p.e2el_ms / 1000.0) for p in predictions)
        above = f"{shape.request_rate:g} requests/s is above the predicted capacity of {capacity:,.2f}/s"
        note = "; ".join(filter(None, [above, caveat]))
    return Forecast(
        fits=True,
        output_tok_s=chosen.output_throughput_tok_s,
        tpot_ms=chosen.tpot_ms,
        ttft_ms=chosen.ttft_ms,
        e2el_ms=chosen.e2el_ms,
        concurrency=chosen.concurrency,
        saturated=saturated,
        note=note,
    )


def _caveat(plan: Plan) -> str:
    provenance = plan.factors.provenance
    return "" if provenance in ("", "fitted") else f"efficiency factors {provenance}"


def _weights(quantization: str | None) -> str | None:
    """The planner's weight format for an engine --quantization (None: the checkpoint's own format)."""
    if quantization is None:
        return None
    lowered = quantization.lower()
    if lowered == "fp8":
        return "fp8-dynamic"  # vLLM's --quantization fp8 quantizes a 16-bit checkpoint at load, per tensor
    if lowered.startswith("awq"):
        return "awq-int4"
    return None


def _rounded(value: Any) -> Any:
    return round(value, 3) if isinstance(value, float) and math.isfinite(value) else value
