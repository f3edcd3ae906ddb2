"""Fit an engine profile's (at most two) overhead parameters: least squares on log(predicted / observed).

Everything else in a prediction comes from the hardware (catalog, kernel table) and the engine's version facts;
only the parameters a profile lists as `fitted` are searched (Nelder-Mead over their logarithms, from a few
starting points, best kept). Targets are published rows (`deepserve plan fit`) or measured runs (the CPU profile,
benchmarks/cpu_profile.py). `leave_one_source_out` is the honest score: each source predicted from a fit to the
others.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np

from deepserve.errors import DeepserveError
from deepserve.plan.benchmark import BenchmarkForecaster
from deepserve.plan.kernels import KernelRates
from deepserve.plan.perf import PerformanceModel
from deepserve.plan.profiles import PROFILES_PATH, EngineParameters, SelectedFactors, write_parameters
from deepserve.plan.published import PublishedRow, benchmark_run, load_rows, row_deployment, unpredictable_reason
from deepserve.plan.scoring import NeedsForecaster, fits_steady, predict_row
from deepserve.plan.types import Deployment

MIN_TARGETS_PER_PARAMETER = 2
# Runs the steady formula describes as well as the forecast: a closed loop, a sweep's best point.
STEADY_OR_FORECAST = ("closed_loop", "sweep_peak")
# Starting points per parameter, spanning what engines do (kernels per layer; prefill efficiency; ms; us).
STARTS: dict[str, tuple[float, ...]] = {
    "kernels_per_layer": (5.0, 30.0, 120.0),
    "prefill_efficiency": (0.05, 0.3, 1.0),
    "request_overhead_ms": (10.0, 60.0, 200.0),
    "cross_node_latency_us": (20.0, 60.0, 200.0),
    "step_overhead_ms": (0.5, 5.0, 30.0),
    "per_sequence_us": (10.0, 200.0, 2000.0),
}


@dataclass(frozen=True)
class Target:
    """One observed figure and how the model predicts it."""

    label: str
    value: float
    predict: Callable[[PerformanceModel], float]
    model: Callable[[EngineParameters], PerformanceModel]

    def predicted(self, parameters: EngineParameters) -> float:
        return self.predict(self.model(parameters))


@dataclass(frozen=True)
class ProfileFit:
    profile: str
    parameters: EngineParameters
    fitted: tuple[str, ...]
    labels: tuple[str, ...]
    rms_log_error: float


def fit_parameters(base: SelectedFactors, targets: Sequence[Target]) -> ProfileFit:
    """The values of BASE's fitted parameters that minimise the squared log errors over TARGETS, plus for each
    parameter with a prior its squared log distance from the prior in units of the prior's spread (one pseudo-row
    each: the prior holds a parameter where the rows say nothing about it, and yields where they do)."""
    names = base.engine.fitted
    if not names:  # a profile with nothing fitted (its values carried over): scored as it is, never searched
        squared = [math.log(t.predicted(base.parameters) / t.value) ** 2 for t in targets]
        rms = math.sqrt(sum(squared) / max(len(squared), 1))
        return ProfileFit(base.profile, base.parameters, (), tuple(t.label for t in targets), rms)
    priors = {name: base.engine.priors[name] for name in names if name in base.engine.priors}
    if not targets and len(priors) == len(names):  # nothing to fit on: the priors are the estimate
        values = {name: priors[name][0] for name in names}
        return ProfileFit(base.profile, base.parameters.with_values(values), names, (), 0.0)
    if len(targets) < MIN_TARGETS_PER_PARAMETER * max(len(names), 1) and len(priors) < len(names):
        raise ValueError(f"{len(targets)} targets cannot determine {len(names)} parameters of {base.profile}")

    def parameters_at(x: np.ndarray) -> EngineParameters:
        return base.parameters.with_values({name: float(math.exp(v)) for name, v in zip(names, x, strict=True)})

    def residuals(x: np.ndarray) -> np.ndarray:
        parameters = parameters_at(x)
        rows = [math.log(t.predicted(parameters) / t.value) for t in targets]
        return np.array(rows + _prior_residuals(dict(zip(names, x, strict=True)), priors))

    def loss(x: np.ndarray) -> float:
        r = residuals(x)
        return float(r @ r)

    starts = _starts(base, names, priors, loss)
    if len(priors) == len(names):  # a smooth least-squares problem: Levenberg-Marquardt needs few evaluations
        winner = min((_levenberg_marquardt(residuals, start) for start in starts), key=loss)
    else:
        winner = min((_nelder_mead(loss, start) for start in starts), key=loss)
    parameters = parameters_at(winner)
    rms = math.sqrt(sum(math.log(t.predicted(parameters) / t.value) ** 2 for t in targets) / max(len(targets), 1))
    return ProfileFit(base.profile, parameters, names, tuple(t.label for t in targets), rms)


def _prior_residuals(log_values: dict[str, float], priors: dict[str, tuple[float, float]]) -> list[float]:
    """Each prior's pseudo-row: the parameter's log distance from the prior in units of its spread."""
    return [(log_values[name] - math.log(value)) / math.log(factor) for name, (value, factor) in priors.items()]


def _levenberg_marquardt(
    residuals: Callable[[np.ndarray], np.ndarray], x0: np.ndarray, iterations: int = 40
) -> np.ndarray:
    """Least squares by Levenberg-Marquardt with a forward-difference Jacobian (steps capped at a factor e^2 per
    parameter); stops when a step no longer lowers the sum of squares."""
    x, r = x0.copy(), residuals(x0)
    cost, damping = float(r @ r), 1e-2
    for _ in range(iterations):
        jacobian = np.column_stack([(residuals(x + 1e-4 * unit) - r) / 1e-4 for unit in np.eye(len(x))])
        gradient, curvature = jacobian.T @ r, jacobian.T @ jacobian
        while damping < 1e8:
            scale = curvature + damping * np.diag(np.diag(curvature) + 1e-12)
            step = np.clip(np.linalg.solve(scale, -gradient), -2.0, 2.0)
            trial = residuals(x + step)
            if float(trial @ trial) < cost:
                x, r, cost, damping = x + step, trial, float(trial @ trial), max(damping / 3, 1e-9)
                break
            damping *= 4
        else:
            break
        if float(np.abs(step).max()) < 1e-5:
            break
    return x


def _starts(
    base: SelectedFactors,
    names: tuple[str, ...],
    priors: dict[str, tuple[float, float]],
    loss: Callable[[np.ndarray], float],
) -> list[np.ndarray]:
    """Where the simplex starts: the priors and the profile's stored values when every parameter has a prior;
    otherwise the best two points of a start grid."""
    if len(priors) == len(names):
        stored = np.log(np.array([max(getattr(base.parameters, name), 1e-9) for name in names]))
        return [np.log(np.array([priors[name][0] for name in names])), stored]
    grid = sorted((np.log(np.array(point)) for point in _start_grid(names)), key=loss)
    return grid[:2]


def _start_grid(names: tuple[str, ...]) -> list[tuple[float, ...]]:
    grid: list[tuple[float, ...]] = [()]
    for name in names:
        grid = [(*point, value) for point in grid for value in STARTS[name]]
    return grid


def _nelder_mead(f: Callable[[np.ndarray], float], x0: np.ndarray, iterations: int = 200) -> np.ndarray:
    """Standard Nelder-Mead (reflection 1, expansion 2, contraction 0.5, shrink 0.5), restarted once from the
    best point so a collapsed simplex cannot stop it early."""
    for _ in range(2):
        simplex = [x0] + [x0 + np.eye(len(x0))[i] * 0.5 for i in range(len(x0))]
        values = [f(x) for x in simplex]
        for _ in range(iterations):
            order = np.argsort(values)
            simplex = [simplex[i] for i in order]
            values = [values[i] for i in order]
            if abs(values[-1] - values[0]) < 1e-7 * max(abs(values[0]), 1e-9) + 1e-12:
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


# ---- published rows ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowCase:
    row: PublishedRow
    deployment: Deployment
    engine: SelectedFactors
    rates: KernelRates

    def model(self, parameters: EngineParameters) -> PerformanceModel:
        return self.deployment.performance_model(self.engine.with_parameters(parameters, "fit"), self.rates)

    def target(self) -> Target:
        """The row's steady-formula prediction, what the fit minimises over."""
        return Target(
            self.row.label(),
            self.row.value,
            lambda m: predict_row(self.row, self.deployment, m, steady=True),
            self.model,
        )

    def predict(self, parameters: EngineParameters, forecaster: BenchmarkForecaster | None = None) -> float:
        """The row as the user measured it: the forecaster's finite run where the row's run is known."""
        return predict_row(self.row, self.deployment, self.model(parameters), forecaster)

    @property
    def steady(self) -> bool:
        return fits_steady(self.row)

    def steady_beside_forecast(
        self, parameters: EngineParameters, forecaster: BenchmarkForecaster | None
    ) -> float | None:
        """The steady formula's value for a row that FORECASTER predicts as its finite run (a closed loop of
        known length): where the two disagree, the run's shape (waves, a first burst, its tail) sets the figure.
        None for rows without both."""
        if forecaster is None or self.row.scored_as not in STEADY_OR_FORECAST or benchmark_run(self.row) is None:
            return None
        return predict_row(self.row, self.deployment, self.model(parameters), steady=True)


