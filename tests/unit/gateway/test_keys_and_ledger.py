from __future__ import annotations

import dataclasses
import multiprocessing
import sqlite3
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from deepserve.errors import ConfigError
from deepserve.gateway.keys import KeyRing, KeyStore
from deepserve.gateway.ledger import UsageLedger, UsageRow, summarise
from deepserve.gateway.limits import KeyLimits


def test_keys_are_stored_hashed_and_verified(tmp_path: Path) -> None:
    store = KeyStore(tmp_path / "keys.sqlite")
    key, secret = store.create("team-a", KeyLimits(rpm=10), ["m"])
    ring = KeyRing(store)
    assert ring.verify(secret) == key
    assert ring.verify(secret + "x") is None
    assert ring.verify("dsk-" + key.id + "-wrong") is None
    assert ring.verify("sk-whatever") is None
    raw = (tmp_path / "keys.sqlite").read_bytes() + (tmp_path / "keys.sqlite-wal").read_bytes()
    assert secret.split("-", 2)[2].encode() not in raw
    assert (tmp_path / "keys.sqlite").stat().st_mode & 0o077 == 0
    assert key.allows("m") and not key.allows("other")


def test_revocation_is_seen_by_a_running_ring(tmp_path: Path) -> None:
    gateway_store = KeyStore(tmp_path / "keys.sqlite")
    ring = KeyRing(gateway_store)
    admin = KeyStore(tmp_path / "keys.sqlite")  # the CLI, another connection
    _, secret = admin.create("b")
    assert ring.refresh() and ring.verify(secret) is not None
    admin.revoke("b")
    assert ring.refresh() and ring.verify(secret) is None
    assert not ring.refresh()  # nothing changed since
    with pytest.raises(ConfigError):
        admin.revoke("b")
    with pytest.raises(ConfigError):
        admin.create("b")  # the name stays taken


def test_ledger_batches_rows_and_summarises_per_key_and_day(tmp_path: Path) -> None:
    path = tmp_path / "usage.sqlite"
    ledger = UsageLedger(path)
    now = time.time()
    for status in (200, 200, 429):
        ledger.record(UsageRow(now, "a", "m", "/v1/completions", False, status, 10, 5, 20.0, None, "u", None))
    ledger.record(UsageRow(now, "b", "m", "/v1/completions", True, 200, 1, 2, 40.0, 3.0, "u", None))
    ledger.close()
    rows = {row.key: row for row in summarise(path)}
    assert rows["a"].requests == 3 and rows["a"].errors == 1
    assert rows["a"].prompt_tokens == 30 and rows["a"].completion_tokens == 15
    assert rows["b"].mean_latency_ms == 40.0
    texts = sqlite3.connect(path).execute("SELECT request_body, response_body FROM usage").fetchall()
    assert all(row == (None, None) for row in texts)


def test_a_new_key_works_at_once(tmp_path: Path) -> None:
    ring = KeyRing(KeyStore(tmp_path / "keys.sqlite"))
    _, secret = KeyStore(tmp_path / "keys.sqlite").create("fresh")
    assert ring.verify(secret) is not None  # no wait for the periodic refresh


# ---- the ledger cannot lose rows silently --------------------------------------------------------------------------


def _row(**changes: Any) -> UsageRow:
    row = UsageRow(time.time(), "k", "m", "/v1/completions", False, 200, 1, 2, 3.0, None, "u", None)
    return dataclasses.replace(row, **changes)


def test_the_ledger_file_and_its_directory_are_private(tmp_path: Path) -> None:
    path = tmp_path / "ledger-dir" / "usage.sqlite"
    ledger = UsageLedger(path, start_writer=False)
    ledger.record(_row())
    assert ledger.flush()
    ledger.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    for sidecar in path.parent.glob("usage.sqlite-*"):  # WAL and shared memory, while they exist
        assert stat.S_IMODE(sidecar.stat().st_mode) & 0o077 == 0


def test_an_existing_open_gateway_directory_and_ledger_are_made_private(isolated_home: Path) -> None:
    """What an older version left behind: a directory and a ledger that anyone could read."""
    directory = isolated_home / "gateway"
    directory.mkdir(parents=True)
    directory.chmod(0o755)
    sqlite3.connect(directory / "usage.sqlite").close()
    (directory / "usage.sqlite").chmod(0o644)
    UsageLedger(start_writer=False).close()
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE((directory / "usage.sqlite").stat().st_mode) == 0o600


