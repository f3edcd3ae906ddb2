"""Admission control: per-key token buckets and concurrency, and the global slot queue.

`LocalLimiter` keeps them in this process's memory (exact, reset on restart); `host_limits.HostLimiter` in memory
that the worker processes of one host share (`--workers N`); `shared_limits.RedisLimiter` in Redis so that gateways
on several hosts enforce one limit. Each is a `Limiter`: the app asks it to admit a key's request
(`admit`, never waits), to get one of the global slots (`acquire_slot`, may wait in the queue), and to give everything
back with the real usage (`release`, never raises, never waits). The protocol declares everything the app, its
metrics and its tests use; `make_limiter` is the one factory (the product's and the tests').

Everything takes an injected clock so that tests can move time by hand."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from deepserve.errors import ConfigError
from deepserve.gateway.clock import Clock
from deepserve.gateway.errors import Overloaded, RateLimited

if TYPE_CHECKING:
    from deepserve.gateway.config import GatewayConfig


class TokenBucket:
    """CAPACITY tokens, refilled continuously at REFILL_PER_S. A take may drive the balance negative (the cost of a
    request is only known afterwards), which then delays later requests: the debt is paid, never forgiven."""

    def __init__(self, capacity: float, refill_per_s: float, clock: Clock = time.monotonic) -> None:
        self.capacity = capacity
        self.refill_per_s = refill_per_s
        self._clock = clock
        self._tokens = capacity
        self._updated = clock()

    @property
    def tokens(self) -> float:
        self._refill()
        return self._tokens

    def try_take(self, amount: float) -> float:
        """Take AMOUNT and return 0, or take nothing and return the seconds until it could be taken. A request
        larger than the whole bucket is admitted when the bucket is full, so that it is not refused forever."""
        self._refill()
        needed = min(amount, self.capacity)
        if self._tokens >= needed:
            self._tokens -= amount
            return 0.0
        return (needed - self._tokens) / self.refill_per_s

    def adjust(self, delta: float) -> None:
        """Give back (positive) or charge more (negative) once the real cost is known."""
        self._refill()
        self._tokens = min(self.capacity, self._tokens + delta)

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = refilled(self._tokens, self._updated, now, self.capacity, self.refill_per_s)
        self._updated = now


def refilled(tokens: float, updated_s: float, now_s: float, capacity: float, refill_per_s: float) -> float:
    """What a bucket that held TOKENS at UPDATED_S holds at NOW_S."""
    return min(capacity, tokens + max(0.0, now_s - updated_s) * refill_per_s)


@dataclass(frozen=True)
class KeyLimits:
    """A key's limits; None means unlimited."""

    rpm: int | None = None
    tpm: int | None = None
    max_concurrency: int | None = None

    def check(self) -> None:
        """Raise ConfigError unless every limit given is at least 1. Zero is refused rather than given a meaning:
        as "unlimited" it would surprise whoever meant "blocked", and the other way round (leave a limit out for
        no limit; `deepserve keys revoke` blocks a key)."""
        for flag, value in (("--rpm", self.rpm), ("--tpm", self.tpm), ("--max-concurrency", self.max_concurrency)):
            if value is not None and value < 1:
                raise ConfigError(
                    f"{flag} {value} is not a limit: give a whole number of at least 1, leave {flag} out for no "
                    "limit, or revoke the key (`deepserve keys revoke NAME`) to refuse all its requests"
                )


