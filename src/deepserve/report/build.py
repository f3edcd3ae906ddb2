"""`deepserve report`: result sets in, OUT/report.html and OUT/*.png out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from deepserve.errors import ConfigError
from deepserve.report.answers import SaturationAnswer, SloAnswer, saturation_answers, slo_answers
from deepserve.report.charts import Chart, draw_charts
from deepserve.report.html import render_html
from deepserve.report.slo import Slo
from deepserve.report.tune import predicted_vs_measured_chart, tune_section_html
from deepserve.results.points import ResultSet
from deepserve.results.sweepdir import load_result_set


@dataclass(frozen=True)
class Report:
    html_path: Path
    charts: list[Chart]
    slo_answers: list[SloAnswer]
    saturation_answers: list[SaturationAnswer]

    def answer_texts(self) -> list[str]:
        return [answer.text for answer in self.slo_answers] + [answer.text for answer in self.saturation_answers]


def load_sets(paths: Sequence[Path], labels: Sequence[str] | None = None) -> list[ResultSet]:
    """One result set per path; LABELS (in the same order) replace the labels the results carry."""
    labels = list(labels or [])
    if len(labels) > len(paths):
        raise ConfigError(f"{len(labels)} labels for {len(paths)} result directories; give at most one per directory")
    sets = [load_result_set(path, labels[i] if i < len(labels) else None) for i, path in enumerate(paths)]
    _make_labels_unique(sets)
    return sets


def _make_labels_unique(sets: list[ResultSet]) -> None:
    """Two sets with one label would share a colour and a legend entry; number the repeats."""
    seen: dict[str, int] = {}
    for result_set in sets:
        count = seen.get(result_set.label, 0)
        seen[result_set.label] = count + 1
        if count:
            result_set.label = f"{result_set.label} ({count + 1})"


def build_report(sets: list[ResultSet], out_dir: Path, slos: Sequence[Slo], title: str | None = None) -> Report:
    out_dir.mkdir(parents=True, exist_ok=True)
    charts = draw_charts(sets, slos, out_dir)
    tuned = predicted_vs_measured_chart(sets, slos, out_dir)  # a `deepserve tune` directory's forecast and goodput
    charts += [tuned] if tuned is not None else []
    slo = slo_answers(sets, slos)
    saturation = saturation_answers(sets)
    html_path = out_dir / "report.html"
    sections = [tune_section_html(sets, slos)]
    html_path.write_text(
        render_html(sets, charts, slo, saturation, slos, title or "deepserve benchmark report", sections)
    )
    return Report(html_path, charts, slo, saturation)
