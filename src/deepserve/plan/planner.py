"""`deepserve plan`: from a model, a GPU type and a GPU count to memory, fit, speed, capacity, cost and commands."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from deepserve.engines.registry import check_engine_name, memory_fraction_of
from deepserve.engines.speculative import resolve_speculation
from deepserve.errors import ConfigError
from deepserve.hardware.catalog import Accelerator, get_accelerator, get_network
from deepserve.models.resolve import load_spec
from deepserve.models.spec import ModelSpec
from deepserve.plan.benchmark import BenchmarkForecast, BenchmarkForecaster, BenchmarkRun
from deepserve.plan.commands import launch_lines
from deepserve.plan.cost import usd_per_million_output_tokens
from deepserve.plan.explain import Explanation, explain
from deepserve.plan.formats import WeightFormat, checkpoint_format, get_format
from deepserve.plan.kernels import KernelRates
from deepserve.plan.layout import Layout, check_layout, default_layout
from deepserve.plan.memory import plan_memory
from deepserve.plan.perf import PerformanceModel, Prediction, RequestLengths
from deepserve.plan.profiles import SelectedFactors
from deepserve.plan.speculative import SpeculativeDecoding, speculative_decoding
from deepserve.plan.track_record import TrackRecord, record_for
from deepserve.plan.types import Deployment, PlanConfig

# Engines that published figures name but deepserve cannot launch: the planner reads their rows, nothing else
# (TensorRT-LLM was one until it got a launcher, engines/trtllm.py).
PUBLISHED_ONLY_ENGINES: tuple[str, ...] = ()


def resolve_kv_dtype(kv_dtype: str, fmt: WeightFormat, spec: ModelSpec | None = None) -> str:
    """vLLM's `auto` caches in the activation dtype: FP16 for AWQ, BF16 otherwise (both 2 bytes); for V4 it is
    FP8 (the packed fp8_ds_mla record its FlashMLA kernels read, models/kv_cache.py)."""
    if kv_dtype == "auto" and spec is not None and spec.attention_kind == "compressed_sparse":
        return "fp8"
    if kv_dtype == "auto":
        return "float16" if fmt.compute_dtype == "fp16" else "bfloat16"
    aliases = {"fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "bf16": "bfloat16", "fp16": "float16"}
    return aliases.get(kv_dtype.lower(), kv_dtype.lower())


def build_deployment(
    spec: ModelSpec,
    gpu: str,
    gpus: int,
    nodes: int = 1,
    weights: str | None = None,
    layout: Layout | None = None,
    engine: str = "vllm",
    kv_dtype: str = "auto",
    network: str = "infiniband-ndr",
    gpu_memory_utilization: float = 0.9,
    max_model_len: int | None = None,
    workload: RequestLengths | None = None,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int = 8192,
    engine_version: str | None = None,
    accelerator: Accelerator | None = None,
    draft_modules: bool = False,
    fp4_indexer_cache: bool = False,
    speculation: SpeculativeDecoding | None = None,
) -> Deployment:
    """GPU names the catalog entry; ACCELERATOR, when given, is used instead (a measured host, for instance).
    DRAFT_MODULES: the checkpoint's MTP / DSpark modules are loaded (their weights and KV count), as SPECULATION's
    draft layers are; SPECULATION: speculative decoding, whose draft layers the step model also runs;
    FP4_INDEXER_CACHE: V4's indexer keys in MXFP4 (vLLM's --attention_config.use_fp4_indexer_cache)."""
    accelerator = accelerator or get_accelerator(gpu)
    check_engine_name(engine, also=PUBLISHED_ONLY_ENGINES)
    fmt = get_format(weights) if weights else checkpoint_format(spec)
    layout = layout or default_layout(gpus, nodes)
    check_layout(layout, spec, gpus)
    if nodes > 1 and gpus // nodes > accelerator.devices_per_node:
        raise ConfigError(f"{gpus // nodes} GPUs per node exceeds the {accelerator.devices_per_node} a node holds")
    workload = workload or RequestLengths(1024, 256)
    check_context_length(spec, max_model_len)
    context = max_model_len or min(32768, spec.max_position_embeddings)
    kv = resolve_kv_dtype(kv_dtype, fmt, spec)
    memory = plan_memory(
        spec,
        fmt,
        layout,
        accelerator,
        kv,
        gpu_memory_utilization,
        context,
        workload.input_len + workload.output_len,
        max_num_batched_tokens,
        draft_modules=draft_modules or (speculation is not None and speculation.draft_layers > 0),
        fp4_indexer_cache=fp4_indexer_cache,
        prompt_len=workload.input_len,
        fraction_of=memory_fraction_of(engine),
    )
    return Deployment(
        spec,
        fmt,
        layout,
        accelerator,
        nodes,
        get_network(network),
        engine,
        kv,
        memory,
        max_num_seqs,
        engine_version,
        max_num_batched_tokens,
        speculation=speculation,
    )


def plan_speculation(config: PlanConfig, spec: ModelSpec) -> SpeculativeDecoding | None:
    """The plan's speculative decoding: the method and draft tokens as the engine resolves them for this model
    and device (the vendor's recommendation filling what is not given; engines/speculative.py), and the acceptance
    per position (given, or published for the method)."""
    hardware_class = get_accelerator(config.gpu).hardware_class
    engine = "sglang" if config.engine == "sglang" else "vllm"
    resolved = resolve_speculation(
        config.speculative_method,
        config.num_speculative_tokens,
        spec,
        engine=engine,
        on_cpu=hardware_class == "cpu",
        hardware_class=hardware_class,
        max_model_len=config.max_model_len,
    )
    if resolved is None:
        if config.spec_acceptance:
            raise ConfigError("--spec-acceptance needs speculative decoding: give --speculative-method or tokens")
        return None
    return speculative_decoding(resolved.method, resolved.num_tokens, config.spec_acceptance, spec)


@dataclass(frozen=True)
class Plan:
    config: PlanConfig
    deployment: Deployment
    factors: SelectedFactors  # the engine profile (name kept from the fitted-factors model)
    predictions: tuple[Prediction, ...]
    max_concurrency_within_slo: int | None
    commands: dict[str, str]
    smallest_fitting_gpus: int | None = None  # when it does not fit: GPUs of this type (whole nodes) that would
    serve_commands: tuple[str, ...] = ()  # `deepserve serve` on each node, node 0 first
    rates: KernelRates | None = None  # the kernel figures the predictions used
    explanations: tuple[Explanation, ...] = ()  # why this format, layout and KV-cache size
    forecasts: tuple[BenchmarkForecast, ...] = ()  # the finite benchmark per concurrency level (--num-prompts)
    deploy_render: str = ""  # `deepserve deploy render` for this plan
    # how far held-out forecasts of this layout kind on this vendor's GPUs have been (plan/track_record.py)
    track_record: TrackRecord | None = None

    @property
    def fits(self) -> bool:
        return self.deployment.memory.fits

    def cost_per_million_output_tokens_usd(self, prediction: Prediction) -> float | None:
        gpus = self.deployment.layout.gpus
        return usd_per_million_output_tokens(prediction.output_throughput_tok_s, gpus, self.config.gpu_hour_usd)

    def to_json(self) -> dict[str, Any]:
        d, memory = self.deployment, self.deployment.memory
        predictions = []
        for prediction in self.predictions:
            row: dict[str, Any] = prediction.to_json()
            cost = self.cost_per_million_output_tokens_usd(prediction)
            row["usd_per_million_output_tokens"] = None if cost is None else round(cost, 4)
            predictions.append(row)
        return {
            "model": d.spec.name,
            "gpu": d.accelerator.name,
            "gpus": d.layout.gpus,
            "nodes": d.nodes,
            "layout": {"tp": d.layout.tp, "pp": d.layout.pp, "dp": d.layout.dp, "ep": d.layout.ep},
            "weights": d.fmt.name,
            "kv_dtype": d.kv_dtype,
            "fits": self.fits,
            "kv_bytes_per_token": memory.kv_bytes_per_token,
            "kv_bytes_per_token_per_gpu": memory.kv_bytes_per_token_per_gpu,
            "kv_fixed_bytes_per_sequence": memory.kv_fixed_bytes_per_sequence,
            "kv_bytes_per_sequence": memory.kv_bytes_per_sequence(memory.sequence_len),
            "draft_modules": memory.draft_modules,
            "weights_bytes_per_gpu": memory.weights_bytes_per_gpu,
            "weights_by_component": {
                c.component: {"bytes_per_gpu": c.bytes_per_gpu, "placement": c.placement} for c in memory.components
            },
            "reserve_bytes_per_gpu": memory.reserve_bytes_per_gpu,
            "budget_bytes_per_gpu": memory.budget_bytes_per_gpu,
            "kv_cache_bytes_per_gpu": memory.kv_cache_bytes_per_gpu,
            "kv_cache_tokens": memory.kv_cache_tokens,
            "max_model_len": memory.max_model_len,
            "max_concurrent_sequences": memory.max_concurrent_sequences,
            "input_len": self.config.input_len,
            "output_len": self.config.output_len,
            "efficiency_factors": {  # key kept for scripts: the engine profile now, not three fitted factors
                **self.factors.parameters.to_json(),
                "profile": self.factors.profile,
                "provenance": self.factors.provenance,
            },
            "performance_model": self._model_json(),
            "explanations": [e.to_json() for e in self.explanations],
            "track_record": self.track_record.to_json() if self.track_record else None,
            "predictions": predictions,
            "slo_itl_ms": self.config.slo_itl_ms,
            "max_concurrency_within_slo": self.max_concurrency_within_slo,
            "smallest_fitting_gpus": self.smallest_fitting_gpus,
            "mtp_params_not_loaded": 0 if d.speculation and d.speculation.draft_layers else d.spec.mtp_params(),
            "speculative_decoding": _speculation_json(d.speculation),
            "commands": self.commands,
            "serve_commands": list(self.serve_commands),
            "deploy_render_command": self.deploy_render,
            "max_num_seqs_per_dp_rank": d.max_num_seqs_per_rank if self.fits else None,
            "benchmark_forecasts": [f.to_json() for f in self.forecasts],
        }

    def _model_json(self) -> dict[str, Any]:
        f = self.factors
        rates = self.rates or self.deployment.kernel_rates()
        return {
            "engine_profile": f.profile,
            "engine_version": f.version,
            "provenance": f.provenance,
            "parameters": f.parameters.to_json(),
            "fitted_parameters": list(f.engine.fitted),
            "launch_mode": f.facts.step_launch(rates.family),
            "kernel_figures": rates.provenance,
            "kinds": {
                kind: {
                    "memory_efficiency": rate.memory_efficiency,
                    "compute_efficiency": rate.compute_efficiency,
                    "floor_us": rate.floor_us,
                    "measured": rate.measured,
                    "source": rate.source,
                }
                for kind, rate in rates.kinds.items()
            },
        }


def _speculation_json(speculation: SpeculativeDecoding | None) -> dict[str, Any] | None:
    if speculation is None:
        return None
    return {
        "method": speculation.method,
        "num_speculative_tokens": speculation.num_tokens,
        "acceptance_per_position": [round(rate, 4) for rate in speculation.acceptance],
        "acceptance_source": speculation.acceptance_source,
        "tokens_per_step": round(speculation.tokens_per_step, 4),
        "draft_layers": speculation.draft_layers,
    }


def make_plan(config: PlanConfig, forecaster: BenchmarkForecaster | None = None) -> Plan:
    """The plan for CONFIG; with FORECASTER and --num-prompts, the benchmark run as it would run, per level."""

    spec = load_spec(config.model)
    layout = _layout_from(config)
    workload = RequestLengths(config.input_len, config.output_len)
    deployment = build_deployment(
        spec,
        config.gpu,
        config.gpus,
        nodes=nodes_for(config),
        weights=config.weights,
        layout=layout,
        engine=config.engine,
        kv_dtype=config.kv_dtype,
        network=config.network,
        gpu_memory_utilization=config.gpu_memory_utilization,
        max_model_len=config.max_model_len,
        workload=workload,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        engine_version=config.engine_version,
        speculation=plan_speculation(config, spec),
    )
    deployment = replace(deployment, calibration=config.calibration)
    selected = deployment.select_engine()
    assert selected is not None  # across_engines=True always finds the device's profile
    rates = deployment.kernel_rates()
    predictions: tuple[Prediction, ...] = ()
    forecasts: tuple[BenchmarkForecast, ...] = ()
    within_slo = None
    if deployment.memory.fits and deployment.running_cap > 0:
        model = deployment.performance_model(selected, rates)
        cap = deployment.running_cap
        predictions = tuple(model.predict(c, workload, cap) for c in config.concurrency)
        if config.slo_itl_ms is not None:
            within_slo = highest_concurrency_within(model, workload, cap, config.slo_itl_ms)
        if forecaster is not None and config.num_prompts:
            forecasts = tuple(forecaster.forecast(deployment, model, run) for run in benchmark_runs(config))
    lines = launch_lines(deployment, config)
    smallest = None if deployment.memory.fits else smallest_fitting_gpus(config)
    explanations = explain(config, deployment, selected, rates, smallest)
    return Plan(
        config,
        deployment,
        selected,
        predictions,
        within_slo,
        lines.engines,
        smallest,
        lines.serve,
        rates,
        explanations,
        forecasts,
        lines.render,
        record_for(deployment.layout.kind, deployment.accelerator.vendor, deployment.spec.attention_kind),
    )


def benchmark_runs(config: PlanConfig) -> list[BenchmarkRun]:
    """The benchmark --num-prompts asks for, at each concurrency level."""
    assert config.num_prompts is not None
    return [
        BenchmarkRun(
            num_prompts=config.num_prompts,
            input_len=config.input_len,
            output_len=config.output_len,
            concurrency=level,
            request_rate=config.request_rate,
            input_spread=config.length_spread,
            output_spread=config.length_spread,
        )
        for level in config.concurrency
    ]


MAX_NODES_SEARCHED = 8


def check_context_length(spec: ModelSpec, max_model_len: int | None) -> None:
    """vLLM refuses a max_model_len beyond the model's positions (max_position_embeddings, which YaRN checkpoints
    state already scaled: vllm/config/model.py, _get_and_verify_max_len), and so does SGLang's --context-length."""
    limit = spec.max_position_embeddings
    if max_model_len is not None and max_model_len > limit:
        raise ConfigError(
            f"--max-model-len {max_model_len:,} exceeds {spec.name}'s {limit:,} positions (max_position_embeddings): "
            f"the engines refuse it (vLLM unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, past which positions are "
            f"undefined); give {limit} or less"
        )


