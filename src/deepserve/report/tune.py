"""The part of a report that a `deepserve tune` directory adds: for every point it measured, the planner's forecast
beside the measurement, and goodput under the report's SLOs (recounted from the per-request lists the tune keeps,
so `--slo` here may differ from the tune's)."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter

from deepserve.report.charts import COLORS, DPI, FIGSIZE, Chart
from deepserve.results.points import ResultPoint, ResultSet
from deepserve.results.slo import Slo
from deepserve.tune.goodput import MissingDetails, output_goodput_tok_s, slos_hold


@dataclass(frozen=True)
class TuneRow:
    set_label: str
    point: str  # the engine fields of the point, e.g. "max_num_seqs=16"
    measured_tok_s: float | None
    predicted_tok_s: float | None
    goodput_output_tok_s: float | None  # None: the result has no per-request lists
    slos_hold: bool | None
    measured_tpot_ms: float | None
    predicted_tpot_ms: float | None
    measured_ttft_ms: float | None
    predicted_ttft_ms: float | None
    search: str  # the load search's answer, if one ran

    @property
    def ratio(self) -> float | None:
        """Predicted over measured output throughput."""
        if not self.predicted_tok_s or not self.measured_tok_s:
            return None
        return self.predicted_tok_s / self.measured_tok_s


def tune_rows(sets: Sequence[ResultSet], slos: Sequence[Slo]) -> list[TuneRow]:
    """One row per tuned point (a result carrying the tune's facts), in each set's order."""
    return [_row(result_set.label, point, slos) for result_set in sets for point in result_set.points if _tuned(point)]


def predicted_vs_measured_chart(sets: list[ResultSet], slos: Sequence[Slo], out_dir: Path) -> Chart | None:
    """Horizontal bars per tuned point: measured output tokens/s, goodput under the SLOs, and the planner's
    forecast where it made one."""
    rows = tune_rows(sets, slos)
    if not rows:
        return None
    height = max(FIGSIZE[1], 1.8 + 0.55 * len(rows))
    fig, ax = plt.subplots(figsize=(FIGSIZE[0], height), dpi=DPI)
    fig.suptitle("Tuned points: predicted vs measured output throughput", fontsize=13, fontweight="bold")
    bars = (
        ("measured output", [row.measured_tok_s for row in rows], COLORS[0], None),
        ("goodput (every SLO met)", [row.goodput_output_tok_s for row in rows], COLORS[2], None),
        ("predicted by the planner", [row.predicted_tok_s for row in rows], "white", "//"),
    )
    width = 0.8 / len(bars)
    for index, (label, values, color, hatch) in enumerate(bars):
        positions = [slot + (index - 1) * width for slot in range(len(rows))]
        shown = [math.nan if value is None else value for value in values]
        ax.barh(positions, shown, height=width * 0.95, color=color, edgecolor="black", hatch=hatch, label=label)
    ax.set_yticks(range(len(rows)), [_label(row, len(sets) > 1) for row in rows], fontsize=8)
    ax.invert_yaxis()  # the tune's order top down
    ax.set_xlabel("output tokens/s")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}"))
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3, frameon=False)
    fig.tight_layout()
    path = out_dir / "tune_predicted_vs_measured.png"
    fig.savefig(path)
    plt.close(fig)
    slo_words = ", ".join(slo.words for slo in slos) or "none"
    return Chart(
        "tune_predicted_vs_measured",
        "Tuned points: predicted vs measured output throughput",
        path,
        f"Each engine config the tune measured: output tokens/s, goodput (tokens/s of requests meeting every SLO: "
        f"{slo_words}) and the planner's forecast (hatched; missing where it could not predict).",
    )


def tune_section_html(sets: Sequence[ResultSet], slos: Sequence[Slo]) -> str:
    """The tuned points as a table, predicted beside measured; empty when the sets hold no tune."""
    rows = tune_rows(sets, slos)
    if not rows:
        return ""
    headings = (
        "set", "engine config", "output tok/s", "predicted", "predicted / measured", "goodput tok/s", "SLOs",
        "mean TPOT (ms)", "predicted", "mean TTFT (ms)", "predicted", "load search",
    )  # fmt: skip
    head = "".join(f"<th>{html.escape(text)}</th>" for text in headings)
    body = []
    for row in rows:
        verdict = "–" if row.slos_hold is None else ("hold" if row.slos_hold else "missed")
        cells = [
            _text(row.set_label), _text(row.point), _number(row.measured_tok_s), _number(row.predicted_tok_s),
            _number(row.ratio), _number(row.goodput_output_tok_s), _text(verdict), _number(row.measured_tpot_ms),
            _number(row.predicted_tpot_ms), _number(row.measured_ttft_ms), _number(row.predicted_ttft_ms),
            _text(row.search or "–"),
        ]  # fmt: skip
        body.append("<tr>" + "".join(cells) + "</tr>")
    return (
        '<h2 id="tune">Tuned points: predicted against measured</h2><table class="points">'
        f"<tr>{head}</tr>{''.join(body)}</table>"
    )


def _tuned(point: ResultPoint) -> bool:
    return isinstance(point.result.get("tune"), dict)


def _row(set_label: str, point: ResultPoint, slos: Sequence[Slo]) -> TuneRow:
    facts: dict[str, Any] = point.result["tune"]
    predicted: dict[str, Any] = facts.get("predicted") or {}
    try:
        goodput: float | None = output_goodput_tok_s(point.result, slos)
        holds: bool | None = slos_hold(point.result, slos)
    except MissingDetails:
        goodput, holds = None, None
    search = facts.get("search") or {}
    return TuneRow(
        set_label=set_label,
        point=point.params.variant or point.point_id,
        measured_tok_s=point.metric("output_throughput"),
        predicted_tok_s=_float(predicted.get("output_tok_s")),
        goodput_output_tok_s=goodput,
        slos_hold=holds,
        measured_tpot_ms=point.metric("mean_tpot_ms"),
        predicted_tpot_ms=_float(predicted.get("tpot_ms")),
        measured_ttft_ms=point.metric("mean_ttft_ms"),
        predicted_ttft_ms=_float(predicted.get("ttft_ms")),
        search=str(search.get("words") or ""),
    )


def _label(row: TuneRow, with_set: bool) -> str:
    return f"{row.set_label}: {row.point}" if with_set else row.point


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _number(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "<td>–</td>"
    return f"<td>{value:,.2f}</td>" if abs(value) < 100 else f"<td>{value:,.0f}</td>"


def _text(value: str) -> str:
    return f'<td class="text">{html.escape(value)}</td>'
