"""The tune's loop: for each planned point, most promising first, start the engine, benchmark, stop, save the point
at once; then pick the best and write DIR/best.yaml.

The directory has a sweep's layout (DIR/index.json and DIR/points/<id>.json, see `deepserve.results.sweepdir`), so
`deepserve report DIR` reads it. A point's id is a slug of its engine fields plus a hash; re-running the same command
keeps every finished point (done, or failed to start: `retry_failed` runs those again) and runs the rest. Pruning,
order and budgets are decided afresh on every run (they depend on the SLOs and flags of that run); what a point
measured does not, because goodput is recounted from the per-request lists saved with it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from deepserve.bench.config import BenchConfig
from deepserve.errors import ConfigError, DeepserveError
from deepserve.results.points import params_from_result
from deepserve.results.slo import Slo
from deepserve.results.store import record_run
from deepserve.results.sweepdir import PointEntry, SweepIndex, now_iso, write_index, write_point_result
from deepserve.sweep.resume import Outcome, PointTask, resume_or_start, run_points
from deepserve.tune.best import engine_section, write_best
from deepserve.tune.engine import EngineFailed, PointRun, PointRunner
from deepserve.tune.predict import Forecast
from deepserve.tune.search import outcome_from_json
from deepserve.tune.select import JUDGED_AT_LOAD, Scored, choose_best, score
from deepserve.tune.spec import TUNE_SUITE, PlannedPoint, TuneSpec

Progress = Callable[[str], None]


@dataclass(frozen=True)
class TuneOptions:
    slos: tuple[Slo, ...]
    max_points: int | None = None  # most points measured in the directory (done or failed to start)
    budget_s: float | None = None  # no new point starts after this many seconds of this run
    tie_margin: float = 0.02
    retry_failed: bool = False
    record: bool = True
    db_path: Path | None = None


@dataclass
class TuneOutcome:
    directory: Path
    index: SweepIndex
    scored: list[Scored]
    best: Scored | None
    best_path: Path | None
    counts: dict[str, int]
    elapsed_s: float
    interrupted: bool = False


def run_tune(
    directory: Path,
    spec: TuneSpec,
    bench: BenchConfig,
    run_point: PointRunner,
    options: TuneOptions,
    progress: Progress = print,
    clock: Callable[[], float] = time.monotonic,
) -> TuneOutcome:
    if bench.metrics.num_runs > 1:
        raise ConfigError(
            "deepserve tune measures each point once (its goodput is counted from one run's requests); leave out "
            "--num-runs, and repeat the best point with `deepserve bench --num-runs N` to see its spread"
        )
    started = clock()
    index = resume_or_start(directory, _fresh_index(spec))

    def tasks() -> Iterator[PointTask]:
        for number, planned in enumerate(spec.points, start=1):
            entry = _entry(index, planned, spec)
            earlier = entry.status if _finished(directory, entry, options) else None
            yield PointTask(
                entry,
                f"[{number}/{len(spec.points)}] {planned.point.describe()}",
                partial(_run_one, directory, index, entry, planned, bench, run_point, options),
                earlier=earlier,
                skip_reason=partial(_skip_reason, index, planned, options, clock, started),
                starting=f"starting the engine{_forecast_words(planned.forecast, options.slos)}",
            )

    loop = run_points(directory, index, tasks(), progress, stop_on_failure=False)
    counts, interrupted = loop.as_dict(), loop.interrupted
    scored = score_points(directory, index, spec, options.slos)
    best = choose_best(scored, options.tie_margin)
    best_path = _write_best(directory, best, spec, options.slos, len(scored)) if best is not None else None
    _record_choice(index, scored, best, interrupted)
    write_index(directory, index)
    return TuneOutcome(directory, index, scored, best, best_path, counts, clock() - started, interrupted)


def _write_best(directory: Path, best: Scored, spec: TuneSpec, slos: Sequence[Slo], measured: int) -> Path:
    overrides = next(p.point.overrides for p in spec.points if p.point.point_id == best.point_id)
    return write_best(directory, best, overrides, spec.label, slos, measured)


def score_points(directory: Path, index: SweepIndex, spec: TuneSpec, slos: Sequence[Slo]) -> list[Scored]:
    """Every finished point of this tune judged against SLOS (recounted from its saved per-request lists)."""
    configs = {planned.point.point_id: planned.point for planned in spec.points}
    scored = []
    for entry in index.points:
        point = configs.get(entry.point_id)
        if point is None or entry.status != "done" or not entry.result_file:
            continue
        path = directory / entry.result_file
        if not path.is_file():
            continue
        result = json.loads(path.read_text())
        stored = (result.get("tune") or {}).get("search")
        search = outcome_from_json(stored) if stored else None
        scored.append(score(point.point_id, point.describe(), point.config, result, slos, search))
    return scored


def extra(entry: PointEntry, key: str) -> Any:
    """A tune's own key of a sweep index entry (engine, predicted, log_tail), None when absent."""
    return (entry.model_extra or {}).get(key)


