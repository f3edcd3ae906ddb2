"""What a tune is asked (`TuneRequest`), turned into its plan (`TuneSpec`): every grid point with the engine
command it would run, the planner's forecast, a skip reason where there is one, in the order to run them."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from deepserve.bench.config import BenchConfig
from deepserve.engines.config import EngineConfig
from deepserve.errors import DeepserveError
from deepserve.results.slo import Slo
from deepserve.results.sweepdir import now_iso
from deepserve.serve.service_plan import ServicePlan
from deepserve.sweep.grid import signature
from deepserve.sweep.probe import local_hardware
from deepserve.tune.best import engine_section
from deepserve.tune.engine import service_plan
from deepserve.tune.grid import GridAxis, TunePoint, expand, format_value
from deepserve.tune.predict import Forecast, default_planner_gpu, forecast, load_shape, promise, prune_reason
from deepserve.tune.search import SearchOptions

TUNE_SUITE = "tune"  # the index's suite: what marks a sweep directory as a tune's


@dataclass(frozen=True)
class TuneRequest:
    """Everything a tune is asked, parsed and checked (the CLI builds it from the flags)."""

    base: EngineConfig  # the engine fields every point shares
    axes: tuple[GridAxis, ...]
    bench: BenchConfig  # the workload and load every point is measured with
    slos: tuple[Slo, ...]
    search: SearchOptions | None = None
    use_planner: bool = True
    planner_gpu: str | None = None  # the catalog entry the planner models the machine with (None: this machine's)
    prune_margin: float | None = 2.0
    label: str | None = None
    python: str = sys.executable  # the interpreter the launcher starts engines with
    spec_acceptance: tuple[float, ...] = ()  # drafts' acceptance the planner assumes (default: published figures)


@dataclass(frozen=True)
class PlannedPoint:
    point: TunePoint
    forecast: Forecast
    skip_reason: str | None = None  # cannot fit, predicted far outside an SLO, or a config this machine refuses
    command: str | None = None  # the engine command line it starts (port aside)


@dataclass
class TuneSpec:
    label: str
    signature: str  # what a point measures (engine grid and base, workload, load, search): equal ones resume
    points: list[PlannedPoint]  # in the order to run
    params: dict[str, Any]  # where every point sits on the report's axes (they share the load)
    metadata: dict[str, Any] = field(default_factory=dict)


def build_spec(request: TuneRequest) -> TuneSpec:
    points = expand(list(request.axes), request.base)
    plans: dict[str, ServicePlan] = {}
    refused: dict[str, str] = {}
    for point in points:
        try:
            plans[point.point_id] = service_plan(point.config, request.python)
        except DeepserveError as exc:
            refused[point.point_id] = f"this machine cannot start it: {exc}"
    gpu, why_not = _planner_gpu(request, plans)
    shape, shape_why_not = load_shape(request.bench)
    forecasts = [
        forecast(
            point.config,
            plans[point.point_id].model.source,
            gpu,
            shape,
            why_not or shape_why_not,
            request.spec_acceptance,
        )
        if point.point_id in plans
        else Forecast(fits=None, note="not planned: the engine refuses this config")
        for point in points
    ]
    for point_id, plan in plans.items():  # the memory plan `serve` itself checks (this machine's GPUs or RAM)
        if plan.fit is not None and plan.fit.fits is False:
            refused[point_id] = f"cannot fit: {plan.fit.describe()}"
    planned = plan_order(points, forecasts, request.slos, request.prune_margin, refused)
    commands = {point_id: plan.launch.shell_line() for point_id, plan in plans.items()}
    planned = [PlannedPoint(p.point, p.forecast, p.skip_reason, commands.get(p.point.point_id)) for p in planned]
    model = next((plan.model.served_name for plan in plans.values()), request.base.model or "model")
    label = request.label or f"tune {model}"
    metadata = _metadata(request, model, gpu, why_not or shape_why_not)
    return TuneSpec(label, tune_signature(request), planned, load_params(request.bench), metadata)


def plan_order(
    points: Sequence[TunePoint],
    forecasts: Sequence[Forecast],
    slos: Sequence[Slo],
    margin: float | None,
    refused: dict[str, str] | None = None,
) -> list[PlannedPoint]:
    """Each point with its forecast and skip reason, most promising first (grid order among equals); REFUSED maps
    point ids to why this machine cannot start them at all."""
    refused = refused or {}
    planned = [
        PlannedPoint(point, forecast, refused.get(point.point_id) or prune_reason(forecast, slos, margin))
        for point, forecast in zip(points, forecasts, strict=True)
    ]
    return sorted(planned, key=lambda item: (item.skip_reason is not None, promise(item.forecast, slos)))


def tune_signature(request: TuneRequest) -> str:
    """What decides what a point measures: equal signatures resume. The SLOs count only with a load search (the
    load it finds depends on them); otherwise goodput is recounted from the saved requests under any SLOs."""
    asked: dict[str, Any] = {
        "engine": engine_section(request.base, {}),
        "grid": [[axis.field, list(axis.values)] for axis in request.axes],
        "bench": request.bench.model_dump(exclude={"command_line", "output"}),
    }
    if request.search is not None:
        asked["search"] = asdict(request.search)
        asked["slos"] = [[slo.metric, slo.max_ms] for slo in request.slos]
    return signature(asked)


def load_params(bench: BenchConfig) -> dict[str, Any]:
    """Where the tune's points sit on the report's axes: the load and lengths they were all measured at."""
    workload, load = bench.workload, bench.load
    synthetic = workload.dataset_name == "random"
    return {
        "max_concurrency": load.max_concurrency,
        "request_rate": None if math.isinf(load.request_rate) else load.request_rate,
        "input_len": workload.random_input_len if synthetic else None,
        "output_len": workload.random_output_len if synthetic else None,
        "num_prompts": workload.num_prompts,
    }


def _planner_gpu(request: TuneRequest, plans: dict[str, ServicePlan]) -> tuple[str | None, str]:
    if not request.use_planner:
        return None, "the planner is off (--no-planner)"
    if request.planner_gpu is not None:
        return request.planner_gpu, ""
    on_cpu = next((plan.model.on_cpu for plan in plans.values()), True)
    return default_planner_gpu(on_cpu)


def _metadata(request: TuneRequest, model: str, gpu: str | None, why_not: str) -> dict[str, Any]:
    grid = " ".join(f"{axis.field}={','.join(map(format_value, axis.values))}" for axis in request.axes)
    return {
        "model": model,
        "engine": request.base.engine,
        "hardware": local_hardware(),
        "flags": f"grid: {grid}",
        "command": " ".join(request.bench.command_line or []),
        "date": now_iso(),
        "slos": [slo.words for slo in request.slos],
        "planner": {"gpu": gpu, "note": why_not, "prune_margin": request.prune_margin},
    }
