"""Fit the efficiency factors to the published figures: least squares on log(predicted / published).

Rows are grouped by profile (hardware class x engine x weight family). A profile with at least MIN_ROWS_PER_FACTOR
rows per factor is fitted; the others are predicted by transfer (same engine and weights on other hardware) or
not at all. Each profile has three factors, so a fitted profile is over-determined by its rows, never tuned row by
row. The search is Nelder-Mead over the factors' logarithms (no SciPy in the dependencies; three dimensions).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np

from deepserve.hardware.catalog import get_accelerator
from deepserve.plan.factors import FACTORS_PATH, EfficiencyFactors, ProfileKey
from deepserve.plan.planner import Deployment
from deepserve.plan.published import (
    PublishedRow,
    load_rows,
    predict_row,
    row_deployment,
    unpredictable_reason,
    with_factors,
)

FACTOR_COUNT = 3
MIN_ROWS_PER_FACTOR = 2  # at least 6 rows for the 3 factors of a profile
# Starting points (layer overhead in us, memory efficiency, compute efficiency): the corners of what engines do.
STARTS = ((100.0, 0.7, 0.2), (400.0, 0.3, 0.05), (30.0, 0.9, 0.5), (1000.0, 0.1, 0.02))


@dataclass(frozen=True)
class ProfileFit:
    key: ProfileKey
    factors: EfficiencyFactors
    rows: tuple[PublishedRow, ...]
    rms_log_error: float


def fittable_rows() -> dict[ProfileKey, list[tuple[PublishedRow, Deployment]]]:
    groups: dict[ProfileKey, list[tuple[PublishedRow, Deployment]]] = {}
    for row in load_rows():
        if unpredictable_reason(row) is not None:
            continue
        deployment = row_deployment(row)
        if not deployment.memory.fits:
            continue
        groups.setdefault(deployment.profile_key(), []).append((row, deployment))
    return groups


def fit_profiles() -> list[ProfileFit]:
    fits = []
    for key, members in sorted(fittable_rows().items(), key=lambda item: item[0].describe()):
        if len(members) < FACTOR_COUNT * MIN_ROWS_PER_FACTOR:
            continue
        fits.append(fit_profile(key, members))
    return fits


def fit_profile(key: ProfileKey, members: list[tuple[PublishedRow, Deployment]]) -> ProfileFit:
    def residuals(factors: EfficiencyFactors) -> np.ndarray:
        errors = []
        for row, deployment in members:
            predicted = predict_row(row, deployment, with_factors(deployment, factors))
            errors.append(math.log(predicted / row.value))
        return np.array(errors)

    def loss(x: np.ndarray) -> float:
        return float(np.sum(residuals(_factors_from(x)) ** 2))

    # Nelder-Mead finds a local minimum; start it from a few corners of the plausible range and keep the best.
    candidates = [_nelder_mead(loss, _to_search_space(start)) for start in STARTS]
    best = min(candidates, key=loss)
    factors = _factors_from(best)
    rms = float(np.sqrt(np.mean(residuals(factors) ** 2)))
    return ProfileFit(key, factors, tuple(row for row, _ in members), rms)


def _to_search_space(start: tuple[float, float, float]) -> np.ndarray:
    overhead, memory, compute = start
    return np.array([math.log(overhead), _logit(memory), _logit(compute)])


def _factors_from(x: np.ndarray) -> EfficiencyFactors:
    """Search space to factors: the overhead is exp(x0); the efficiencies are logistic, so they stay in (0, 1)
    without a penalty wall the simplex could stick to."""
    return EfficiencyFactors(float(math.exp(x[0])), _logistic(x[1]), _logistic(x[2]))


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


def _logistic(u: float) -> float:
    return 1 / (1 + math.exp(-min(max(u, -50.0), 50.0)))


def _nelder_mead(f: Callable[[np.ndarray], float], x0: np.ndarray, iterations: int = 600) -> np.ndarray:
    """Standard Nelder-Mead (reflection 1, expansion 2, contraction 0.5, shrink 0.5), restarted once from the
    best point so a collapsed simplex cannot stop it early."""
    for _ in range(2):
        simplex = [x0] + [x0 + np.eye(len(x0))[i] * 0.5 for i in range(len(x0))]
        values = [f(x) for x in simplex]
        for _ in range(iterations):
            order = np.argsort(values)
            simplex = [simplex[i] for i in order]
            values = [values[i] for i in order]
            if abs(values[-1] - values[0]) < 1e-12:
                break
            centroid = np.mean(simplex[:-1], axis=0)
            reflected = centroid + (centroid - simplex[-1])
            fr = f(reflected)
            if fr < values[0]:
                expanded = centroid + 2 * (centroid - simplex[-1])
                fe = f(expanded)
                simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
            elif fr < values[-2]:
                simplex[-1], values[-1] = reflected, fr
            else:
                contracted = centroid + 0.5 * (simplex[-1] - centroid)
                fc = f(contracted)
                if fc < values[-1]:
                    simplex[-1], values[-1] = contracted, fc
                else:
                    simplex = [simplex[0] + 0.5 * (x - simplex[0]) for x in simplex]
                    values = [f(x) for x in simplex]
        x0 = simplex[int(np.argmin(values))]
    return x0


def fits_to_json(fits: list[ProfileFit]) -> dict[str, Any]:
    """The stored factors with the fit's inputs: which rows, and the catalog figures the model used for them."""
    profiles = []
    for fit in fits:
        hardware = sorted({row.hardware for row in fit.rows})
        profiles.append(
            {
                "key": {"hardware_class": fit.key.hardware_class, "engine": fit.key.engine, "weights": fit.key.weights},
                "factors": fit.factors.to_json(),
                "rms_log_error": round(fit.rms_log_error, 4),
                "fitted_on_rows": [row.number for row in fit.rows],
                "inputs": {
                    "rows": [
                        {"row": row.number, "label": row.label(), "published": row.value, "unit": row.unit}
                        for row in fit.rows
                    ],
                    "catalog": {
                        name: {
                            "memory_bandwidth_gb_s": get_accelerator(name).memory_bandwidth_gb_s,
                            "dense_tflops": get_accelerator(name).dense_tflops,
                        }
                        for name in hardware
                    },
                },
            }
        )
    return {
        "generated_by": "deepserve plan fit --write",
        "generated_on": date.today().isoformat(),
        "method": "least squares on log(predicted/published) per profile; Nelder-Mead from each start, best kept",
        "starts": [
            dict(zip(("layer_overhead_us", "memory_efficiency", "compute_efficiency"), start, strict=True))
            for start in STARTS
        ],
        "profiles": profiles,
    }


def write_fits(fits: list[ProfileFit], path: Path = FACTORS_PATH) -> Path:
    path.write_text(json.dumps(fits_to_json(fits), indent=1) + "\n")
    return path


@dataclass(frozen=True)
class HeldOut:
    row: PublishedRow
    predicted: float  # by factors fitted without this row

    @property
    def ratio(self) -> float:
        return self.predicted / self.row.value


def leave_one_out() -> list[HeldOut]:
    """Refit each fitted profile once per row without that row and predict it: how the model does on a figure it
    has not seen, with everything else about the setup the same."""
    held = []
    for key, members in sorted(fittable_rows().items(), key=lambda item: item[0].describe()):
        if len(members) < FACTOR_COUNT * MIN_ROWS_PER_FACTOR:
            continue
        for index, (row, deployment) in enumerate(members):
            others = members[:index] + members[index + 1 :]
            factors = fit_profile(key, others).factors
            held.append(HeldOut(row, predict_row(row, deployment, with_factors(deployment, factors))))
    return held
