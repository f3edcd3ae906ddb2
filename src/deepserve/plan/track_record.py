"""How far the planner's figures have been from published runs it never saw, by layout kind and GPU vendor.

`deepserve plan validate --write-track-record` condenses its leave-one-source-out results into
data/track_record.json: for each layout kind (tp, tp+ep, dp-attention+ep, ...) on each vendor's GPUs and each metric
group, how many published figures of how many sources were predicted, the median of predicted / published, the range
holding the middle 80% of those ratios and the share within 1.5x. `plan` and `plan search` print the record of the
layout they chose beside its figures, so a forecast for a layout the planner has often overestimated says so where
the user reads it, not only in docs/PLANNING.md. The integration test of `plan validate` checks that the stored file
is what the current model and rows give.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from deepserve.errors import ConfigError

TRACK_RECORD_PATH = Path(__file__).with_name("data") / "track_record.json"
RECORDED_GROUPS = ("throughput", "tpot", "ttft")
MIN_FIGURES = 5  # fewer held-out figures than this say nothing about a layout kind
BIAS_RATIO = 1.2  # a median ratio this far from 1 (either way) is a lean the user is told to expect
CLOSE_RATIO = 1.5  # "within 1.5x": the share of figures predicted within this factor either way
ALL_LAYOUTS = "all"


@dataclass(frozen=True)
class MetricRecord:
    """One metric group's held-out ratios (predicted / published) for one layout kind on one vendor's GPUs."""

    group: str
    figures: int
    sources: int
    median_ratio: float
    low_ratio: float  # 10th percentile
    high_ratio: float  # 90th percentile
    within_close: float  # share of figures within CLOSE_RATIO either way

    def words(self) -> str:
        lean = ""
        if self.median_ratio >= BIAS_RATIO:
            lean = ", forecasts ran high: expect less"
        elif self.median_ratio <= 1 / BIAS_RATIO:
            lean = ", forecasts ran low: expect more"
        if self.group != "throughput":  # a latency predicted low is a latency that will come out higher
            lean = lean.replace("expect less", "expect lower").replace("expect more", "expect higher")
        return (
            f"{self.group} {self.median_ratio:.2f}x median, {self.low_ratio:.2f}-{self.high_ratio:.2f}x for 80%, "
            f"{self.within_close:.0%} within {CLOSE_RATIO:g}x ({_count(self.figures, 'figure')}, "
            f"{_count(self.sources, 'source')}{lean})"
        )


@dataclass(frozen=True)
class TrackRecord:
    layout_kind: str
    vendor: str
    metrics: tuple[MetricRecord, ...]
    instead_of: str | None = None  # the layout kind asked for, where it has too few figures of its own

    def words(self) -> str:
        usable = [m for m in self.metrics if m.figures >= MIN_FIGURES]
        where = "every layout" if self.layout_kind == ALL_LAYOUTS else self.layout_kind
        if self.instead_of:
            where += f", as {self.instead_of} has too few published figures of its own"
        head = f"predicted / published on runs it never saw ({where}, {self.vendor} GPUs): "
        if not usable:
            counts = ", ".join(f"{m.group} {m.figures}" for m in self.metrics) or "none"
            return head + f"too few published figures to say ({counts})"
        return head + "; ".join(m.words() for m in usable)

    def to_json(self) -> dict[str, Any]:
        return {
            "layout_kind": self.layout_kind,
            "vendor": self.vendor,
            "metrics": {m.group: _metric_json(m) for m in self.metrics},
        }


@dataclass(frozen=True)
class HeldOutFigure:
    """What the summary needs of one held-out prediction (plan.validate.RowResult gives it)."""

    layout_kind: str
    vendor: str
    group: str
    source: str
    ratio: float


def summarise(figures: Iterable[HeldOutFigure]) -> dict[str, Any]:
    """The stored form: {"records": [...]} per layout kind and vendor, plus every layout together per vendor."""
    chosen = [f for f in figures if f.group in RECORDED_GROUPS and f.ratio > 0]
    keys = sorted({(f.layout_kind, f.vendor) for f in chosen}) + sorted({(ALL_LAYOUTS, f.vendor) for f in chosen})
    records = []
    for kind, vendor in keys:
        mine = [f for f in chosen if f.vendor == vendor and kind in (ALL_LAYOUTS, f.layout_kind)]
        metrics = tuple(_metric(group, [f for f in mine if f.group == group]) for group in RECORDED_GROUPS)
        records.append(TrackRecord(kind, vendor, tuple(m for m in metrics if m is not None)).to_json())
    return {"records": records}


def load_track_records(path: Path = TRACK_RECORD_PATH) -> dict[tuple[str, str], TrackRecord]:
    try:
        data = json.loads(path.read_text())
        return {(r.layout_kind, r.vendor): r for r in (_record(entry) for entry in data["records"])}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"{path}: not a track record ({exc}); regenerate it with `deepserve plan validate --write-track-record`"
        ) from exc


def record_for(layout_kind: str, vendor: str, path: Path = TRACK_RECORD_PATH) -> TrackRecord | None:
    """The record of LAYOUT_KIND on VENDOR's GPUs; every layout's where the kind has too few figures of its own."""
    records = _records_as_of(path, path.stat().st_mtime_ns) if path.is_file() else {}
    own = records.get((layout_kind, vendor))
    if own is not None and any(m.figures >= MIN_FIGURES for m in own.metrics):
        return own
    every = records.get((ALL_LAYOUTS, vendor))
    return own if every is None else replace(every, instead_of=layout_kind)


@lru_cache(maxsize=4)
def _records_as_of(path: Path, _mtime_ns: int) -> dict[tuple[str, str], TrackRecord]:
    """The file read once per version of it (a search plans many layouts)."""
    return load_track_records(path)


def _metric(group: str, figures: Sequence[HeldOutFigure]) -> MetricRecord | None:
    if not figures:
        return None
    ratios = sorted(f.ratio for f in figures)
    close = sum(1 / CLOSE_RATIO <= r <= CLOSE_RATIO for r in ratios)
    return MetricRecord(
        group=group,
        figures=len(ratios),
        sources=len({f.source for f in figures}),
        median_ratio=round(_quantile(ratios, 0.5), 3),
        low_ratio=round(_quantile(ratios, 0.1), 3),
        high_ratio=round(_quantile(ratios, 0.9), 3),
        within_close=round(close / len(ratios), 3),
    )


def _quantile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default), over ORDERED values."""
    position = q * (len(ordered) - 1)
    below = int(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")


def _metric_json(metric: MetricRecord) -> dict[str, float | int]:
    return {
        "figures": metric.figures,
        "sources": metric.sources,
        "median_ratio": metric.median_ratio,
        "low_ratio": metric.low_ratio,
        "high_ratio": metric.high_ratio,
        "within_1_5x": metric.within_close,
    }


def _record(entry: dict[str, Any]) -> TrackRecord:
    metrics = tuple(
        MetricRecord(
            group=group,
            figures=int(values["figures"]),
            sources=int(values["sources"]),
            median_ratio=float(values["median_ratio"]),
            low_ratio=float(values["low_ratio"]),
            high_ratio=float(values["high_ratio"]),
            within_close=float(values["within_1_5x"]),
        )
        for group, values in entry["metrics"].items()
    )
    return TrackRecord(str(entry["layout_kind"]), str(entry["vendor"]), metrics)
