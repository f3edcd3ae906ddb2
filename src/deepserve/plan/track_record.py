"""How far the planner's figures have been from published runs it never saw, by layout kind, GPU vendor and model
generation.

`deepserve plan validate --write-track-record` condenses its leave-one-source-out results into
data/track_record.json: for each layout kind (tp, tp+ep, dp-attention+ep, ...) on each vendor's GPUs, for each model
generation (told apart by attention: MLA for V3/R1/V3.1, sparse MLA for V3.2, compressed sparse attention for V4) and
for every generation together, and each metric group: how many published figures of how many sources were
predicted, the median of predicted / published, the range holding the middle 80% of those ratios and the share
within 1.5x. `plan` and `plan search` print the record closest to the plan they chose beside its figures, so a
forecast for a setup the planner has often overestimated says so where the user reads it, not only in
docs/PLANNING.md. The integration test of `plan validate` checks that the stored file is what the current model and
rows give.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from deepserve.errors import ConfigError

TRACK_RECORD_PATH = Path(__file__).with_name("data") / "track_record.json"
RECORDED_GROUPS = ("throughput", "tpot", "ttft")
MIN_FIGURES = 5  # fewer held-out figures than this say nothing about a setup
BIAS_RATIO = 1.2  # a median ratio this far from 1 (either way) is a lean the user is told to expect
CLOSE_RATIO = 1.5  # "within 1.5x": the share of figures predicted within this factor either way
ANY = "all"  # a layout kind or attention that stands for every one
GENERATIONS = {
    "mla": "MLA models (V3, R1, V3.1)",
    "mla_sparse": "sparse-MLA models (V3.2)",
    "compressed_sparse": "compressed-attention models (V4)",
}


@dataclass(frozen=True)
class MetricRecord:
    """One metric group's held-out ratios (predicted / published) for one layout kind, generation and vendor."""

    group: str
    figures: int
    sources: int
    median_ratio: float
    low_ratio: float  # 10th percentile
    high_ratio: float  # 90th percentile
    within_close: float  # share of figures within CLOSE_RATIO either way

    def words(self) -> str:
        more, less = ("more", "less") if self.group == "throughput" else ("higher", "lower")  # a rate, or a latency
        lean = ""
        if self.median_ratio >= BIAS_RATIO:
            lean = f", forecasts ran high: expect {less}"
        elif self.median_ratio <= 1 / BIAS_RATIO:
            lean = f", forecasts ran low: expect {more}"
        return (
            f"{self.group} {self.median_ratio:.2f}x median, {self.low_ratio:.2f}-{self.high_ratio:.2f}x for 80%, "
            f"{self.within_close:.0%} within {CLOSE_RATIO:g}x ({_count(self.figures, 'figure')}, "
            f"{_count(self.sources, 'source')}{lean})"
        )


@dataclass(frozen=True)
class TrackRecord:
    """The held-out record of one setup: a layout kind (or ANY) for one generation (or ANY) on one vendor's GPUs."""

    layout_kind: str
    vendor: str
    attention: str
    metrics: tuple[MetricRecord, ...]
    instead_of: str | None = None  # what was asked for, where it has too few figures of its own

    @property
    def scope(self) -> str:
        return scope_words(self.layout_kind, self.vendor, self.attention)

    def words(self) -> str:
        usable = [m for m in (self.metric(group) for group in RECORDED_GROUPS) if m is not None]
        where = self.scope
        if self.instead_of:
            where += f"; too few published figures for {self.instead_of}"
        head = f"predicted / published on runs it never saw ({where}): "
        if not usable:
            counts = ", ".join(f"{m.group} {m.figures}" for m in self.metrics) or "none"
            return head + f"too few published figures to say ({counts})"
        return head + "; ".join(m.words() for m in usable)

    def metric(self, group: str) -> MetricRecord | None:
        """GROUP's figures where there are enough of them to say anything."""
        return next((m for m in self.metrics if m.group == group and m.figures >= MIN_FIGURES), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "layout_kind": self.layout_kind,
            "vendor": self.vendor,
            "attention": self.attention,
            "metrics": {m.group: _metric_json(m) for m in self.metrics},
            **({"instead_of": self.instead_of} if self.instead_of else {}),
        }


