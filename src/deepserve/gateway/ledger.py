"""The usage ledger: one SQLite row per request (key, model, tokens, status, latency), written off the hot path.

The request path only appends a row to a queue; a writer thread commits batches. The prompt and completion text
are stored only when `log_bodies` is switched on.

Nothing recorded is dropped silently. A batch that fails is written again row by row; a row that still fails is
written with its text fields made storable (invalid Unicode replaced, oversized numbers left out), then without
them; a database that cannot be written at all (locked, disk full) keeps the rows queued and is tried again on the
next batch. Every failure is logged and counted (`LedgerStats`, exported as Prometheus metrics); rows are given up
only when more than MAX_PENDING_ROWS wait, or when the ledger closes with rows it could not write, and the count
of lost rows is what `close` returns (the gateway then exits non-zero)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import operator
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from deepserve.gateway.config import gateway_home

log = logging.getLogger(__name__)

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
    response_body TEXT,
    reasoning_tokens INTEGER,
    reasoning_source TEXT,
    prefill_upstream TEXT
);
CREATE INDEX IF NOT EXISTS usage_key_ts ON usage (key, ts);
"""
# Columns added since the first ledgers (an older file gets them, empty for its old rows, when a gateway opens it).
_ADDED_COLUMNS = {"reasoning_tokens": "INTEGER", "reasoning_source": "TEXT", "prefill_upstream": "TEXT"}
_COLUMNS = (
    "ts", "key", "model", "endpoint", "stream", "status", "prompt_tokens", "completion_tokens", "latency_ms", "ttft_ms",
    "upstream", "error", "request_body", "response_body", "reasoning_tokens", "reasoning_source", "prefill_upstream",
)  # fmt: skip
_INSERT = f"INSERT INTO usage ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})"
# A row's values in _COLUMNS' order, by name: 0.3 µs against dataclasses.astuple's 20 (it copies every field), and
# the writer thread holds the interpreter lock for that time while the event loop relays streams.
_row_values = operator.attrgetter(*_COLUMNS)
BATCH_INTERVAL_S = 0.25
MAX_BATCH = 2048
# Rows waiting while the database cannot be written (about 1 KB each without bodies): beyond this the oldest go.
MAX_PENDING_ROWS = 200_000
# How long a write waits for another writer's lock (gateway workers share the file) before it counts as failed; the
# rows stay queued and the next pass tries again, so a short wait loses nothing. Commits take milliseconds, so 1 s
# covers contention between workers many times over, while a database that someone holds locked (a stuck process, an
# open `sqlite3` shell) is reported within a second and never holds up the shutdown's last flush for long.
BUSY_TIMEOUT_S = 1.0
WAL_RETRY_S = 0.01
_SQLITE_MAX_INT = 2**63 - 1


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
    # Of completion_tokens, those the model spent reasoning, and where the count comes from: "usage" (the engine's
    # usage said, completion_tokens_details / output_tokens_details) or "deltas" (the stream's events that carried
    # reasoning text, one token each: approximate); None when neither said.
    reasoning_tokens: int | None = None
    reasoning_source: str | None = None
    prefill_upstream: str | None = None  # the prefill replica, when prefill and decode are disaggregated


@dataclass(frozen=True)
class UsageSummary:
    key: str
    day: str
    requests: int
    errors: int
    prompt_tokens: int
    completion_tokens: int
    mean_latency_ms: float
    reasoning_tokens: int = 0


@dataclass
class LedgerStats:
    """What the writer did, for /metrics (plain integers written by the writer thread, read by the scrape)."""

    written: int = 0  # rows committed
    write_failures: int = 0  # failed attempts (a batch, a row, or a whole pass when the database is unwritable)
    rows_repaired: int = 0  # rows committed only after their text or numbers were made storable or left out
    rows_lost: int = 0  # rows given up: the queue overflowed while the database was unwritable, or it closed so


def default_ledger_path() -> Path:
    return gateway_home() / "usage.sqlite"