class KeyLimiter:
    """One key's buckets and in-flight count."""

    def __init__(self, limits: KeyLimits, clock: Clock = time.monotonic) -> None:
        self.limits = limits
        self.in_flight = 0
        self._requests = TokenBucket(limits.rpm, limits.rpm / 60, clock) if limits.rpm else None
        self._tokens = TokenBucket(limits.tpm, limits.tpm / 60, clock) if limits.tpm else None

    def admit(self, charged_tokens: int) -> None:
        """Count one request that may use CHARGED_TOKENS, or raise RateLimited (charging nothing)."""
        if self.limits.max_concurrency is not None and self.in_flight >= self.limits.max_concurrency:
            raise concurrency_refusal(self.in_flight)
        if self._requests is not None:
            wait_s = self._requests.try_take(1)
            if wait_s:
                raise rpm_refusal(self.limits, wait_s)
        if self._tokens is not None:
            wait_s = self._tokens.try_take(charged_tokens)
            if wait_s:
                if self._requests is not None:
                    self._requests.adjust(1)  # not admitted: the request does not count
                raise tpm_refusal(self.limits, charged_tokens, wait_s)
        self.in_flight += 1

    def release(self, charged_tokens: int, used_tokens: int | None) -> None:
        """The request ended: free its slot and correct the charge with the real usage (when known)."""
        self.in_flight -= 1
        if self._tokens is not None and used_tokens is not None:
            self._tokens.adjust(charged_tokens - used_tokens)


def concurrency_refusal(in_flight: int, where: str = "") -> RateLimited:
    """A key's request refused because IN_FLIGHT of its requests are running (WHERE: across what they count)."""
    return RateLimited(
        f"this key already has {in_flight} requests in flight (its limit{where}); wait for one to finish",
        retry_after_s=1.0,
        reason="key_concurrency",
    )


def rpm_refusal(limits: KeyLimits, wait_s: float) -> RateLimited:
    return RateLimited(
        f"this key's limit of {limits.rpm} requests per minute is reached", retry_after_s=wait_s, reason="key_rpm"
    )


def tpm_refusal(limits: KeyLimits, charged_tokens: int, wait_s: float) -> RateLimited:
    return RateLimited(
        f"this key's limit of {limits.tpm} tokens per minute is reached (this request may use {charged_tokens})",
        retry_after_s=wait_s,
        reason="key_tpm",
    )


def queue_timed_out(timeout_s: float) -> Overloaded:
    return Overloaded(f"no capacity freed within {timeout_s:g} s of queueing; retry later", reason="queue_timeout")


class _QueueTimeout(Exception):
    pass


class AdmissionQueue:
    """At most MAX_CONCURRENCY requests forwarded at once; up to MAX_QUEUE more wait (FIFO) up to TIMEOUT_S.
    A freed slot is handed directly to the oldest waiter, so no newcomer can overtake the queue. Waits are timed by
    CLOCK; a timer per waiter looks when one is due, and `expire_overdue` looks at once (for tests)."""

    def __init__(self, max_concurrency: int, max_queue: int, timeout_s: float, clock: Clock = time.monotonic) -> None:
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.timeout_s = timeout_s
        self.in_flight = 0
        self.waiting = 0
        self._clock = clock
        self._waiters: collections.deque[tuple[float, asyncio.Future[None]]] = collections.deque()  # (deadline, slot)

    async def acquire(self) -> None:
        if self.in_flight < self.max_concurrency and not self.waiting:
            self.in_flight += 1
            return
        if self.waiting >= self.max_queue:
            raise Overloaded(
                f"the gateway is at capacity ({self.in_flight} in flight, {self.waiting} queued); retry later",
                reason="queue_full",
            )
        await self._wait_for_slot()

    async def _wait_for_slot(self) -> None:
        loop = asyncio.get_running_loop()
        slot: asyncio.Future[None] = loop.create_future()
        deadline_s = self._clock() + self.timeout_s
        timer = loop.call_later(self.timeout_s, self._expire_when_due, deadline_s, slot)
        self._waiters.append((deadline_s, slot))
        self.waiting += 1
        try:
            await slot
        except _QueueTimeout:
            raise queue_timed_out(self.timeout_s) from None
        except asyncio.CancelledError:
            if slot.done() and not slot.cancelled() and slot.exception() is None:
                self.release()  # the slot was handed over just as the client went away: pass it on
            raise
        finally:
            timer.cancel()
            self.waiting -= 1

    def release(self) -> None:
        while self._waiters:
            _, slot = self._waiters.popleft()
            if not slot.done():
                slot.set_result(None)  # the slot moves to the waiter: in_flight stays the same
                return
        self.in_flight -= 1

    def expire_overdue(self) -> None:
        """Time out every wait that is past its deadline by the clock."""
        now_s = self._clock()
        while self._waiters and self._waiters[0][0] <= now_s:
            _expire(self._waiters.popleft()[1])

    def _expire_when_due(self, deadline_s: float, slot: asyncio.Future[None]) -> None:
        if slot.done():
            return
        remaining_s = deadline_s - self._clock()
        if remaining_s > 0:  # the loop's timer ran ahead of the clock: look again then
            asyncio.get_running_loop().call_later(remaining_s, self._expire_when_due, deadline_s, slot)
            return
        _expire(slot)


