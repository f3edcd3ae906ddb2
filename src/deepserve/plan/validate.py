"""`deepserve plan validate`: the model against the published figures.

The headline is leave-one-source-out: for each source, the engine profile's fitted parameters are refitted on the
other sources' rows and the source's rows are predicted with them, so no row is scored by parameters that saw it.
Each row is predicted as its run was made: a closed loop by the steady formula, a finite run (a request rate,
everything at once, a few requests) by the simulator's forecast of that run when one is passed in, one pool of a
disaggregated deployment by that pool alone. The in-sample score (parameters fitted on every row) comes second.
Scores are broken down by source, metric and layout kind; the targets apply to closed-loop runs on NVIDIA GPUs
(issue 20), the 2x bound to every row. Rows the model cannot express are listed with the reason; for a row on
hardware without measured kernel figures the prediction with the carried-over figures is shown for information.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from deepserve.plan.benchmark import BenchmarkForecaster, RememberingForecaster
from deepserve.plan.fit import HeldOut, RowCase, fit_profiles, leave_one_source_out, row_cases
from deepserve.plan.profiles import EngineParameters
from deepserve.plan.published import PublishedRow, load_rows, row_deployment, unpredictable_reason
from deepserve.plan.scoring import NeedsForecaster, predict_row
from deepserve.plan.track_record import HeldOutFigure

GROUPS = ("throughput", "tpot", "ttft", "e2el", "p99")
TARGET_MAPE_PCT = {"throughput": 15.0, "tpot": 15.0, "ttft": 30.0}
MAX_RATIO = 2.0
HEADLINE_KINDS = ("closed_loop", "sweep_peak")


@dataclass(frozen=True)
class RowResult:
    row: PublishedRow
    predicted: float
    profile: str
    provenance: str  # "leave-one-source-out", "in-sample", "carried-over kernel figures"
    vendor: str = "nvidia"
    attention: str = "mla"  # the model's attention kind (ModelSpec.attention_kind): its generation
    steady: float | None = None  # the steady formula's value beside a forecast closed loop (not scored)

    @property
    def ratio(self) -> float:
        return self.predicted / self.row.value

    @property
    def steady_ratio(self) -> float | None:
        return None if self.steady is None else self.steady / self.row.value

    @property
    def abs_pct_error(self) -> float:
        return abs(self.predicted - self.row.value) / self.row.value * 100

    @property
    def group(self) -> str:
        metric = self.row.parsed_metric
        assert metric is not None
        return metric.group

    @property
    def headline(self) -> bool:
        """Scored against the targets: a closed-loop run on an NVIDIA GPU."""
        return self.row.scored_as in HEADLINE_KINDS and self.vendor == "nvidia"


@dataclass(frozen=True)
class Score:
    """MAPE per metric group, the worst ratio, and the rows beyond 2x, over one set of predictions."""

    results: tuple[RowResult, ...]

    def mape_pct(self, group: str | None = None) -> float:
        chosen = [r for r in self.results if group is None or r.group == group]
        return sum(r.abs_pct_error for r in chosen) / max(len(chosen), 1)

    def groups(self) -> list[str]:
        return [g for g in GROUPS if any(r.group == g for r in self.results)]

    def where(self, keep: Callable[[RowResult], bool]) -> Score:
        return Score(tuple(r for r in self.results if keep(r)))

    @property
    def headline(self) -> Score:
        return self.where(lambda r: r.headline)

    @property
    def worst(self) -> RowResult | None:
        return max(self.results, key=lambda r: max(r.ratio, 1 / r.ratio), default=None)

    @property
    def off_by_more_than_2x(self) -> list[RowResult]:
        return [r for r in self.results if not 1 / MAX_RATIO <= r.ratio <= MAX_RATIO]

    def meets_targets(self) -> bool:
        headline = self.headline
        within = all(headline.mape_pct(g) <= TARGET_MAPE_PCT[g] for g in headline.groups() if g in TARGET_MAPE_PCT)
        return bool(headline.results) and within and not self.off_by_more_than_2x

    def breakdown(self, key: Callable[[RowResult], str]) -> dict[str, dict[str, tuple[float, int]]]:
        """MAPE and row count per group, for each value of KEY (a source, a layout kind)."""
        table: dict[str, dict[str, tuple[float, int]]] = {}
        for name in sorted({key(r) for r in self.results}):
            part = Score(tuple(r for r in self.results if key(r) == name))
            table[name] = {g: (part.mape_pct(g), sum(r.group == g for r in part.results)) for g in part.groups()}
        return table

    def to_json(self) -> dict[str, object]:
        worst = self.worst
        headline = self.headline
        return {
            "headline_mape_pct_by_metric": {g: round(headline.mape_pct(g), 2) for g in headline.groups()},
            "headline_rows": len(headline.results),
            "mape_pct": round(self.mape_pct(), 2),
            "mape_pct_by_metric": {g: round(self.mape_pct(g), 2) for g in self.groups()},
            "worst_ratio": round(worst.ratio, 3) if worst else None,
            "off_by_more_than_2x": [r.row.number for r in self.off_by_more_than_2x],
            "meets_targets": self.meets_targets(),
            "by_source": _rounded(self.breakdown(lambda r: r.row.source_id or r.row.source)),
            "by_layout_kind": _rounded(self.breakdown(lambda r: r.row.layout_kind)),
            "by_run": _rounded(self.breakdown(lambda r: r.row.scored_as)),
            "rows": [_row_json(r) for r in self.results],
        }


def track_record_figures(score: Score) -> list[HeldOutFigure]:
    """SCORE's predictions as plan/track_record.py summarises them (layout kind, vendor, attention, metric group,
    source)."""
    return [
        HeldOutFigure(r.row.layout_kind, r.vendor, r.attention, r.group, r.row.source_id or r.row.source, r.ratio)
        for r in score.results
    ]


def _rounded(table: dict[str, dict[str, tuple[float, int]]]) -> dict[str, dict[str, list[float]]]:
    return {name: {g: [round(m, 2), n] for g, (m, n) in groups.items()} for name, groups in table.items()}


@dataclass(frozen=True)
class Skipped:
    row: PublishedRow
    reason: str
    transferred: RowResult | None = None  # what carried-over kernel figures would predict: shown, never scored


@dataclass(frozen=True)
class Validation:
    held_out: Score  # leave-one-source-out: the headline
    in_sample: Score
    skipped: tuple[Skipped, ...]
    not_held_out: tuple[Skipped, ...]  # predictable in-sample, but no other source to fit its profile on
    parameters: dict[str, EngineParameters]  # the in-sample fit per profile

    # Kept for callers of the in-sample-only validation.
    @property
    def results(self) -> tuple[RowResult, ...]:
        return self.in_sample.results

    @property
    def mape_pct(self) -> float:
        return self.in_sample.mape_pct()

    def to_json(self) -> dict[str, object]:
        in_sample = self.in_sample.to_json()
        return {
            "leave_one_source_out": self.held_out.to_json(),
            "in_sample": in_sample,
            "targets": {"mape_pct": TARGET_MAPE_PCT, "max_ratio": MAX_RATIO, "headline": "closed-loop, NVIDIA"},
            "fitted_parameters": {name: p.to_json() for name, p in self.parameters.items()},
            "not_held_out": [_skipped_json(s) for s in self.not_held_out],
            "unpredictable": [_skipped_json(s) for s in self.skipped],
            # In-sample figures under the keys the earlier validation used.
            "mape_pct": in_sample["mape_pct"],
            "worst_ratio": in_sample["worst_ratio"],
            "rows": in_sample["rows"],
        }


def _row_json(r: RowResult) -> dict[str, object]:
    return {
        "row": r.row.number,
        "label": r.row.label(),
        "source": r.row.source_id or r.row.source,
        "scored_as": r.row.scored_as,
        "layout_kind": r.row.layout_kind,
        "predicted": round(r.predicted, 2),
        "published": r.row.value,
        "unit": r.row.unit,
        "ratio": round(r.ratio, 3),
        "profile": r.profile,
        "provenance": r.provenance,
        **_steady_json(r),
    }


def _steady_json(r: RowResult) -> dict[str, float]:
    if r.steady is None or r.steady_ratio is None:
        return {}
    return {"steady_predicted": round(r.steady, 2), "steady_ratio": round(r.steady_ratio, 3)}


def _skipped_json(skipped: Skipped) -> dict[str, object]:
    entry: dict[str, object] = {"row": skipped.row.number, "label": skipped.row.label(), "reason": skipped.reason}
    if skipped.transferred is not None:
        entry["transferred_prediction"] = {
            "predicted": round(skipped.transferred.predicted, 2),
            "ratio": round(skipped.transferred.ratio, 3),
            "profile": skipped.transferred.profile,
        }
    return entry


def validate(
    rows: list[PublishedRow] | None = None,
    calibration: Path | None = None,
    forecaster: BenchmarkForecaster | None = None,
) -> Validation:
    """ROWS (the published figures) predicted leave-one-source-out and in-sample; with CALIBRATION, the rows on its
    GPU class use its measured kernel figures, in the fits as in the predictions; with FORECASTER, finite runs are
    predicted as they ran (without one they are listed as needing it)."""
    rows = load_rows() if rows is None else rows
    forecaster = RememberingForecaster(forecaster) if forecaster is not None else None
    cases, reasons = row_cases(rows, calibration)
    fits = {fit.profile: fit.parameters for fit in fit_profiles(cases)}
    in_sample = tuple(_in_sample(cases, fits, forecaster))
    held = leave_one_source_out(cases, forecaster)
    held_results = tuple(_held_result(h, cases) for h in held if h.predicted is not None)
    not_held = tuple(Skipped(h.row, h.reason) for h in held if h.predicted is None)
    skipped = tuple(_skipped(row, reasons[row.number], fits, calibration) for row in rows if row.number in reasons)
    return Validation(Score(held_results), Score(in_sample), skipped, not_held, fits)


def _in_sample(
    cases: list[RowCase], fits: dict[str, EngineParameters], forecaster: BenchmarkForecaster | None
) -> Iterable[RowResult]:
    for case in cases:
        parameters = fits.get(case.engine.profile)
        if parameters is None:
            continue
        try:
            value = case.predict(parameters, forecaster)
        except NeedsForecaster:
            continue
        d = case.deployment
        yield RowResult(case.row, value, case.engine.profile, "in-sample", d.accelerator.vendor, d.spec.attention_kind)


def _held_result(held: HeldOut, cases: list[RowCase]) -> RowResult:
    case = next(c for c in cases if c.row.number == held.row.number)
    assert held.predicted is not None
    d = case.deployment
    provenance = "leave-one-source-out"
    return RowResult(
        held.row,
        held.predicted,
        case.engine.profile,
        provenance,
        d.accelerator.vendor,
        d.spec.attention_kind,
        held.steady,
    )


def _skipped(
    row: PublishedRow, reason: str, fits: dict[str, EngineParameters], calibration: Path | None = None
) -> Skipped:
    """A row's reason; for a row refused only for its hardware's kernel figures, what the carried-over figures
    and the engine's fitted profile would predict (for information)."""
    if unpredictable_reason(row) is not None or "kernel figures" not in reason:
        return Skipped(row, reason)
    deployment = row_deployment(row, calibration)
    engine = deployment.select_engine(across_engines=False)
    # a profile with nothing fitted predicts with its own (carried-over) values, rows to fit on or not
    parameters = fits.get(engine.profile) if engine else None
    if engine is not None and parameters is None and not engine.engine.fitted:
        parameters = engine.parameters
    if engine is None or parameters is None or not deployment.memory.fits:
        return Skipped(row, reason)
    model = deployment.performance_model(engine.with_parameters(parameters, "fit"))
    try:
        value = predict_row(row, deployment, model, steady=True)
    except NeedsForecaster:
        return Skipped(row, reason)
    return Skipped(row, reason, RowResult(row, value, engine.profile, "carried-over kernel figures"))
