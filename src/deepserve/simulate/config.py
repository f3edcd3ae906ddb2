"""What `deepserve simulate` is asked (section `simulate` of the config file): the hardware to pretend to be, how
time passes, and the faults to inject. The engine's own settings (model, parallel layout, max_num_seqs, block
size, …) come from the `engine` section, the same EngineConfig that `deepserve serve` launches vLLM with, so a
config that serves a model on GPUs simulates it unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from deepserve.config import Section, parse_key_values
from deepserve.errors import ConfigError

CutMode = Literal["close", "error_event", "malformed_event", "stall"]
TokenIdsPolicy = Literal["requested", "always", "ignore", "reject"]
# EngineConfig fields that mean nothing to a simulated engine: one process stands for every node, and nothing is
# launched (the hardware is SimulateConfig's --gpu/--gpus/--nodes).
ENGINE_FIELDS_NOT_SIMULATED = (
    "device", "dtype", "trust_remote_code", "extra_args", "startup_timeout_s", "node_rank", "master_addr",
    "master_port", "join_port", "join_timeout_s", "gpus_per_node", "data_parallel_size_local", "nnodes", "gpu_type",
    "data_parallel_address", "data_parallel_rpc_port", "distributed_executor_backend", "role", "kv_connector",
    "kv_connector_config", "speculative_draft_model",
    "prompt_lookup_min", "prompt_lookup_max",
)  # fmt: skip


class SimulateConfig(Section):
    gpu: str = Field("h200", description="GPU type from the catalog whose step times to simulate (h100 = H100 SXM)")
    gpus: int = Field(8, ge=1, description="total GPUs of the simulated deployment (all nodes)")
    nodes: int | None = Field(
        None,
        ge=1,
        description="machines the GPUs are spread over (an NVL72 rack's compute trays share its NVLink; default: as "
        "few as hold them)",
    )
    weights: str | None = Field(
        None,
        description=(
            "bf16, fp16, fp8, fp8-dynamic, awq-int4, mxfp4, nvfp4; None = the checkpoint's format (or --quantization)"
        ),
    )
    network: str = Field("infiniband-ndr", description="between nodes: infiniband-ndr, roce-400g, ethernet-100g")
    calibration: Path | None = Field(None, description="JSON from benchmarks/calibrate_gpu.py (measured kernels)")
    # ---- time ----
    time_scale: float = Field(
        1.0, gt=0, description="wall seconds per simulated second: 0.1 runs ten times faster than the modelled GPU"
    )
    fixed_ttft_ms: float | None = Field(
        None, ge=0, description="no step model: every request's first token this long after it arrived"
    )
    fixed_itl_ms: float | None = Field(
        None, ge=0, description="no step model: then one token every this many ms (0: as fast as possible)"
    )
    fixed_step_ms: float | None = Field(
        None, gt=0, description="no step model: every engine step takes this long (lockstep streams)"
    )
    fixed_burst_tokens: int = Field(
        64,
        ge=1,
        description="with --fixed-itl-ms 0: tokens a stream gets per turn of the event loop, written together "
        "(with --tokens-per-chunk 1: that many chunks per write)",
    )
    # ---- replies ----
    tokens_per_chunk: int = Field(
        1, ge=1, description="tokens per streamed chunk after the first (vLLM's --stream-interval)"
    )
    spec_acceptance: list[float] = Field(
        default_factory=list,
        description="with speculative decoding (--speculative-method/--num-speculative-tokens): acceptance per draft "
        "position, vLLM's per-position rates (0.8,0.6,0.4), or one rate for each draft given the ones before it "
        "(default: published MTP/DSpark figures)",
    )
    spec_seed: int = Field(0, description="seed of the draws that accept or reject drafts (a run is reproducible)")
    natural_output_len: int | None = Field(
        None, ge=1, description="replies end with EOS after this many tokens unless ignore_eos (None: never)"
    )
    reasoning_tokens: int = Field(
        0,
        ge=0,
        description="chat replies: the first N tokens are reasoning, in their own field (as vLLM's reasoning parsers "
        "answer), unless the request's chat_template_kwargs say thinking (or enable_thinking) false",
    )
    reasoning_field: Literal["reasoning", "reasoning_content"] = Field(
        "reasoning",
        description="the reasoning field: vLLM 0.32's `reasoning` (usage counts them in completion_tokens_details) or "
        "`reasoning_content` (older vLLM, SGLang: usage without the count)",
    )
    tool_calls: bool = Field(
        False, description="chat requests that offer tools are answered with a call of the first (or chosen) function"
    )
    api_key: str | None = Field(None, description="require `Authorization: Bearer KEY` on /v1 (vLLM's --api-key)")
    lora_modules: list[str] = Field(default_factory=list, description="extra model names served (LoRA adapters)")
    record_bodies: bool = Field(False, description="keep every generation request's body (GET /simulate/stats)")
    usage_chunk: Literal["requested", "never", "always"] = Field(
        "requested", description="stream the usage chunk when stream_options.include_usage asks (vLLM), never, always"
    )
    token_ids: TokenIdsPolicy = Field(
        "requested",
        description="token_ids in each choice when return_token_ids asks (vLLM), always, never though asked "
        "(ignore, as servers without the field), or answer the field with 400 (reject)",
    )
    token_text: Literal["bytes", "varied"] = Field(
        "bytes",
        description="each generated token's text: one byte (the tiny model's tokenizer), or 1 to 8 characters "
        "(varied, as real vocabularies: a client counting tokens by text is then not exact; /detokenize differs)",
    )
    tokenize_endpoints: bool = Field(True, description="serve /tokenize and /detokenize (off: 404, as some servers)")
    detokenize_endpoint: bool = Field(True, description="serve /detokenize (off: 404, a server with /tokenize only)")
    metrics_endpoint: bool = Field(True, description="serve /metrics (off: 404, a server without metrics)")
    models_max_model_len: bool = Field(
        True, description="list max_model_len in /v1/models (off: as SGLang and older servers do not)"
    )
    profiler_endpoints: bool = Field(False, description="answer /start_profile and /stop_profile (vLLM's profiler)")
    log_sends: bool = Field(
        False,
        description="keep when each chunk of each stream was written, and when its request arrived by the kernel's "
        "receive timestamp (GET /simulate/sends): ground truth for measuring benchmark clients",
    )
    # ---- faults ----
    error_fraction: float = Field(0.0, ge=0, le=1, description="fraction of generation requests answered with an error")
    error_status: int = Field(500, ge=400, le=599, description="HTTP status of those errors")
    cut_fraction: float = Field(0.0, ge=0, le=1, description="fraction of streams cut short after --cut-after-tokens")
    cut_after_tokens: int = Field(1, ge=0, description="tokens a cut stream delivers before it is cut")
    cut_mode: CutMode = Field(
        "close", description="how a stream is cut: close, error_event, malformed_event, stall (open and silent)"
    )
    hang_fraction: float = Field(0.0, ge=0, le=1, description="fraction of requests never answered (no byte)")
    unhealthy_after_s: float | None = Field(None, ge=0, description="/health answers 503 from this long after start")
    unhealthy_after_requests: int | None = Field(
        None, ge=0, description="/health answers 503 once this many generation requests arrived"
    )
    health_delay_s: float = Field(0.0, ge=0, description="answer /health this late (an overloaded replica)")
    metrics_delay_s: float = Field(0.0, ge=0, description="answer /metrics this late")
    # ---- process ----
    startup_delay_s: float = Field(0.0, ge=0, description="wait this long before listening (an engine loading)")
    fail_startup: str | None = Field(None, description="print this and exit 1 instead of serving (a failed start)")
    ignore_sigterm: bool = Field(False, description="ignore SIGTERM (an engine that must be killed)")
    engine_core_process: bool = Field(
        False,
        description="start a child process standing for vLLM's engine core (it only waits), so that a supervisor's "
        "clean-up of the whole process group can be tested",
    )
    max_seconds: float | None = Field(None, gt=0, description="exit after this long, whatever happens (CI safety)")

    @field_validator("spec_acceptance", mode="before")
    @classmethod
    def _acceptance_list(cls, value: object) -> object:
        """ "0.8,0.6,0.4" from a flag or a file, also repeated."""
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list):
            return [float(part) for item in value for part in str(item).replace(" ", "").split(",") if part]
        return value

    @model_validator(mode="after")
    def _one_timing_mode(self) -> SimulateConfig:
        fixed_latency = self.fixed_ttft_ms is not None or self.fixed_itl_ms is not None
        if fixed_latency and self.fixed_step_ms is not None:
            raise ValueError(
                "--fixed-step-ms (lockstep engine steps) and --fixed-ttft-ms/--fixed-itl-ms (each stream on its own "
                "schedule) are two different engines: give one or the other"
            )
        return self

    @property
    def fixed_latency(self) -> bool:
        return self.fixed_ttft_ms is not None or self.fixed_itl_ms is not None


def parse_metric_overrides(pairs: list[str]) -> dict[str, float]:
    """`--metric NAME=VALUE` arguments: the value each named series reports in /metrics."""
    example = "vllm:num_requests_waiting=12"
    overrides = {}
    for name, value in parse_key_values("--metric", pairs, example).items():
        try:
            overrides[name] = float(value)
        except ValueError:
            raise ConfigError(f"--metric {name}={value}: the value must be a number, e.g. --metric {example}") from None
    return overrides
