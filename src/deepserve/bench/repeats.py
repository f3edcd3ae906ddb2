"""`--num-runs N`: the same workload measured N times, each metric reported as the mean over the runs with its 95%
confidence interval (Student's t over the runs: mean ± t(0.975, N−1) · s / √N, s the runs' sample standard
deviation). A run-to-run spread is what tells a real difference from noise (vLLM's `bench sweep --num-runs`, AIPerf's
confidence intervals); `deepserve runs compare --fail-on` reads these intervals (results/compare.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

CONFIDENCE = 0.95
# Result keys that are not measurements (identifiers, settings): never averaged.
NOT_MEASURED = frozenset(
    {"num_prompts", "request_rate", "burstiness", "max_concurrency", "num_warmups", "num_workers", "duration_limit_s",
     "ramp_up_s", "ramp_up_start_rps", "ramp_up_end_rps", "clock_origin_perf_counter_s", "num_runs"}
)  # fmt: skip


@dataclass(frozen=True)
class Interval:
    """A metric over N runs: its mean and the 95% confidence interval of the mean (None for one run)."""

    mean: float
    std: float  # the runs' sample standard deviation (ddof 1); 0 for one run
    n: int
    half_width: float | None  # t · s / √n
    # 0 when every run measured ≥ 0 (a latency, a rate): t's symmetric interval around a skewed tail's mean (one slow
    # run in five) can reach below 0, a value the metric cannot take, so the interval stops there.
    floor: float | None = None

    @property
    def low(self) -> float | None:
        if self.half_width is None:
            return None
        low = self.mean - self.half_width
        return low if self.floor is None else max(low, self.floor)

    @property
    def high(self) -> float | None:
        return None if self.half_width is None else self.mean + self.half_width

    def to_json(self) -> dict[str, Any]:
        return {
            "mean": self.mean,
            "std": self.std,
            "n": self.n,
            "ci95_half_width": self.half_width,
            "ci95_low": self.low,
            "ci95_high": self.high,
        }


def interval_words(interval: dict[str, Any]) -> str:
    """How a recorded interval (Interval.to_json) follows its mean in a table: " ± h", or the bounds when the
    interval stops at 0 (no longer symmetric); "" for one run."""
    half, low = interval.get("ci95_half_width"), interval.get("ci95_low")
    if not isinstance(half, int | float):
        return ""
    mean = float(interval.get("mean") or 0.0)
    if isinstance(low, int | float) and low > mean - half:
        return f" (95% CI {low:,.2f} to {mean + half:,.2f})"
    return f" ± {half:,.2f}"


def confidence_interval(values: list[float], confidence: float = CONFIDENCE) -> Interval:
    """The mean of VALUES and its two-sided CONFIDENCE interval by Student's t with n − 1 degrees of freedom."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return Interval(mean, 0.0, n, None)
    std = math.sqrt(sum((value - mean) ** 2 for value in values) / (n - 1))
    half_width = student_t_quantile(0.5 + confidence / 2, n - 1) * std / math.sqrt(n)
    return Interval(mean, std, n, half_width, floor=0.0 if min(values) >= 0 else None)


def student_t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t distribution with DF degrees of freedom (p in (0.5, 1)): bisection on its
    distribution function, 1 − I_x(df/2, 1/2)/2 with x = df/(df + t²)."""
    low, high = 0.0, 1.0
    while _t_cdf(high, df) < p:
        high *= 2
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if _t_cdf(middle, df) < p else (low, middle)
    return (low + high) / 2


def _t_cdf(t: float, df: int) -> float:
    return 1 - 0.5 * _regularized_beta(df / (df + t * t), df / 2, 0.5)


def _regularized_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b) by its continued fraction (Numerical Recipes' betacf), mirrored where it converges slowly."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _beta_fraction(x, a, b) / a
    return 1 - front * _beta_fraction(1 - x, b, a) / b


def _beta_fraction(x: float, a: float, b: float) -> float:
    tiny = 1e-300
    c, d = 1.0, 1 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    fraction = d
    for m in range(1, 300):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):  # fmt: skip
            d = 1 + numerator * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + numerator / c
            c = c if abs(c) > tiny else tiny
            fraction *= c * d
        if abs(c * d - 1) < 1e-15:
            break
    return fraction


def measured_keys(summaries: list[dict[str, Any]]) -> list[str]:
    """The numeric keys every run's summary has (the measurements), in the first summary's order."""
    first = summaries[0]
    return [
        key
        for key, value in first.items()
        if key not in NOT_MEASURED and _number(value) and all(_number(summary.get(key)) for summary in summaries)
    ]


def combine_runs(summaries: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Interval]]:
    """(the first run's summary with every measurement replaced by its mean over SUMMARIES, the intervals)."""
    intervals = {key: confidence_interval([float(s[key]) for s in summaries]) for key in measured_keys(summaries)}
    combined = dict(summaries[0]) | {key: interval.mean for key, interval in intervals.items()}
    return combined, intervals


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
