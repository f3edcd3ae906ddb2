"""The published serving figures (calibration set) and how each row becomes a prediction of the model.

Rows come from ../shared/published/serving_figures.csv, copied to data/serving_figures.json, and from the research
notes' collection (data/serving_figures_research.json: the rows on AMD Instinct GPUs and with TensorRT-LLM, with
its extra columns: data-parallel attention, expert parallelism, speculative decoding). A row is predictable when its
workload (input and output lengths) is known, its engine has a profile and its hardware has measured kernel figures.
Setup facts the CSV leaves out but the sources state (the engine's max_num_seqs, the network between nodes, the
concurrency sweep) are listed in SOURCE_SETUPS.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from deepserve.errors import ConfigError
from deepserve.models.presets import preset_spec
from deepserve.models.spec import ModelSpec
from deepserve.plan.calibration import calibrated_class
from deepserve.plan.formats import get_format
from deepserve.plan.layout import Layout
from deepserve.plan.perf import PerformanceModel, Prediction, Workload
from deepserve.plan.planner import build_deployment
from deepserve.plan.profiles import EngineParameters, version_key
from deepserve.plan.types import Deployment

FIGURES_PATH = Path(__file__).with_name("data") / "serving_figures.json"
RESEARCH_FIGURES_PATH = Path(__file__).with_name("data") / "serving_figures_research.json"
TRTLLM_BLOG = (
    "github:NVIDIA/TensorRT-LLM docs/source/blogs/Best_perf_practice_on_DeepSeek-R1_in_TensorRT-LLM.md @01c4ece"
)
SGLANG_AMD_MTP_BLOG = (
    "https://lmsys.org/blog/2025-09-02-sglang-amd-deepseek-v3-mtp/ "
    "(github:lm-sys/lm-sys.github.io blog/2025-09-02-sglang-amd-deepseek-v3-mtp.md)"
)


@dataclass(frozen=True)
class SourceSetup:
    """What a seed document says about its setup beyond the CSV's columns."""

    max_num_seqs: int | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    network: str = "infiniband-ndr"
    concurrency_sweep: tuple[int, ...] = ()  # a "best over the sweep" row is the best of these levels
    rate_sweep: bool = False  # rows without a concurrency are peaks over a request-rate sweep
    throughput_tokens_stated: bool = True  # False: "tokens/s" without saying output or all tokens


SOURCE_SETUPS = {
    # 001: vLLM 0.7.3, MAX_NUM_SEQS=128 and MAX_MODEL_LEN=8000; two nodes over 100 Gb/s Ethernet, no InfiniBand;
    # its figures without a concurrency come from request-rate sweeps (QPS 1-20).
    "001_5e41702b812a2cc2.txt": SourceSetup(
        max_num_seqs=128, max_model_len=8000, network="ethernet-100g", rate_sweep=True
    ),
    # 002: vLLM 0.16 on B200, --max-model-len 32768 --gpu-memory-utilization 0.90; vLLM's default max_num_seqs
    # for large GPUs (1024).
    "002_9b8c54d8c5a2373d.txt": SourceSetup(max_num_seqs=1024, max_model_len=32768),
    # 004: online sweep at concurrency 4, 8, ..., 128 with 3200 input and 800 output tokens. Its throughputs are
    # "tokens/s" with no word on which tokens: its client (SGLang's bench_serving) prints both output and total
    # (input + output) throughput, and the H200 row's own note reads "all tokens/s as reported". As output rates the
    # MI300X and H200 figures would need a TPOT near 28-31 ms at 128 requests of 4,000 tokens on TP8, below what
    # reading the weights and the replicated latent cache takes at full bandwidth (docs/PLANNING.md, section 6).
    "004_857d13a67e4d6d20.txt": SourceSetup(concurrency_sweep=(4, 8, 16, 32, 64, 128), throughput_tokens_stated=False),
    # TensorRT-LLM's DeepSeek-R1 guide: the H200 max-throughput run caps each of the 8 attention-DP ranks at 128
    # requests (max_batch_size 128 per rank) with 1K/2K requests; trtllm-bench keeps 1,024 in flight.
    TRTLLM_BLOG: SourceSetup(max_num_seqs=1024, max_model_len=3072),
    # LMSYS/AMD, DeepSeek-V3 on 8 x MI300X with SGLang: --mem-fraction-static 0.85; the client sent 300 prompts at
    # 1 request/s under each max concurrency, so from 32 up fewer than the cap were in flight (1/s x E2E: about 31
    # at 32, 44 at 64).
    SGLANG_AMD_MTP_BLOG: SourceSetup(gpu_memory_utilization=0.85, max_model_len=2048),
}


@dataclass(frozen=True)
class PublishedRow:
    number: int  # 1-based data row of the CSV
    source: str
    hardware: str
    gpus: int
    engine: str
    engine_version: str
    model: str
    weights: str
    kv_dtype: str
    tp: int
    pp: int
    input_len: int | None
    output_len: int | None
    concurrency: int | None
    metric: str
    value: float
    unit: str
    note: str
    dp: int = 1  # data-parallel attention ranks (the research rows' column); tp is then TP inside one rank
    ep: bool = False  # routed experts spread over the stage's GPUs
    spec: str = "none"  # speculative decoding: none, or mtp:K

    def label(self) -> str:
        setup = f"{self.hardware} x{self.gpus} {self.engine} {self.weights} TP{self.tp}" + (
            f" PP{self.pp}" if self.pp > 1 else ""
        )
        setup += (f" DP{self.dp}" if self.dp > 1 else "") + (" EP" if self.ep else "")
        lengths = f"{self.input_len}/{self.output_len}" if self.input_len else "?/?"
        level = f"c={self.concurrency}" if self.concurrency else "peak"
        return f"#{self.number} {setup} {lengths} {level} {self.metric}"

    @property
    def setup(self) -> SourceSetup:
        return SOURCE_SETUPS.get(self.source, SourceSetup())


