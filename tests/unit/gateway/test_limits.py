from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from deepserve.errors import ConfigError
from deepserve.gateway.errors import Overloaded, RateLimited
from deepserve.gateway.keys import KeyStore
from deepserve.gateway.limits import AdmissionQueue, KeyLimiter, KeyLimits, LocalLimiter, TokenBucket
from tests.helpers import FakeClock


def test_bucket_refills_continuously_and_reports_wait() -> None:
    clock = FakeClock()
    bucket = TokenBucket(capacity=60, refill_per_s=1.0, clock=clock)
    assert bucket.try_take(60) == 0
    assert bucket.try_take(1) == pytest.approx(1.0)  # empty: one token a second
    clock.now_s += 0.5
    assert bucket.try_take(1) == pytest.approx(0.5)
    clock.now_s += 0.5
    assert bucket.try_take(1) == 0
    clock.now_s += 1000
    assert bucket.tokens == 60  # never above capacity


def test_bucket_debt_from_a_correction_delays_later_requests() -> None:
    clock = FakeClock()
    bucket = TokenBucket(capacity=100, refill_per_s=10.0, clock=clock)
    assert bucket.try_take(50) == 0
    bucket.adjust(-100)  # the request used 100 more than charged
    assert bucket.tokens == -50
    assert bucket.try_take(10) == pytest.approx(6.0)  # (10 - -50) / 10


def test_request_larger_than_bucket_is_admitted_only_when_full() -> None:
    clock = FakeClock()
    bucket = TokenBucket(capacity=100, refill_per_s=10.0, clock=clock)
    assert bucket.try_take(500) == 0
    assert bucket.try_take(500) == pytest.approx(50.0)  # (100 - -400) / 10: back to full


def test_key_limiter_rpm_then_retry_after() -> None:
    clock = FakeClock()
    limiter = KeyLimiter(KeyLimits(rpm=2), clock)
    limiter.admit(10)
    limiter.admit(10)
    with pytest.raises(RateLimited) as caught:
        limiter.admit(10)
    assert caught.value.reason == "key_rpm"
    assert caught.value.retry_after_s == pytest.approx(30.0)
    assert caught.value.headers() == [(b"retry-after", b"30")]


def test_key_limiter_tpm_charges_then_corrects_with_real_usage() -> None:
    clock = FakeClock()
    limiter = KeyLimiter(KeyLimits(rpm=100, tpm=1000), clock)
    limiter.admit(800)
    with pytest.raises(RateLimited) as caught:
        limiter.admit(800)  # 200 left
    assert caught.value.reason == "key_tpm"
    limiter.release(800, used_tokens=100)  # it used far less than charged: 700 given back
    limiter.admit(800)
    assert limiter.in_flight == 1


def test_key_limiter_refused_tpm_does_not_count_against_rpm() -> None:
    limiter = KeyLimiter(KeyLimits(rpm=1, tpm=10), FakeClock())
    limiter.admit(10)
    limiter.release(10, None)
    with pytest.raises(RateLimited) as caught:
        limiter.admit(10)
    assert caught.value.reason in ("key_rpm", "key_tpm")


def test_key_concurrency_limit() -> None:
    limiter = KeyLimiter(KeyLimits(max_concurrency=1), FakeClock())
    limiter.admit(1)
    with pytest.raises(RateLimited) as caught:
        limiter.admit(1)
    assert caught.value.reason == "key_concurrency"
    limiter.release(1, 1)
    limiter.admit(1)


async def test_queue_admits_then_queues_then_rejects_when_full() -> None:
    queue = AdmissionQueue(max_concurrency=1, max_queue=1, timeout_s=5)
    await queue.acquire()
    waiter = asyncio.create_task(queue.acquire())
    await asyncio.sleep(0)
    assert queue.waiting == 1
    with pytest.raises(Overloaded) as caught:
        await queue.acquire()
    assert caught.value.reason == "queue_full"
    assert caught.value.status == 503
    queue.release()  # the slot passes to the waiter
    await waiter
    assert queue.in_flight == 1 and queue.waiting == 0
    queue.release()
    assert queue.in_flight == 0


