"""The limits that the workers of one host share in memory (host_limits.py), here as two or three workers' limiters
in one process on one zone file; the same zone across real processes is in tests/integration/gateway."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from deepserve.errors import ConfigError
from deepserve.gateway.config import GatewayConfig
from deepserve.gateway.errors import Overloaded, RateLimited
from deepserve.gateway.host_limits import HostLimiter, LimitZone, key_hash
from deepserve.gateway.limits import KeyLimits, make_limiter
from tests.helpers import FakeClock


@pytest.fixture
def zone(tmp_path: Path) -> Iterator[LimitZone]:
    created = LimitZone.create(tmp_path / "limits.zone", workers=3, capacity=64)
    yield created
    created.close()


def workers(
    zone: LimitZone, clock: FakeClock, max_concurrency: int = 100, max_queue: int = 10, queue_timeout_s: float = 1.0
) -> list[HostLimiter]:
    """One limiter per worker, each on its own mapping of the zone (as each worker process has)."""
    return [
        HostLimiter(
            LimitZone.attach(zone.path),
            index,
            max_concurrency=max_concurrency,
            max_queue=max_queue,
            queue_timeout_s=queue_timeout_s,
            clock=clock,
        )
        for index in range(zone.workers)
    ]


async def test_rpm_is_one_limit_across_workers_and_refills(zone: LimitZone) -> None:
    clock = FakeClock()
    first, second, third = workers(zone, clock)
    limits = KeyLimits(rpm=6)
    for limiter in (first, second, third, first, second, third):
        await limiter.admit("team", limits, 10)
    with pytest.raises(RateLimited) as refused:
        await second.admit("team", limits, 10)
    assert refused.value.reason == "key_rpm" and refused.value.retry_after_s == pytest.approx(10.0)
    clock.now_s += 10  # one request a minute / 6 = one every 10 s
    await third.admit("team", limits, 10)
    with pytest.raises(RateLimited):
        await first.admit("team", limits, 10)
    await first.admit("another team", limits, 10)  # its own bucket


async def test_tokens_are_charged_then_corrected_with_the_real_usage_by_any_worker(zone: LimitZone) -> None:
    clock = FakeClock()
    first, second, _ = workers(zone, clock)
    limits = KeyLimits(tpm=1000)
    charged = await first.admit("team", limits, 800)
    with pytest.raises(RateLimited) as refused:
        await second.admit("team", limits, 300)  # 200 left
    assert refused.value.reason == "key_tpm" and "may use 300" in str(refused.value)
    first.release(charged, 100)  # used 100 of the 800 charged: 700 back, 900 left
    await second.admit("team", limits, 900)
    with pytest.raises(RateLimited):
        await first.admit("team", limits, 1)


async def test_a_keys_concurrency_counts_every_workers_requests(zone: LimitZone) -> None:
    clock = FakeClock()
    first, second, third = workers(zone, clock)
    limits = KeyLimits(max_concurrency=2)
    held = [await first.admit("team", limits, 1), await second.admit("team", limits, 1)]
    with pytest.raises(RateLimited) as refused:
        await third.admit("team", limits, 1)
    assert refused.value.reason == "key_concurrency" and "across this host's workers" in str(refused.value)
    first.release(held[0], 1)
    await third.admit("team", limits, 1)


async def test_global_slots_are_one_limit_and_a_slot_freed_by_another_worker_is_taken(zone: LimitZone) -> None:
    clock = FakeClock()
    first, second, _ = workers(zone, clock, max_concurrency=2, queue_timeout_s=30)
    running = [await first.admit(None, None, 1), await second.admit(None, None, 1)]
    for limiter, admission in zip((first, second), running, strict=True):
        await limiter.acquire_slot(admission)
    queued_admission = await first.admit(None, None, 1)
    queued = asyncio.create_task(first.acquire_slot(queued_admission))
    await asyncio.sleep(0.05)
    assert not queued.done() and first.waiting == 1
    newcomer = await second.admit(None, None, 1)
    second.release(running[1], None)  # a slot frees in the other worker ...
    waiting_newcomer = asyncio.create_task(second.acquire_slot(newcomer))  # ... and a newcomer there queues behind
    await asyncio.wait_for(queued, 5)  # the first worker's queued request finds it by itself (it polls)
    await asyncio.sleep(0.05)
    assert queued_admission.has_slot and not waiting_newcomer.done()
    first.release(queued_admission, None)
    await asyncio.wait_for(waiting_newcomer, 5)
    assert (first.in_flight, second.in_flight) == (1, 1)


async def test_a_full_queue_refuses_and_a_queued_request_times_out_by_the_clock(zone: LimitZone) -> None:
    clock = FakeClock()
    first, second, _ = workers(zone, clock, max_concurrency=1, max_queue=1, queue_timeout_s=5)
    await first.acquire_slot(await first.admit(None, None, 1))
    queued = asyncio.create_task(second.acquire_slot(await second.admit(None, None, 1)))
    await asyncio.sleep(0.02)
    with pytest.raises(Overloaded) as full:
        await second.acquire_slot(await second.admit(None, None, 1))
    assert full.value.reason == "queue_full" and "across its workers" in str(full.value)
    clock.now_s += 6
    second.expire_overdue()
    with pytest.raises(Overloaded) as late:
        await asyncio.wait_for(queued, 5)
    assert late.value.reason == "queue_timeout"
    assert second.waiting == 0 and zone.oldest_ticket() is None  # it no longer holds back newcomers anywhere


async def test_a_dead_workers_slots_and_requests_are_given_back(zone: LimitZone) -> None:
    clock = FakeClock()
    first, second, _ = workers(zone, clock, max_concurrency=2)
    limits = KeyLimits(max_concurrency=2)
    for _ in range(2):
        await first.acquire_slot(await first.admit("team", limits, 1))
    with pytest.raises(RateLimited):
        await second.admit("team", limits, 1)
    zone.forget_worker(0)  # the supervisor, before it restarts worker 0
    for _ in range(2):
        await second.acquire_slot(await second.admit("team", limits, 1))


async def test_a_full_table_drops_idle_keys_and_refuses_only_when_every_key_holds_something(tmp_path: Path) -> None:
    clock = FakeClock()
    small = LimitZone.create(tmp_path / "small.zone", workers=1, capacity=16)  # holds 12 keys (three quarters)
    (limiter,) = workers(small, clock)
    limits = KeyLimits(rpm=60, max_concurrency=5)
    admissions = [await limiter.admit(f"key{index}", limits, 1) for index in range(12)]
    with pytest.raises(Overloaded) as full:  # every key holds a request
        await limiter.admit("key12", limits, 1)
    assert full.value.reason == "limit_zone_full" and "--limit-zone-keys" in str(full.value)
    for admission in admissions[1:]:
        limiter.release(admission, 1)
    with pytest.raises(Overloaded):  # their requests ended, but their buckets are not full yet
        await limiter.admit("key12", limits, 1)
    clock.now_s += 1  # one request back a second: full again, and a key that holds nothing can go
    await limiter.admit("key12", limits, 1)
    assert small.keys_stored == 2 and small.find(key_hash("key0")) is not None
    with pytest.raises(RateLimited):  # key0's request in flight survived the move
        await limiter.admit("key0", KeyLimits(max_concurrency=1), 1)
    small.close()


async def test_a_changed_limit_keeps_what_the_bucket_holds_up_to_the_new_capacity(zone: LimitZone) -> None:
    clock = FakeClock()
    (limiter, *_) = workers(zone, clock)
    for _ in range(3):
        await limiter.admit("team", KeyLimits(rpm=10), 1)
    await limiter.admit("team", KeyLimits(rpm=4), 1)  # 7 left, capped at 4: this takes one, 3 left
    for _ in range(3):
        await limiter.admit("team", KeyLimits(rpm=4), 1)
    with pytest.raises(RateLimited):
        await limiter.admit("team", KeyLimits(rpm=4), 1)
    await limiter.admit("team", KeyLimits(tpm=50), 50)  # a new token bucket starts full ...
    with pytest.raises(RateLimited):
        await limiter.admit("team", KeyLimits(tpm=50), 1)  # ... and is spent


def test_a_file_that_is_not_a_zone_and_a_worker_without_a_supervisor_are_refused(tmp_path: Path) -> None:
    stray = tmp_path / "stray"
    stray.write_bytes(bytes(4096))
    with pytest.raises(ConfigError, match="not a gateway limit zone"):
        LimitZone.attach(stray)
    stray.write_bytes(b"short")
    with pytest.raises(ConfigError, match="not a gateway limit zone"):
        LimitZone.attach(stray)
    config = GatewayConfig(upstream=["http://127.0.0.1:1/v1"], workers=2)
    with pytest.raises(ConfigError, match="deepserve gateway --workers N"):
        make_limiter(config)
