"""Limits shared by the worker processes of one host (`deepserve gateway --workers N` without --redis-url).

The state lives in a memory-mapped file that every worker maps, the way nginx's `limit_req_zone` shares its state
between worker processes: a table of keys (their buckets and in-flight counts) and the global slot counts, changed
only under an exclusive file lock. An admission is then a few microseconds of arithmetic in the worker's own thread,
with no round trip and no other process's CPU: a burst of requests that arrive together reaches the engine about as
fast as through a single worker (docs/PERFORMANCE.md, "Engine scale"). Gateways on several hosts share their limits
through Redis instead (shared_limits.py).

Why a file lock (`flock`): the kernel releases it when its holder dies, so a worker killed while it held the lock
cannot block the others. Every count a worker holds (its in-flight requests per key, its global slots, the place in
the queue of its longest-queued request) sits in that worker's own column, which the supervisor zeroes before it
starts the replacement (`LimitZone.forget_worker`): a dead worker's requests give their capacity back, as Redis's
leases expire.

The table holds `capacity` keys (open addressing on a 64-bit hash of the key id, at most three quarters full). When
it fills, the keys that hold nothing (no request in flight, buckets full again) are dropped, which loses nothing: a
new entry starts with full buckets. A table full of keys that all hold something refuses new keys with 503 and says
to raise --limit-zone-keys.

Buckets refill on CLOCK_MONOTONIC, which every process on the host reads alike."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import functools
import hashlib
import mmap
import os
import time
from collections.abc import Iterator
from pathlib import Path

from deepserve._compat import wait_for_event
from deepserve.errors import ConfigError
from deepserve.gateway.clock import Clock
from deepserve.gateway.errors import Overloaded
from deepserve.gateway.limits import (
    Admission,
    HostOnlyLifecycle,
    KeyLimits,
    concurrency_refusal,
    queue_timed_out,
    refilled,
    rpm_refusal,
    tpm_refusal,
)

# Set by the supervisor for its workers: the zone's file, and which column is the worker's.
ZONE_PATH_ENV = "DEEPSERVE_GATEWAY_LIMIT_ZONE"
WORKER_INDEX_ENV = "DEEPSERVE_GATEWAY_WORKER_INDEX"

_MAGIC = 0x64736C696D7A6E31  # "dslimzn1": a file that is not a zone (or of another layout) is refused
_HEADER_INTS = 5  # magic, workers, capacity, keys stored, the next queue ticket
_ENTRY_FLOATS = 4  # rpm tokens, rpm refilled at, tpm tokens, tpm refilled at
_ENTRY_FIXED_INTS = 3  # key hash (0: empty), rpm, tpm; then one in-flight count per worker
# How often the oldest request queued in a worker looks for a slot freed by another worker (a slot freed by its own
# worker wakes it at once). Short, because only requests already queued behind a full gateway wait for it.
SLOT_POLL_S = 0.005


def key_hash(key_id: str) -> int:
    """A stable, non-zero 64-bit id of KEY_ID (Python's hash() differs between processes)."""
    value = int.from_bytes(hashlib.blake2b(key_id.encode(), digest_size=8).digest(), "little", signed=True)
    return value or 1


_cached_key_hash = functools.lru_cache(maxsize=65536)(key_hash)


class LimitZone:
    """The shared table (see the module docstring). Every method that reads or changes it must run inside
    `locked()`; the offsets below are in 8-byte words."""

    def __init__(self, path: Path, fd: int, memory: mmap.mmap) -> None:
        self.path = path
        self._fd = fd
        self._memory = memory
        header = memoryview(memory)[: 8 * _HEADER_INTS].cast("q")
        if header[0] != _MAGIC:
            raise ConfigError(f"{path} is not a gateway limit zone (or one of another version); remove it")
        self.workers, self.capacity = int(header[1]), int(header[2])
        header.release()
        self._entry_ints = _ENTRY_FIXED_INTS + self.workers
        int_words = _HEADER_INTS + 2 * self.workers + self.capacity * self._entry_ints
        self._ints = memoryview(memory)[: 8 * int_words].cast("q")
        self._floats = memoryview(memory)[8 * int_words :].cast("d")
        self._slots_at = _HEADER_INTS
        self._oldest_at = _HEADER_INTS + self.workers
        self._entries_at = _HEADER_INTS + 2 * self.workers

    @classmethod
    def create(cls, path: Path, workers: int, capacity: int) -> LimitZone:
        """A new, empty zone in PATH for WORKERS workers and CAPACITY keys."""
        if workers < 1 or capacity < 4:
            raise ConfigError(f"a limit zone needs at least 1 worker and 4 keys (got {workers} and {capacity})")
        int_words = _HEADER_INTS + 2 * workers + capacity * (_ENTRY_FIXED_INTS + workers)
        size = 8 * (int_words + capacity * _ENTRY_FLOATS)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(fd, size)  # zero-filled: every entry empty, every count zero
        memory = mmap.mmap(fd, size)
        header = memoryview(memory)[: 8 * _HEADER_INTS].cast("q")
        header[0], header[1], header[2], header[3], header[4] = _MAGIC, workers, capacity, 0, 1
        header.release()
        return cls(path, fd, memory)

    @classmethod
    def attach(cls, path: Path) -> LimitZone:
        """The zone another process created in PATH."""
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise ConfigError(f"cannot open the workers' limit zone {path} ({exc})") from exc
        size = os.fstat(fd).st_size
        if size < 8 * _HEADER_INTS:
            os.close(fd)
            raise ConfigError(f"{path} is not a gateway limit zone ({size} bytes); remove it")
        return cls(path, fd, mmap.mmap(fd, size))

    def close(self) -> None:
        self._ints.release()
        self._floats.release()
        self._memory.close()
        os.close(self._fd)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    # ---- global slots and queues (one column per worker) --------------------------------------------------------

    def slots_held(self) -> int:
        return sum(self._ints[self._slots_at : self._slots_at + self.workers])

    def add_slots(self, worker: int, delta: int) -> None:
        self._ints[self._slots_at + worker] = max(0, self._ints[self._slots_at + worker] + delta)

    def next_ticket(self) -> int:
        """A place in the one queue for a slot that spans the workers (tickets only grow)."""
        ticket = int(self._ints[4])
        self._ints[4] = ticket + 1
        return ticket

    def oldest_ticket(self) -> int | None:
        """The ticket of the request that has queued longest on any worker, or None when none queues."""
        tickets = [ticket for ticket in self._ints[self._oldest_at : self._oldest_at + self.workers] if ticket]
        return min(tickets) if tickets else None

    def set_oldest_ticket(self, worker: int, ticket: int | None) -> None:
        """The ticket of WORKER's longest-queued request (None: it has none queued)."""
        self._ints[self._oldest_at + worker] = ticket or 0

    def forget_worker(self, worker: int) -> None:
        """Zero every count WORKER holds (it died: its requests are gone). Takes the lock itself."""
        with self.locked():
            self._ints[self._slots_at + worker] = 0
            self._ints[self._oldest_at + worker] = 0
            for entry in range(self.capacity):
                self._ints[self._entry(entry) + _ENTRY_FIXED_INTS + worker] = 0

    # ---- key entries --------------------------------------------------------------------------------------------

    def find(self, hashed: int) -> int | None:
        """The entry of the key with hash HASHED, or None."""
        entry = hashed % self.capacity
        for _ in range(self.capacity):
            stored = self._ints[self._entry(entry)]
            if stored == hashed:
                return entry
            if stored == 0:
                return None
            entry = (entry + 1) % self.capacity
        return None

    def find_or_add(self, hashed: int, limits: KeyLimits, now_s: float) -> int:
        """The entry of the key with hash HASHED, added with full buckets when new; its limits set to LIMITS (a
        bucket keeps its tokens, up to a changed capacity; one the key did not have starts full)."""
        entry = self.find(hashed)
        if entry is None:
            entry = self._add(hashed, now_s)
        at = self._entry(entry)
        for offset, limit in ((1, limits.rpm), (2, limits.tpm)):
            before, limit = self._ints[at + offset], limit or 0
            if before != limit:
                self._ints[at + offset] = limit
                floats = entry * _ENTRY_FLOATS + 2 * (offset - 1)
                tokens = self._floats[floats] if before else float(limit)
                self._floats[floats], self._floats[floats + 1] = min(tokens, float(limit)), now_s
        return entry

    def in_flight(self, entry: int) -> int:
        at = self._entry(entry) + _ENTRY_FIXED_INTS
        return sum(self._ints[at : at + self.workers])

    def add_in_flight(self, entry: int, worker: int, delta: int) -> None:
        at = self._entry(entry) + _ENTRY_FIXED_INTS + worker
        self._ints[at] = max(0, self._ints[at] + delta)

    def bucket(self, entry: int, kind: int, now_s: float) -> float:
        """Tokens in bucket KIND (0: requests, 1: tokens) of ENTRY at NOW_S, refilled at limit/60 per second."""
        limit = self._ints[self._entry(entry) + 1 + kind]
        at = entry * _ENTRY_FLOATS + 2 * kind
        return refilled(self._floats[at], self._floats[at + 1], now_s, limit, limit / 60)

    def set_bucket(self, entry: int, kind: int, tokens: float, now_s: float) -> None:
        at = entry * _ENTRY_FLOATS + 2 * kind
        self._floats[at], self._floats[at + 1] = tokens, now_s

    @property
    def keys_stored(self) -> int:
        return int(self._ints[3])

    def _entry(self, entry: int) -> int:
        return self._entries_at + entry * self._entry_ints

    def _add(self, hashed: int, now_s: float) -> int:
        if self._ints[3] + 1 > self.capacity * 3 // 4:
            self._drop_idle(now_s)
        if self._ints[3] + 1 > self.capacity * 3 // 4:
            raise Overloaded(
                f"the workers' limit table is full ({self._ints[3]} keys with requests in flight or limits in use); "
                f"restart the gateway with a larger --limit-zone-keys (now {self.capacity})",
                reason="limit_zone_full",
            )
        empty = hashed.to_bytes(8, "little", signed=True) + bytes(8 * (self._entry_ints - 1))
        return self._place(empty, bytes(8 * _ENTRY_FLOATS))

    def _place(self, ints: bytes, floats: bytes) -> int:
        """Store an entry (its words as bytes) in the first free place of its probe sequence."""
        row = memoryview(ints).cast("q")
        entry = row[0] % self.capacity
        while self._ints[self._entry(entry)] != 0:
            entry = (entry + 1) % self.capacity
        at = self._entry(entry)
        self._ints[at : at + self._entry_ints] = row
        self._floats[entry * _ENTRY_FLOATS : (entry + 1) * _ENTRY_FLOATS] = memoryview(floats).cast("d")
        self._ints[3] += 1
        return entry

    def _drop_idle(self, now_s: float) -> None:
        """Keep only the entries that hold something, re-placed so that every probe sequence stays unbroken."""
        kept = []
        for entry in range(self.capacity):
            at, float_at = self._entry(entry), entry * _ENTRY_FLOATS
            if self._ints[at] != 0 and not self._idle(entry, now_s):
                kept.append((bytes(self._ints[at : at + self._entry_ints]),
                             bytes(self._floats[float_at : float_at + _ENTRY_FLOATS])))  # fmt: skip
            self._ints[at] = 0
        self._ints[3] = 0
        for ints, floats in kept:
            self._place(ints, floats)

    def _idle(self, entry: int, now_s: float) -> bool:
        at = self._entry(entry)
        if self.in_flight(entry):
            return False
        return all(
            self._ints[at + 1 + kind] == 0 or self.bucket(entry, kind, now_s) >= self._ints[at + 1 + kind]
            for kind in (0, 1)
        )


class HostLimiter(HostOnlyLifecycle):
    """The `Limiter` of one worker among several on a host, on their shared `LimitZone`. The global slots are one
    limit for all workers, with one FIFO queue across them (up to max_queue requests in each worker)."""

    def __init__(
        self,
        zone: LimitZone,
        worker: int,
        *,
        max_concurrency: int,
        max_queue: int,
        queue_timeout_s: float,
        clock: Clock = time.monotonic,
    ) -> None:
        if not 0 <= worker < zone.workers:
            raise ConfigError(f"worker {worker} is not one of the limit zone's {zone.workers} workers")
        self.zone = zone
        self.worker = worker
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.revoked_ids: set[str] = set()  # the workers read one key database: nothing is announced
        self._clock = clock
        self._slots_here = 0
        self._waiters: collections.deque[tuple[int, asyncio.Event]] = collections.deque()  # (ticket, wake-up)

    @property
    def in_flight(self) -> int:
        return self._slots_here

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def admit(self, key_id: str | None, limits: KeyLimits | None, charged_tokens: int) -> Admission:
        admission = Admission(key_id, limits, charged_tokens)
        if key_id is not None and limits is not None:
            with self.zone.locked():
                self._admit_key(_cached_key_hash(key_id), limits, charged_tokens)
        return admission

    def _admit_key(self, hashed: int, limits: KeyLimits, charged_tokens: int) -> None:
        """Count one request of the key with hash HASHED, or raise RateLimited (changing no count)."""
        now_s = self._clock()
        zone = self.zone
        entry = zone.find_or_add(hashed, limits, now_s)
        if limits.max_concurrency is not None and (held := zone.in_flight(entry)) >= limits.max_concurrency:
            raise concurrency_refusal(held, where=" across this host's workers")
        requests = zone.bucket(entry, 0, now_s) if limits.rpm else 0.0
        if limits.rpm and requests < 1:
            raise rpm_refusal(limits, (1 - requests) * 60 / limits.rpm)
        tokens = zone.bucket(entry, 1, now_s) if limits.tpm else 0.0
        if limits.tpm and tokens < (needed := min(charged_tokens, limits.tpm)):
            raise tpm_refusal(limits, charged_tokens, (needed - tokens) * 60 / limits.tpm)
        if limits.rpm:
            zone.set_bucket(entry, 0, requests - 1, now_s)
        if limits.tpm:
            zone.set_bucket(entry, 1, tokens - charged_tokens, now_s)
        zone.add_in_flight(entry, self.worker, 1)

    async def acquire_slot(self, admission: Admission) -> None:
        if admission.has_slot:
            return
        if not self._waiters and self._take_slot(ticket=None):
            admission.has_slot = True
            return
        if len(self._waiters) >= self.max_queue:
            raise Overloaded(
                f"the gateway is at capacity ({self.max_concurrency} in flight across its workers, "
                f"{len(self._waiters)} queued in this one); retry later",
                reason="queue_full",
            )
        await self._wait_for_slot()
        admission.has_slot = True

    def release(self, admission: Admission, used_tokens: int | None) -> None:
        had_slot, admission.has_slot = admission.has_slot, False
        key_id, limits = admission.key_id, admission.limits
        with self.zone.locked():
            if had_slot:
                self.zone.add_slots(self.worker, -1)
            if key_id is not None and limits is not None:
                self._release_key(_cached_key_hash(key_id), limits, admission.charged_tokens, used_tokens)
        if had_slot:
            self._slots_here -= 1
            if self._waiters:
                self._waiters[0][1].set()

    def _release_key(self, hashed: int, limits: KeyLimits, charged_tokens: int, used_tokens: int | None) -> None:
        entry = self.zone.find(hashed)
        if entry is None:  # not expected (an entry with a request in flight is never dropped): nothing to give back
            return
        self.zone.add_in_flight(entry, self.worker, -1)
        if limits.tpm and used_tokens is not None:
            now_s = self._clock()
            tokens = min(float(limits.tpm), self.zone.bucket(entry, 1, now_s) + charged_tokens - used_tokens)
            self.zone.set_bucket(entry, 1, tokens, now_s)

    def expire_overdue(self) -> None:
        for _, woken in self._waiters:
            woken.set()

    # ---- the global slots ---------------------------------------------------------------------------------------

    def _take_slot(self, ticket: int | None) -> bool:
        """Take a global slot if one is free and no request queues ahead: for a newcomer (TICKET None), none on
        any worker; for a queued request, none with an older ticket."""
        with self.zone.locked():
            if self.zone.slots_held() >= self.max_concurrency or self.zone.oldest_ticket() != ticket:
                return False
            self.zone.add_slots(self.worker, 1)
        self._slots_here += 1
        return True

    async def _wait_for_slot(self) -> None:
        """One FIFO queue across the workers (a shared ticket counter): only the request whose ticket is the oldest
        takes a freed slot. This worker's oldest looks when a slot of this worker is freed, and every SLOT_POLL_S
        (a slot freed by another worker, or an older request of another worker gone)."""
        deadline = self._clock() + self.queue_timeout_s
        woken = asyncio.Event()
        ticket = self._queue(woken)
        try:
            while True:
                if self._waiters[0][1] is woken and self._take_slot(ticket):
                    return
                remaining_s = deadline - self._clock()
                if remaining_s <= 0:
                    raise queue_timed_out(self.queue_timeout_s)
                woken.clear()
                wait_s = min(SLOT_POLL_S, remaining_s) if self._waiters[0][1] is woken else remaining_s
                await wait_for_event(woken, wait_s)
        finally:
            self._unqueue(ticket, woken)

    def _queue(self, woken: asyncio.Event) -> int:
        with self.zone.locked():
            ticket = self.zone.next_ticket()
            self._waiters.append((ticket, woken))
            self.zone.set_oldest_ticket(self.worker, self._waiters[0][0])
        return ticket

    def _unqueue(self, ticket: int, woken: asyncio.Event) -> None:
        head = self._waiters[0][1] is woken
        self._waiters.remove((ticket, woken))
        with self.zone.locked():
            self.zone.set_oldest_ticket(self.worker, self._waiters[0][0] if self._waiters else None)
        if head and self._waiters:
            self._waiters[0][1].set()


def worker_zone_from_environment() -> tuple[LimitZone, int]:
    """The zone and column the supervisor gave this worker (ZONE_PATH_ENV, WORKER_INDEX_ENV)."""
    path, index = os.environ.get(ZONE_PATH_ENV), os.environ.get(WORKER_INDEX_ENV)
    if not path or index is None:
        raise ConfigError(
            "--workers above 1 without --redis-url shares its limits in memory set up by the gateway's supervisor; "
            "start it with `deepserve gateway --workers N`, not a worker on its own"
        )
    return LimitZone.attach(Path(path)), int(index)
