"""The published serving figures (calibration set) and how each row becomes a prediction of the model.

Two files: the seeds' rows (../shared/published/serving_figures.csv, copied to data/serving_figures.json, rows
1-31) and the rows collected from 24 public sources (data/published_rows.csv, rows 101-452: row 100 + n is line n
of the research CSV; every row keeps its source, and its `scored_as` and `curation` columns say how the planner
reads it and what was filled in or why it is left out). A row is expressible when its workload, layout, model,
GPU, weight format and engine are known to the planner; `unpredictable_reason` says why not otherwise.

How a row is scored (`scored_as`):
- closed_loop: clients at a concurrency, each sending its next request when the last ended (the steady formula;
  the forecaster's finite run where the number of requests is known);
- sweep_peak: the best of a concurrency sweep or a request-rate sweep (the seeds);
- finite: a run whose shape matters (a request rate, everything at once, few requests): the forecaster's run;
- prefill_phase / decode_phase: one pool of a prefill/decode disaggregated deployment measured alone;
- excluded: not a measurement the planner can express (the curation column says why).
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, replace
from pathlib import Path

from deepserve.engines.sglang import default_chunked_prefill_size
from deepserve.errors import DeepserveError
from deepserve.hardware.catalog import get_accelerator
from deepserve.models.presets import preset_spec
from deepserve.models.spec import ModelSpec
from deepserve.plan.benchmark import BenchmarkRun
from deepserve.plan.calibration import calibrated_class
from deepserve.plan.formats import get_format
from deepserve.plan.layout import Layout
from deepserve.plan.perf import RequestLengths, StepOptions
from deepserve.plan.planner import build_deployment
from deepserve.plan.profiles import version_key
from deepserve.plan.speculative import SpeculativeDecoding, acceptance_from_length, speculative_decoding
from deepserve.plan.types import Deployment, PlanConfig

FIGURES_PATH = Path(__file__).with_name("data") / "serving_figures.json"
ROWS_PATH = Path(__file__).with_name("data") / "published_rows.csv"
RESEARCH_ROW_OFFSET = 100
SCORED_KINDS = ("closed_loop", "sweep_peak", "finite", "prefill_phase", "decode_phase")
GPUS_PER_NODE = 8
DEFAULT_BATCHED_TOKENS: int = PlanConfig.model_fields["max_num_batched_tokens"].default  # plan's own default


@dataclass(frozen=True)
class SourceSetup:
    """What a source says about its setup beyond the CSV's columns (each field with the source's words in
    SOURCE_SETUPS)."""

    max_num_seqs: int | None = None
    max_model_len: int | None = None
    # the engine's memory fraction in its own meaning (TensorRT-LLM's free_gpu_memory_fraction is of the memory the
    # weights leave: Engine.memory_fraction_of)
    gpu_memory_utilization: float = 0.9
    network: str = "infiniband-ndr"
    concurrency_sweep: tuple[int, ...] = ()  # a "best over the sweep" row is the best of these levels
    rate_sweep: bool = False  # rows without a concurrency are peaks over a request-rate sweep
    throughput_tokens_stated: bool = True  # False: "tokens/s" without saying output or all tokens
    prompts_per_concurrency: int = 0  # the client sends this many requests per unit of concurrency
    client_default_prompts: int = 0  # the client's own default request count, where the source states none
    length_mean_factor: float = 1.0  # mean length / stated length (clients that draw lengths below the stated one)
    length_spread: float = 0.0  # lengths uniform within mean x (1 +- spread)
    overlap_comm: bool = False  # two-batch overlap of the experts' exchange with computation
    prefill_tokens_per_gpu: int = 0  # prefill-phase rows: prompt tokens per GPU per step
    decode_batch_per_gpu: float = 0.0  # decode-phase rows: sequences per GPU (0: as many as the KV cache holds)
    accept_lengths: tuple[tuple[int, float], ...] = ()  # speculative rows: (draft tokens, mean acceptance length)
    max_num_batched_tokens: int | None = None  # None: the engine's own (SGLang's by GPU memory), else plan's
    mla_decode_backend: str | None = None  # the MLA decode kernel the launch command forces (kernels.json)
    dense_gemm_backend: str | None = None  # the dense GEMM kernel the launch forces (kernels.json, per family)


# InferenceX's client (its benchmark scripts): ten requests per client, lengths drawn within [0.8 L, L].
_INFERENCEX_CLIENT = SourceSetup(prompts_per_concurrency=10, length_mean_factor=0.9, length_spread=0.111)

SOURCE_SETUPS = {
    # 001: vLLM 0.7.3, MAX_NUM_SEQS=128 and MAX_MODEL_LEN=8000; two nodes over 100 Gb/s Ethernet, no InfiniBand;
    # its figures without a concurrency come from request-rate sweeps (QPS 1-20).
    "001_5e41702b812a2cc2.txt": SourceSetup(
        max_num_seqs=128, max_model_len=8000, network="ethernet-100g", rate_sweep=True
    ),
    # 002: vLLM 0.16 on B200, --max-model-len 32768 --gpu-memory-utilization 0.90; vLLM's default max_num_seqs
    # for large GPUs (1024). Its client is `vllm bench serve` (the table's TPOT, ITL p99 and "peak burst
    # throughput", bench serve's "Peak output token throughput") with no request count given: bench serve's
    # default, --num-prompts 1000 (vllm/benchmarks/serve.py), so at 512 and 1024 clients the run is one or two
    # waves of 1000 requests, not a steady loop.
    # Its command sets --block-size 1, which on Blackwell only vLLM's Triton MLA backend accepts (FlashMLA takes
    # 64, FlashInfer's MLA 32 or 64, CUTLASS MLA 128: each backend's get_supported_kernel_block_sizes, selected in
    # vllm/platforms/cuda.py), so its decode attention ran Triton's kernel.
    "002_9b8c54d8c5a2373d.txt": SourceSetup(
        max_num_seqs=1024, max_model_len=32768, client_default_prompts=1000, mla_decode_backend="triton"
    ),
    # 004: online sweep at concurrency 4, 8, ..., 128 with 3200 input and 800 output tokens. Its throughputs are
    # "tokens/s" with no word on which tokens: its client (SGLang's bench_serving) prints both output and total
    # (input + output) throughput, and the H200 row's own note reads "all tokens/s as reported". As output rates the
    # MI300X and H200 figures would need a TPOT near 28-31 ms at 128 requests of 4,000 tokens on TP8, below what
    # reading the weights and the replicated latent cache takes at full bandwidth (docs/PLANNING.md, section 6).
    "004_857d13a67e4d6d20.txt": SourceSetup(concurrency_sweep=(4, 8, 16, 32, 64, 128), throughput_tokens_stated=False),
    # LMSYS large-scale EP: prefill nodes at 16,384 prompt tokens per GPU (the 4K case), decode nodes at 256
    # sequences per GPU, both with two-batch overlap (--enable-two-batch-overlap) and DeepEP.
    "lmsys-large-ep-h100": SourceSetup(
        overlap_comm=True, prefill_tokens_per_gpu=16384, decode_batch_per_gpu=256, max_num_batched_tokens=16384
    ),
    # LMSYS MTP blog: 2 requests per rank on the decode nodes; MTP accept lengths 2.18 (3 drafts) and 2.44 (4).
    "lmsys-mtp-h200": SourceSetup(decode_batch_per_gpu=2, accept_lengths=((3, 2.18), (4, 2.44))),
    # AMD MTP blog: sglang.bench_serving --random-input 1024 --random-output 1024 without --random-range-ratio
    # (default 0.0: lengths uniform in [1, L], mean L/2); --mem-fraction-static 0.85; MTP accept length not tabled.
    "lmsys-amd-mtp-mi300x": SourceSetup(gpu_memory_utilization=0.85, length_mean_factor=0.5, length_spread=1.0),
    # InferenceX (benchmarks/dsr1_fp8_h200.sh): --num-prompts CONC*10, --max-running-requests 512 (1K/1K) or 256,
    # --mem-fraction-static 0.82, --chunked-prefill-size 32768; lengths drawn within [0.8 L, L] (the e2e latency
    # over TPOT gives 0.9 L tokens on average).
    "inferencex-870-h200": replace(
        _INFERENCEX_CLIENT, max_num_seqs=512, gpu_memory_utilization=0.82, max_num_batched_tokens=32768
    ),
    # InferenceX on MI325X (PR 3318's baseline, benchmarks/dsr1_fp8_mi325x.sh): --num-prompts CONC*10,
    # --mem-fraction-static 0.8, --chunked-prefill-size 131072, the same client as the H200 run above.
    "inferencex-3318-mi325x": replace(_INFERENCEX_CLIENT, gpu_memory_utilization=0.8, max_num_batched_tokens=131072),
    # TensorRT-LLM's DeepSeek-R1 guide (trtllm-bench throughput, an in-process client): the H200 max-throughput run
    # caps each of the 8 attention-DP ranks at max_batch_size 128 requests and max_num_tokens 1151 tokens a step,
    # 1K/2K requests (max_seq_len 3072 in its options), kv_cache_free_gpu_mem_fraction 0.8.
    "trtllm-best-perf": SourceSetup(
        max_num_seqs=128, max_model_len=3072, max_num_batched_tokens=1151, gpu_memory_utilization=0.8
    ),
    # InferenceX on B200 with TensorRT-LLM (PR 3317's baseline, benchmarks/single_node/dsr1_fp8_b200_trt.sh @
    # f5d7fa4): trtllm-serve --max_num_tokens max(8192, CONC+ISL rounded up to 64), i.e. 8192 for every 1K/1K
    # point (8320 at 8K/1K, where a prompt of at most 8192 tokens fits either way); max_batch_size not set (the
    # server's default, far above 128 clients); free_gpu_memory_fraction 0.8 (0.75 for 8K/1K on TP4, where either
    # leaves some 14 GiB per GPU, hundreds of times what 8 clients hold); the client of the InferenceX runs above.
    "inferencex-3317-b200-trt": replace(_INFERENCEX_CLIENT, max_num_batched_tokens=8192, gpu_memory_utilization=0.8),
    # LMSYS GB200 part II (lm-sys.github.io blog/2025-09-25-gb200-part-2.md): each decode rank's batch fills its KV
    # cache, which the blog puts at 1,408 sequences for 2K prompts (768 for 4K) with FP8 attention; where the cache
    # holds fewer (BF16 attention), the batch is what it holds (scoring.py takes the smaller).
    "lmsys-gb200-2": SourceSetup(decode_batch_per_gpu=1408),
    # PR 3602: bench_serving's default range ratio (lengths uniform in [1, L]).
    "sglang-3602-h200": SourceSetup(length_mean_factor=0.5, length_spread=1.0),
    # SGLang's DeepSeek-V4 cookbook (docs_new/src/snippets/configs/deepseek-ai/deepseek-v4.jsx, benchmarkCommands):
    # sglang.bench_serving --dataset-name random --random-input-len ISL --random-output-len OSL without
    # --random-range-ratio (default 0.0: lengths uniform in [1, L]), --num-prompts by concurrency (numPromptsByConc,
    # the CSV's num_prompts) and 64 warm-up requests sent before the measured ones.
    "sglang-v4-cookbook": SourceSetup(length_mean_factor=0.5, length_spread=1.0),
    # PR 5571's run set SGL_ENABLE_JIT_DEEPGEMM=0 and not SGLANG_SUPPORT_CUTLASS_BLOCK_FP8, so SGLang's FP8
    # block-scaled linear layers ran its Triton GEMM (w8a8_block_fp8_matmul), not DeepGEMM.
    "sglang-5571-h200": SourceSetup(dense_gemm_backend="triton"),
}


@dataclass(frozen=True)
class RowMetric:
    """A published metric read as the quantity the planner predicts, its statistic and its normalisation."""

    quantity: str  # output_throughput, total_throughput, input_throughput, request_throughput, tpot, ttft, itl,
    # e2el, duration, per_user
    statistic: str = "mean"  # mean, median, p99
    per: str = ""  # "", gpu, node
    seconds: bool = False  # the value is in seconds, not ms

    @property
    def group(self) -> str:
        """How validation groups it: throughput, tpot, ttft, e2el; tails (p99) apart."""
        if self.statistic == "p99":
            return "p99"
        if self.quantity in ("tpot", "itl", "per_user"):
            return "tpot"
        if self.quantity in ("ttft", "e2el"):
            return self.quantity
        return "throughput"


_THROUGHPUTS = ("output_throughput", "total_throughput", "input_throughput", "request_throughput")


def parse_metric(name: str, unit: str) -> RowMetric | None:
    """NAME (e.g. ttft_p99, total_throughput_per_gpu, e2el) as a RowMetric; None for metrics the planner does not
    predict (a per-second peak, an unnamed token type)."""
    if name == "benchmark_duration":
        return RowMetric("duration", seconds=True)
    if name == "output_throughput_per_user":
        return RowMetric("per_user")
    for quantity in _THROUGHPUTS:
        if name == quantity or name.startswith(quantity + "_per_"):
            return RowMetric(quantity, per=name[len(quantity) + 5 :] if name != quantity else "")
    base, _, statistic = name.partition("_")
    if base in ("ttft", "tpot", "itl", "e2el") and statistic in ("", "mean", "median", "p99"):
        return RowMetric(base, statistic or "mean", seconds=unit == "s")
    return None


@dataclass(frozen=True)
class PublishedRow:
    number: int  # 1-31: the seeds' CSV; 101-432: 100 + the line of the research CSV
    source: str
    hardware: str
    gpus: int
    engine: str
    engine_version: str
    model: str
    weights: str
    kv_dtype: str
    tp: int | None
    pp: int | None
    input_len: int | None
    output_len: int | None
    concurrency: int | None
    metric: str
    value: float
    unit: str
    note: str
    dp: int = 1
    ep: int | None = None  # GPUs the routed experts are spread over as whole experts (None: split by TP)
    nodes: int | None = None
    spec: str = ""
    num_prompts: int | None = None
    request_rate: float | None = None
    source_id: str = ""
    scored_as: str = "closed_loop"
    curation: str = ""

    def label(self) -> str:
        layout = self.layout_words()
        lengths = f"{self.input_len}/{self.output_len}" if self.input_len else "?/?"
        level = f"rate {self.request_rate:g}" if self.request_rate else "peak"
        level = f"c={self.concurrency}" if self.concurrency else level
        setup = f"{self.hardware} x{self.gpus} {self.engine} {self.weights} {layout}"
        return f"#{self.number} {setup} {lengths} {level} {self.metric}"

    def layout_words(self) -> str:
        parts = [f"TP{self.tp}" if self.tp else "TP?"]
        if self.pp and self.pp > 1:
            parts.append(f"PP{self.pp}")
        if self.dp > 1:
            parts.append(f"DP{self.dp}")
        if self.ep and self.ep > 1:
            parts.append(f"EP{self.ep}")
        return " ".join(parts)

    @property
    def setup(self) -> SourceSetup:
        return SOURCE_SETUPS.get(self.source_id or self.source, SOURCE_SETUPS.get(self.source, SourceSetup()))

    @property
    def weight_format(self) -> str:
        """The format's name: the weights column up to its first parenthesis, which says how the source put it
        (e.g. 'fp4 (DeepSeek release: MXFP4 experts + FP8)' -> 'fp4', the V4 release's MXFP4 experts)."""
        return self.weights.split("(", 1)[0].strip()

    @property
    def parsed_metric(self) -> RowMetric | None:
        return parse_metric(self.metric, self.unit)

    @property
    def speculative_tokens(self) -> int:
        """Draft tokens per step from the `spec` column: mtp:N, or SGLang's NEXTN "stepsN"; 0 without."""
        if not self.spec.startswith("mtp:"):
            return 0
        words = self.spec[4:].split()
        steps = [w[5:] for w in words if w.startswith("steps") and w[5:].isdigit()]
        digits = steps[0] if steps else "".join(ch for ch in (words[0] if words else "") if ch.isdigit())
        return int(digits) if digits else 0

    def layout(self) -> Layout:
        assert self.tp is not None
        return Layout(tp=self.tp, pp=self.pp or 1, dp=self.dp, ep=bool(self.ep and self.ep > 1))

    @property
    def layout_kind(self) -> str:
        return self.layout().kind if self.tp else "unknown"

    @property
    def stage_count(self) -> int:
        return self.nodes or max(self.gpus // GPUS_PER_NODE, 1)


def load_rows(seeds_path: Path = FIGURES_PATH, research_path: Path | None = ROWS_PATH) -> list[PublishedRow]:
    rows = [_seed_row(number, raw) for number, raw in enumerate(json.loads(seeds_path.read_text())["rows"], 1)]
    if research_path is not None and research_path.is_file():
        with research_path.open() as handle:
            rows += [_research_row(raw) for raw in csv.DictReader(handle)]
    return rows


def _seed_row(number: int, raw: dict[str, str]) -> PublishedRow:
    concurrency = _int_or_none(raw["concurrency"])
    row = PublishedRow(
        number=number,
        source=raw["source"],
        hardware=raw["hardware"],
        gpus=int(raw["gpus"]),
        engine=raw["engine"],
        engine_version=raw["engine_version"],
        model=raw["model"],
        weights=raw["weights"],
        kv_dtype=raw["kv_dtype"],
        tp=int(raw["tp"]),
        pp=int(raw["pp"]),
        input_len=_int_or_none(raw["input_len"]),
        output_len=_int_or_none(raw["output_len"]),
        concurrency=concurrency,
        metric=raw["metric"],
        value=float(raw["value"]),
        unit=raw["unit"],
        note=raw["note"],
        source_id=f"seed-{raw['source'][:3]}",
        nodes=max(int(raw["gpus"]) // GPUS_PER_NODE, 1),
    )
    return replace(row, scored_as="closed_loop" if concurrency is not None else "sweep_peak")


def _research_row(raw: dict[str, str]) -> PublishedRow:
    tp, pp, dp = _int_or_none(raw["tp"]), _int_or_none(raw["pp"]) or 1, _int_or_none(raw["dp"]) or 1
    gpus = int(raw["gpus"]) if raw["gpus"] else 0
    if tp is not None and dp > 1 and tp * pp * dp != gpus and tp * pp == gpus:
        tp = tp // dp  # SGLang's --tp is the whole group; the DP replica's attention TP is --tp / --dp-size
    return PublishedRow(
        number=int(raw["row"]),
        source=raw["source"],
        hardware=raw["hardware"],
        gpus=gpus,
        engine=raw["engine"],
        engine_version=raw["engine_version"],
        model=raw["model"],
        weights=raw["weights"],
        kv_dtype=raw["kv_dtype"],
        tp=tp,
        pp=pp,
        input_len=_int_or_none(raw["input_len"]),
        output_len=_int_or_none(raw["output_len"]),
        concurrency=_int_or_none(raw["concurrency"]),
        metric=raw["metric"],
        value=float(raw["value"]),
        unit=raw["unit"],
        note=raw["note"],
        dp=dp,
        ep=_int_or_none(raw["ep"]),
        nodes=_int_or_none(raw["nodes"]),
        spec=raw["spec"].strip(),
        num_prompts=_int_or_none(raw["num_prompts"]),
        request_rate=_float_or_none(raw["request_rate"]),
        source_id=raw["source_id"],
        scored_as=raw["scored_as"],
        curation=raw["curation"],
    )


# ---- expressibility -----------------------------------------------------------------------------------------

MODEL_PRESETS = (  # the row's model, by the first name its text contains
    ("W4AFP8", ""),
    ("V4-Flash", "deepseek-ai/DeepSeek-V4-Flash"),
    ("V4-Pro", "deepseek-ai/DeepSeek-V4-Pro"),
    ("V3.2", "deepseek-ai/DeepSeek-V3.2"),
    ("V3.1", "deepseek-ai/DeepSeek-V3.1"),
    ("DeepSeek", "deepseek-ai/DeepSeek-V3"),  # V3, V3-0324, R1, R1-0528: one architecture
)
AWQ_PRESET = "cognitivecomputations/DeepSeek-V3-AWQ"


def row_spec(row: PublishedRow) -> ModelSpec:
    """V3, V3-0324 and R1 share one architecture; the AWQ rows load cognitivecomputations' export (no MTP)."""
    if row.weights.startswith("awq"):
        return preset_spec(AWQ_PRESET)
    preset = next(name for needle, name in MODEL_PRESETS if needle in row.model)
    return preset_spec(preset)


def unpredictable_reason(row: PublishedRow) -> str | None:
    """Why the model cannot predict ROW, or None."""
    if row.scored_as == "excluded":
        return row.curation or "excluded"
    if row.parsed_metric is None:
        return f"metric {row.metric}: not a quantity the planner predicts (an offline run, an undefined token count)"
    if row.parsed_metric.group == "throughput" and not row.setup.throughput_tokens_stated:
        return "the source's tokens/s does not say whether it counts output or all tokens"
    phase = row.scored_as in ("prefill_phase", "decode_phase")
    if row.input_len is None or (row.output_len is None and not phase):
        return "input/output lengths not given (a figure quoted without its workload)"
    if row.tp is None:
        return "parallel layout not stated"
    return _setup_reason(row) or _workload_reason(row)


def _setup_reason(row: PublishedRow) -> str | None:
    for check, what in ((_model_known, "model"), (_gpu_known, "GPU"), (_format_known, "weight format")):
        problem = check(row)
        if problem:
            return f"{what} {problem}: unknown to deepserve (expressible once the catalog, formats or presets have it)"
    return None


def _model_known(row: PublishedRow) -> str | None:
    try:
        row_spec(row)
    except (DeepserveError, StopIteration):
        return f"{row.model!r}"
    return None


def _gpu_known(row: PublishedRow) -> str | None:
    try:
        get_accelerator(row.hardware)
    except DeepserveError:
        return f"{row.hardware!r}"
    return None


def _format_known(row: PublishedRow) -> str | None:
    try:
        get_format(row.weight_format)
    except DeepserveError:
        return f"{row.weights!r}"
    return None


def _workload_reason(row: PublishedRow) -> str | None:
    setup = row.setup
    if row.scored_as == "sweep_peak" and not (setup.concurrency_sweep or setup.rate_sweep):
        return "no concurrency and no sweep to take the peak of"
    if row.scored_as == "closed_loop" and row.concurrency is None:
        return "no concurrency stated"
    if row.scored_as == "finite" and benchmark_run(row) is None:
        return "the run's number of requests is not stated"
    return None


# ---- the row as a deployment, a workload, a benchmark run ------------------------------------------------------


def row_workload(row: PublishedRow) -> RequestLengths:
    """The mean lengths the client sent (a client that draws lengths below the stated ones scales them); a phase
    row without an output length decodes at its stated KV length."""
    assert row.input_len is not None
    factor = row.setup.length_mean_factor
    output = row.output_len if row.output_len is not None else 2
    return RequestLengths(max(round(row.input_len * factor), 1), max(round(output * factor), 2))


LONG_RUN_ROUNDS = 6  # a closed loop of unstated length: this many requests per client after a first round
LONG_RUN_MAX_CLIENTS = 128  # beyond, a long closed loop is the steady formula's (the queue, not waves, decides)


def benchmark_run(row: PublishedRow) -> BenchmarkRun | None:
    """The finite run the source's client made, when the number of requests is known; a closed loop of unstated
    length (a long run) as LONG_RUN_ROUNDS requests per client after a first round left out (its first wave)."""
    setup = row.setup
    prompts = row.num_prompts or (setup.prompts_per_concurrency * (row.concurrency or 0)) or None
    if prompts is None and row.scored_as == "closed_loop" and row.concurrency:
        prompts = setup.client_default_prompts or None
    warmup = 0
    if (
        prompts is None
        and row.scored_as == "closed_loop"
        and row.concurrency
        and row.concurrency <= LONG_RUN_MAX_CLIENTS
    ):
        prompts, warmup = (LONG_RUN_ROUNDS + 1) * row.concurrency, row.concurrency
    if prompts is None:
        return None
    workload = row_workload(row)
    return BenchmarkRun(
        num_prompts=prompts,
        input_len=workload.input_len,
        output_len=workload.output_len,
        concurrency=row.concurrency,
        request_rate=row.request_rate,
        input_spread=setup.length_spread,
        output_spread=setup.length_spread,
        warmup_requests=warmup,
    )


def row_deployment(row: PublishedRow, calibration: Path | None = None) -> Deployment:
    """ROW's setup as a deployment; with CALIBRATION's measured kernel figures where the row's GPU is of the class
    the file was measured on."""
    setup = row.setup
    deployment = _row_build(row)
    options = StepOptions(
        overlap_comm=setup.overlap_comm,
        mla_decode_backend=setup.mla_decode_backend,
        dense_gemm_backend=setup.dense_gemm_backend,
    )
    deployment = replace(deployment, options=options)
    if calibration is not None and calibrated_class(calibration) == deployment.accelerator.hardware_class:
        return replace(deployment, calibration=calibration)
    return deployment


def _row_build(row: PublishedRow) -> Deployment:
    """ROW's setup as the planner builds a deployment (its engine reads the memory fraction its own way)."""
    setup = row.setup
    workload = row_workload(row)
    return build_deployment(
        row_spec(row),
        row.hardware,
        row.gpus,
        nodes=get_accelerator(row.hardware).nvlink_domains(row.gpus, row.stage_count),
        weights=row.weight_format,
        layout=row.layout(),
        engine=row.engine,
        kv_dtype="auto" if row.kv_dtype in ("auto", "") else row.kv_dtype,
        network=setup.network,
        gpu_memory_utilization=setup.gpu_memory_utilization,
        max_model_len=setup.max_model_len or _longest_sequence(workload, setup.length_spread),
        workload=workload,
        max_num_seqs=setup.max_num_seqs,
        max_num_batched_tokens=setup.max_num_batched_tokens or _engine_default_budget(row),
        engine_version=_version(row.engine_version),
        speculation=row_speculation(row),
    )


def _engine_default_budget(row: PublishedRow) -> int:
    """The step's prompt-token budget of ROW's engine where its source states none: SGLang's own, which depends on
    its version and the GPU's memory (16,384 on a B200 since 0.4.7, 8,192 on an H200); the planner's 8,192 for the
    others."""
    if row.engine == "sglang":
        version = _version(row.engine_version)
        return default_chunked_prefill_size(
            get_accelerator(row.hardware).memory_gib, version_key(version) if version else None
        )
    return DEFAULT_BATCHED_TOKENS


def _longest_sequence(workload: RequestLengths, spread: float) -> int:
    """The context a run's longest request needs (lengths spread within mean x (1 +- spread))."""
    return round((workload.input_len + workload.output_len) * (1 + spread)) + 1


def row_speculation(row: PublishedRow) -> SpeculativeDecoding | None:
    """The row's MTP with the mean acceptance length its source states (each draft accepted with one rate given
    the ones before it), else with the planner's published default, as a user's plan would take it; None without
    speculative decoding."""
    k = row.speculative_tokens
    if not k:
        return None
    stated = dict(row.setup.accept_lengths).get(k)
    if stated is None:  # what `plan --speculative-method mtp` assumes when the user gives no acceptance either
        return speculative_decoding("mtp", k, (), row_spec(row))
    rates = acceptance_from_length(k, stated)
    return replace(speculative_decoding("mtp", k, rates, row_spec(row)), acceptance_source=f"{row.source_id}")


def _version(text: str) -> str | None:
    """The release number a version column starts with (e.g. '0.4.10.post1 (ROCm ...)' -> '0.4.10'); None for a
    branch or a date (the profile's current version's facts)."""
    head = text.strip().lstrip("~v").split(" ")[0]
    parts = [p for p in head.split(".") if p]
    digits = [p for p in parts[:3] if p.isdigit()]
    return ".".join(digits) if len(digits) >= 2 else None


def _int_or_none(text: str) -> int | None:
    text = text.strip()
    return int(float(text)) if text else None


def _float_or_none(text: str) -> float | None:
    text = text.strip()
    return float(text) if text else None