async def test_queue_times_out_by_its_clock() -> None:
    clock = FakeClock()
    queue = AdmissionQueue(max_concurrency=1, max_queue=10, timeout_s=30.0, clock=clock)
    await queue.acquire()
    first = asyncio.create_task(queue.acquire())
    await asyncio.sleep(0)
    clock.now_s += 10
    second = asyncio.create_task(queue.acquire())
    await asyncio.sleep(0)
    clock.now_s += 20  # the first has waited 30 s, the second 20 s
    queue.expire_overdue()  # what each waiter's timer does when it fires
    with pytest.raises(Overloaded) as caught:
        await first
    assert caught.value.reason == "queue_timeout"
    assert not second.done() and queue.waiting == 1
    queue.release()  # the slot goes to the one still waiting
    await second
    assert queue.waiting == 0 and queue.in_flight == 1


async def test_queue_timeout_fires_by_itself_on_the_loops_timer() -> None:
    queue = AdmissionQueue(max_concurrency=1, max_queue=10, timeout_s=0.05)  # the real clock
    await queue.acquire()
    with pytest.raises(Overloaded) as caught:
        await asyncio.wait_for(queue.acquire(), 20)  # the bound only keeps a broken timer from hanging the run
    assert caught.value.reason == "queue_timeout"
    assert queue.waiting == 0


async def test_cancelled_waiter_does_not_leak_the_slot() -> None:
    queue = AdmissionQueue(max_concurrency=1, max_queue=10, timeout_s=5)
    await queue.acquire()
    first = asyncio.create_task(queue.acquire())
    second = asyncio.create_task(queue.acquire())
    await asyncio.sleep(0)
    first.cancel()
    await asyncio.sleep(0)
    queue.release()  # skips the cancelled waiter
    await second
    assert queue.in_flight == 1
    queue.release()
    assert queue.in_flight == 0 and queue.waiting == 0


@pytest.mark.parametrize(
    ("limits", "flag"),
    [(KeyLimits(rpm=-5), "--rpm -5"), (KeyLimits(rpm=0), "--rpm 0"), (KeyLimits(tpm=0), "--tpm 0"),
     (KeyLimits(max_concurrency=-1), "--max-concurrency -1")],
)  # fmt: skip
def test_limits_below_one_are_refused_with_what_to_do_instead(limits: KeyLimits, flag: str) -> None:
    with pytest.raises(ConfigError) as caught:
        limits.check()
    message = str(caught.value)
    assert message.startswith(f"{flag} is not a limit") and "leave" in message and "revoke" in message


def test_limits_of_one_and_more_and_no_limit_are_accepted() -> None:
    KeyLimits().check()
    KeyLimits(rpm=1, tpm=1, max_concurrency=1).check()


def test_a_key_with_a_negative_limit_cannot_be_created(tmp_path: Path) -> None:
    store = KeyStore(tmp_path / "keys.sqlite")
    with pytest.raises(ConfigError, match="--rpm -5 is not a limit"):
        store.create("broken", KeyLimits(rpm=-5))
    assert store.all_keys() == []


async def test_local_limiter_counts_keys_and_slots_and_gives_them_back() -> None:
    clock = FakeClock()
    limiter = LocalLimiter(max_concurrency=1, max_queue=0, queue_timeout_s=1, clock=clock)
    limits = KeyLimits(tpm=100, max_concurrency=2)
    first = await limiter.admit("k", limits, 60)
    await limiter.acquire_slot(first)
    assert limiter.in_flight == 1
    second = await limiter.admit("k", limits, 40)
    with pytest.raises(Overloaded):  # the one global slot is taken and nothing may queue
        await limiter.acquire_slot(second)
    limiter.release(second, 0)  # refused: nothing used, its 40 back
    limiter.release(first, 10)  # used 10 of the 60 charged: 50 back
    assert limiter.in_flight == 0
    anonymous = await limiter.admit(None, None, 10**9)  # no key: no key limits
    await limiter.acquire_slot(anonymous)
    limiter.release(anonymous, None)
    assert (await limiter.admit("k", limits, 90)).key_limiter is not None  # 100 - 60 - 40 + 40 + 50 = 90 left
    with pytest.raises(RateLimited):
        await limiter.admit("k", limits, 1)
