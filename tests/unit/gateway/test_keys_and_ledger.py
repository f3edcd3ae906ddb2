from __future__ import annotations

import sqlite3
import time
from pathlib import Path

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
