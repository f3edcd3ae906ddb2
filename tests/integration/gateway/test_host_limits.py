"""The workers' shared limit zone (host_limits.py) across real processes: updates under its file lock lose nothing
when processes race, and a process killed while it holds the lock does not block the others."""

from __future__ import annotations

import asyncio
import multiprocessing
import signal
import time
from pathlib import Path
from typing import Any

from deepserve.gateway.errors import RateLimited
from deepserve.gateway.host_limits import HostLimiter, LimitZone, key_hash
from deepserve.gateway.limits import KeyLimits

WORKERS = 4
ATTEMPTS = 1500
RPM = 3000
# Bound for spawned interpreters to start and finish on a machine at load 10-20; nothing asserts on timing.
PROCESS_BOUND_S = 120.0


def _frozen_clock() -> float:
    return 0.0  # no refill: exactly RPM admissions exist, whoever races for them


def _race(path: str, worker: int, admitted: multiprocessing.SimpleQueue[int]) -> None:
    async def attempts() -> int:
        zone = LimitZone.attach(Path(path))
        limiter = HostLimiter(zone, worker, max_concurrency=10**6, max_queue=0, queue_timeout_s=1.0,
                              clock=_frozen_clock)  # fmt: skip
        count = 0
        for _ in range(ATTEMPTS):
            try:
                admission = await limiter.admit("shared", KeyLimits(rpm=RPM, max_concurrency=10**6), 1)
            except RateLimited:
                continue
            await limiter.acquire_slot(admission)
            limiter.release(admission, 1)
            count += 1
        await limiter.close()
        return count

    admitted.put(asyncio.run(attempts()))


def _hold_the_lock(path: str, holding: Any) -> None:
    zone = LimitZone.attach(Path(path))
    with zone.locked():
        holding.set()
        time.sleep(PROCESS_BOUND_S * 10)  # killed long before


def test_racing_workers_admit_exactly_the_limit_and_give_everything_back(tmp_path: Path) -> None:
    zone = LimitZone.create(tmp_path / "limits.zone", workers=WORKERS, capacity=64)
    context = multiprocessing.get_context("spawn")
    admitted: multiprocessing.SimpleQueue[int] = context.SimpleQueue()
    processes = [context.Process(target=_race, args=(str(zone.path), index, admitted)) for index in range(WORKERS)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(PROCESS_BOUND_S)
        assert process.exitcode == 0
    counts = [admitted.get() for _ in processes]
    assert sum(counts) == RPM, counts  # WORKERS x ATTEMPTS tried, never one more or fewer than the bucket held
    with zone.locked():
        assert zone.slots_held() == 0 and zone.oldest_ticket() is None
        entry = zone.find(key_hash("shared"))
        assert entry is not None and zone.in_flight(entry) == 0
    zone.close()


def test_a_process_killed_while_it_holds_the_lock_does_not_block_the_others(tmp_path: Path) -> None:
    zone = LimitZone.create(tmp_path / "limits.zone", workers=1, capacity=16)
    context = multiprocessing.get_context("spawn")
    holding = context.Event()
    holder = context.Process(target=_hold_the_lock, args=(str(zone.path), holding))
    holder.start()
    assert holding.wait(PROCESS_BOUND_S)  # it holds the lock now
    holder.kill()
    holder.join(PROCESS_BOUND_S)
    assert holder.exitcode == -signal.SIGKILL
    with zone.locked():  # the kernel released the dead holder's lock
        assert zone.slots_held() == 0
    zone.close()
