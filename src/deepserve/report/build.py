"""`deepserve report`: result sets in, OUT/report.html and OUT/*.png out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from deepserve.errors import ConfigError
from deepserve.report.answers import (
    EfficiencyAnswer,
    SaturationAnswer,
    SloAnswer,
    efficiency_answers,
    saturation_answers,
    slo_answers,
)
from deepserve.report.charts import Chart, draw_charts
from deepserve.report.deployment import DeploymentOptions, SetDeployment, resolve_deployment
from deepserve.report.derived import annotate
from deepserve.report.html import render_html
from deepserve.report.tune import predicted_vs_measured_chart, tune_section_html
from deepserve.results.points import ResultSet
from deepserve.results.slo import Slo
from deepserve.results.sweepdir import load_result_set


@dataclass(frozen=True)
class Report:
    html_path: Path
    charts: list[Chart]
    slo_answers: list[SloAnswer]
    saturation_answers: list[SaturationAnswer]
    efficiency_answers: list[EfficiencyAnswer]
    deployments: list[SetDeployment]

    def answer_texts(self) -> list[str]:
        answers: list[SloAnswer | SaturationAnswer | EfficiencyAnswer] = [
            *self.slo_answers,
            *self.saturation_answers,
            *self.efficiency_answers,
        ]
        return [answer.text for answer in answers]


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


def build_report(
    sets: list[ResultSet],
    out_dir: Path,
    slos: Sequence[Slo],
    title: str | None = None,
    deployment: DeploymentOptions | None = None,
) -> Report:
    out_dir.mkdir(parents=True, exist_ok=True)
    deployments = [resolve_deployment(result_set, deployment or DeploymentOptions()) for result_set in sets]
    for result_set, resolved in zip(sets, deployments, strict=True):
        annotate(result_set.points, resolved)
    charts = [_with_deployment_notes(chart, sets, deployments) for chart in draw_charts(sets, slos, out_dir)]
    tuned = predicted_vs_measured_chart(sets, slos, out_dir)  # a `deepserve tune` directory's forecast and goodput
    charts += [tuned] if tuned is not None else []
    slo = slo_answers(sets, slos)
    saturation = saturation_answers(sets)
    efficiency = efficiency_answers(sets, deployments)
    html_path = out_dir / "report.html"
    answers = (slo, saturation, efficiency)
    sections = [tune_section_html(sets, slos)]
    title = title or "deepserve benchmark report"
    html_path.write_text(render_html(sets, deployments, charts, answers, slos, title, sections))
    return Report(html_path, charts, slo, saturation, efficiency, deployments)


# Charts whose numbers rest on the deployment (GPU counts, prices, the hardware): the caption says where from.
_DEPLOYMENT_CHARTS = {"pareto": "GPUs", "cost_per_million_tokens": "price", "decode_vs_hardware_limit": "limit"}


def _with_deployment_notes(chart: Chart, sets: list[ResultSet], deployments: list[SetDeployment]) -> Chart:
    kind = _DEPLOYMENT_CHARTS.get(chart.name)
    if kind is None:
        return chart
    notes = []
    for result_set, resolved in zip(sets, deployments, strict=True):
        if kind == "GPUs":
            notes.append(f"{result_set.label}: {resolved.gpus} ({resolved.gpus_source})")
        elif kind == "price" and resolved.gpu_hour_usd is not None:
            price = f"${resolved.gpu_hour_usd:,.2f}/h"
            notes.append(f"{result_set.label}: {resolved.gpus} x {price} ({resolved.price_source})")
        elif kind == "limit" and resolved.limit is not None:
            notes.append(f"{result_set.label}: {resolved.limit.describe()}")
    heading = {"GPUs": "GPUs per point", "price": "Prices", "limit": "Hardware"}[kind]
    return replace(chart, caption=f"{chart.caption} {heading}: {'; '.join(notes)}.") if notes else chart
