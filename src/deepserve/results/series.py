"""Group result points into the lines of a chart: which points share an x axis, and what each line is called.

A result set is one colour family (one machine, engine or model). Within a set, points that differ in something
other than the x axis (input 1,024 against 4,096, say) become separate lines, named after that difference.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from deepserve.results.points import ResultPoint, ResultSet

# Variant names the suites give their workload variants; charts that compare them look for these.
PREFIX_SHARED = "shared prefix"
PREFIX_NONE = "no sharing"
OFFLINE = "offline"

ParamKey = tuple[tuple[str, object], ...]  # (name, value) of the parameters that are not the x axis
PointFilter = Callable[[ResultPoint], bool]
XValue = Callable[[ResultPoint], float | None]


@dataclass
class Series:
    """One line: a label and its points sorted by x."""

    label: str
    xs: list[float]
    points: list[ResultPoint]

    def ys(self, metric: str) -> list[float]:
        """Values of METRIC, NaN where a point lacks it (matplotlib leaves a gap)."""
        return [_nan_if_none(point.metric(metric)) for point in self.points]


def _nan_if_none(value: float | None) -> float:
    return math.nan if value is None else value


def is_concurrency_point(point: ResultPoint) -> bool:
    """Closed-loop points: a concurrency limit and everything offered at once."""
    params = point.params
    return params.max_concurrency is not None and math.isinf(params.request_rate) and params.variant != OFFLINE


def is_rate_point(point: ResultPoint) -> bool:
    return not math.isinf(point.params.request_rate)


def is_closed_loop(point: ResultPoint) -> bool:
    return math.isinf(point.params.request_rate) and point.params.variant != OFFLINE


def is_offline_point(point: ResultPoint) -> bool:
    return point.params.variant == OFFLINE


def concurrency_x(point: ResultPoint) -> float | None:
    return float(point.params.max_concurrency) if point.params.max_concurrency is not None else None


def rate_x(point: ResultPoint) -> float | None:
    return None if math.isinf(point.params.request_rate) else point.params.request_rate


def output_len_x(point: ResultPoint) -> float | None:
    return float(point.params.output_len) if point.params.output_len is not None else None


def input_len_x(point: ResultPoint) -> float | None:
    return float(point.params.input_len) if point.params.input_len is not None else None


def batch_x(point: ResultPoint) -> float | None:
    return float(point.params.num_prompts) if point.params.num_prompts is not None else None


def build_series(
    sets: list[ResultSet], keep: PointFilter, x_of: XValue, x_name: str, min_points: int = 2
) -> list[Series]:
    """Lines for a chart whose x axis is X_NAME (a PointParams field): points of each set that KEEP accepts,
    split by the parameters other than X_NAME, each line sorted by x. Lines of fewer than MIN_POINTS points are
    dropped: one point is not a curve."""
    lines: list[Series] = []
    for result_set in sets:
        groups: dict[ParamKey, list[ResultPoint]] = {}
        for point in result_set.points:
            if keep(point) and x_of(point) is not None:
                groups.setdefault(_other_params(point, x_name), []).append(point)
        # Lines are named by what tells them apart from the set's other lines drawn (a suite of several
        # experiments has one-point groups that are no line: they must not lengthen the names).
        kept = {key: points for key, points in groups.items() if len(points) >= min_points}
        for key, points in kept.items():
            points.sort(key=lambda point: x_of(point) or 0.0)
            label = _series_label(result_set.label, key, list(kept), x_name)
            lines.append(Series(label, [x_of(point) or 0.0 for point in points], points))
    return lines


def build_workload_series(sets: list[ResultSet], x_of: XValue, y_key: str) -> list[Series]:
    """Lines whose points are every load level (concurrency, request rate, batch) of one workload (input and
    output length, variant) of a set, for charts whose axes are both measured (Pareto, cost): each line sorted by
    x, points without an x or a Y_KEY value left out. One point is kept: a dot still places a set."""
    lines: list[Series] = []
    for result_set in sets:
        groups: dict[ParamKey, list[ResultPoint]] = {}
        for point in result_set.points:
            if x_of(point) is not None and point.metric(y_key) is not None:
                groups.setdefault(_workload_params(point), []).append(point)
        for key, points in groups.items():
            points.sort(key=lambda point: x_of(point) or 0.0)
            label = _series_label(result_set.label, key, list(groups), "")
            lines.append(Series(label, [x_of(point) or 0.0 for point in points], points))
    return lines


_PARAM_NAMES = ("max_concurrency", "request_rate", "input_len", "output_len", "variant")
_WORKLOAD_NAMES = ("input_len", "output_len", "variant")


def _workload_params(point: ResultPoint) -> ParamKey:
    values = point.params.as_dict()
    return tuple((name, values[name]) for name in _WORKLOAD_NAMES)


def _other_params(point: ResultPoint, x_name: str) -> ParamKey:
    values = point.params.as_dict()
    return tuple((name, values[name]) for name in _PARAM_NAMES if name != x_name and name != "num_prompts")


def _series_label(set_label: str, key: ParamKey, all_keys: list[ParamKey], x_name: str) -> str:
    """The set's label, plus the parameters that tell this line apart from the set's other lines."""
    if len(all_keys) == 1:
        return set_label
    differing = [index for index in range(len(key)) if len({other[index] for other in all_keys}) > 1]
    words = [_param_words(*key[index]) for index in differing]
    return f"{set_label} · {', '.join(words)}"


def _param_words(name: str, value: object) -> str:
    short = {
        "max_concurrency": "c",
        "request_rate": "rate",
        "input_len": "in",
        "output_len": "out",
    }
    if name == "variant":
        return str(value)
    return f"{short.get(name, name)} {value if value is not None else '∞'}"
