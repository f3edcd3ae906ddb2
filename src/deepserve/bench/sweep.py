"""`deepserve sweep`: run the benchmark at every point of a grid, one result file per point, resumable.

A point is identified by its parameters (the bench config fields it overrides): its id is a readable slug plus a
hash of them. The sweep directory's index (see `deepserve.results.sweepdir`) records each point's status after it
finishes, so a re-run of the same sweep keeps finished points and runs the rest. Along the sweep axis (concurrency
or request rate), each line of the grid stops early once it saturates: its throughput has not risen by more than
`min_gain` over the best before it for `patience` points in a row, or too many of its requests failed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, ValidationError

from deepserve.bench.config import BenchConfig
from deepserve.bench.suites import SpeedProbe, SuitePlan, fit_prefill
from deepserve.errors import ConfigError, DeepserveError
from deepserve.hardware.detect import local_gpus
from deepserve.results.points import PointParams, params_from_result
from deepserve.results.store import record_run
from deepserve.results.sweepdir import (
    PointEntry,
    SweepIndex,
    now_iso,
    read_index,
    write_index,
    write_point_result,
)

# Flags of `deepserve sweep` that take comma-separated lists, and the config field each sets.
LIST_FIELDS = ("max_concurrency", "request_rate", "random_input_len", "random_output_len")
SECTION_NAMES = ("workload", "load", "target", "metrics", "output")

PointRunner = Callable[[BenchConfig], dict[str, Any]]  # one point's config → its result JSON
Progress = Callable[[str], None]


@dataclass(frozen=True)
class SweepPoint:
    point_id: str
    overrides: dict[str, Any]  # bench config fields this point sets
    variant: str | None = None

    @property
    def params(self) -> dict[str, Any]:
        """What the report needs to place this point (PointParams' fields)."""
        o = self.overrides
        input_len = o.get("long_prompt_len") if o.get("dataset_name") == "long" else o.get("random_input_len")
        if o.get("dataset_name") == "sampled":
            input_len = None
        return {
            "max_concurrency": o.get("max_concurrency"),
            "request_rate": o.get("request_rate"),
            "input_len": input_len,
            "output_len": o.get("random_output_len"),
            "num_prompts": o.get("num_prompts"),
            "variant": self.variant,
        }


@dataclass
class SweepSpec:
    label: str
    points: list[SweepPoint]
    sweep_axis: str | None  # "max_concurrency", "request_rate" or None
    signature: str  # what was asked (suite or lists, base flags, budget): equal signatures resume
    suite: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


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


def point_id(overrides: dict[str, Any], variant: str | None) -> str:
    """A readable slug ("c16-i1024-o256") plus a hash of every parameter, so that two points differing in anything
    (a seed, a duration) never share a result file."""
    parts = [variant.replace(" ", "_")] if variant else []
    for key, tag in (
        ("max_concurrency", "c"),
        ("request_rate", "r"),
        ("random_input_len", "i"),
        ("long_prompt_len", "L"),
        ("random_output_len", "o"),
    ):
        if overrides.get(key) is not None:
            parts.append(f"{tag}{overrides[key]:g}" if isinstance(overrides[key], float) else f"{tag}{overrides[key]}")
    if overrides.get("dataset_name") == "offline" or variant == "offline":
        parts.append(f"n{overrides.get('num_prompts')}")
    digest = hashlib.sha256(json.dumps([overrides, variant], sort_keys=True, default=str).encode()).hexdigest()[:8]
    return "-".join([*parts, digest])


def signature(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:16]


def grid_spec(lists: dict[str, list[Any]], label: str, inputs: dict[str, Any]) -> SweepSpec:
    """Points of a plain grid: every combination of the given lists (input × output × rate × concurrency, with
    the sweep axis varying fastest so that each line runs from its lowest value up)."""
    order = ("random_input_len", "random_output_len", "request_rate", "max_concurrency")
    names = [name for name in order if lists.get(name)]
    axis = next((name for name in ("max_concurrency", "request_rate") if len(lists.get(name) or []) > 1), None)
    if axis is not None:  # the axis last: it varies fastest
        names = [name for name in names if name != axis] + [axis]
    points = []
    for values in product(*(lists[name] for name in names)):
        overrides = dict(zip(names, values, strict=True))
        points.append(SweepPoint(point_id(overrides, None), overrides))
    if not points:
        points = [SweepPoint(point_id({}, None), {})]
    return SweepSpec(label, points, axis, signature({"grid": lists, **inputs}))


def suite_spec(plan: SuitePlan, label: str, inputs: dict[str, Any]) -> SweepSpec:
    points = [SweepPoint(point_id(point.params, point.variant), point.params, point.variant) for point in plan.points]
    spec = SweepSpec(label, points, plan.suite.sweep_axis, signature({"suite": plan.suite.name, **inputs}))
    spec.suite = plan.suite.name
    spec.metadata["scale"] = plan.describe()
    return spec


def parse_list(flag: str, text: str | None, kind: type) -> list[Any] | None:
    """ "1,2,4" → [1, 2, 4]; request rates accept "inf"."""
    if text is None:
        return None
    values = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            value = kind(item)
        except ValueError as exc:
            raise ConfigError(
                f"--{flag.replace('_', '-')} {text!r}: {item!r} is not {'an integer' if kind is int else 'a number'}"
            ) from exc
        if isinstance(value, int | float) and value <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')} {text!r}: values must be positive")
        values.append(value)
    if not values:
        raise ConfigError(f"--{flag.replace('_', '-')} needs at least one value")
    return values


def apply_overrides(base: BenchConfig, overrides: dict[str, Any]) -> BenchConfig:
    """BASE with each field in OVERRIDES set in whichever section (workload, load, ...) defines it."""
    data = base.model_dump()
    for key, value in overrides.items():
        section = _section_of(base, key)
        data[section][key] = math.inf if key == "request_rate" and value is None else value
    try:
        return BenchConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"invalid sweep point {overrides}: {problems}") from exc