def nodes_for(config: PlanConfig) -> int:
    """The NVLink domains of --nodes machines (12 trays of an NVL72 rack are one), or the fewest whole nodes that
    hold --gpus (16 H100s: two nodes of 8, as practitioners run it)."""
    accelerator = get_accelerator(config.gpu)
    return accelerator.nvlink_domains(config.gpus, config.nodes or 1)


def smallest_fitting_gpus(config: PlanConfig) -> int | None:
    """Fewest GPUs of the planned type on which the model fits with the planned format, context and memory
    settings: part of a node first (1, 2, 4, ... GPUs with TP over all of them, as V4-Flash runs on 4 of a node's
    8), then whole nodes with TP inside a node and PP across nodes; None beyond MAX_NODES_SEARCHED nodes."""
    spec = load_spec(config.model)
    per_node = get_accelerator(config.gpu).devices_per_node
    speculation = plan_speculation(config, spec)
    for gpus, nodes in fitting_candidates(per_node):
        try:
            deployment = build_deployment(
                spec,
                config.gpu,
                gpus,
                nodes=nodes,
                weights=config.weights,
                kv_dtype=config.kv_dtype,
                network=config.network,
                gpu_memory_utilization=config.gpu_memory_utilization,
                max_model_len=config.max_model_len,
                workload=RequestLengths(config.input_len, config.output_len),
                max_num_batched_tokens=config.max_num_batched_tokens,
                speculation=speculation,
            )
        except ConfigError:
            continue  # e.g. a node size whose TP does not divide the heads
        if deployment.memory.fits:
            return gpus
    return None