def _connect(path: Path, busy_timeout_s: float = BUSY_TIMEOUT_S) -> sqlite3.Connection:
    """The ledger database, readable by its owner only (0600, in a directory created 0700): even without bodies it
    says who used what, when. SQLite gives the -wal and -shm files it creates the database file's mode; a ledger
    left world-readable by an older version is made private too."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not path.exists():
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
    for file in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        with contextlib.suppress(FileNotFoundError):
            info = file.stat()
            if info.st_mode & 0o077 and info.st_uid == os.getuid():
                file.chmod(0o600)
    db = sqlite3.connect(path, check_same_thread=False, timeout=busy_timeout_s)
    use_wal(db)
    db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across process crashes, fast commits
    db.executescript(_SCHEMA)
    _add_new_columns(db)
    return db


def _add_new_columns(db: sqlite3.Connection) -> None:
    """A ledger written by an older gateway gets the columns added since (its rows keep them empty)."""
    present = {row[1] for row in db.execute("PRAGMA table_info(usage)")}
    for name, kind in _ADDED_COLUMNS.items():
        if name not in present:
            with contextlib.suppress(sqlite3.OperationalError):  # another worker added it a moment ago
                db.execute(f"ALTER TABLE usage ADD COLUMN {name} {kind}")


def use_wal(db: sqlite3.Connection, timeout_s: float = BUSY_TIMEOUT_S) -> None:
    """Switch DB to write-ahead logging unless it already is (the mode is kept in the file). Switching takes an
    exclusive lock, which SQLite refuses at once ("database is locked"), whatever the busy timeout, to a process
    switching a file another one is opening: gateway workers starting together did. Such a refusal is retried for
    up to TIMEOUT_S."""
    deadline = time.monotonic() + timeout_s
    while str(db.execute("PRAGMA journal_mode").fetchone()[0]).lower() != "wal":
        try:
            db.execute("PRAGMA journal_mode=WAL")
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(WAL_RETRY_S)


class UsageLedger:
    """Append rows from the event loop with `record`; a daemon thread writes them in batches.

    `record` is a deque append: no lock, no syscall, no thread wake-up on the request path. The writer sleeps
    BATCH_INTERVAL_S between batches instead of waiting on the queue (a wake-up per row would cost a futex call and
    a GIL hand-over per request). `flush` writes what is queued now, in the caller's thread (tests, shutdown)."""

    def __init__(
        self, path: Path | None = None, *, busy_timeout_s: float = BUSY_TIMEOUT_S, start_writer: bool = True
    ) -> None:
        self.path = path or default_ledger_path()
        self.stats = LedgerStats()
        self._rows: collections.deque[UsageRow] = collections.deque()
        self._stop = threading.Event()
        self._write_lock = threading.Lock()  # the writer thread and flush(); never taken by record()
        self._db = _connect(self.path, busy_timeout_s)
        self._thread: threading.Thread | None = None
        if start_writer:
            self._thread = threading.Thread(target=self._write_loop, name="usage-ledger", daemon=True)
            self._thread.start()

    @property
    def pending(self) -> int:
        return len(self._rows)

    def record(self, row: UsageRow) -> None:
        self._rows.append(row)

    def flush(self) -> bool:
        """Write every queued row; False when some are still queued because the database could not be written."""
        with self._write_lock:
            return self._write_batches()

    def close(self) -> int:
        """Write everything recorded, then stop. Returns the number of rows lost over the ledger's life (0 when
        every recorded row was written)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10 + BUSY_TIMEOUT_S)
        if self._thread is None or not self._thread.is_alive():
            self.flush()
        left = len(self._rows)
        if left:
            self.stats.rows_lost += left
            log.error("the usage ledger %s could not be written: %d rows lost at shutdown", self.path, left)
            self._rows.clear()
        with contextlib.suppress(sqlite3.Error):
            self._db.close()
        return self.stats.rows_lost

    def _write_loop(self) -> None:
        while not self._stop.wait(BATCH_INTERVAL_S):
            try:
                self.flush()
            except Exception:  # never let the thread die: every later row would be lost
                self.stats.write_failures += 1
                log.exception("the usage ledger writer failed; it goes on with the next batch")
        with contextlib.suppress(Exception):
            self.flush()

    def _write_batches(self) -> bool:
        """Commit queued rows in batches; rows of a batch that cannot be committed stay queued, in order."""
        while self._rows:
            batch: list[UsageRow] = []
            while self._rows and len(batch) < MAX_BATCH:
                batch.append(self._rows.popleft())
            unwritten = self._write_batch(batch)
            if unwritten:
                self._rows.extendleft(reversed(unwritten))  # back at the front, for the next pass
                self._drop_overflow()
                return False
        return True

    def _write_batch(self, batch: list[UsageRow]) -> list[UsageRow]:
        """Write BATCH; return the rows that could not be written for reasons of the database, not of the row."""
        try:
            with self._db:
                self._db.executemany(_INSERT, [_row_values(row) for row in batch])
        except Exception as exc:
            self.stats.write_failures += 1
            log.warning("writing %d usage rows failed (%s: %s); writing them one by one", len(batch), _name(exc), exc)
        else:
            self.stats.written += len(batch)
            return []
        for index, row in enumerate(batch):
            if not self._write_row(row):
                return batch[index:]
        return []

    def _write_row(self, row: UsageRow) -> bool:
        """Write ROW as it is, else made storable, else without its free text; False when the database itself
        refuses writes (the row is kept for later)."""
        for attempt, candidate in enumerate((row, _storable(row), _without_text(row))):
            try:
                with self._db:
                    self._db.execute(_INSERT, _row_values(candidate))
            except sqlite3.OperationalError as exc:  # locked, read-only, disk full: not this row's fault
                self.stats.write_failures += 1
                log.error("the usage ledger %s cannot be written (%s); %d rows wait", self.path, exc, self.pending + 1)
                return False
            except Exception as exc:  # this row: text that is not valid Unicode, a number SQLite cannot hold
                self.stats.write_failures += 1
                log.warning("a usage row could not be written as it was (%s: %s)", _name(exc), exc)
                continue
            self.stats.written += 1
            if attempt:
                self.stats.rows_repaired += 1
            return True
        self.stats.rows_lost += 1  # not reached with rows the gateway builds; counted if it ever is
        log.error("a usage row could not be written in any form and was dropped: %r", _without_text(row))
        return True

    def _drop_overflow(self) -> None:
        excess = len(self._rows) - MAX_PENDING_ROWS
        if excess > 0:
            for _ in range(excess):
                self._rows.popleft()
            self.stats.rows_lost += excess
            log.error("the usage ledger is unwritable: the oldest %d waiting rows were dropped", excess)


def _name(exc: BaseException) -> str:
    return type(exc).__name__


def _storable(row: UsageRow) -> UsageRow:
    """ROW with text that SQLite can encode (invalid Unicode replaced) and integers it can hold (others None)."""
    changes: dict[str, object] = {}
    for field in dataclasses.fields(row):
        value = getattr(row, field.name)
        if isinstance(value, str):
            fixed: object = value.encode("utf-8", "replace").decode("utf-8")
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > _SQLITE_MAX_INT:
            fixed = None
        else:
            continue
        if fixed != value:
            changes[field.name] = fixed
    return dataclasses.replace(row, **changes)  # type: ignore[arg-type]


def _without_text(row: UsageRow) -> UsageRow:
    """ROW without the fields that hold free text (bodies, error) and with only the numbers SQLite can hold."""
    row = _storable(row)
    error = "(not storable)" if row.error else None
    return dataclasses.replace(row, error=error, request_body=None, response_body=None)


def summarise(path: Path | None = None, since_ts: float | None = None) -> list[UsageSummary]:
    """Per key and UTC day: requests, errors (status ≥ 400), tokens, mean latency."""
    db = _connect(path or default_ledger_path())
    try:
        rows = db.execute(
            "SELECT key, date(ts, 'unixepoch') AS day, count(*), sum(status >= 400), "
            "coalesce(sum(prompt_tokens), 0), coalesce(sum(completion_tokens), 0), avg(latency_ms), "
            "coalesce(sum(reasoning_tokens), 0) "
            "FROM usage WHERE ts >= ? GROUP BY key, day ORDER BY day, key",
            (since_ts or 0.0,),
        ).fetchall()
    finally:
        db.close()
    return [UsageSummary(*row) for row in rows]