def row_cases(
    rows: list[PublishedRow] | None = None, calibration: Path | None = None
) -> tuple[list[RowCase], dict[int, str]]:
    """The rows a profile can be fitted to or scored on (with CALIBRATION's measured kernel figures for the rows
    on its GPU class), and why each other row cannot be."""
    cases, reasons = [], {}
    for row in load_rows() if rows is None else rows:
        reason = unpredictable_reason(row)
        if reason is None:
            reason, case = _row_case(row, calibration)
            if case is not None:
                cases.append(case)
                continue
        reasons[row.number] = reason or ""
    return cases, reasons


def _row_case(row: PublishedRow, calibration: Path | None) -> tuple[str | None, RowCase | None]:
    try:
        deployment = row_deployment(row, calibration)
    except DeepserveError as exc:
        return f"the row's setup is refused: {exc}", None
    engine = deployment.select_engine(across_engines=False)
    rates = deployment.kernel_rates()
    if engine is None:
        return (
            f"no engine profile for {row.engine}: no other published row to fit its overheads on, and fitting them "
            "to this row alone would memorise it"
        ), None
    if not rates.measured:
        return (
            f"no measured kernel figures for {deployment.accelerator.hardware_class} hardware "
            f"({deployment.accelerator.vendor}): the table carries NVIDIA's over, and another vendor's kernel stack "
            "does not run at NVIDIA's fractions"
        ), None
    if not deployment.memory.fits:
        return "the model says this setup does not fit in memory", None
    return None, RowCase(row, deployment, engine, rates)


