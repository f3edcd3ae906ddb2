"""The benchmark's typed config: where to send (target), what to send (workload), how hard (load), what to report
(metrics) and where to write it (output). Field names are `vllm bench serve`'s flag names with underscores
wherever the meaning is the same, so that the derived CLI flags accept existing vLLM command lines."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deepserve.bench.metrics import ALL_PERCENTILE_METRICS, parse_goodput, parse_percentiles
from deepserve.bench.workloads import WorkloadConfig
from deepserve.config import Section

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"


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
    temperature: float | None = Field(None, ge=0, description="sampling temperature sent with each request")
    top_p: float | None = Field(None, gt=0, le=1, description="top-p sent with each request")
    top_k: int | None = Field(None, description="top-k sent with each request")
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

    @field_validator("extra_body")
    @classmethod
    def _json_object(cls, value: str | None) -> str | None:
        if value is not None and not isinstance(_parse_json(value), dict):
            raise ValueError("extra_body must be a JSON object")
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
        extras: dict[str, Any] = _parse_json(self.extra_body) if self.extra_body else {}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                extras[name] = getattr(self, name)
        return extras


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
    num_workers: int = Field(1, ge=1, le=64, description="client processes the load is spread over")


class MetricsConfig(Section):
    """Which statistics to report, and the SLOs of goodput."""

    goodput: list[str] | None = Field(None, description="SLOs as KEY:MS pairs: ttft:300 tpot:50 e2el:5000")
    percentile_metrics: str = Field(
        "ttft,tpot,itl,e2el", description=f"comma-separated metrics to report: {','.join(ALL_PERCENTILE_METRICS)}"
    )
    metric_percentiles: str = Field("99", description="comma-separated percentiles, e.g. 50,90,99 (P25..P99 always)")
    server_metrics: bool = Field(True, description="scrape the server's Prometheus /metrics during the run")
    server_metrics_url: str | None = Field(None, description="Prometheus URL (default: <base URL>/metrics)")
    server_metrics_interval_s: float = Field(1.0, gt=0, description="seconds between /metrics scrapes")

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
    def _rate_or_concurrency_with_duration(self) -> BenchConfig:
        load = self.load
        if load.duration_s is not None and math.isinf(load.request_rate) and load.max_concurrency is None:
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
