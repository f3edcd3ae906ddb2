"""`deepserve plan validate`: every published row the model can predict (predicted, published, ratio), the mean
absolute percentage error, and the rows it cannot predict with the reason."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from deepserve.plan.factors import FACTORS_PATH, load_fitted, select_factors
from deepserve.plan.published import PublishedRow, load_rows, predict_row, row_deployment, unpredictable_reason


@dataclass(frozen=True)
class RowResult:
    row: PublishedRow
    predicted: float
    profile: str
    provenance: str  # "fitted" or "transferred (...)"

    @property
    def ratio(self) -> float:
        return self.predicted / self.row.value

    @property
    def abs_pct_error(self) -> float:
        return abs(self.predicted - self.row.value) / self.row.value * 100


@dataclass(frozen=True)
class Skipped:
    row: PublishedRow
    reason: str


@dataclass(frozen=True)
class Validation:
    results: tuple[RowResult, ...]
    skipped: tuple[Skipped, ...]

    @property
    def mape_pct(self) -> float:
        return sum(r.abs_pct_error for r in self.results) / max(len(self.results), 1)

    def mape_pct_of(self, fitted: bool) -> float:
        chosen = [r for r in self.results if (r.provenance == "fitted") == fitted]
        return sum(r.abs_pct_error for r in chosen) / max(len(chosen), 1)

    @property
    def worst(self) -> RowResult | None:
        return max(self.results, key=lambda r: max(r.ratio, 1 / r.ratio), default=None)

    @property
    def worst_fitted(self) -> RowResult | None:
        fitted = [r for r in self.results if r.provenance == "fitted"]
        return max(fitted, key=lambda r: max(r.ratio, 1 / r.ratio), default=None)

    @property
    def off_by_more_than_2x(self) -> list[RowResult]:
        return [r for r in self.results if not 0.5 <= r.ratio <= 2.0]

    def to_json(self) -> dict[str, object]:
        worst = self.worst
        return {
            "mape_pct": round(self.mape_pct, 2),
            "mape_pct_fitted_rows": round(self.mape_pct_of(True), 2),
            "worst_ratio": round(worst.ratio, 3) if worst else None,
            "worst_ratio_fitted_rows": round(self.worst_fitted.ratio, 3) if self.worst_fitted else None,
            "rows": [
                {
                    "row": r.row.number,
                    "label": r.row.label(),
                    "predicted": round(r.predicted, 2),
                    "published": r.row.value,
                    "unit": r.row.unit,
                    "ratio": round(r.ratio, 3),
                    "profile": r.profile,
                    "provenance": r.provenance,
                }
                for r in self.results
            ],
            "unpredictable": [{"row": s.row.number, "label": s.row.label(), "reason": s.reason} for s in self.skipped],
        }


def validate(factors_path: Path = FACTORS_PATH) -> Validation:
    fitted = load_fitted(factors_path)
    results, skipped = [], []
    for row in load_rows():
        reason = unpredictable_reason(row)
        if reason is None:
            deployment = row_deployment(row)
            selected = select_factors(deployment.profile_key(), fitted, across_engines=False)
            if not deployment.memory.fits:
                reason = "the model says this setup does not fit in memory"
            elif selected is None:
                reason = (
                    f"no efficiency factors for engine {row.engine}: no other published row to fit them on, and "
                    "fitting them to this row alone would memorise it"
                )
            else:
                value = predict_row(row, deployment, deployment.performance_model(selected))
                results.append(RowResult(row, value, selected.profile, selected.provenance))
                continue
        if row.engine not in {key.engine for key in fitted} and "engine" not in reason:
            reason += (
                f"; and no efficiency factors exist for engine {row.engine} (no other published row to fit them on)"
            )
        skipped.append(Skipped(row, reason))
    return Validation(tuple(results), tuple(skipped))
