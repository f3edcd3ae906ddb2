"""The planner's types: what `deepserve plan` is asked (PlanConfig) and the deployment it resolves (Deployment)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pydantic import Field, field_validator

from deepserve.config import Section
from deepserve.engines.registry import check_engine_name
from deepserve.engines.speculative import SpeculativeMethod
from deepserve.errors import ConfigError
from deepserve.hardware.catalog import Accelerator, Network
from deepserve.models.spec import ModelSpec
from deepserve.plan.calibration import apply_calibration
from deepserve.plan.engine_pools import sglang_v4_pool
from deepserve.plan.formats import WeightFormat
from deepserve.plan.kernels import KernelRates, kernel_rates
from deepserve.plan.layout import Layout, layout_links
from deepserve.plan.memory import MemoryPlan
from deepserve.plan.perf import PerformanceModel, StepOptions
from deepserve.plan.profiles import SelectedFactors, select_profile
from deepserve.plan.speculative import SpeculativeDecoding, parse_acceptance, speculative_model

DEFAULT_CONCURRENCY = (1, 8, 16, 32, 64, 128, 256)


class PlanConfig(Section):
    """What `deepserve plan` is asked; CLI flags derive from these fields (section `plan` of the config file)."""

    model: str = Field("deepseek-ai/DeepSeek-V3", description="preset name (`deepserve model list`) or model dir")
    gpu: str = Field("h100", description="GPU type from the catalog, case-insensitive (h100 = H100 SXM)")
    gpus: int = Field(8, ge=1, description="total GPUs (all nodes)")
    nodes: int | None = Field(
        None,
        ge=1,
        description="machines the GPUs are spread over (an NVL72 rack's compute trays share its NVLink; default: as "
        "few as hold them)",
    )
    weights: str | None = Field(
        None,
        description=(
            "bf16, fp16, fp8, fp8-dynamic, awq-int4, mxfp4, nvfp4; None = the checkpoint's format (another format "
            "loads the model's published export in it, e.g. an AWQ or NVFP4 repack)"
        ),
    )
    kv_dtype: str = Field("auto", description="KV-cache dtype: auto (the activation dtype, 16-bit) or fp8")
    max_model_len: int | None = Field(
        None, ge=16, description="context length; None = 32768 or the model's maximum if smaller"
    )
    input_len: int = Field(1024, ge=1, description="prompt tokens per request")
    output_len: int = Field(256, ge=2, description="output tokens per request")
    concurrency: list[int] = Field(default_factory=lambda: list(DEFAULT_CONCURRENCY), description="levels")
    slo_itl_ms: float | None = Field(50.0, gt=0, description="inter-token latency objective (mean, ms)")
    gpu_hour_usd: float | None = Field(None, gt=0, description="price of one GPU-hour, for cost per 1M tokens")
    engine: str = Field("vllm", description="engine whose overhead profile to use (a name in the engines registry)")
    engine_version: str | None = Field(
        None, description="engine version (e.g. 0.7.3) for its version facts; None = the profile's current version"
    )
    tp: int | None = Field(None, ge=1, description="tensor-parallel size; None = GPUs per node")
    pp: int | None = Field(None, ge=1, description="pipeline-parallel size; None = the number of nodes")
    dp: int = Field(1, ge=1, description="data-parallel attention replicas (with --ep)")
    ep: bool = Field(False, description="expert parallelism: whole experts per GPU instead of split experts")
    network: str = Field(
        "infiniband-ndr", description="between nodes: ib, roce, tcp (or infiniband-ndr, roce-400g, ethernet-100g)"
    )
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="fraction of GPU memory the engine uses")
    max_num_seqs: int | None = Field(None, ge=1, description="running-batch cap; None = what the KV cache holds")
    max_num_batched_tokens: int = Field(8192, ge=1, description="tokens per step (sizes the activation reserve)")
    calibration: Path | None = Field(
        None, description="JSON from benchmarks/calibrate_gpu.py: measured kernel efficiencies replace the table's"
    )
    num_prompts: int | None = Field(
        None, ge=1, description="forecast a benchmark of this many requests per concurrency level (the simulator)"
    )
    request_rate: float | None = Field(
        None, gt=0, description="with --num-prompts: requests arrive at this Poisson rate (None: all at once)"
    )
    length_spread: float = Field(
        0.0, ge=0, lt=1, description="with --num-prompts: lengths drawn within mean x (1 +- spread)"
    )
    speculative_method: SpeculativeMethod | None = Field(
        None, description="speculative decoding: mtp, dspark, ngram, auto (the vendor's), none (default: off)"
    )
    num_speculative_tokens: int | None = Field(None, ge=0, description="draft tokens per step (0: off)")
    spec_acceptance: list[float] = Field(
        default_factory=list,
        description="acceptance per draft position (0.8,0.6,0.4, vLLM's per-position rates) or one rate for each "
        "draft given the ones before; default: published MTP/DSpark figures",
    )

    @field_validator("spec_acceptance", mode="before")
    @classmethod
    def _acceptance_list(cls, value: object) -> object:
        """ "0.8,0.6" from a flag or a file, also repeated (--spec-acceptance 0.8 --spec-acceptance 0.6)."""
        if isinstance(value, str):
            return list(parse_acceptance(value))
        if isinstance(value, list) and any(isinstance(item, str) for item in value):
            return [rate for item in value for rate in parse_acceptance(str(item))]
        return value

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, name: str) -> str:
        try:
            return check_engine_name(name)
        except ConfigError as exc:  # as a ValueError, pydantic reports it with the field like every other
            raise ValueError(str(exc)) from None

    @field_validator("concurrency")
    @classmethod
    def _positive_levels(cls, levels: list[int]) -> list[int]:
        if not levels or any(level < 1 for level in levels):
            raise ValueError("concurrency levels must be positive integers, e.g. 1,8,64")
        return sorted(set(levels))


@dataclass(frozen=True)
class Deployment:
    """Model x format x layout x hardware x engine, resolved and checked."""

    spec: ModelSpec
    fmt: WeightFormat
    layout: Layout
    accelerator: Accelerator
    nodes: int
    network: Network
    engine: str
    kv_dtype: str
    memory: MemoryPlan
    max_num_seqs: int | None
    engine_version: str | None = None
    max_num_batched_tokens: int = 8192
    calibration: Path | None = None  # kernel figures measured on this GPU class (benchmarks/calibrate_gpu.py)
    speculation: SpeculativeDecoding | None = None  # speculative decoding (its MTP layers are in the memory plan)
    options: StepOptions = field(default_factory=StepOptions)  # two-batch overlap of communication

    @property
    def hosts(self) -> int:
        """The machines the engine launches on: the nodes, or more where one node's NVLink domain spans several
        machines (an NVL72 rack's 72 GPUs are 18 compute trays of 4)."""
        return max(self.nodes, -(-self.layout.gpus // self.accelerator.gpus_per_machine))

    @property
    def running_cap(self) -> int:
        """Most requests running at once over the whole deployment: what the KV cache holds at the planned lengths,
        and max_num_seqs as the engine applies it (see seqs_schedulers and max_num_seqs_in_effect)."""
        cap = self.memory.max_concurrent_sequences
        seqs = self.max_num_seqs_in_effect
        if seqs is not None:
            cap = min(cap, seqs * self.seqs_schedulers)
        pool = self.engine_pool_sequences_per_rank
        if pool is not None:
            cap = min(cap, pool * self.layout.dp)
        return max(cap, 0)

    @property
    def engine_pool_sequences_per_rank(self) -> int | None:
        """Requests of the planned lengths that the engine's own KV pool admits on one data-parallel rank, where
        its profile records a pool of its own for this model (SGLang's sliding-window pool for DeepSeek-V4,
        plan/engine_pools.py); None where the planner's cache model is the engine's."""
        selected = self.select_engine(across_engines=False)
        ratio = None if selected is None else selected.facts.swa_full_tokens_ratio.get(self.spec.architecture)
        if ratio is None or not self.memory.fits:
            return None
        slots = self.max_num_seqs_in_effect or self.memory.max_concurrent_sequences // self.layout.dp
        memory = self.memory
        pool = sglang_v4_pool(
            self.spec, memory.kv_cache_bytes_per_gpu, ratio, max(slots, 1), speculative=self.speculation is not None
        )
        return pool.sequences(memory.prompt_len or memory.sequence_len, memory.sequence_len)

    @property
    def prefill_tokens_per_rank_step(self) -> int:
        """Prompt tokens one data-parallel rank may prefill in a step: the step's token budget, divided where the
        engine's profile says its DP attention divides it (SGLang's --chunked-prefill-size // dp_size: 8,192 on
        8 ranks is 1,024 tokens each)."""
        selected = self.select_engine(across_engines=False)
        if selected is None:
            return self.max_num_batched_tokens
        return selected.facts.prefill_chunk_per_rank(self.max_num_batched_tokens, self.layout.dp)

    @property
    def max_num_seqs_in_effect(self) -> int | None:
        """max_num_seqs per scheduler as the engine runs it: the plan's; else the engine's own default for this
        model where its profile records one (SGLang runs DeepSeek-V4 with 256 requests at most, shared out over
        the data-parallel ranks); else None, and the KV cache decides."""
        if self.max_num_seqs is not None:
            return self.max_num_seqs
        default = self.engine_default_running_requests
        return None if default is None else max(default // self.layout.dp, 1)

    @property
    def engine_default_running_requests(self) -> int | None:
        """The engine's running-request cap over all ranks for this model when its command sets none (the
        profile's fact default_running_requests); None when the engine has no such default."""
        selected = self.select_engine(across_engines=False)
        if selected is None:
            return None
        return selected.facts.default_running_requests.get(self.spec.architecture)

    @property
    def seqs_schedulers(self) -> int:
        """How many schedulers each apply max_num_seqs to their own requests: one per data-parallel rank (vLLM V1
        and SGLang: each rank runs its own scheduler, which caps all pipeline micro-batches together), times the
        pipeline micro-batches where the engine's version caps each separately (vLLM V0's one scheduler per
        "virtual engine"; the profile's fact max_num_seqs_per_micro_batch in data/engine_profiles.json)."""
        return self.layout.dp * self.micro_batches_capped()

    def micro_batches_capped(self) -> int:
        """How many pipeline micro-batches one max_num_seqs covers separately (vLLM V0: each; else one cap)."""
        selected = self.select_engine()
        per_micro_batch = selected is not None and selected.facts.max_num_seqs_per_micro_batch
        return self.layout.pp if per_micro_batch else 1

    @property
    def max_num_seqs_per_rank(self) -> int | None:
        """The engine's --max-num-seqs for this plan: the running cap shared out over the schedulers that apply it
        (SGLang's launcher turns it back into its global --max-running-requests); None when nothing fits."""
        if self.running_cap <= 0:
            return None
        return max(self.running_cap // self.seqs_schedulers, 1)

    def select_engine(self, across_engines: bool = True) -> SelectedFactors | None:
        """The engine profile for this deployment (see plan/profiles.py); None when none may stand in."""
        return select_profile(
            self.engine, self.accelerator.hardware_class, self.engine_version, across_engines=across_engines
        )

    def kernel_rates(self) -> KernelRates:
        """The kernel table's figures for this GPU and weight format, with the calibration's measured ones in place
        where the deployment has one."""
        rates = kernel_rates(
            self.accelerator,
            self.fmt.name,
            mla_decode_backend=self.options.mla_decode_backend,
            dense_gemm_backend=self.options.dense_gemm_backend,
            kv_cache_dtype=self.kv_dtype,
        )
        return rates if self.calibration is None else apply_calibration(rates, self.calibration)

    def performance_model(
        self, selected: SelectedFactors | None = None, rates: KernelRates | None = None
    ) -> PerformanceModel:
        """The step model of this deployment with engine profile SELECTED (default: the deployment's own) and
        kernel figures RATES (default: the table's for this GPU and weight format)."""
        engine = selected or self.select_engine()
        assert engine is not None  # across_engines=True always finds the device's profile
        links = layout_links(self.layout, self.accelerator, self.nodes, self.network)
        model = PerformanceModel(
            self.spec,
            self.fmt,
            self.layout,
            self.accelerator,
            links,
            rates or self.kernel_rates(),
            engine,
            self.kv_dtype,
            self.options,
        )
        return speculative_model(model, self.speculation)