def _section_of(config: BenchConfig, key: str) -> str:
    for name in SECTION_NAMES:
        section: BaseModel = getattr(config, name)
        if key in type(section).model_fields:
            return name
    raise ConfigError(f"sweep parameter {key!r} is not a field of the benchmark config")


def prepare_index(directory: Path, spec: SweepSpec) -> SweepIndex:
    """The index to run: the existing one when it records the same sweep (resume), else a new one. A directory
    that holds a different sweep's finished points is refused rather than mixed."""
    index = read_index(directory)
    if index is not None:
        if index.signature == spec.signature:
            return index
        if any(entry.status == "done" for entry in index.points):
            raise ConfigError(
                f"{directory} already holds a different sweep ({index.suite or 'grid'} '{index.label}'); "
                "pick another --result-dir, or delete that directory to start over"
            )
    index = SweepIndex(
        label=spec.label,
        suite=spec.suite,
        signature=spec.signature,
        sweep_axis=spec.sweep_axis,
        metadata=spec.metadata,
    )
    for point in spec.points:
        index.points.append(PointEntry(point_id=point.point_id, params=point.params, overrides=point.overrides))
    write_index(directory, index)
    return index


def stored_points(index: SweepIndex) -> list[SweepPoint]:
    """The points an index planned (a resumed suite runs exactly what was planned, without probing again)."""
    return [SweepPoint(entry.point_id, dict(entry.overrides), entry.params.get("variant")) for entry in index.points]


def run_sweep(
    directory: Path,
    spec: SweepSpec,
    base: BenchConfig,
    run_point: PointRunner,
    options: SweepOptions,
    progress: Progress = print,
) -> SweepOutcome:
    """Run every unfinished point of SPEC into DIRECTORY; see the module doc for resume and early stop."""
    started = time.monotonic()
    index = prepare_index(directory, spec)
    axis = index.sweep_axis
    points = stored_points(index)
    counts = {"ran": 0, "kept": 0, "skipped": 0, "failed": 0}
    for number, point in enumerate(points, start=1):
        entry = index.entry(point.point_id)
        assert entry is not None
        where = f"[{number}/{len(points)}] {_describe(entry)}"
        if entry.status == "done" and entry.result_file and (directory / entry.result_file).is_file():
            counts["kept"] += 1
            progress(f"{where}: kept (finished earlier)")
            continue
        reason = _skip_reason(directory, index, entry, axis, options, started)
        if reason:
            entry.status, entry.note = "skipped", reason
            counts["skipped"] += 1
            progress(f"{where}: skipped, {reason}")
            write_index(directory, index)
            continue
        progress(f"{where}: running")
        ok = _run_one(directory, index, entry, point, base, run_point, options)
        counts["ran" if ok else "failed"] += 1
        progress(f"{where}: {entry.note}")
        if not ok:
            break  # a point that could not run at all (server gone, Ctrl-C): stop; a re-run resumes here
    index.stopped_reason = None if counts["failed"] == 0 else "a point failed; re-run the same command to resume"
    write_index(directory, index)
    return SweepOutcome(directory, index, elapsed_s=time.monotonic() - started, **counts)


