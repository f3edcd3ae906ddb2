"""The results store: every benchmark run, one row in SQLite, with its whole result JSON.

Where: `--db PATH`, else $DEEPSERVE_RESULTS_DB, else DEEPSERVE_HOME/results/results.db (~/.deepserve/...).
The headline metrics get their own columns (so `runs list` sorts and filters without parsing JSON); the full
result and the run metadata are kept as JSON so that nothing a run measured is lost.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepserve.config import deepserve_home
from deepserve.results.points import PointParams, ResultPoint, ResultsError, ResultSet, params_from_result
from deepserve.results.sweepdir import now_iso, result_metadata

DB_ENV = "DEEPSERVE_RESULTS_DB"
SCHEMA_VERSION = 1

# Result keys copied into columns; everything else stays in result_json.
METRIC_COLUMNS = (
    "completed",
    "failed",
    "duration",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "median_e2el_ms",
    "p99_e2el_ms",
)

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    created_at TEXT NOT NULL,
    label TEXT,
    model TEXT,
    base_url TEXT,
    suite TEXT,
    sweep_dir TEXT,
    point_id TEXT,
    max_concurrency INTEGER,
    request_rate REAL,
    input_len INTEGER,
    output_len INTEGER,
    variant TEXT,
    {", ".join(f"{column} REAL" for column in METRIC_COLUMNS)},
    result_json TEXT NOT NULL,
    metadata_json TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS runs_by_label ON runs(label);
CREATE INDEX IF NOT EXISTS runs_by_sweep ON runs(sweep_dir, point_id);
"""


def default_db_path() -> Path:
    """$DEEPSERVE_RESULTS_DB, else DEEPSERVE_HOME/results/results.db."""
    override = os.environ.get(DB_ENV)
    return Path(override).expanduser() if override else deepserve_home() / "results" / "results.db"


@dataclass(frozen=True)
class RunRecord:
    """One stored run."""

    run_id: int
    created_at: str
    label: str | None
    model: str | None
    base_url: str | None
    suite: str | None
    sweep_dir: str | None
    point_id: str | None
    params: PointParams
    result: dict[str, Any]
    metadata: dict[str, Any]

    def metric(self, key: str) -> float | None:
        value = self.result.get(key)
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None

    def as_point(self) -> ResultPoint:
        return ResultPoint(f"run-{self.run_id}", self.params, self.result, f"run {self.run_id}")