def fit_profiles(cases: list[RowCase] | None = None) -> list[ProfileFit]:
    """Every profile with enough published rows, fitted to all of them."""
    cases = row_cases()[0] if cases is None else cases
    fits = []
    for _name, members in sorted(_by_profile(cases).items()):
        fit = _fit_if_determined(members[0].engine, [m for m in members if m.steady])
        if fit is not None:
            fits.append(fit)
    return fits


def _fit_if_determined(engine: SelectedFactors, train: list[RowCase]) -> ProfileFit | None:
    """ENGINE's profile fitted on TRAIN's rows, where they (or, lacking rows, its priors) determine every fitted
    parameter; None otherwise."""
    fitted = engine.engine.fitted
    priors_cover = all(name in engine.engine.priors for name in fitted)
    if len(train) < MIN_TARGETS_PER_PARAMETER * len(fitted) and not priors_cover:
        return None
    return fit_parameters(engine, [c.target() for c in train])


def _by_profile(cases: list[RowCase]) -> dict[str, list[RowCase]]:
    groups: dict[str, list[RowCase]] = {}
    for case in cases:
        groups.setdefault(case.engine.profile, []).append(case)
    return groups


@dataclass(frozen=True)
class HeldOut:
    row: PublishedRow
    predicted: float | None  # by parameters fitted without the row's source; None when none could be
    parameters: EngineParameters | None
    reason: str = ""
    steady: float | None = None  # the steady formula's value, where the row was forecast as a finite run

    @property
    def ratio(self) -> float:
        assert self.predicted is not None
        return self.predicted / self.row.value


