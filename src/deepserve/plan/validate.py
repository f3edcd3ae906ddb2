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
    transferred: RowResult | None = None  # what another vendor's factors would predict: shown, never counted


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
            "unpredictable": [_skipped_json(s) for s in self.skipped],
        }


def _skipped_json(skipped: Skipped) -> dict[str, object]:
    entry: dict[str, object] = {"row": skipped.row.number, "label": skipped.row.label(), "reason": skipped.reason}
    if skipped.transferred is not None:
        entry["transferred_prediction"] = {
            "predicted": round(skipped.transferred.predicted, 2),
            "ratio": round(skipped.transferred.ratio, 3),
            "profile": skipped.transferred.profile,
        }
    return entry


def validate(factors_path: Path = FACTORS_PATH) -> Validation:
    """Rows are predicted only with factors fitted for their engine on their vendor's hardware; a row whose
    factors would have to come from another engine or vendor is listed as unpredictable, with the reason (and,
    for another vendor, the transferred figure for information)."""
    fitted = load_fitted(factors_path)
    results, skipped = [], []
    for row in load_rows():
        reason = unpredictable_reason(row)
        transferred = None
        if reason is None:
            deployment = row_deployment(row)
            key = deployment.profile_key()
            selected = select_factors(key, fitted, across_engines=False, across_vendors=False)
            if not deployment.memory.fits:
                reason = "the model says this setup does not fit in memory"
            elif selected is not None:
                value = predict_row(row, deployment, deployment.performance_model(selected))
                results.append(RowResult(row, value, selected.profile, selected.provenance))
                continue
            elif row.engine in {k.engine for k in fitted}:
                reason = (
                    f"no efficiency factors for {row.engine} on {key.vendor} hardware ({key.hardware_class}): no other "
                    f"published {key.vendor} row to fit them on, and fitting them to this row alone would memorise it"
                )
                donor = select_factors(key, fitted, across_engines=False)
                if donor is not None:
                    value = predict_row(row, deployment, deployment.performance_model(donor))
                    transferred = RowResult(row, value, donor.profile, donor.provenance)
        if row.engine not in {key.engine for key in fitted}:
            prefix = "" if reason is None else reason + "; and "
            reason = (
                f"{prefix}no efficiency factors for engine {row.engine}: no other published row to fit them on, "
                "and fitting them to this row alone would memorise it"
            )
        skipped.append(Skipped(row, reason or "", transferred))
    return Validation(tuple(results), tuple(skipped))
