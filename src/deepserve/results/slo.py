"""Service-level objectives the report judges points against: a result key and the most it may be."""

from __future__ import annotations

from dataclasses import dataclass

from deepserve.errors import ConfigError

# What the seeds used: "business requirements stipulate that the inter-token latency must not exceed 50 ms".
DEFAULT_SLOS = ("p99_itl_ms=50",)

_METRIC_WORDS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}
_STAT_WORDS = {"mean": "mean", "median": "median", "std": "std"}


@dataclass(frozen=True)
class Slo:
    metric: str  # a result key in milliseconds, e.g. p99_itl_ms
    max_ms: float

    @property
    def words(self) -> str:
        """ "P99 ITL ≤ 50 ms"."""
        return f"{metric_words(self.metric)} ≤ {self.max_ms:g} ms"

    def met_by(self, value: float | None) -> bool:
        return value is not None and value <= self.max_ms


def metric_words(metric: str) -> str:
    """p99_itl_ms → "P99 ITL"; median_ttft_ms → "median TTFT"."""
    parts = metric.removesuffix("_ms").split("_")
    if len(parts) != 2:
        return metric
    stat, name = parts
    stat_words = _STAT_WORDS.get(stat, stat.upper())
    return f"{stat_words} {_METRIC_WORDS.get(name, name.upper())}"


def parse_slo(text: str) -> Slo:
    """ "p99_itl_ms=50" or "p99_itl_ms:50" (the --goodput style)."""
    name, sep, value = text.replace(":", "=").partition("=")
    name = name.strip()
    if not sep or not name:
        raise ConfigError(f"SLO {text!r} must look like METRIC=MS, e.g. p99_itl_ms=50 or median_ttft_ms=2000")
    if not name.endswith("_ms"):
        name += "_ms"
    stat, _, metric = name.removesuffix("_ms").partition("_")
    if metric not in _METRIC_WORDS or not (stat in _STAT_WORDS or (stat.startswith("p") and stat[1:].isdigit())):
        raise ConfigError(
            f"SLO metric {name!r} is not a latency key; use STAT_METRIC_ms with STAT mean, median or pNN and METRIC "
            "ttft, tpot, itl or e2el (e.g. p99_itl_ms=50)"
        )
    try:
        limit = float(value)
    except ValueError as exc:
        raise ConfigError(f"SLO {text!r}: {value!r} is not a number of milliseconds") from exc
    if limit <= 0:
        raise ConfigError(f"SLO {text!r}: the limit must be positive")
    return Slo(name, limit)


def parse_slos(texts: list[str] | None) -> list[Slo]:
    return [parse_slo(text) for text in (texts or list(DEFAULT_SLOS))]