def test_a_row_that_cannot_be_encoded_is_kept_and_the_others_are_written(tmp_path: Path) -> None:
    path = tmp_path / "usage.sqlite"
    ledger = UsageLedger(path, start_writer=False)
    ledger.record(_row(key="before"))
    ledger.record(_row(key="bad", request_body="a lone surrogate \ud800 here", completion_tokens=2**70))
    ledger.record(_row(key="after"))
    assert ledger.flush()
    assert ledger.stats.written == 3 and ledger.stats.rows_repaired == 1 and ledger.stats.write_failures >= 2
    assert ledger.close() == 0
    rows = sqlite3.connect(path).execute("SELECT key, request_body, completion_tokens FROM usage").fetchall()
    assert rows == [("before", None, 2), ("bad", "a lone surrogate ? here", None), ("after", None, 2)]


def test_the_writer_thread_survives_a_bad_row_and_keeps_writing(tmp_path: Path) -> None:
    """The defect: one body that could not be encoded killed the writer thread, and every later row was lost."""
    path = tmp_path / "usage.sqlite"
    ledger = UsageLedger(path)
    ledger.record(_row(response_body="\udcff"))
    ledger.record(_row(key="later"))
    assert ledger.close() == 0
    assert sqlite3.connect(path).execute("SELECT count(*) FROM usage").fetchone() == (2,)


def test_rows_wait_while_the_database_is_locked_and_are_written_after(tmp_path: Path) -> None:
    path = tmp_path / "usage.sqlite"
    ledger = UsageLedger(path, busy_timeout_s=0.05, start_writer=False)
    locker = sqlite3.connect(path, isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")  # another process holds the write lock
    for index in range(3):
        ledger.record(_row(status=200 + index))
    assert not ledger.flush()
    assert ledger.pending == 3 and ledger.stats.write_failures >= 1 and ledger.stats.written == 0
    locker.execute("ROLLBACK")
    assert ledger.flush()
    assert ledger.pending == 0 and ledger.stats.written == 3
    assert ledger.close() == 0
    assert [row[0] for row in sqlite3.connect(path).execute("SELECT status FROM usage")] == [200, 201, 202]


def test_closing_with_rows_that_cannot_be_written_reports_them_lost(tmp_path: Path) -> None:
    path = tmp_path / "usage.sqlite"
    ledger = UsageLedger(path, busy_timeout_s=0.05, start_writer=False)
    locker = sqlite3.connect(path, isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    ledger.record(_row())
    ledger.record(_row())
    assert ledger.close() == 2
    assert ledger.stats.rows_lost == 2
    locker.execute("ROLLBACK")


def test_ledger_counters_are_exported_as_metrics(tmp_path: Path) -> None:
    from deepserve.gateway.balancing import make_policy
    from deepserve.gateway.limits import LocalLimiter
    from deepserve.gateway.metrics import GatewayMetrics
    from deepserve.gateway.upstreams import UpstreamPool

    ledger = UsageLedger(tmp_path / "usage.sqlite", start_writer=False)
    ledger.record(_row(error="\ud800"))
    ledger.flush()
    pool = UpstreamPool([], make_policy("round_robin"))
    metrics = GatewayMetrics(pool, LocalLimiter(1, 1, 1.0), None, lambda: ledger)
    text = metrics.render().decode()
    assert "deepserve_gateway_ledger_rows_written_total 1.0" in text
    assert "deepserve_gateway_ledger_rows_repaired_total 1.0" in text
    assert "deepserve_gateway_ledger_write_failures_total 2.0" in text
    assert "deepserve_gateway_ledger_rows_lost_total 0.0" in text
    ledger.close()


def _open_both(keys_path: Path, ledger_path: Path, barrier: Any, errors: Any) -> None:
    barrier.wait()
    try:
        KeyStore(keys_path).close()
        UsageLedger(ledger_path, start_writer=False).close()
    except Exception as exc:  # reported to the test, which names it
        errors.put(repr(exc))


def test_processes_creating_the_databases_at_the_same_moment_all_open_them(tmp_path: Path) -> None:
    """Gateway workers start together; a second process switching a new SQLite file to WAL mode used to get
    "database is locked" at once (6 of 12 processes over 10 trials, measured) and the worker exited."""
    context = multiprocessing.get_context("fork")
    errors = context.SimpleQueue()
    for trial in range(4):
        barrier = context.Barrier(8)
        args = (tmp_path / f"keys{trial}.sqlite", tmp_path / f"usage{trial}.sqlite", barrier, errors)
        processes = [context.Process(target=_open_both, args=args) for _ in range(8)]
        for process in processes:
            process.start()
        for process in processes:
            process.join(timeout=60)
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert not failures