class ResultsStore:
    """SQLite-backed store of benchmark runs. Opens (and creates) the database lazily, per operation, so that
    a sweep and a separate `deepserve bench` can record into the same file at once."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or default_db_path()

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            connection = sqlite3.connect(self.path, timeout=30)
        except (OSError, sqlite3.Error) as exc:
            raise ResultsError(f"cannot open the results store {self.path}: {exc}; set --db or ${DB_ENV}") from exc
        try:
            connection.row_factory = sqlite3.Row
            self._migrate(connection)
            with connection:  # one transaction: committed on success, rolled back on error
                yield connection
        except sqlite3.DatabaseError as exc:
            raise ResultsError(f"the results store {self.path} is unusable: {exc}") from exc
        finally:
            connection.close()

    @staticmethod
    def _migrate(connection: sqlite3.Connection) -> None:
        version = connection.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise ResultsError(f"results store schema {version} is newer than this deepserve knows ({SCHEMA_VERSION})")
        connection.executescript(_SCHEMA)
        connection.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def add(
        self,
        result: dict[str, Any],
        *,
        label: str | None = None,
        metadata: dict[str, Any] | None = None,
        params: PointParams | None = None,
        sweep_dir: str | None = None,
        point_id: str | None = None,
        suite: str | None = None,
    ) -> int:
        """Store one run; returns its id."""
        params = params or params_from_result(result)
        metadata = metadata or {}
        row: dict[str, Any] = {
            "created_at": now_iso(),
            "label": label or result.get("label"),
            "model": result.get("model_id") or metadata.get("model"),
            "base_url": metadata.get("base_url") or result.get("base_url"),
            "suite": suite,
            "sweep_dir": sweep_dir,
            "point_id": point_id,
            "max_concurrency": params.max_concurrency,
            "request_rate": None if math.isinf(params.request_rate) else params.request_rate,
            "input_len": params.input_len,
            "output_len": params.output_len,
            "variant": params.variant,
            "result_json": json.dumps(result, default=str),
            "metadata_json": json.dumps(metadata, default=str),
        }
        for column in METRIC_COLUMNS:
            value = result.get(column)
            row[column] = value if isinstance(value, int | float) and not isinstance(value, bool) else None
        columns = ", ".join(row)
        placeholders = ", ".join(f":{name}" for name in row)
        with self._connect() as db:
            cursor = db.execute(f"INSERT INTO runs ({columns}) VALUES ({placeholders})", row)
            return int(cursor.lastrowid or 0)

    def list_runs(
        self, *, label: str | None = None, model: str | None = None, suite: str | None = None, limit: int | None = None
    ) -> list[RunRecord]:
        """Newest first, optionally filtered by exact label, model or suite."""
        clauses, values = [], []
        for column, value in (("label", label), ("model", model), ("suite", suite)):
            if value is not None:
                clauses.append(f"{column} = ?")
                values.append(value)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        limit_sql = f"LIMIT {int(limit)}" if limit else ""
        with self._connect() as db:
            rows = db.execute(f"SELECT * FROM runs {where} ORDER BY id DESC {limit_sql}", values).fetchall()
        return [_record(row) for row in rows]

    def get(self, run_id: int) -> RunRecord:
        with self._connect() as db:
            row = db.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
        if row is None:
            raise ResultsError(f"no run with id {run_id} in {self.path}; see `deepserve runs list`")
        return _record(row)

    def get_many(self, run_ids: Sequence[int]) -> list[RunRecord]:
        return [self.get(run_id) for run_id in run_ids]

    def remove(self, run_ids: Sequence[int]) -> int:
        """Delete runs; every id must exist (a typo must not silently delete nothing). Returns how many."""
        self.get_many(run_ids)
        with self._connect() as db:
            db.executemany("DELETE FROM runs WHERE id = ?", [(run_id,) for run_id in run_ids])
        return len(run_ids)

    def as_result_set(self, run_ids: Sequence[int], label: str | None = None) -> ResultSet:
        """Stored runs as one set of points, for `deepserve report --run`."""
        records = self.get_many(run_ids)
        first = records[0]
        return ResultSet(
            label or first.label or f"runs {','.join(map(str, run_ids))}",
            [record.as_point() for record in records],
            {**result_metadata(first.result), **first.metadata},  # a single bench run records its facts inline
            str(self.path),
        )


def _record(row: sqlite3.Row) -> RunRecord:
    result = json.loads(row["result_json"])
    return RunRecord(
        run_id=row["id"],
        created_at=row["created_at"],
        label=row["label"],
        model=row["model"],
        base_url=row["base_url"],
        suite=row["suite"],
        sweep_dir=row["sweep_dir"],
        point_id=row["point_id"],
        params=PointParams(
            max_concurrency=row["max_concurrency"],
            request_rate=math.inf if row["request_rate"] is None else row["request_rate"],
            input_len=row["input_len"],
            output_len=row["output_len"],
            variant=row["variant"],
            num_prompts=result.get("num_prompts"),
        ),
        result=result,
        metadata=json.loads(row["metadata_json"]),
    )


def record_run(
    result_json: dict[str, Any],
    *,
    label: str | None = None,
    metadata: dict[str, Any] | None = None,
    params: PointParams | None = None,
    sweep_dir: str | None = None,
    point_id: str | None = None,
    suite: str | None = None,
    db_path: Path | None = None,
) -> int:
    """Record one benchmark run in the results store (the default one unless DB_PATH); returns its run id.
    Every `deepserve bench` run and every sweep point calls this."""
    return ResultsStore(db_path).add(
        result_json,
        label=label,
        metadata=metadata,
        params=params,
        sweep_dir=sweep_dir,
        point_id=point_id,
        suite=suite,
    )