def _expire(slot: asyncio.Future[None]) -> None:
    if not slot.done():
        slot.set_exception(_QueueTimeout())


# ---- the limiter interface ----------------------------------------------------------------------------------------


class Admission:
    """What one admitted request holds, so that `release` gives back exactly that."""

    __slots__ = ("charged_tokens", "has_slot", "key_id", "key_limiter", "lease", "limits", "local")

    def __init__(self, key_id: str | None, limits: KeyLimits | None, charged_tokens: int) -> None:
        self.key_id = key_id
        self.limits = limits
        self.charged_tokens = charged_tokens
        self.has_slot = False  # holds one of the global --max-concurrency slots
        self.key_limiter: KeyLimiter | None = None  # the local limiter that counted it (local path)
        self.lease: str | None = None  # its lease id in Redis (shared path)
        self.local = True  # admitted by this process's own limits (always without Redis; on fallback with it)


class Limiter(Protocol):
    """Admission control as the app uses it (see the module docstring)."""

    # Key ids revoked anywhere (shared limits: announced through Redis). The app's key ring refuses them; it is the
    # same set object, so an announcement takes effect at once. Always empty for limits of this process alone.
    revoked_ids: set[str]

    @property
    def in_flight(self) -> int: ...

    @property
    def waiting(self) -> int: ...

    @property
    def shared(self) -> bool:
        """Whether the limits are shared with other gateways (and `up` means anything)."""
        ...

    @property
    def up(self) -> bool:
        """Whether the shared state answers (always True for limits of this process alone)."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def watch(self, on_fallback: Callable[[], None], on_error: Callable[[], None]) -> None:
        """Call ON_FALLBACK for each request admitted by this process's own limits because the shared state was
        unreachable, ON_ERROR for each failed call to it (the app's metrics count them)."""
        ...

    async def admit(self, key_id: str | None, limits: KeyLimits | None, charged_tokens: int) -> Admission:
        """Count a request against its key's limits (none for an anonymous request), or raise RateLimited."""
        ...

    async def acquire_slot(self, admission: Admission) -> None:
        """Wait (FIFO, bounded) for a global slot, or raise Overloaded."""
        ...

    def release(self, admission: Admission, used_tokens: int | None) -> None:
        """The request ended: free what it held and correct its token charge with USED_TOKENS (when known)."""
        ...

    async def settle(self, timeout_s: float | None = None) -> None:
        """Wait until every release sent so far has taken effect (for at most TIMEOUT_S)."""
        ...

    def expire_overdue(self) -> None:
        """Time out every wait for a slot that is past its deadline by the clock (what the waiters' timers do)."""
        ...

    async def publish_revocation(self, key_id: str, revoked_at: float) -> None:
        """Tell the other gateways that KEY_ID was revoked (nothing to tell for limits of this process alone)."""
        ...


def make_limiter(config: GatewayConfig, clock: Clock = time.monotonic, shared_clock: Clock | None = None) -> Limiter:
    """Limits in this process's memory; shared by the workers of one host (`--workers N`, in memory they all map:
    host_limits.py); or shared by gateways anywhere through Redis with --redis-url. CLOCK times this process's own
    waits (the slot queue, the local and host limits); shared buckets run on Redis's clock, or on SHARED_CLOCK when
    given (a test's)."""
    if not config.redis_url and config.workers > 1:
        from deepserve.gateway.host_limits import HostLimiter, worker_zone_from_environment

        zone, worker = worker_zone_from_environment()
        return HostLimiter(
            zone,
            worker,
            max_concurrency=config.max_concurrency,
            max_queue=config.max_queue,
            queue_timeout_s=config.queue_timeout_s,
            clock=clock,
        )
    if not config.redis_url:
        return LocalLimiter(config.max_concurrency, config.max_queue, config.queue_timeout_s, clock)
    from deepserve.gateway.shared_limits import RedisLimiter  # the redis client: only when limits are shared

    return RedisLimiter(
        config.redis_url,
        max_concurrency=config.max_concurrency,
        max_queue=config.max_queue,
        queue_timeout_s=config.queue_timeout_s,
        lease_s=config.redis_lease_s,
        timeout_s=config.redis_timeout_s,
        fail_open=config.redis_fail_open,
        prefix=config.redis_prefix,
        clock=shared_clock,
        local_clock=clock,
    )


class HostOnlyLifecycle:
    """What every `Limiter` whose limits no other host shares (this process's own, or this host's workers' in shared
    memory) does alike: no Redis that could be down, nothing to start or stop, no revocation to announce
    (gateways on one host read one key database), releases that take effect at once."""

    @property
    def shared(self) -> bool:
        return False

    @property
    def up(self) -> bool:
        return True

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass  # the host-shared zone stays mapped until the process ends: a request cut at shutdown may release later

    def watch(self, on_fallback: Callable[[], None], on_error: Callable[[], None]) -> None:
        pass  # nothing falls back, nothing fails

    async def settle(self, timeout_s: float | None = None) -> None:
        pass

    async def publish_revocation(self, key_id: str, revoked_at: float) -> None:
        pass


class LocalLimiter(HostOnlyLifecycle):
    """This process's own limits: a KeyLimiter per key and one AdmissionQueue. Nothing here suspends except a wait
    for a slot in the queue, so the request path pays no more than it did before the Limiter interface."""

    def __init__(self, max_concurrency: int, max_queue: int, queue_timeout_s: float, clock: Clock = time.monotonic):
        self.queue = AdmissionQueue(max_concurrency, max_queue, queue_timeout_s, clock)
        self.revoked_ids: set[str] = set()
        self._clock = clock
        self._keys: dict[str, KeyLimiter] = {}

    @property
    def in_flight(self) -> int:
        return self.queue.in_flight

    @property
    def waiting(self) -> int:
        return self.queue.waiting

    def expire_overdue(self) -> None:
        """Time out every wait for a slot that is past its deadline by the clock (what the waiters' timers do)."""
        self.queue.expire_overdue()

    async def admit(self, key_id: str | None, limits: KeyLimits | None, charged_tokens: int) -> Admission:
        return self.admit_now(key_id, limits, charged_tokens)

    def admit_now(self, key_id: str | None, limits: KeyLimits | None, charged_tokens: int) -> Admission:
        admission = Admission(key_id, limits, charged_tokens)
        if key_id is not None and limits is not None:
            limiter = self._keys.get(key_id)
            if limiter is None or limiter.limits != limits:
                limiter = self._keys[key_id] = KeyLimiter(limits, self._clock)
            limiter.admit(charged_tokens)
            admission.key_limiter = limiter
        return admission

    async def acquire_slot(self, admission: Admission) -> None:
        await self.queue.acquire()
        admission.has_slot = True

    def release(self, admission: Admission, used_tokens: int | None) -> None:
        if admission.has_slot:
            admission.has_slot = False
            self.queue.release()
        limiter, admission.key_limiter = admission.key_limiter, None
        if limiter is not None:
            limiter.release(admission.charged_tokens, used_tokens)
