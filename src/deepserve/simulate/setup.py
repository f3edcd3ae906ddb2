"""From the engine flags and the hardware to pretend to be, to a simulated engine: the planner's deployment (its
memory plan gives the KV cache, its performance model the step times) and vLLM's defaults for what is left out.

Only the planner's stable interface is used: `make_plan(PlanConfig)` → `Plan.deployment` (a `Deployment` with its
`MemoryPlan`) and `Plan.factors`, then `Deployment.performance_model(factors).step(...)`. It is imported only when
step times come from it: a simulator with fixed timings (what tests and benchmarks start) is up sooner without.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from deepserve.config import validate_section
from deepserve.engines.config import EngineConfig
from deepserve.engines.vllm import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    cpu_runs_prompts_whole,
    default_batch_limits,
    default_block_size,
)
from deepserve.errors import ConfigError
from deepserve.hardware.catalog import Accelerator, get_accelerator
from deepserve.models.presets import canonical_preset_name
from deepserve.models.resolve import load_spec
from deepserve.models.spec import ModelSpec
from deepserve.simulate.clock import SimClock
from deepserve.simulate.config import SimulateConfig
from deepserve.simulate.core import EngineCore
from deepserve.simulate.engine import FixedLatencyEngine, SimEngine, SteppedEngine
from deepserve.simulate.kv_cache import KVCacheManager
from deepserve.simulate.scheduler import Scheduler, SchedulerLimits
from deepserve.simulate.speculation import AcceptanceSampler, Drafting
from deepserve.simulate.timing import FixedStepTimer, PlannerStepTimer, StepTimer

if TYPE_CHECKING:
    from deepserve.plan.perf import PerformanceModel, Prediction, RequestLengths
    from deepserve.plan.planner import Plan
    from deepserve.plan.speculative import SpeculativeDecoding
    from deepserve.plan.types import PlanConfig

DEFAULT_MODEL = "deepseek-ai/DeepSeek-V3"
FIXED_MAX_MODEL_LEN = 32768  # a fixed-timing simulator of an unknown model: the planner's default context
# vLLM's --quantization values that change the weight format of a checkpoint that does not already have it
QUANTIZATION_FORMATS = {"fp8": "fp8-dynamic"}
CHECKPOINT_QUANTIZATIONS = {"awq": "awq", "awq_marlin": "awq", "gptq": "gptq", "gptq_marlin": "gptq"}
CHECKPOINT_EXAMPLES = {"awq": "cognitivecomputations/DeepSeek-V3-0324-AWQ"}  # presets stored that way


@dataclass(frozen=True)
class SimulatedDeployment:
    """Everything the simulated engine runs with, resolved and checked."""

    served_model_name: str
    model: str
    max_model_len: int
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    chunked_prefill: bool
    prefix_caching: bool
    pipeline_stages: int
    gpu: str
    timing: str  # how step times are decided, in words
    data_parallel: int = 1  # attention replicas, each with its own max_num_seqs and token budget
    state_blocks_per_sequence: int = 0  # V4: blocks of windows and compressor state every request holds
    plan: Plan | None = None  # the planner's view (None with fixed timings of a model it does not know)
    model_of_steps: PerformanceModel | None = None
    speculation: SpeculativeDecoding | None = None  # speculative decoding: K drafts a step, acceptance per position

    def describe(self) -> str:
        if self.plan is None and self.timing.startswith("fixed TTFT"):
            return f"{self.served_model_name} with {self.timing} (no batching, no KV cache), max_model_len " + (
                f"{self.max_model_len:,}"
            )
        where = f"as if on {self._hardware()}" if self.plan is not None else f"with {self.timing}"
        state = (
            f" (each request also holds {self.state_blocks_per_sequence} for its sliding windows and compressor state)"
            if self.state_blocks_per_sequence
            else ""
        )
        speculation = f"; speculative decoding: {self.speculation.describe()}" if self.speculation else ""
        return (
            f"{self.served_model_name} {where}; KV cache {self.num_blocks:,} blocks of {self.block_size} tokens"
            f"{state}; "
            f"max_num_seqs {self.max_num_seqs}, max_num_batched_tokens {self.max_num_batched_tokens}, chunked "
            f"prefill {_on(self.chunked_prefill)}, prefix caching {_on(self.prefix_caching)}, max_model_len "
            f"{self.max_model_len:,}{speculation}"
        )

    def _hardware(self) -> str:
        assert self.plan is not None
        d = self.plan.deployment
        return (
            f"{d.layout.gpus} x {d.accelerator.name} ({d.layout.describe()}, weights {d.fmt.name}, KV cache "
            f"{d.kv_dtype}); {self.timing}"
        )

    def predict(self, concurrency: int, workload: RequestLengths) -> Prediction:
        """The planner's closed-loop prediction for this deployment (its running cap: what the KV cache holds at
        the workload's lengths, and max_num_seqs per pipeline stage)."""
        if self.model_of_steps is None:
            raise ConfigError("fixed timings have no step model to predict with; leave out --fixed-*")
        sequence_blocks = -(-(workload.input_len + workload.output_len) // self.block_size)
        sequence_blocks += self.state_blocks_per_sequence
        cap = min(self.num_blocks // sequence_blocks, self.max_num_seqs * self.pipeline_stages)
        return self.model_of_steps.predict(concurrency, workload, cap)

    def cache_info(self) -> dict[str, str]:
        """vLLM's vllm:cache_config_info labels (the ones that mean something here)."""
        return {
            "block_size": str(self.block_size),
            "num_gpu_blocks": str(self.num_blocks),
            "enable_prefix_caching": str(self.prefix_caching),
            "gpu": self.gpu,
        }


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def resolve(engine: EngineConfig, sim: SimulateConfig) -> SimulatedDeployment:
    sim = _hardware_from_engine(engine, sim)
    accelerator = get_accelerator(sim.gpu)
    default_seqs, default_tokens = default_batch_limits(accelerator)
    model = engine.model or DEFAULT_MODEL
    chunked = engine.enable_chunked_prefill is not False  # vLLM's V1 default: on (prefix caching too)
    served = engine.served_model_name or canonical_preset_name(model) or model.rstrip("/")
    common: dict[str, Any] = {
        "served_model_name": served,
        "max_num_seqs": engine.max_num_seqs or default_seqs,
        "chunked_prefill": chunked,
        "prefix_caching": engine.enable_prefix_caching is not False,
        "gpu": accelerator.name,
    }
    if sim.spec_acceptance and not engine.speculation_requested:
        raise ConfigError(
            "--spec-acceptance sets how drafts are accepted: turn speculative decoding on with "
            "--num-speculative-tokens K (or --speculative-method)"
        )
    if sim.fixed_latency or sim.fixed_step_ms is not None:
        return _fixed(engine, sim, model, common, default_tokens)
    from deepserve.plan.planner import make_plan

    spec = load_spec(model)
    if cpu_runs_prompts_whole(accelerator, spec.is_mla):
        chunked = common["chunked_prefill"] = common["prefix_caching"] = False
    max_model_len = engine.max_model_len or min(FIXED_MAX_MODEL_LEN, spec.max_position_embeddings)
    batched = engine.max_num_batched_tokens or (default_tokens if chunked else max(max_model_len, default_tokens))
    plan = make_plan(_plan_config(engine, sim, model, spec, max_model_len, batched, common["max_num_seqs"]))
    memory = plan.deployment.memory
    pooled = memory.kv_layout is not None and not memory.kv_layout.is_linear
    block_size = engine.block_size or (
        memory.kv_block_tokens if pooled else default_block_size(spec.is_mla, accelerator)
    )
    num_blocks = _kv_blocks(plan, engine, block_size, accelerator)
    state_blocks = memory.kv_state_blocks_per_sequence if pooled else 0
    if (num_blocks - state_blocks) * block_size < max_model_len:
        raise ConfigError(
            f"the simulated KV cache holds {num_blocks * block_size:,} tokens, fewer than one sequence of "
            f"max_model_len {max_model_len:,} (vLLM refuses to start so); lower --max-model-len, raise "
            "--gpu-memory-utilization or --kv-cache-memory-gib, or add GPUs"
        )
    factors = plan.factors
    return SimulatedDeployment(
        model=model,
        max_model_len=max_model_len,
        block_size=block_size,
        num_blocks=num_blocks,
        state_blocks_per_sequence=state_blocks,
        max_num_batched_tokens=batched,
        pipeline_stages=plan.deployment.layout.pp,
        data_parallel=plan.deployment.layout.dp,
        timing=f"step times from the planner (profile {factors.profile}, {factors.provenance})",
        plan=plan,
        model_of_steps=plan.deployment.performance_model(factors, plan.rates),
        speculation=plan.deployment.speculation,
        **common,
    )


def _hardware_from_engine(engine: EngineConfig, sim: SimulateConfig) -> SimulateConfig:
    """A config file's engine.gpu_type and engine.nnodes (what `deepserve serve` checks a deployment with) stand
    for --gpu and --nodes when those are not given; given both, they must agree."""
    updates: dict[str, Any] = {}
    for engine_field, sim_field, value in (
        ("gpu_type", "gpu", engine.gpu_type),
        ("nnodes", "nodes", engine.nnodes),
    ):
        if engine_field not in engine.model_fields_set or value is None:
            continue
        if sim_field in sim.model_fields_set and getattr(sim, sim_field) != value:
            raise ConfigError(
                f"--{engine_field.replace('_', '-')} {value} and --{sim_field} {getattr(sim, sim_field)} disagree: "
                "give one of them"
            )
        updates[sim_field] = value
    return sim.model_copy(update=updates) if updates else sim


def _fixed(
    engine: EngineConfig, sim: SimulateConfig, model: str, common: dict[str, Any], default_tokens: int
) -> SimulatedDeployment:
    """Fixed timings need no planner: any model name is served, and the KV cache holds max_num_seqs sequences of
    max_model_len (nothing is ever preempted)."""
    max_model_len = engine.max_model_len or FIXED_MAX_MODEL_LEN
    block_size = engine.block_size or DEFAULT_BLOCK_SIZE
    chunked = common["chunked_prefill"]
    batched = engine.max_num_batched_tokens or (default_tokens if chunked else max(max_model_len, default_tokens))
    if sim.fixed_step_ms is not None:
        timing = f"every step {sim.fixed_step_ms:g} ms"
    else:
        timing = f"fixed TTFT {sim.fixed_ttft_ms or 0:g} ms, ITL {sim.fixed_itl_ms or 0:g} ms per stream"
    speculation = _fixed_speculation(engine, sim)
    return SimulatedDeployment(
        model=model,
        max_model_len=max_model_len,
        block_size=block_size,
        num_blocks=common["max_num_seqs"] * -(-max_model_len // block_size),
        max_num_batched_tokens=batched,
        pipeline_stages=1,
        timing=timing,
        speculation=speculation,
        **common,
    )


def _fixed_speculation(engine: EngineConfig, sim: SimulateConfig) -> SpeculativeDecoding | None:
    """Speculative decoding with fixed step times: drafts and their acceptance as asked (no model to consult, so
    the method is only a name and the number of draft tokens must be given)."""
    from deepserve.plan.speculative import SpeculativeDecoding, acceptance_per_position, published_acceptance

    if not engine.speculation_requested:
        return None
    if sim.fixed_latency:
        raise ConfigError(
            "--fixed-ttft-ms/--fixed-itl-ms stream each request on its own, one token at a time: simulate "
            "speculative decoding with --fixed-step-ms (engine steps) or the step model"
        )
    method = engine.speculative_method if engine.speculative_method not in (None, "auto") else "mtp"
    if engine.num_speculative_tokens is None:
        raise ConfigError("with fixed step times give the number of drafts: --num-speculative-tokens K")
    k = engine.num_speculative_tokens
    published = published_acceptance(method, k)
    if sim.spec_acceptance:
        rates, source = acceptance_per_position(sim.spec_acceptance, k), "given"
    elif published is not None:
        rates, source = published
    else:
        raise ConfigError(f"give the acceptance of {method} drafts: --spec-acceptance 0.6 or 0.7,0.5,0.3")
    return SpeculativeDecoding(method, k, rates, 0, source)


def _plan_config(
    engine: EngineConfig,
    sim: SimulateConfig,
    model: str,
    spec: ModelSpec,
    max_model_len: int,
    batched: int,
    max_num_seqs: int,
) -> PlanConfig:
    from deepserve.plan.types import PlanConfig

    given = engine.model_fields_set
    values = {
        "model": model,
        "gpu": sim.gpu,
        "gpus": sim.gpus,
        "nodes": sim.nodes,
        "weights": sim.weights or _weights_from_quantization(engine.quantization, spec),
        "kv_dtype": engine.kv_cache_dtype or "auto",
        "max_model_len": max_model_len,
        "concurrency": [1],
        "engine": engine.engine,
        "tp": engine.tensor_parallel_size if "tensor_parallel_size" in given else None,
        "pp": engine.pipeline_parallel_size if "pipeline_parallel_size" in given else None,
        "dp": engine.data_parallel_size,
        "ep": engine.enable_expert_parallel,
        "network": sim.network,
        "gpu_memory_utilization": engine.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": batched,
        "calibration": sim.calibration,
        "speculative_method": engine.speculative_method,
        "num_speculative_tokens": engine.num_speculative_tokens,
        "spec_acceptance": sim.spec_acceptance or None,
    }
    # Fields left unset take the planner's defaults: fewer names tie this module to PlanConfig's.
    return validate_section(PlanConfig, "plan", {key: value for key, value in values.items() if value is not None})


def _weights_from_quantization(quantization: str | None, spec: ModelSpec) -> str | None:
    """vLLM's --quantization as the planner's weight format: fp8 quantizes a 16-bit checkpoint on the fly; the
    others name the checkpoint's own format, which the planner reads from the checkpoint."""
    from deepserve.plan.formats import checkpoint_format

    if quantization is None:
        return None
    method = quantization.lower()
    stored = checkpoint_format(spec).name
    if method in QUANTIZATION_FORMATS:
        return None if stored.startswith(method) else QUANTIZATION_FORMATS[method]
    family = CHECKPOINT_QUANTIZATIONS.get(method)
    if family is None:
        valid = ", ".join([*QUANTIZATION_FORMATS, *CHECKPOINT_QUANTIZATIONS])
        raise ConfigError(f"--quantization {quantization} is not simulated; valid: {valid} (or give --weights)")
    if family not in stored:
        example = CHECKPOINT_EXAMPLES.get(family, "a local checkpoint directory")
        raise ConfigError(
            f"--quantization {quantization} needs a checkpoint stored as {family.upper()}, but {spec.name} is "
            f"stored as {stored}; name one stored so with --model (e.g. {example}), or give --weights"
        )
    return None


def _kv_blocks(plan: Plan, engine: EngineConfig, block_size: int, accelerator: Accelerator) -> int:
    from deepserve.plan.memory import GIB

    deployment = plan.deployment
    memory = deployment.memory
    if not memory.fits and memory.kv_cache_bytes_per_gpu <= 0:
        raise ConfigError(
            f"{deployment.spec.name} does not fit on {deployment.layout.gpus} x {accelerator.name} with weights "
            f"{deployment.fmt.name}: {memory.weights_bytes_per_gpu / 1e9:,.1f} GB of weights and "
            f"{memory.reserve_bytes_per_gpu / 1e9:,.1f} GB of reserve per GPU exceed the "
            f"{memory.budget_bytes_per_gpu / 1e9:,.1f} GB budget; `deepserve plan` with the same flags shows the "
            "breakdown (try --weights awq-int4, a larger --gpu, or more --gpus)"
        )
    cache = memory.kv_layout
    if cache is not None and not cache.is_linear:
        # V4: vLLM's pool of blocks, each as large as the largest cache group's pages (models/kv_cache.py); a block
        # of the growing cache holds block_size tokens
        kv_bytes = int(engine.kv_cache_memory_gib * GIB) if engine.kv_cache_memory_gib is not None else None
        pool = memory.kv_pool_blocks if kv_bytes is None else kv_bytes // cache.block_bytes
        return max(pool * deployment.layout.dp * memory.kv_block_tokens // block_size, 0)
    if engine.kv_cache_memory_gib is not None:
        tokens = int(engine.kv_cache_memory_gib * GIB) // memory.kv_bytes_per_token_per_gpu * deployment.layout.dp
    else:
        tokens = memory.kv_cache_tokens
    return max(tokens // block_size, 0)


def build_engine(deployment: SimulatedDeployment, sim: SimulateConfig, clock: SimClock) -> SimEngine:
    """The engine the server runs: stepped (the scheduler over the step model, or over fixed steps), or fixed
    latency per stream."""
    if sim.fixed_latency:
        ttft_s, itl_s = (sim.fixed_ttft_ms or 0.0) / 1e3, (sim.fixed_itl_ms or 0.0) / 1e3
        return FixedLatencyEngine(clock, ttft_s, itl_s, deployment.max_model_len, sim.fixed_burst_tokens)
    return SteppedEngine(build_core(deployment, sim), clock)


def build_core(deployment: SimulatedDeployment, sim: SimulateConfig) -> EngineCore:
    timer: StepTimer
    if sim.fixed_step_ms is not None:
        timer = FixedStepTimer(sim.fixed_step_ms / 1e3)
    elif deployment.model_of_steps is not None:
        timer = PlannerStepTimer(deployment.model_of_steps)
    else:
        raise ConfigError("no step model for this deployment: give --fixed-step-ms or a model the planner knows")
    # vLLM's V1 engine caps the running requests of all pipeline micro-batches together at max_num_seqs; each
    # data-parallel rank has its own scheduler (simulated as one whose limits are the ranks' sum).
    dp = deployment.data_parallel
    limits = SchedulerLimits(
        max_num_seqs=deployment.max_num_seqs * dp,
        max_num_batched_tokens=deployment.max_num_batched_tokens * dp,
        max_model_len=deployment.max_model_len,
        chunked_prefill=deployment.chunked_prefill,
    )
    kv = KVCacheManager(
        deployment.num_blocks,
        deployment.block_size,
        deployment.max_model_len,
        deployment.prefix_caching,
        deployment.state_blocks_per_sequence,
    )
    speculation = deployment.speculation
    drafting = None
    if speculation is not None:
        drafting = Drafting(speculation.num_tokens, AcceptanceSampler(speculation.acceptance, seed=sim.spec_seed))
    try:
        scheduler = Scheduler(limits, kv, drafting)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return EngineCore(scheduler, timer, deployment.pipeline_stages)
