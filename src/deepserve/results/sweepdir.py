"""A results directory: one result JSON per point under points/, and index.json that says what each point asked for.

    DIR/index.json          {"format": "deepserve-sweep/1", "label", "suite", "metadata", "points": [...]}
    DIR/points/<id>.json    the result JSON of one point (vLLM's key names)

The index is rewritten atomically after every point, so an interrupted sweep leaves a readable directory that the
next run resumes and that `deepserve report` can already draw.
A directory without index.json is read as loose result files (e.g. `vllm bench serve --save-result` output).
"""

from __future__ import annotations

import json
import os
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deepserve.results.deployment import DEPLOYMENT_KEY, USER_KEYS
from deepserve.results.points import (
    ResultPoint,
    ResultsError,
    ResultSet,
    is_result_json,
    params_from_result,
    read_result_file,
)

INDEX_NAME = "index.json"
POINTS_DIR = "points"
INDEX_FORMAT = "deepserve-sweep/1"

PointStatus = Literal["pending", "done", "failed", "skipped"]


class PointEntry(BaseModel):
    model_config = ConfigDict(extra="allow")

    point_id: str
    params: dict[str, Any]  # where the point sits on the report's axes (PointParams' fields)
    overrides: dict[str, Any] = Field(default_factory=dict)  # the bench config fields it sets: what runs
    status: PointStatus = "pending"
    result_file: str | None = None  # relative to the directory
    note: str = ""  # why a point failed or was skipped, in words
    started_at: str | None = None
    finished_at: str | None = None
    wall_s: float | None = None


class SweepIndex(BaseModel):
    model_config = ConfigDict(extra="allow")

    format: str = INDEX_FORMAT
    label: str
    suite: str | None = None
    signature: str | None = None  # a hash of what was asked: a re-run with the same signature resumes
    sweep_axis: str | None = None  # the parameter along which lines saturate
    created_at: str = Field(default_factory=lambda: now_iso())
    updated_at: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    points: list[PointEntry] = Field(default_factory=list)
    stopped_reason: str | None = None

    def entry(self, point_id: str) -> PointEntry | None:
        return next((entry for entry in self.points if entry.point_id == point_id), None)


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def read_index(directory: Path) -> SweepIndex | None:
    path = directory / INDEX_NAME
    if not path.is_file():
        return None
    try:
        return SweepIndex.model_validate_json(path.read_text())
    except (OSError, ValueError) as exc:
        raise ResultsError(f"cannot read sweep index {path}: {exc}") from exc


def write_index(directory: Path, index: SweepIndex) -> None:
    """Write atomically: a crash mid-write must not lose the record of finished points."""
    directory.mkdir(parents=True, exist_ok=True)
    index.updated_at = now_iso()
    _write_atomic(directory / INDEX_NAME, index.model_dump_json(indent=2))


def write_point_result(directory: Path, point_id: str, result: dict[str, Any]) -> str:
    """Save one point's result JSON; returns its path relative to DIRECTORY."""
    relative = f"{POINTS_DIR}/{point_id}.json"
    (directory / POINTS_DIR).mkdir(parents=True, exist_ok=True)
    _write_atomic(directory / relative, json.dumps(result, indent=2, default=str))
    return relative


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(tmp, path)


def load_result_set(path: Path, label: str | None = None) -> ResultSet:
    """A sweep directory, a directory of result files, or one result file, as a labelled set of points."""
    if not path.exists():
        raise ResultsError(f"{path} does not exist; pass a sweep directory, a directory of result JSON files or one")
    if path.is_file():
        result = read_result_file(path)
        point = ResultPoint(path.stem, params_from_result(result), result, str(path))
        return ResultSet(label or result.get("label") or path.stem, [point], result_metadata(result), str(path))
    index = read_index(path)
    if index is not None:
        return _load_sweep(path, index, label)
    return _load_loose_files(path, label)


def _load_sweep(directory: Path, index: SweepIndex, label: str | None) -> ResultSet:
    points = []
    for entry in index.points:
        if entry.status != "done" or not entry.result_file:
            continue
        result_path = directory / entry.result_file
        if not result_path.is_file():
            continue  # deleted by hand: the sweep re-runs it; the report leaves it out
        result = read_result_file(result_path)
        points.append(ResultPoint(entry.point_id, params_from_result(result, entry.params), result, str(result_path)))
    metadata = dict(index.metadata)
    if index.suite:
        metadata.setdefault("suite", index.suite)
    return ResultSet(label or index.label, points, metadata, str(directory))


def _load_loose_files(directory: Path, label: str | None) -> ResultSet:
    points = []
    metadata: dict[str, Any] = {}
    for path in sorted(directory.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # not every JSON file in a directory is a result; skip the ones that do not parse
        if not is_result_json(data):
            continue
        points.append(ResultPoint(path.stem, params_from_result(data), data, str(path)))
        metadata = metadata or result_metadata(data)
    if not points:
        raise ResultsError(f"{directory} holds no index.json and no benchmark result JSON files")
    return ResultSet(label or directory.name, points, metadata, str(directory))


def result_metadata(result: dict[str, Any]) -> dict[str, Any]:
    """The run facts a vLLM-format result carries itself (with --metadata KEY=VALUE pairs, which both vLLM and
    deepserve write as top-level keys: gpus, gpu_hour_usd, hardware, ...)."""
    keys: tuple[str, ...] = ("date", "backend", "endpoint_type", "model_id", "tokenizer_id", "label", "metadata")
    keys += (DEPLOYMENT_KEY, *USER_KEYS)
    found = {key: result[key] for key in keys if result.get(key) is not None}
    nested = result.get("deepserve")  # our additions, when C's runner writes them under one key
    if isinstance(nested, dict):
        found.update({key: value for key, value in nested.items() if not isinstance(value, list)})
    return found
