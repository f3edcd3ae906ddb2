"""Reservations of the limits shared through a real Redis (shared_limits.Reserve): each gateway holds a few spare
slots and a slice of each per-minute bucket in Redis and admits from them without a round trip. Two gateways on one
Redis never admit more than a limit together (and still reach it), a burst goes without a script call per request,
an idle gateway's reservation goes back to the others, and a dead one's expires with its leases. Bucket time is a
shared injected clock that stands still, so no bucket refills while a test counts."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import redis

from deepserve.gateway.errors import Overloaded, RateLimited
from deepserve.gateway.limits import Admission, KeyLimits
from deepserve.gateway.shared_limits import RESERVE_IDLE_S, RESERVE_SLOTS, RedisLimiter
from tests.helpers import FakeClock

from .conftest import RedisServer


@contextlib.asynccontextmanager
async def limiters(url: str, count: int, **fields: object) -> AsyncIterator[list[RedisLimiter]]:
    """COUNT gateways' limiters on one Redis; no request queues (a request without a slot is refused at once)."""
    fields = {"max_queue": 0, "queue_timeout_s": 5, "lease_s": 10, "clock": FakeClock(), **fields}
    started = [RedisLimiter(url, **fields) for _ in range(count)]  # type: ignore[arg-type]
    for limiter in started:
        await limiter.start()
    try:
        yield started
    finally:
        for limiter in started:
            await limiter.close()


async def take(
    limiter: RedisLimiter, key_id: str | None, limits: KeyLimits | None, tokens: int = 1
) -> Admission | None:
    """One request's admission and global slot, or None when a limit refused it."""
    try:
        admission = await limiter.admit(key_id, limits, tokens)
    except RateLimited:
        return None
    try:
        await limiter.acquire_slot(admission)
    except Overloaded:
        limiter.release(admission, None)
        return None
    return admission


async def bursts(gateways: list[RedisLimiter], limits: KeyLimits | None, tokens: int, keep: bool) -> int:
    """Bursts of requests on every gateway at once until the limit refuses them all; how many were admitted.
    KEEP: admissions hold their slots (concurrency), otherwise each ends at once (rpm, tpm)."""
    key_id = "k" if limits else None
    admitted = 0
    for _ in range(100):
        arrivals = [gateway for gateway in gateways for _ in range(4)]
        answers = await asyncio.gather(*(take(gateway, key_id, limits, tokens) for gateway in arrivals))
        taken = [
            (gateway, admission) for gateway, admission in zip(arrivals, answers, strict=True) if admission is not None
        ]
        if not taken and admitted:
            break
        admitted += len(taken)
        for gateway, admission in [] if keep else taken:
            gateway.release(admission, tokens)
        await asyncio.sleep(0.01)  # reservations and releases arrive between bursts
    return admitted


@pytest.mark.parametrize(
    ("limits", "tokens", "keep", "limit"),
    [
        (None, 1, True, 48),  # the global concurrency (--max-concurrency 48): 6 spare slots per gateway
        (KeyLimits(max_concurrency=24), 1, True, 24),  # a key's concurrency: 3 spare slots
        (KeyLimits(rpm=300), 1, False, 300),  # a slice of 15 requests
        (KeyLimits(tpm=30_000), 100, False, 300),  # a slice of 1,500 tokens: 15 requests of 100
    ],
    ids=["global-concurrency", "key-concurrency", "rpm", "tpm"],
)
async def test_two_reserving_gateways_admit_exactly_the_limit_together(
    redis_server: RedisServer, limits: KeyLimits | None, tokens: int, keep: bool, limit: int
) -> None:
    async with limiters(redis_server.url, 2, max_concurrency=48 if keep else 10_000) as gateways:
        admitted = await bursts(gateways, limits, tokens, keep)
        spares = [gateway.spare_slots("k" if limits else None) for gateway in gateways]
        assert admitted == limit, spares  # never more; and reservations leave none of it unused at the end
        assert sum(gateway.reserved_admissions for gateway in gateways) >= limit // 4  # most came from reserves