@dataclass(frozen=True)
class HeldOutFigure:
    """What the summary needs of one held-out prediction (plan.validate.RowResult gives it)."""

    layout_kind: str
    vendor: str
    attention: str
    group: str
    source: str
    ratio: float


def summarise(figures: Iterable[HeldOutFigure]) -> dict[str, Any]:
    """The stored form: {"records": [...]} for each layout kind, vendor and attention that has figures, and for
    every layout kind, every attention and both together on each vendor's GPUs."""
    chosen = [f for f in figures if f.group in RECORDED_GROUPS and f.ratio > 0]
    keys = sorted(
        {
            (kind, f.vendor, attention)
            for f in chosen
            for kind in (f.layout_kind, ANY)
            for attention in (f.attention, ANY)
        },
        key=lambda key: (key[0] == ANY, key[2] == ANY, key),
    )
    records = []
    for kind, vendor, attention in keys:
        mine = [
            f for f in chosen if f.vendor == vendor and kind in (ANY, f.layout_kind) and attention in (ANY, f.attention)
        ]
        metrics = tuple(_metric(group, [f for f in mine if f.group == group]) for group in RECORDED_GROUPS)
        records.append(TrackRecord(kind, vendor, attention, tuple(m for m in metrics if m is not None)).to_json())
    return {"records": records}


def load_track_records(path: Path = TRACK_RECORD_PATH) -> dict[tuple[str, str, str], TrackRecord]:
    try:
        data = json.loads(path.read_text())
        return {(r.layout_kind, r.vendor, r.attention): r for r in (_record(entry) for entry in data["records"])}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"{path}: not a track record ({exc}); regenerate it with `deepserve plan validate --write-track-record`"
        ) from exc


def record_for(layout_kind: str, vendor: str, attention: str, path: Path = TRACK_RECORD_PATH) -> TrackRecord | None:
    """The record of LAYOUT_KIND for models of ATTENTION on VENDOR's GPUs; where that has too few figures, the
    nearest that has enough: the layout kind for every model, the model's generation on every layout, then every
    layout and model on the vendor's GPUs."""
    records = _records_as_of(path, path.stat().st_mtime_ns) if path.is_file() else {}
    order = ((layout_kind, attention), (layout_kind, ANY), (ANY, attention), (ANY, ANY))
    found = [records[(kind, vendor, models)] for kind, models in order if (kind, vendor, models) in records]
    enough = next((r for r in found if any(m.figures >= MIN_FIGURES for m in r.metrics)), None)
    if enough is None:
        return found[0] if found else None  # too few anywhere: its words say so
    if (enough.layout_kind, enough.attention) == (layout_kind, attention):
        return enough
    return replace(enough, instead_of=setup_words(layout_kind, attention))


def scope_words(layout_kind: str, vendor: str, attention: str) -> str:
    return f"{setup_words(layout_kind, attention)}, {vendor} GPUs"


def setup_words(layout_kind: str, attention: str) -> str:
    layouts = "every layout" if layout_kind == ANY else layout_kind
    models = "every model" if attention == ANY else GENERATIONS.get(attention, attention)
    return f"{layouts} on {models}"


@lru_cache(maxsize=4)
def _records_as_of(path: Path, _mtime_ns: int) -> dict[tuple[str, str, str], TrackRecord]:
    """The file read once per version of it (a search plans many layouts)."""
    return load_track_records(path)


def _metric(group: str, figures: Sequence[HeldOutFigure]) -> MetricRecord | None:
    if not figures:
        return None
    ratios = [f.ratio for f in figures]
    low, median, high = (round(float(q), 3) for q in np.percentile(ratios, (10, 50, 90)))
    close = sum(1 / CLOSE_RATIO <= r <= CLOSE_RATIO for r in ratios)
    return MetricRecord(
        group=group,
        figures=len(ratios),
        sources=len({f.source for f in figures}),
        median_ratio=median,
        low_ratio=low,
        high_ratio=high,
        within_close=round(close / len(ratios), 3),
    )


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
    return TrackRecord(str(entry["layout_kind"]), str(entry["vendor"]), str(entry["attention"]), metrics)