def load_rows(paths: tuple[Path, ...] = (FIGURES_PATH, RESEARCH_FIGURES_PATH)) -> list[PublishedRow]:
    """Every row of PATHS, numbered on from one file to the next."""
    raws = [raw for path in paths for raw in json.loads(path.read_text())["rows"]]
    rows = []
    for number, raw in enumerate(raws, start=1):
        rows.append(
            PublishedRow(
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
                concurrency=_int_or_none(raw["concurrency"]),
                metric=raw["metric"],
                value=float(raw["value"]),
                unit=raw["unit"],
                note=raw["note"],
                dp=int(raw.get("dp") or 1),
                ep=bool((raw.get("ep") or "").strip()),
                spec=(raw.get("spec") or "none").strip() or "none",
            )
        )
    return rows


# Metrics the model predicts, as functions of the prediction at the row's concurrency and the workload.
METRICS: dict[str, Callable[[Prediction, Workload], float]] = {
    "output_throughput": lambda p, w: p.output_throughput_tok_s,
    "total_throughput": lambda p, w: p.output_throughput_tok_s * (w.input_len + w.output_len) / w.output_len,
    "request_throughput": lambda p, w: p.output_throughput_tok_s / w.output_len,
    "tpot_mean": lambda p, w: p.tpot_ms,
    "ttft_mean": lambda p, w: p.ttft_ms,
    "e2el_mean": lambda p, w: p.e2el_ms,
    "e2el": lambda p, w: p.e2el_ms,  # "end-to-end latency" with no statistic named: read as the mean
}
THROUGHPUT_METRICS = ("output_throughput", "total_throughput", "request_throughput")


def row_spec(row: PublishedRow) -> ModelSpec:
    """V3, V3-0324 and R1 share one architecture; the AWQ rows load cognitivecomputations' export (no MTP)."""
    if row.weights.startswith("awq"):
        return preset_spec("cognitivecomputations/DeepSeek-V3-AWQ")
    return preset_spec("deepseek-ai/DeepSeek-V3")


def unpredictable_reason(row: PublishedRow) -> str | None:
    """Why the model cannot predict ROW from its columns alone, or None."""
    if row.metric not in METRICS:
        return f"metric {row.metric}: not one the model predicts (an offline batch run, or a per-GPU/per-user form)"
    if row.spec != "none":
        return f"speculative decoding ({row.spec}): not modelled yet"
    if row.metric in THROUGHPUT_METRICS and not row.setup.throughput_tokens_stated:
        return "the source's tokens/s does not say whether it counts output or all tokens"
    if not _known_weights(row.weights):
        return f"weights {row.weights}: a format the planner does not model"
    if row.input_len is None or row.output_len is None:
        return "input/output lengths and concurrency not given (a figure quoted from a third-party report)"
    if row.concurrency is None and not row.setup.concurrency_sweep and not row.setup.rate_sweep:
        return "no concurrency and no sweep to take the peak of"
    return None


def row_deployment(row: PublishedRow, calibration: Path | None = None) -> Deployment:
    """ROW's setup as a deployment; with CALIBRATION's measured kernel figures where the row's GPU is of the class
    the file was measured on."""
    assert row.input_len is not None and row.output_len is not None
    setup = row.setup
    nodes = max(row.gpus // 8, 1)
    deployment = build_deployment(
        row_spec(row),
        row.hardware,
        row.gpus,
        nodes=nodes,
        weights=row.weights,
        layout=Layout(tp=row.tp, pp=row.pp, dp=row.dp, ep=row.ep),
        engine=row.engine,
        kv_dtype="auto" if row.kv_dtype == "auto" else row.kv_dtype,
        network=setup.network,
        gpu_memory_utilization=setup.gpu_memory_utilization,
        max_model_len=setup.max_model_len or row.input_len + row.output_len,
        workload=Workload(row.input_len, row.output_len),
        max_num_seqs=setup.max_num_seqs,
        engine_version=row.engine_version if version_key(row.engine_version) else None,  # "PyTorch backend (…)"
    )
    if calibration is not None and calibrated_class(calibration) == deployment.accelerator.hardware_class:
        return replace(deployment, calibration=calibration)
    return deployment


def predict_row(row: PublishedRow, deployment: Deployment, model: PerformanceModel) -> float:
    """The model's value for ROW's metric: at its concurrency, at saturation for a peak over a request-rate sweep,
    or the best over the seed's concurrency sweep."""
    assert row.input_len is not None and row.output_len is not None
    workload = Workload(row.input_len, row.output_len)
    cap = deployment.running_cap
    metric = METRICS[row.metric]
    if row.concurrency is not None:
        return metric(model.predict(row.concurrency, workload, cap), workload)
    if row.setup.concurrency_sweep:
        return max(metric(model.predict(c, workload, cap), workload) for c in row.setup.concurrency_sweep)
    return metric(model.predict(cap, workload, cap), workload)  # a request-rate sweep peaks when the batch is full


def with_parameters(deployment: Deployment, parameters: EngineParameters) -> PerformanceModel:
    """DEPLOYMENT's step model with its own engine profile's overhead parameters set to PARAMETERS."""
    selected = deployment.select_engine(across_engines=False)
    if selected is None:
        raise ValueError(f"no engine profile for {deployment.engine} on {deployment.accelerator.name}")
    return deployment.performance_model(selected.with_parameters(parameters, "fit"))


def _known_weights(weights: str) -> bool:
    try:
        get_format(weights)
    except ConfigError:
        return False
    return True


def _int_or_none(text: str) -> int | None:
    return int(text) if text.strip() else None