def _run_one(
    directory: Path,
    index: SweepIndex,
    entry: PointEntry,
    point: SweepPoint,
    base: BenchConfig,
    run_point: PointRunner,
    options: SweepOptions,
) -> bool:
    entry.started_at = now_iso()
    began = time.monotonic()
    try:
        config = apply_overrides(base, point.overrides)
        result = run_point(config)
    except (DeepserveError, OSError) as exc:
        entry.status, entry.note = "failed", f"failed: {exc}"
        return False
    finally:
        entry.finished_at = now_iso()
        entry.wall_s = round(time.monotonic() - began, 2)
        write_index(directory, index)
    if result.get("incomplete"):
        entry.status, entry.note = "failed", "interrupted: partial result not kept; re-run to resume"
        write_index(directory, index)
        return False
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
    return True


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


def server_facts(base: BenchConfig) -> dict[str, Any]:
    """What the server says about itself (model, engine, version, context length) and, for a server on this
    machine, its hardware: the report's run metadata. Best effort: the benchmark's own preflight reports a server
    that cannot be reached."""
    target = base.target
    facts: dict[str, Any] = {"base_url": target.root_url, "date": now_iso()}
    try:
        models = httpx.get(f"{target.root_url}/v1/models", headers=target.request_headers(), timeout=10).json()
        cards = models.get("data") or []
        card = next((c for c in cards if c.get("id") == target.model), cards[0] if cards else {})
        facts |= {"model": card.get("id"), "engine": card.get("owned_by"), "max_model_len": card.get("max_model_len")}
        version = httpx.get(f"{target.root_url}/version", headers=target.request_headers(), timeout=10)
        if version.status_code == 200:
            facts["engine_version"] = version.json().get("version")
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    if urlsplit(target.root_url).hostname in ("127.0.0.1", "localhost", "::1"):
        facts["hardware"] = local_hardware()
    return {key: value for key, value in facts.items() if value is not None}


def local_hardware() -> str:
    gpus = local_gpus()
    if gpus:
        return f"{len(gpus)}x {gpus[0].name} ({gpus[0].memory_mib // 1024} GiB)"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU only: {os.cpu_count()} cores, {cpu}"


def probe_speed(base: BenchConfig, run_point: PointRunner, context_len: int | None) -> SpeedProbe:
    """Four short runs that tell a suite how far to scale: a short and a long prompt alone (prefill time against
    length, time per output token), 64 requests at concurrency 32 (peak output tokens/s) and 32 prompts at once
    (batched prefill tokens/s). Seconds on the tiny model."""
    short_len = min(1024, (context_len or 4096) // 8)
    long_len = min(4 * short_len, (context_len or 4096) // 2)
    common = {"dataset_name": "random", "request_rate": None, "duration_s": None, "ignore_eos": True}
    alone = {"max_concurrency": 1, "random_output_len": 32}
    short = run_point(apply_overrides(base, common | alone | {"num_prompts": 2, "random_input_len": short_len}))
    long = run_point(apply_overrides(base, common | alone | {"num_prompts": 1, "random_input_len": long_len}))
    batch = run_point(
        apply_overrides(
            base, common | {"num_prompts": 64, "max_concurrency": 32, "random_input_len": 64, "random_output_len": 64}
        )
    )
    prefills = run_point(
        apply_overrides(
            base, common | {"num_prompts": 32, "max_concurrency": 32, "random_input_len": 512, "random_output_len": 1}
        )
    )
    short_ms, long_ms = short.get("median_ttft_ms"), long.get("median_ttft_ms")
    tpot_ms, peak = short.get("median_tpot_ms"), batch.get("output_throughput")
    if not short_ms or not long_ms or not tpot_ms or not peak:
        raise ConfigError(
            "the speed probe got no timings from the server (every probe request failed?); check the server, or pass "
            "--time-budget-s 0 to run the suite at the seeds' sizes"
        )
    prefill_tok_s, quadratic = fit_prefill(short_len, float(short_ms) / 1000, long_len, float(long_ms) / 1000)
    return SpeedProbe(
        prefill_tok_s=prefill_tok_s,
        tpot_s=float(tpot_ms) / 1000,
        peak_output_tok_s=float(peak),
        prefill_s_per_tok2=quadratic,
        batched_prefill_tok_s=_input_tok_s(prefills),
    )


def _input_tok_s(result: dict[str, Any]) -> float | None:
    tokens, duration_s = result.get("total_input_tokens"), result.get("duration")
    return float(tokens) / float(duration_s) if tokens and duration_s else None
