"""API keys: created and revoked from the CLI, stored hashed in SQLite under DEEPSERVE_HOME, verified by the
gateway in constant time.

A key reads `dsk-<id>-<secret>`. The id is public (it finds the row); the secret is only ever stored as
sha256(salt ‖ secret) with a random per-key salt, so a copy of the database does not reveal any key.

Admin operations (create, list, revoke) have no network surface at all: they are the `deepserve keys` CLI acting on
the database file, which is created 0600 in a 0700 directory. Whoever can run the CLI as the gateway's user is the
admin; nobody else can be. The gateway notices changes within a second (SQLite's data_version).

Where the keys cannot live in a writable database (a Kubernetes Secret is a read-only file, replaced whole when it
changes), `deepserve keys export` writes them (hashes only) to a file the gateway reads with `--keys-file`: a
`KeyFile` source, re-read within a second of a change (its inode, size or modification time), without a restart. A
key removed from the file stops working; a key marked revoked is announced to the other gateways as from a database.
Both are a `KeySource`, the one thing the gateway's `KeyRing` reads."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import sqlite3
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from deepserve.errors import ConfigError
from deepserve.gateway.config import gateway_home
from deepserve.gateway.ledger import BUSY_TIMEOUT_S, use_wal
from deepserve.gateway.limits import KeyLimits

KEY_PREFIX = "dsk"
KEY_FILE_FORMAT = "deepserve-keys/1"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS keys (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    salt BLOB NOT NULL,
    secret_hash BLOB NOT NULL,
    rpm INTEGER,
    tpm INTEGER,
    max_concurrency INTEGER,
    models TEXT NOT NULL DEFAULT '',
    created_at REAL NOT NULL,
    revoked_at REAL
)
"""


@dataclass(frozen=True)
class ApiKey:
    """A key as the gateway sees it (never the secret)."""

    id: str
    name: str
    limits: KeyLimits
    models: frozenset[str] | None  # None: every model
    created_at: float
    revoked_at: float | None = None

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models


@dataclass(frozen=True)
class StoredKey:
    """A key with what verifies its secret (never the secret)."""

    key: ApiKey
    salt: bytes
    secret_hash: bytes

    def to_json(self) -> dict[str, Any]:
        key = self.key
        return {
            "id": key.id, "name": key.name, "salt": self.salt.hex(), "secret_hash": self.secret_hash.hex(),
            "rpm": key.limits.rpm, "tpm": key.limits.tpm, "max_concurrency": key.limits.max_concurrency,
            "models": sorted(key.models) if key.models is not None else None, "created_at": key.created_at,
            "revoked_at": key.revoked_at,
        }  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StoredKey:
        models = data.get("models")
        key = ApiKey(
            str(data["id"]),
            str(data["name"]),
            KeyLimits(data.get("rpm"), data.get("tpm"), data.get("max_concurrency")),
            frozenset(models) if models is not None else None,
            float(data["created_at"]),
            None if data.get("revoked_at") is None else float(data["revoked_at"]),
        )
        return cls(key, bytes.fromhex(data["salt"]), bytes.fromhex(data["secret_hash"]))


class KeySource(Protocol):
    """Where the gateway's keys come from: the key database, or a key file."""

    path: Path

    def version(self) -> object:
        """Something that changes whenever the keys may have changed (a cheap probe, polled once a second)."""
        ...

    def load(self) -> list[StoredKey]: ...

    def close(self) -> None: ...


def default_keys_path() -> Path:
    return gateway_home() / "keys.sqlite"


def _hash(salt: bytes, secret: str) -> bytes:
    return hashlib.sha256(salt + secret.encode()).digest()