async def test_a_burst_is_admitted_from_the_reserve_without_a_script_call_per_request(
    redis_server: RedisServer,
) -> None:
    limits = KeyLimits(rpm=10**6, tpm=10**9, max_concurrency=1000)
    client = redis.Redis.from_url(redis_server.url)
    async with limiters(redis_server.url, 1, max_concurrency=1000) as (gateway,):
        first = await take(gateway, "k", limits, 100)  # the admission script; it reserves for the next requests
        await gateway.settle()
        assert first is not None and gateway.spare_slots("k") == RESERVE_SLOTS
        scripts_before = evalsha_calls(client)
        burst = await asyncio.gather(*(take(gateway, "k", limits, 100) for _ in range(RESERVE_SLOTS)))
        await gateway.settle()
        # one call for the whole burst: the reservation that tops the reserve up once it is half used
        assert evalsha_calls(client) - scripts_before == 1
        for admission in burst:
            assert admission is not None and admission.has_slot and not admission.local
            assert admission.lease is not None
            assert client.zscore(gateway.names.global_leases, admission.lease) is not None  # counted in Redis
            assert client.zscore(gateway.names.key_leases("k"), admission.lease) is not None
        # what Redis holds: the admitted requests and the spares, and nothing else
        held = 1 + RESERVE_SLOTS + gateway.spare_slots("k")
        assert client.zcard(gateway.names.global_leases) == held == client.zcard(gateway.names.key_leases("k"))
        assert gateway.in_flight == 1 + RESERVE_SLOTS
    client.close()


def evalsha_calls(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


async def test_an_idle_gateway_gives_its_reservation_back_so_another_can_use_the_whole_limit(
    redis_server: RedisServer,
) -> None:
    local_clock = FakeClock()  # the gateways' own clock, which times their idleness
    async with limiters(redis_server.url, 2, max_concurrency=16, local_clock=local_clock) as (idle, busy):
        one = await take(idle, None, None)
        await idle.settle()
        assert one is not None and idle.spare_slots(None) == 2  # 16 // 8
        idle.release(one, None)
        await idle.settle()
        held = [await take(busy, None, None) for _ in range(20)]
        assert sum(admission is not None for admission in held) == 14  # the idle gateway's 2 spares count
        local_clock.now_s += RESERVE_IDLE_S  # no arrival at the idle gateway for a second
        idle.return_idle()
        await idle.settle()
        assert idle.spare_slots(None) == 0
        more = [await take(busy, None, None) for _ in range(4)]
        assert sum(admission is not None for admission in more) == 2  # the busy gateway holds all 16 now


async def test_a_dead_gateways_reserved_slots_expire(redis_server: RedisServer) -> None:
    clock = FakeClock()
    async with limiters(redis_server.url, 2, max_concurrency=16, clock=clock) as (dying, alive):
        held = await take(dying, None, None)
        await dying.settle()
        assert held is not None and dying.spare_slots(None) == 2
        dying.up = False  # it loses Redis, then dies: nothing given back, nothing renewed
        await dying.close()
        taken = [await take(alive, None, None) for _ in range(20)]
        assert sum(admission is not None for admission in taken) == 13  # 16 less the dead one's request and spares
        clock.now_s += 5
        await alive.renew_leases()  # what its renewal loop does every lease/3 s
        clock.now_s += 6  # past the dead one's lease (10 s, rounded up to the whole second), not the live one's
        more = [await take(alive, None, None) for _ in range(5)]
        assert sum(admission is not None for admission in more) == 3


async def test_near_a_limit_nothing_is_reserved_so_no_gateway_waits_for_anothers_spares(
    redis_server: RedisServer,
) -> None:
    """The last quarter of a limit goes one admission script per request: a gateway that holds most of it keeps no
    spare slots nor tokens for itself, and the other gateway gets the rest at once."""
    limits = KeyLimits(rpm=100)
    async with limiters(redis_server.url, 2, max_concurrency=16) as (first, second):
        held = []
        for _ in range(13):
            held.append(await take(first, "k", limits))
            await first.settle()  # each reservation lands before the next request
        assert all(held) and first.reserved_admissions > 0
        assert first.spare_slots("k") == 0  # 13 of 16 in flight: past three quarters
        others = [await take(second, "k", limits) for _ in range(5)]
        assert sum(admission is not None for admission in others) == 3
        for admission in held:
            assert admission is not None
            first.release(admission, None)
        await first.settle()
        first.return_idle()  # (by its clock it is not idle yet: nothing goes back)
        for admission in others:
            if admission is not None:
                second.release(admission, None)
        rpm_left = 0
        for _ in range(100):
            admission = await take(second, "k", limits)
            if admission is not None:
                rpm_left += 1
                second.release(admission, None)
        # the rpm bucket: 100 less the 16 + 3 admitted, less what the first gateway still holds reserved (at most a
        # slice, 5 requests, taken only while the bucket kept three quarters)
        assert 100 - 16 - 3 - 5 <= rpm_left <= 100 - 16 - 3
