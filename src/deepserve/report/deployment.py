"""Per result set: how many GPUs served it, what a GPU-hour costs, and the hardware's decode limit, each with where
it came from, from what the run recorded (`deepserve.results.deployment`) and the report's flags.

GPUs: the run's recorded deployment where known, else `--gpus N`, else 1 with a note (so that a set from another
machine in the same report keeps its own count). The price: the recorded `gpu_hour_usd`, else `--gpu-hour-usd`.
The limit needs the model's architecture and the hardware: a catalog accelerator (its datasheet bandwidth) or a
CPU host whose bandwidth deepserve measured when the run was made.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepserve.errors import ConfigError, DeepserveError
from deepserve.report.hardware_limit import DecodeLimit, cpu_limit, gpu_limit
from deepserve.results.deployment import RecordedDeployment, read_deployment
from deepserve.results.points import ResultSet


@dataclass(frozen=True)
class DeploymentOptions:
    """The report's flags: what applies to sets whose run did not record it."""

    gpus: int | None = None  # --gpus
    gpu_hour_usd: float | None = None  # --gpu-hour-usd

    def __post_init__(self) -> None:
        if self.gpus is not None and self.gpus < 1:
            raise ConfigError(f"--gpus {self.gpus}: give the number of GPUs that served the runs, 1 or more")
        if self.gpu_hour_usd is not None and not self.gpu_hour_usd > 0:
            raise ConfigError(f"--gpu-hour-usd {self.gpu_hour_usd}: give the price of one GPU-hour in USD, e.g. 2.49")


@dataclass(frozen=True)
class SetDeployment:
    gpus: int
    gpus_source: str  # in words: "recorded hardware: 8x H100", "--gpus", "assumed (…)"
    gpu_hour_usd: float | None
    price_source: str
    limit: DecodeLimit | None
    limit_note: str  # why there is no limit line, when there is none
    is_cpu_host: bool

    @property
    def gpus_assumed(self) -> bool:
        return self.gpus_source.startswith("assumed")

    def facts(self) -> list[tuple[str, str]]:
        """(heading, words) for the report's run metadata: what these numbers rest on and where each came from."""
        device = "device (the CPU host)" if self.is_cpu_host else "GPU"
        facts = [("GPUs", f"{self.gpus} {device}{'s' if self.gpus > 1 else ''} ({self.gpus_source})")]
        if self.gpu_hour_usd is not None:
            facts.append(("price", f"${self.gpu_hour_usd:,.2f} per {device}-hour ({self.price_source})"))
        limit = self.limit.describe() if self.limit is not None else f"none: {self.limit_note}"
        facts.append(("hardware limit", limit))
        return facts


def resolve_deployment(result_set: ResultSet, options: DeploymentOptions) -> SetDeployment:
    recorded = read_deployment(result_set.metadata)
    gpus, gpus_source = _gpus(recorded, options)
    price, price_source = recorded.gpu_hour_usd, recorded.price_source
    if price is None and options.gpu_hour_usd is not None:
        price, price_source = options.gpu_hour_usd, "--gpu-hour-usd"
    limit, note = _limit(recorded, gpus)
    return SetDeployment(gpus, gpus_source, price, price_source, limit, note, recorded.is_cpu_host)


def _gpus(recorded: RecordedDeployment, options: DeploymentOptions) -> tuple[int, str]:
    if recorded.devices is not None:
        return recorded.devices, recorded.devices_source
    if options.gpus is not None:
        return options.gpus, "--gpus"
    return 1, "assumed: the run recorded no GPU count; pass --gpus N"


def _limit(recorded: RecordedDeployment, gpus: int) -> tuple[DecodeLimit | None, str]:
    if recorded.spec is None:
        model = f"model {recorded.model!r}" if recorded.model else "the model"
        return None, f"the architecture of {model} is unknown (not a preset, and the run recorded no config.json)"
    try:
        if recorded.accelerator is not None:
            return gpu_limit(recorded.spec, recorded.accelerator, gpus), ""
        if recorded.is_cpu_host and recorded.host_bandwidth_gb_s is not None:
            source = f"measured by deepserve: {recorded.host_words}"
            return cpu_limit(recorded.spec, recorded.host_bandwidth_gb_s, source), ""
    except DeepserveError as exc:  # e.g. a quantization the planner does not model
        return None, str(exc)
    if recorded.is_cpu_host:
        return None, "the run recorded no memory-bandwidth measurement of its CPU host; re-run it with this deepserve"
    return None, (
        "the hardware is unknown; record it with --metadata hardware='8x H100 SXM5' (or accelerator=h100) when "
        "benchmarking"
    )
