"""The benchmark's typed config: where to send (target), what to send (workload), how hard (load), what to report
(metrics) and where to write it (output). Field names are `vllm bench serve`'s flag names with underscores
wherever the meaning is the same, so that the derived CLI flags accept existing vLLM command lines."""

from __future__ import annotations

import json
import math
import os
import random
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from deepserve.bench.arrivals import RateRamp
from deepserve.bench.metrics import ALL_PERCENTILE_METRICS, parse_goodput, parse_percentiles
from deepserve.bench.workloads import MESSAGES_DATASETS, WorkloadConfig
from deepserve.config import Section

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
# sent in the request body when given, under these names (vLLM's flags and OpenAI's/vLLM's body fields alike)
SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
)  # fmt: skip

# arguments of the chat-template render that the benchmark sets itself (Hugging Face's apply_chat_template)
RENDER_ARGUMENTS = frozenset({"conversation", "tokenize", "add_generation_prompt"})


class TargetConfig(Section):
    """The OpenAI-compatible server under test and how each request is shaped."""

    base_url: str | None = Field(None, description="server URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    host: str = Field("127.0.0.1", description="server host when --base-url is not given")
    port: int = Field(8000, ge=1, le=65535, description="server port when --base-url is not given")
    endpoint: str = Field(COMPLETIONS, description=f"API path: {COMPLETIONS} or {CHAT_COMPLETIONS}")
    model: str | None = Field(None, description="model name (default: the first of the server's /v1/models)")
    api_key: str | None = Field(None, description="bearer token (default: $OPENAI_API_KEY)")
    header: list[str] = Field(default_factory=list, description="extra request headers as KEY=VALUE")
    extra_body: str | None = Field(None, description="JSON object merged into every request body")
    served_model_name: str | None = Field(
        None, description="model name sent in requests when --model names the tokenizer's model (vLLM's)"
    )
    temperature: float | None = Field(None, ge=0, description="sampling temperature sent with each request")
    top_p: float | None = Field(None, gt=0, le=1, description="top-p sent with each request")
    top_k: int | None = Field(None, description="top-k sent with each request")
    min_p: float | None = Field(None, ge=0, le=1, description="min-p sent with each request")
    frequency_penalty: float | None = Field(None, description="frequency penalty sent with each request")
    presence_penalty: float | None = Field(None, description="presence penalty sent with each request")
    repetition_penalty: float | None = Field(None, gt=0, description="repetition penalty sent with each request")
    logprobs: int | None = Field(
        None, ge=0, description="logprobs per token: completions get logprobs=N, chat logprobs=true, top_logprobs=N"
    )
    chat_template_kwargs: str | None = Field(
        None,
        description="JSON object for the chat template, e.g. '{\"thinking\": true}': used wherever a prompt is "
        "rendered here (messages of custom/sharegpt files on completions) and sent in chat request bodies",
    )
    lora_modules: list[str] = Field(
        default_factory=list, description="LoRA adapter names: each request's model is one of them (vLLM's)"
    )
    lora_assignment: Literal["random", "round-robin"] = Field(
        "random", description="how --lora-modules are assigned: random (seeded) or round-robin"
    )
    request_id_prefix: str | None = Field(
        None, description="x-request-id is PREFIX + request index (default: bench-<8 hex digits>-, as vLLM)"
    )
    return_token_ids: Literal["auto", "on", "off"] = Field(
        "auto",
        description="ask for each chunk's token ids (vLLM's return_token_ids), so ITL counts every token exactly: "
        "auto asks one probe request first and sends it if the server lists them; on sends it unprobed; off never",
    )
    insecure: bool = Field(False, description="do not verify the server's TLS certificate")
    ready_check_timeout_sec: int = Field(
        0, ge=0, description="wait up to this long for the server to answer a first request (0: check once)"
    )
    request_timeout_s: float = Field(6 * 3600.0, gt=0, description="a request not finished by then fails")

    @field_validator("endpoint")
    @classmethod
    def _known_endpoint(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(f"endpoint must be a path such as {COMPLETIONS}")
        return value

    @field_validator("header")
    @classmethod
    def _key_value_headers(cls, values: list[str]) -> list[str]:
        for item in values:
            if "=" not in item:
                raise ValueError(f"header {item!r} must be KEY=VALUE")
        return values

    @field_validator("extra_body", "chat_template_kwargs")
    @classmethod
    def _json_object(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and not isinstance(_parse_json(value), dict):
            raise ValueError(f"{info.field_name} must be a JSON object")
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_render_arguments(cls, value: str | None) -> str | None:
        """The template is always rendered as text with the generation prompt; these keys would clash with that
        (a TypeError deep inside the render)."""
        clashing = sorted(set(_parse_json(value)) & RENDER_ARGUMENTS) if value is not None else []
        if clashing:
            raise ValueError(
                f"--chat-template-kwargs must not set {', '.join(clashing)}: the benchmark renders prompts as text "
                "with the generation prompt itself; leave those keys out"
            )
        return value

    @property
    def root_url(self) -> str:
        """Scheme, host and port, without /v1."""
        base = self.base_url or f"http://{self.host}:{self.port}"
        return base.rstrip("/").removesuffix("/v1")

    @property
    def url(self) -> str:
        return self.root_url + self.endpoint

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")

    def resolved_api_key(self) -> str | None:
        return self.api_key or os.environ.get("OPENAI_API_KEY") or None

    def request_headers(self) -> dict[str, str]:
        headers: dict[str, str] = {}
        key = self.resolved_api_key()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        for item in self.header:
            name, _, value = item.partition("=")
            headers[name.strip()] = value.strip()
        return headers

    def body_extras(self) -> dict[str, Any]:
        """What every request body gets besides the prompt: the sampling flags, then --extra-body over them (as
        vLLM merges them)."""
        extras: dict[str, Any] = {}
        for name in SAMPLING_FIELDS:
            if getattr(self, name) is not None:
                extras[name] = getattr(self, name)
        if self.logprobs is not None:
            extras.update(
                {"logprobs": True, "top_logprobs": self.logprobs} if self.chat else {"logprobs": self.logprobs}
            )
        if self.chat_template_kwargs is not None and self.chat:
            # our addition (vLLM's client only renders with them): vLLM's server renders chat prompts, and takes them
            extras["chat_template_kwargs"] = self.template_kwargs()
        if self.extra_body:
            extras.update(_parse_json(self.extra_body))
        return extras

    def template_kwargs(self) -> dict[str, Any] | None:
        """--chat-template-kwargs as an object (None when not given)."""
        return None if self.chat_template_kwargs is None else dict(_parse_json(self.chat_template_kwargs))

    def request_model(self, served: str) -> str:
        """The model name requests carry: --served-model-name, else SERVED (--model or the server's first)."""
        return self.served_model_name or served

    def request_models(self, served: str, count: int, seed: int) -> list[str]:
        """The model of each of COUNT requests: a LoRA adapter per request when --lora-modules are given (picked
        at random with SEED, or round-robin, as vLLM does), else the one model name."""
        if not self.lora_modules:
            return [self.request_model(served)] * count
        if self.lora_assignment == "round-robin":
            return [self.lora_modules[i % len(self.lora_modules)] for i in range(count)]
        rng = random.Random(seed)
        return [rng.choice(self.lora_modules) for _ in range(count)]


class LoadConfig(Section):
    """How requests are released: closed loop (max concurrency), open loop (request rate), or both."""

    max_concurrency: int | None = Field(None, ge=1, description="most requests in flight (closed loop)")
    request_rate: float = Field(math.inf, gt=0, description="requests per second (inf: all at once)")
    burstiness: float = Field(1.0, gt=0, description="gamma shape of arrivals: 1 Poisson, <1 burstier, >1 steadier")
    num_warmups: int = Field(0, ge=0, description="requests sent and awaited before the measured run, not counted")
    duration_s: float | None = Field(
        None, gt=0, description="issue requests for this long (cycling the workload), then wait for the in-flight"
    )
    ramp_up_s: float | None = Field(
        None, gt=0, description="ramp the request rate (or the concurrency, in closed loop) linearly over this"
    )
    ramp_up_strategy: Literal["linear", "exponential"] | None = Field(
        None, description="vLLM's ramp: the rate goes from --ramp-up-start-rps to --ramp-up-end-rps over the requests"
    )
    ramp_up_start_rps: float | None = Field(None, ge=0, description="request rate of the first request (ramp-up)")
    ramp_up_end_rps: float | None = Field(None, ge=0, description="request rate of the last request (ramp-up)")
    num_workers: int = Field(1, ge=1, le=64, description="client processes the load is spread over")

    @model_validator(mode="after")
    def _ramp_up_as_vllm(self) -> LoadConfig:
        """vLLM's checks of --ramp-up-strategy, plus the two ramps being exclusive."""
        if self.ramp_up_strategy is None:
            if self.ramp_up_start_rps is not None or self.ramp_up_end_rps is not None:
                raise ValueError("--ramp-up-start-rps and --ramp-up-end-rps need --ramp-up-strategy")
            return self
        if math.isfinite(self.request_rate):
            raise ValueError("with --ramp-up-strategy, leave out --request-rate: the ramp sets the rate")
        if self.ramp_up_s is not None:
            raise ValueError("give --ramp-up-strategy (vLLM's, over the requests) or --ramp-up-s (over time), not both")
        if self.ramp_up_start_rps is None or self.ramp_up_end_rps is None:
            raise ValueError("--ramp-up-strategy needs --ramp-up-start-rps and --ramp-up-end-rps")
        if self.ramp_up_start_rps > self.ramp_up_end_rps:
            raise ValueError("--ramp-up-start-rps must not be above --ramp-up-end-rps")
        if self.ramp_up_start_rps == 0:
            raise ValueError(
                "--ramp-up-start-rps must be above 0 (the first request would wait forever); "
                "for a ramp from 0 over time use --ramp-up-s with --request-rate"
            )
        return self

    def rate_ramp(self) -> RateRamp | None:
        if self.ramp_up_strategy is None or self.ramp_up_start_rps is None or self.ramp_up_end_rps is None:
            return None
        return RateRamp(self.ramp_up_strategy, self.ramp_up_start_rps, self.ramp_up_end_rps)


class MetricsConfig(Section):
    """Which statistics to report, and the SLOs of goodput."""

    goodput: list[str] | None = Field(None, description="SLOs as KEY:MS pairs: ttft:300 tpot:50 e2el:5000")
    percentile_metrics: str = Field(
        "ttft,tpot,itl,e2el", description=f"comma-separated metrics to report: {','.join(ALL_PERCENTILE_METRICS)}"
    )
    metric_percentiles: str = Field("99", description="comma-separated percentiles, e.g. 50,90,99 (P25..P99 always)")
    server_metrics: bool = Field(True, description="scrape the server's Prometheus /metrics during the run")
    server_metrics_url: str | None = Field(None, description="Prometheus URL (default: <base URL>/metrics)")
    server_metrics_interval_s: float | None = Field(
        None,
        gt=0,
        description="seconds between /metrics scrapes (default: every 50 ms at first, then a twentieth of the time "
        "elapsed, at most 1 s; and at each new high of requests in flight)",
    )
    profile: bool = Field(
        False, description="POST the server's /start_profile after the warm-ups, /stop_profile after the run (vLLM's)"
    )
    num_runs: int = Field(
        1,
        ge=1,
        le=100,
        description="run the same requests N times: every metric is then the mean over the runs, with its 95%% "
        "confidence interval (Student's t)",
    )

    @field_validator("goodput")
    @classmethod
    def _valid_slos(cls, value: list[str] | None) -> list[str] | None:
        parse_goodput(value)
        return value

    @field_validator("percentile_metrics")
    @classmethod
    def _valid_metrics(cls, value: str) -> str:
        for name in value.split(","):
            if name.strip() and name.strip() not in ALL_PERCENTILE_METRICS:
                raise ValueError(f"unknown metric {name.strip()!r}; valid: {', '.join(ALL_PERCENTILE_METRICS)}")
        return value

    @field_validator("metric_percentiles")
    @classmethod
    def _valid_percentiles(cls, value: str) -> str:
        parse_percentiles(value)
        return value

    @property
    def slos_ms(self) -> dict[str, float]:
        return parse_goodput(self.goodput)

    @property
    def selected_metrics(self) -> tuple[str, ...]:
        return tuple(name.strip() for name in self.percentile_metrics.split(",") if name.strip())

    @property
    def percentiles(self) -> tuple[float, ...]:
        return parse_percentiles(self.metric_percentiles)


class OutputConfig(Section):
    """What is written: the console block always; JSON and per-request records on request."""

    save_result: bool = Field(False, description="write the result JSON")
    append_result: bool = Field(
        False, description="append the result to the file as one JSON line (vLLM's), instead of replacing it"
    )
    save_detailed: bool = Field(False, description="add per-request lists (ttfts, itls, …) to the JSON, as vLLM")
    result_dir: str | None = Field(None, description="directory for the result JSON (default: current directory)")
    result_filename: str | None = Field(None, description="result JSON file name (default: vLLM's naming)")
    save_records: Literal["csv", "jsonl"] | None = Field(None, description="also write per-request records")
    label: str | None = Field(None, description="label (prefix) of the result file name")
    metadata: list[str] = Field(default_factory=list, description="KEY=VALUE pairs added to the result JSON")
    disable_tqdm: bool = Field(False, description="hide the live progress bar")

    @field_validator("metadata")
    @classmethod
    def _key_value(cls, values: list[str]) -> list[str]:
        for item in values:
            if "=" not in item:
                raise ValueError(f"metadata {item!r} must be KEY=VALUE")
        return values


class BenchConfig(BaseModel):
    """Everything one benchmark run needs; `run_benchmark(config)` takes nothing else."""

    model_config = ConfigDict(extra="forbid")

    target: TargetConfig = Field(default_factory=lambda: TargetConfig.model_validate({}))
    workload: WorkloadConfig = Field(default_factory=lambda: WorkloadConfig.model_validate({}))
    load: LoadConfig = Field(default_factory=lambda: LoadConfig.model_validate({}))
    metrics: MetricsConfig = Field(default_factory=lambda: MetricsConfig.model_validate({}))
    output: OutputConfig = Field(default_factory=lambda: OutputConfig.model_validate({}))
    command_line: list[str] | None = None  # recorded in the results so the run can be repeated

    @model_validator(mode="after")
    def _chat_template_used(self) -> BenchConfig:
        """On completions the kwargs only shape messages rendered here; refuse them where nothing is rendered."""
        target, dataset = self.target, self.workload.dataset_name
        if target.chat_template_kwargs is not None and not target.chat and dataset not in MESSAGES_DATASETS:
            raise ValueError(
                f"--chat-template-kwargs has no effect here: on {target.endpoint} only the 'messages' of "
                f"{' and '.join(sorted(MESSAGES_DATASETS))} files are rendered with a chat template, and the "
                f"{dataset} dataset has none; use --endpoint {CHAT_COMPLETIONS}, or leave the flag out"
            )
        return self

    @model_validator(mode="after")
    def _trace_times_or_a_rate(self) -> BenchConfig:
        """A trace replayed at its own times has no room for another arrival process."""
        load = self.load
        if self.workload.self_timed_replay and (
            math.isfinite(load.request_rate) or load.rate_ramp() is not None or load.ramp_up_s is not None
        ):
            raise ValueError(
                f"--dataset-name {self.workload.dataset_name} releases requests at the trace's own times; leave out "
                "--request-rate and the ramp-up flags, or pass --no-self-timed to send the trace's requests by rate"
            )
        return self

    @model_validator(mode="after")
    def _rate_or_concurrency_with_duration(self) -> BenchConfig:
        load = self.load
        unbounded = math.isinf(load.request_rate) and load.max_concurrency is None
        if load.duration_s is not None and unbounded and not self.workload.self_timed_replay:
            raise ValueError("duration_s needs --max-concurrency or a finite --request-rate to bound the load")
        return self


def _parse_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {exc}") from exc


BENCH_SECTIONS: dict[str, type[Section]] = {
    "target": TargetConfig,
    "load": LoadConfig,
    "metrics": MetricsConfig,
    "output": OutputConfig,
}
