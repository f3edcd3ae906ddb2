"""The usage ledger: one SQLite row per request (key, model, tokens, status, latency), written off the hot path.

The request path only appends a tuple to a queue; a writer thread commits batches. The prompt and completion text
are stored only when `log_bodies` is switched on."""

from __future__ import annotations

import collections
import sqlite3
import threading
from dataclasses import astuple, dataclass
from pathlib import Path

from deepserve.gateway.config import gateway_home

_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    ts REAL NOT NULL,
    key TEXT NOT NULL,
    model TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    stream INTEGER NOT NULL,
    status INTEGER NOT NULL,
    prompt_tokens INTEGER,
    completion_tokens INTEGER,
    latency_ms REAL NOT NULL,
    ttft_ms REAL,
    upstream TEXT,
    error TEXT,
    request_body TEXT,
    response_body TEXT
);
CREATE INDEX IF NOT EXISTS usage_key_ts ON usage (key, ts);
"""

_INSERT = "INSERT INTO usage VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
BATCH_INTERVAL_S = 0.25
LOCK_WAIT_S = 30.0
MAX_BATCH = 2048


@dataclass
class UsageRow:
    ts: float  # unix time the request arrived
    key: str  # key name ("anonymous" on an open gateway)
    model: str
    endpoint: str
    stream: bool
    status: int
    prompt_tokens: int | None
    completion_tokens: int | None
    latency_ms: float
    ttft_ms: float | None
    upstream: str | None
    error: str | None
    request_body: str | None = None  # only with log_bodies
    response_body: str | None = None  # only with log_bodies


@dataclass(frozen=True)
class UsageSummary:
    key: str
    day: str
    requests: int
    errors: int
    prompt_tokens: int
    completion_tokens: int
    mean_latency_ms: float


def default_ledger_path() -> Path:
    return gateway_home() / "usage.sqlite"


def _connect(path: Path) -> sqlite3.Connection:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    # Several writers (gateway workers, `deepserve usage`) share the file: a writer that finds it locked waits up to
    # LOCK_WAIT_S for the others' commits instead of failing (WAL: readers never wait for writers).
    db = sqlite3.connect(path, check_same_thread=False, timeout=LOCK_WAIT_S)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across process crashes, fast commits
    db.executescript(_SCHEMA)
    return db


class UsageLedger:
    """Append rows from the event loop with `record`; a daemon thread writes them in batches.

    `record` is a deque append: no lock, no syscall, no thread wake-up on the request path. The writer sleeps
    BATCH_INTERVAL_S between batches instead of waiting on the queue (a wake-up per row would cost a futex call and
    a GIL hand-over per request)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or default_ledger_path()
        self._rows: collections.deque[UsageRow] = collections.deque()
        self._stop = threading.Event()
        self._db = _connect(self.path)
        self._thread = threading.Thread(target=self._write_loop, name="usage-ledger", daemon=True)
        self._thread.start()

    def record(self, row: UsageRow) -> None:
        self._rows.append(row)

    def close(self) -> None:
        """Write everything recorded, then stop."""
        self._stop.set()
        self._thread.join(timeout=10)
        self._db.close()

    def _write_loop(self) -> None:
        while not self._stop.wait(BATCH_INTERVAL_S):
            self._write_batches()
        self._write_batches()

    def _write_batches(self) -> None:
        while self._rows:
            batch: list[tuple[object, ...]] = []
            while self._rows and len(batch) < MAX_BATCH:
                batch.append(astuple(self._rows.popleft()))
            with self._db:
                self._db.executemany(_INSERT, batch)


def summarise(path: Path | None = None, since_ts: float | None = None) -> list[UsageSummary]:
    """Per key and UTC day: requests, errors (status ≥ 400), tokens, mean latency."""
    db = _connect(path or default_ledger_path())
    try:
        rows = db.execute(
            "SELECT key, date(ts, 'unixepoch') AS day, count(*), sum(status >= 400), "
            "coalesce(sum(prompt_tokens), 0), coalesce(sum(completion_tokens), 0), avg(latency_ms) "
            "FROM usage WHERE ts >= ? GROUP BY key, day ORDER BY day, key",
            (since_ts or 0.0,),
        ).fetchall()
    finally:
        db.close()
    return [UsageSummary(*row) for row in rows]