def set_extra(entry: PointEntry, key: str, value: Any) -> None:
    """Keys a tune adds to a sweep index entry; the index keeps keys it does not define (extra="allow")."""
    assert entry.model_extra is not None
    entry.model_extra[key] = value


def _fresh_index(spec: TuneSpec) -> SweepIndex:
    index = SweepIndex(label=spec.label, suite=TUNE_SUITE, signature=spec.signature, metadata=spec.metadata)
    for planned in spec.points:
        index.points.append(_new_entry(planned, spec))
    return index


def _new_entry(planned: PlannedPoint, spec: TuneSpec) -> PointEntry:
    point = planned.point
    entry = PointEntry(point_id=point.point_id, params={**spec.params, "variant": point.describe()})
    set_extra(entry, "engine", engine_section(point.config, point.overrides))
    set_extra(entry, "command", planned.command)
    return entry


def _entry(index: SweepIndex, planned: PlannedPoint, spec: TuneSpec) -> PointEntry:
    """The point's entry, with this run's forecast (which depends on this run's SLOs and planner)."""
    entry = index.entry(planned.point.point_id)
    if entry is None:
        entry = _new_entry(planned, spec)
        index.points.append(entry)
    set_extra(entry, "predicted", planned.forecast.to_json())
    return entry


def _finished(directory: Path, entry: PointEntry, options: TuneOptions) -> bool:
    if entry.status == "done":
        return entry.result_file is not None and (directory / entry.result_file).is_file()
    return entry.status == "failed" and not options.retry_failed


def _skip_reason(
    index: SweepIndex, planned: PlannedPoint, options: TuneOptions, clock: Callable[[], float], started: float
) -> str | None:
    return planned.skip_reason or _budget_reason(index, options, clock() - started)


def _budget_reason(index: SweepIndex, options: TuneOptions, elapsed_s: float) -> str | None:
    measured = sum(1 for entry in index.points if entry.status in ("done", "failed"))
    if options.max_points is not None and measured >= options.max_points:
        return f"the point budget is spent ({measured} measured, --max-points {options.max_points})"
    if options.budget_s is not None and elapsed_s > options.budget_s:
        return f"the time budget is spent (--budget-s {options.budget_s:g})"
    return None


