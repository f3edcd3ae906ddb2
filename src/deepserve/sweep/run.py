"""Run the benchmark at every point of a grid, one result file per point, resumable.

A point is identified by its parameters (the bench config fields it overrides): its id is a readable slug plus a
hash of them. The sweep directory's index (see `deepserve.results.sweepdir`) records each point's status after it
finishes, so a re-run of the same sweep keeps finished points and runs the rest. Along the sweep axis (concurrency
or request rate), each line of the grid stops early once it saturates: its throughput has not risen by more than
`min_gain` over the best before it for `patience` points in a row, or too many of its requests failed.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from deepserve.bench.config import BenchConfig
from deepserve.errors import DeepserveError
from deepserve.results.points import PointParams, params_from_result
from deepserve.results.store import record_run
from deepserve.results.sweepdir import PointEntry, SweepIndex, now_iso, write_index, write_point_result
from deepserve.sweep.grid import SweepPoint, SweepSpec, apply_overrides
from deepserve.sweep.resume import Outcome, PointTask, prepare_index, run_points, stored_points

PointRunner = Callable[[BenchConfig], dict[str, Any]]  # one point's config → its result JSON
Progress = Callable[[str], None]


@dataclass(frozen=True)
class SweepOptions:
    stop_at_saturation: bool = True
    patience: int = 2  # points in a row without a gain before a line counts as saturated
    min_gain: float = 0.03  # a gain smaller than 3% is no gain
    max_failed_fraction: float = 0.10  # more failed requests than this ends a line
    time_budget_s: float | None = None  # no new point starts after this much time (None: no limit)
    record: bool = True  # record every point in the results store
    db_path: Path | None = None


@dataclass
class SweepOutcome:
    directory: Path
    index: SweepIndex
    ran: int
    kept: int
    skipped: int
    failed: int
    elapsed_s: float


def run_sweep(
    directory: Path,
    spec: SweepSpec,
    base: BenchConfig,
    run_point: PointRunner,
    options: SweepOptions,
    progress: Progress = print,
) -> SweepOutcome:
    """Run every unfinished point of SPEC into DIRECTORY; see the module doc for resume and early stop. Every
    point's config is checked first: a bad one fails the sweep before any point runs."""
    started = time.monotonic()
    index = prepare_index(directory, spec)
    points = stored_points(index)
    for point in points:
        apply_overrides(base, point.overrides)  # raises ConfigError with the fix, before any work

    def tasks() -> Iterator[PointTask]:
        for number, point in enumerate(points, start=1):
            entry = index.entry(point.point_id)
            assert entry is not None
            finished = entry.status == "done" and entry.result_file and (directory / entry.result_file).is_file()
            yield PointTask(
                entry,
                f"[{number}/{len(points)}] {_describe(entry)}",
                partial(_run_one, directory, index, entry, point, base, run_point, options),
                earlier="done" if finished else None,
                skip_reason=partial(_skip_reason, directory, index, entry, index.sweep_axis, options, started),
            )

    counts = run_points(directory, index, tasks(), progress, stop_on_failure=True)
    stopped = counts.failed or counts.interrupted
    index.stopped_reason = "a point failed; re-run the same command to resume" if stopped else None
    write_index(directory, index)
    return SweepOutcome(directory, index, elapsed_s=time.monotonic() - started, **counts.as_dict())


def _run_one(
    directory: Path,
    index: SweepIndex,
    entry: PointEntry,
    point: SweepPoint,
    base: BenchConfig,
    run_point: PointRunner,
    options: SweepOptions,
) -> Outcome:
    entry.started_at = now_iso()
    began = time.monotonic()
    try:
        config = apply_overrides(base, point.overrides)
        result = run_point(config)
    except (DeepserveError, OSError) as exc:
        entry.status, entry.note = "failed", f"failed: {exc}"
        return "failed"
    finally:
        entry.finished_at = now_iso()
        entry.wall_s = round(time.monotonic() - began, 2)
        write_index(directory, index)
    if result.get("incomplete"):
        entry.status, entry.note = "failed", "interrupted: partial result not kept; re-run to resume"
        write_index(directory, index)
        return "failed"
    entry.result_file = write_point_result(directory, point.point_id, result)
    entry.status, entry.note = "done", _headline(result, entry.wall_s or 0.0)
    write_index(directory, index)
    if options.record:
        params = params_from_result(result, entry.params)
        record_run(
            result,
            label=index.label,
            metadata=index.metadata,
            params=params,
            sweep_dir=str(directory.resolve()),
            point_id=point.point_id,
            suite=index.suite,
            db_path=options.db_path,
        )
    return "done"