def leave_one_source_out(
    cases: list[RowCase] | None = None, forecaster: BenchmarkForecaster | None = None
) -> list[HeldOut]:
    """For each source: refit each engine profile on the other sources' steady rows, predict the source's rows (as
    their runs were made, with FORECASTER where a row's run is finite). A source whose profile has too few rows
    elsewhere is reported, not predicted."""
    cases = row_cases()[0] if cases is None else cases
    held = []
    for source in sorted({c.row.source for c in cases}):
        others = [c for c in cases if c.row.source != source and c.steady]
        fitted: dict[str, EngineParameters | None] = {}
        for case in (c for c in cases if c.row.source == source):
            name = case.engine.profile
            if name not in fitted:
                fit = _fit_if_determined(case.engine, [c for c in others if c.engine.profile == name])
                fitted[name] = fit.parameters if fit is not None else None
            parameters = fitted[name]
            if parameters is None:
                held.append(
                    HeldOut(
                        case.row,
                        None,
                        None,
                        f"fewer than {MIN_TARGETS_PER_PARAMETER} rows per fitted "
                        f"parameter of {name} in the other sources",
                    )
                )
                continue
            held.append(_held(case, parameters, forecaster))
    return sorted(held, key=lambda h: h.row.number)


def _held(case: RowCase, parameters: EngineParameters, forecaster: BenchmarkForecaster | None) -> HeldOut:
    try:
        predicted = case.predict(parameters, forecaster)
    except NeedsForecaster:
        return HeldOut(case.row, None, parameters, "a finite run: predicted only through the simulator's forecast")
    return HeldOut(case.row, predicted, parameters, steady=case.steady_beside_forecast(parameters, forecaster))


def fit_to_json(fit: ProfileFit, cases: list[RowCase]) -> dict[str, Any]:
    """What `plan fit --write` stores next to the parameters: the rows, the catalog figures, the error."""
    labels = set(fit.labels)
    used = [c for c in cases if c.row.label() in labels]
    return {
        "generated_by": "deepserve plan fit --write",
        "generated_on": date.today().isoformat(),
        "method": "least squares on log(predicted/published) over the fitted parameters' logarithms; Nelder-Mead "
        "from the best two points of a start grid",
        "fitted_on": f"{len(used)} published rows of {len({c.row.source for c in used})} sources",
        "values": {name: round(getattr(fit.parameters, name), 6) for name in fit.fitted},
        "rms_log_error": round(fit.rms_log_error, 4),
        "rows": [
            {"row": c.row.number, "label": c.row.label(), "published": c.row.value, "unit": c.row.unit} for c in used
        ],
        "catalog": {
            c.deployment.accelerator.name: {
                "memory_bandwidth_gb_s": c.deployment.accelerator.memory_bandwidth_gb_s,
                "dense_tflops": c.deployment.accelerator.dense_tflops,
            }
            for c in used
        },
    }


def write_fits(fits: list[ProfileFit], cases: list[RowCase], path: Path = PROFILES_PATH) -> Path:
    for fit in (f for f in fits if f.fitted):
        values = {name: getattr(fit.parameters, name) for name in fit.fitted}
        write_parameters(fit.profile, values, fit_to_json(fit, cases), path)
    return path