class KeyStore:
    """The keys database. One instance per process; the gateway keeps a verified in-memory copy (`KeyRing`)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or default_keys_path()
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        new = not self.path.exists()
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_S)
        if new:
            self.path.chmod(0o600)
        use_wal(self._db)
        self._db.execute(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    def create(self, name: str, limits: KeyLimits | None = None, models: list[str] | None = None) -> tuple[ApiKey, str]:
        """Create a key; return it and the full key text, which is shown once and never stored."""
        limits = limits or KeyLimits()
        limits.check()
        key_id = secrets.token_hex(6)
        secret = secrets.token_urlsafe(32)
        salt = secrets.token_bytes(16)
        now = time.time()
        try:
            self._db.execute(
                "INSERT INTO keys (id, name, salt, secret_hash, rpm, tpm, max_concurrency, models, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (key_id, name, salt, _hash(salt, secret), limits.rpm, limits.tpm, limits.max_concurrency,
                 ",".join(models or []), now),
            )  # fmt: skip
        except sqlite3.IntegrityError:
            raise ConfigError(f"a key named {name!r} already exists; choose another name or revoke it first") from None
        key = ApiKey(key_id, name, limits, frozenset(models) if models else None, now)
        return key, f"{KEY_PREFIX}-{key_id}-{secret}"

    def revoke(self, name: str) -> ApiKey:
        """Revoke the active key NAME; return it as it is now (with its revoked_at)."""
        cursor = self._db.execute(
            "UPDATE keys SET revoked_at = ? WHERE name = ? AND revoked_at IS NULL", (time.time(), name)
        )
        if cursor.rowcount == 0:
            valid = [key.name for key in self.all_keys() if key.revoked_at is None]
            raise ConfigError(f"no active key named {name!r}; active keys: {', '.join(valid) or 'none'}")
        return next(key for key in self.all_keys() if key.name == name)

    def all_keys(self) -> list[ApiKey]:
        return [stored.key for stored in self.load()]

    def data_version(self) -> int:
        """Changes whenever another connection commits: a cheap "did anything change?" probe."""
        return int(self._db.execute("PRAGMA data_version").fetchone()[0])

    def version(self) -> object:
        return self.data_version()

    def export(self, path: Path) -> int:
        """Write every key (hashes only, revoked ones marked) to PATH for `--keys-file`, replacing it whole; return
        how many. The file is 0600: the hashes are not secrets, but who has which limits need not be public."""
        document = {"format": KEY_FILE_FORMAT, "keys": [stored.to_json() for stored in self.load()]}
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
        with os.fdopen(handle, "w") as out:
            json.dump(document, out, indent=1)
        os.replace(temporary, path)  # readers see the old file or the new one, never half of one
        return len(document["keys"])

    def load(self) -> list[StoredKey]:
        rows = self._db.execute(
            "SELECT id, name, salt, secret_hash, rpm, tpm, max_concurrency, models, created_at, revoked_at "
            "FROM keys ORDER BY created_at"
        ).fetchall()
        return [
            StoredKey(
                ApiKey(
                    row[0],
                    row[1],
                    KeyLimits(row[4], row[5], row[6]),
                    frozenset(row[7].split(",")) if row[7] else None,
                    row[8],
                    row[9],
                ),
                row[2],
                row[3],
            )
            for row in rows
        ]


class KeyFile:
    """Keys from a file `KeyStore.export` wrote (a mounted Kubernetes Secret): read again whenever the file changes.
    A Secret is updated by swapping a symlink, so the file found at PATH gets a new inode."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.load()  # a file that cannot be read is a configuration error, found at start

    def version(self) -> object:
        try:
            info = self.path.stat()
        except OSError as exc:
            return repr(exc)  # gone or unreadable: a change too (the next load says why)
        return (info.st_ino, info.st_size, info.st_mtime_ns)

    def load(self) -> list[StoredKey]:
        try:
            document = json.loads(self.path.read_text())
            if not isinstance(document, dict) or document.get("format") != KEY_FILE_FORMAT:
                raise ValueError(f"not a key file of format {KEY_FILE_FORMAT!r}")
            return [StoredKey.from_json(entry) for entry in document["keys"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(
                f"the key file {self.path} cannot be read ({type(exc).__name__}: {exc}); write it with "
                "`deepserve keys export --output FILE`"
            ) from exc

    def close(self) -> None:
        pass


def key_source(keys_file: Path | None = None) -> KeySource:
    """The key file when one is given (--keys-file), else the key database under DEEPSERVE_HOME."""
    return KeyFile(keys_file) if keys_file is not None else KeyStore()


class KeyRing:
    """The gateway's in-memory copy of the active keys; `verify` is the only hot-path call.

    `revoked_ids` holds keys revoked elsewhere (another host's key database, through Redis: shared_limits.py);
    `revoked_here` the keys this source revoked ({id: when}), which the gateway publishes to the others."""

    def __init__(self, source: KeySource) -> None:
        self.source = source
        self.revoked_ids: set[str] = set()
        self.revoked_here: dict[str, float] = {}
        self._keys: dict[str, StoredKey] = {}
        self._version: object = None
        self.refresh()

    def __len__(self) -> int:
        return len(self._keys)

    def refresh(self) -> bool:
        """Reload if the source changed; return whether it did. A source that cannot be read raises, and the keys
        stay as they were (the next refresh tries again)."""
        version = self.source.version()
        if version == self._version:
            return False
        stored_keys = self.source.load()
        self._version = version
        self._keys = {stored.key.id: stored for stored in stored_keys if stored.key.revoked_at is None}
        self.revoked_here = {
            stored.key.id: stored.key.revoked_at for stored in stored_keys if stored.key.revoked_at is not None
        }
        return True

    def verify(self, token: str) -> ApiKey | None:
        """The key TOKEN belongs to, or None. Constant-time in the secret."""
        prefix, _, rest = token.partition("-")
        key_id, _, secret = rest.partition("-")
        if prefix != KEY_PREFIX or not secret:
            return None
        stored = self._keys.get(key_id)
        if stored is None and self.refresh():  # a key created a moment ago: usable at once
            stored = self._keys.get(key_id)
        if stored is None or key_id in self.revoked_ids:
            return None
        if not hmac.compare_digest(_hash(stored.salt, secret), stored.secret_hash):
            return None
        return stored.key