def _skip_reason(
    directory: Path, index: SweepIndex, entry: PointEntry, axis: str | None, options: SweepOptions, started: float
) -> str | None:
    if options.time_budget_s is not None and time.monotonic() - started > options.time_budget_s:
        return f"the time budget ({options.time_budget_s:.0f} s) is spent"
    if not options.stop_at_saturation or axis is None:
        return None
    return saturation_reason(_line_before(directory, index, entry, axis), axis, options)


def _line_before(
    directory: Path, index: SweepIndex, entry: PointEntry, axis: str
) -> list[tuple[float, dict[str, Any]]]:
    """Finished points on ENTRY's line (the same parameters but the axis) below it on the axis, in axis order:
    (axis value, result JSON)."""
    mine = _line_key(entry, axis)
    value = _axis_value(entry.params.get(axis))
    line = []
    for other in index.points:
        if other.status != "done" or not other.result_file or _line_key(other, axis) != mine:
            continue
        other_value = _axis_value(other.params.get(axis))
        if other_value < value:
            line.append((other_value, json.loads((directory / other.result_file).read_text())))
    line.sort(key=lambda item: item[0])
    return line


def _line_key(entry: PointEntry, axis: str) -> dict[str, Any]:
    return {key: value for key, value in entry.params.items() if key not in (axis, "num_prompts")}


def _axis_value(value: Any) -> float:
    return math.inf if value is None else float(value)


def saturation_reason(line: list[tuple[float, dict[str, Any]]], axis: str, options: SweepOptions) -> str | None:
    """Why a line needs no more points, or None. LINE: the finished points below, in axis order, as (axis value,
    result JSON)."""
    if not line:
        return None
    last_value, result = line[-1]
    completed, failed = result.get("completed") or 0, result.get("failed") or 0
    if completed + failed and failed / (completed + failed) > options.max_failed_fraction:
        return f"errors: {failed} of {completed + failed} requests failed at {_axis_words(axis, last_value)}"
    metric = "request_throughput" if axis == "request_rate" else "output_throughput"
    values = [float(item.get(metric) or 0.0) for _, item in line]
    if len(values) <= options.patience:
        return None
    best_before = max(values[: -options.patience])
    recent = values[-options.patience :]
    if all(value <= best_before * (1 + options.min_gain) for value in recent):
        unit = "requests/s" if metric == "request_throughput" else "output tokens/s"
        shown = ", ".join(f"{value:,.1f}" for value in values[-options.patience - 1 :])
        return f"saturated: {unit} stopped rising ({shown})"
    return None


def _axis_words(axis: str, value: float) -> str:
    return f"concurrency {value:g}" if axis == "max_concurrency" else f"rate {value:g}/s"


def _describe(entry: PointEntry) -> str:
    params = entry.params
    return PointParams(
        max_concurrency=params.get("max_concurrency"),
        request_rate=math.inf if params.get("request_rate") is None else float(params["request_rate"]),
        input_len=params.get("input_len"),
        output_len=params.get("output_len"),
        num_prompts=params.get("num_prompts"),
        variant=params.get("variant"),
    ).describe()


def _headline(result: dict[str, Any], wall_s: float) -> str:
    def number(key: str) -> float:
        value = result.get(key)
        return float(value) if isinstance(value, int | float) else math.nan

    return (
        f"done in {wall_s:.1f} s: {result.get('completed', 0)} completed, {result.get('failed', 0)} failed, "
        f"{number('request_throughput'):.2f} req/s, {number('output_throughput'):,.0f} output tok/s, "
        f"P99 ITL {number('p99_itl_ms'):,.1f} ms"
    )