def fitting_candidates(per_node: int) -> list[tuple[int, int]]:
    """(GPUs, nodes) in the order smallest_fitting_gpus tries them: powers of two below a node, then whole nodes."""
    partial = [(1 << k, 1) for k in range(per_node.bit_length()) if (1 << k) < per_node]
    return partial + [(per_node * nodes, nodes) for nodes in range(1, MAX_NODES_SEARCHED + 1)]


def nodes_holding(gpus: int, per_node: int) -> int:
    """Whole nodes GPUS spans (at least one)."""
    return max(-(-gpus // per_node), 1)


def highest_concurrency_within(
    model: PerformanceModel, workload: RequestLengths, cap: int, slo_itl_ms: float
) -> int | None:
    """Largest concurrency (up to the running cap) whose predicted TPOT meets the SLO; TPOT grows with
    concurrency, so a bisection finds it. None when even one request misses it."""
    if model.predict(1, workload, cap).tpot_ms > slo_itl_ms:
        return None
    low, high = 1, max(cap, 1)
    if model.predict(high, workload, cap).tpot_ms <= slo_itl_ms:
        return high
    while high - low > 1:
        middle = (low + high) // 2
        if model.predict(middle, workload, cap).tpot_ms <= slo_itl_ms:
            low = middle
        else:
            high = middle
    return low


def _layout_from(config: PlanConfig) -> Layout | None:
    """The layout the flags ask for; what they leave out fills the GPUs: PP from TP x DP when TP is given (so TP1 x
    DP16 with EP on 16 GPUs is wide EP over two nodes, PP 1), else PP across the nodes for TP alone and PP 1 with
    data-parallel attention."""
    if config.tp is None and config.pp is None and config.dp == 1 and not config.ep:
        return None
    dp = config.dp
    pp = _pipeline_stages(config)
    tp = config.tp or max(config.gpus // (pp * dp), 1)
    return Layout(tp=tp, pp=pp, dp=dp, ep=config.ep)


def _pipeline_stages(config: PlanConfig) -> int:
    """--pp, else what --tp x --dp leave of the GPUs (wide EP, `--tp 1 --dp 16 --ep` on two nodes, spreads the
    data-parallel ranks over the nodes with PP 1; `--tp 16` spans them), else one stage per node (TP inside a node,
    PP across)."""
    if config.pp is not None:
        return config.pp
    if config.tp is not None:
        return max(config.gpus // (config.tp * config.dp), 1)
    return 1 if config.dp > 1 else nodes_for(config)