def _run_one(
    directory: Path,
    index: SweepIndex,
    entry: PointEntry,
    planned: PlannedPoint,
    bench: BenchConfig,
    run_point: PointRunner,
    options: TuneOptions,
) -> Outcome:
    """Run one point and record it at once: "done", "failed" or "interrupted" (the engine is stopped)."""
    entry.started_at, entry.finished_at = now_iso(), None
    began = time.monotonic()
    try:
        run = run_point(planned.point, bench)
    except KeyboardInterrupt:
        return _unfinished(directory, index, entry)
    except EngineFailed as exc:
        set_extra(entry, "log_tail", exc.log_tail)
        return _failed(directory, index, entry, began, str(exc))
    except DeepserveError as exc:
        return _failed(directory, index, entry, began, f"could not be measured: {exc}")
    if run.interrupted:
        return _unfinished(directory, index, entry)
    entry.finished_at, entry.wall_s = now_iso(), round(time.monotonic() - began, 2)
    result = _with_tune_facts(run, planned, entry)
    entry.result_file = write_point_result(directory, entry.point_id, result)
    entry.status = "done"
    entry.note = _headline(score(entry.point_id, "", planned.point.config, result, options.slos, run.search), run)
    write_index(directory, index)
    if options.record:
        _record(directory, index, entry, result, options)
    return "done"


def _failed(directory: Path, index: SweepIndex, entry: PointEntry, began: float, note: str) -> Outcome:
    entry.status, entry.note = "failed", note
    entry.finished_at, entry.wall_s = now_iso(), round(time.monotonic() - began, 2)
    write_index(directory, index)
    return "failed"


def _unfinished(directory: Path, index: SweepIndex, entry: PointEntry) -> Outcome:
    entry.status, entry.note = "pending", "interrupted; re-run the same command to measure it"
    write_index(directory, index)
    return "interrupted"


def _with_tune_facts(run: PointRun, planned: PlannedPoint, entry: PointEntry) -> dict[str, Any]:
    """The benchmark's result JSON plus what the tune knows of the point, under one key: the engine fields, the
    forecast, the load search, the engine's start-up time and log."""
    facts = {
        "engine": extra(entry, "engine"),
        "predicted": planned.forecast.to_json(),
        "search": run.search.to_json() if run.search is not None else None,
        "startup_s": run.startup_s,
        "engine_log": run.engine_log,
        **run.extra,
    }
    return {**run.result, "variant": planned.point.describe(), "tune": facts}


def _record(
    directory: Path, index: SweepIndex, entry: PointEntry, result: dict[str, Any], options: TuneOptions
) -> None:
    metadata = {**index.metadata, "engine_config": extra(entry, "engine"), "flags": entry.params["variant"]}
    record_run(
        result,
        label=index.label,
        metadata=metadata,
        params=params_from_result(result, entry.params),
        sweep_dir=str(directory.resolve()),
        point_id=entry.point_id,
        suite=TUNE_SUITE,
        db_path=options.db_path,
    )


def _record_choice(index: SweepIndex, scored: list[Scored], best: Scored | None, interrupted: bool) -> None:
    index.metadata["best"] = best.to_json() if best is not None else None
    index.metadata["scored"] = [item.to_json() for item in scored]
    index.stopped_reason = "interrupted (Ctrl-C); re-run the same command to resume" if interrupted else None


def _forecast_words(forecast: Forecast, slos: Sequence[Slo]) -> str:
    if not forecast.predicted:
        return ""  # why not was said once, with the plan
    verdict = "meets" if forecast.meets(slos) else "misses"
    return (
        f" (predicted {forecast.output_tok_s or 0:,.0f} output tok/s, TPOT {forecast.tpot_ms or 0:,.1f} ms, "
        f"TTFT {forecast.ttft_ms or 0:,.0f} ms: {verdict} the SLOs)"
    )


def _headline(scored: Scored, run: PointRun) -> str:
    startup = f"engine ready in {run.startup_s:.0f} s; " if run.startup_s is not None else ""
    verdict = "SLOs hold" if scored.holds else "SLOs missed"
    where = "" if scored.judged_at == JUDGED_AT_LOAD else f" at {scored.judged_at}"
    found = f"; {run.search.words()}" if run.search is not None else ""
    return (
        f"done: {startup}{scored.output_tok_s:,.0f} output tok/s, "
        f"goodput {scored.goodput_output_tok_s:,.0f} tok/s{where}, "
        f"{verdict} ({'; '.join(check.words for check in scored.checks)}){found}"
    )
