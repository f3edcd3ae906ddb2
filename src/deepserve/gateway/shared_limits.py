"""Limits shared by several gateways (`--redis-url`): per-key rpm/tpm buckets, per-key and global concurrency, and
key revocations live in Redis, so that N gateways (replicas behind a load balancer, or `--workers N` on one host)
enforce one limit.

Every decision is one Lua script, which Redis runs atomically: the check and the charge cannot be split by another
gateway's request (no check-then-set race). An admitted request costs two script calls: the admission script (key
limits and, when free, a global slot) and the release script (sent in the background once the request ended). Calls
go out in pipelines (`ScriptBatcher`): alone when no call waits for an answer, and otherwise together with every
call made in the same turn of the event loop, without waiting for the answers in flight, so that under load one
write serves many requests and no admission waits behind another's round trip. The scripts
go over a lean connection of their own (resp.py: redis-py's client work was most of what Redis added per request);
redis-py does the rest (subscriptions, the revocation hash).

Concurrency slots are leases: a sorted-set member whose score is its expiry. The gateway renews its leases every
lease/3 seconds; a gateway that dies stops renewing, and its slots expire after at most `--redis-lease-s` (rounded up
to a whole second: whole-number scores are what Redis stores and compares cheaply), so they never leak. A script
drops a set's expired members before it decides on it when they could change the decision (the set looks full);
until then they only take room, and counting first saves a command on every call.

Time comes from Redis (`TIME`) so that gateways whose clocks differ agree, unless a clock is injected (tests). This
gateway's own waits (a queued request's timeout, the pause after Redis failed, the fallback limits) are timed by
`local_clock`, the gateway's injected clock.

At shutdown (`close`) the releases still on their way to Redis (requests that ended during the drain, streams cut
at its end) get up to `timeout_s` to arrive before the connection closes, so that a stopping gateway's slots and
token refunds are not left to expire.

When Redis cannot be reached the gateway fails closed: 503 `limiter_unavailable`, since admitting without the shared
state would break the limits it promises. With `fail_open` it falls back to this process's own limits
(`LocalLimiter`) instead, logs a warning when that starts and when Redis answers again, and counts each request so
admitted (`deepserve_gateway_limiter_fallbacks_total`). After a connection failure, or TIMEOUTS_TO_DOWN timeouts in a
row, Redis is left alone for RETRY_S, so that requests do not each wait for a connect timeout; a lone timeout fails
only the requests whose calls waited for it.

Revocations: `deepserve keys revoke` writes the key database on one host; every gateway polls its own database and
publishes each revocation it sees to Redis (a hash of revoked ids, and a pub/sub message), and `deepserve keys revoke
--redis-url` publishes at once. Every gateway subscribes, so a revocation on one host is honoured by gateways on other
hosts (with their own copy of the key database) within a second; the hash is re-read on every (re)subscription, so a
message missed while disconnected is not lost."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import hashlib
import itertools
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from deepserve._compat import wait_for_event
from deepserve.gateway.clock import Clock
from deepserve.gateway.errors import LimiterUnavailable, Overloaded, RateLimited
from deepserve.gateway.limits import (
    Admission,
    KeyLimits,
    LocalLimiter,
    concurrency_refusal,
    queue_timed_out,
    rpm_refusal,
    tpm_refusal,
)
from deepserve.gateway.resp import ReplyError, RespConnection

log = logging.getLogger(__name__)

# After a failed connection (or TIMEOUTS_TO_DOWN timeouts in a row), Redis is left alone this long (meanwhile: 503,
# or local limits with fail_open). A single slow answer fails only the calls that waited for it: on a busy host one
# late answer must not refuse every request for a second.
RETRY_S = 1.0
TIMEOUTS_TO_DOWN = 3
# A request waiting for a global slot retries at least this often, in case a release message was missed.
SLOT_POLL_S = 0.1
# The subscriber wakes at least this often (to notice that the gateway stops).
LISTEN_POLL_S = 0.25

_PRELUDE = """
-- Redis's clock, read once and only by the scripts that need it (an injected clock's time comes as ARGV[1])
local now = tonumber(ARGV[1])
local function clock()
  if not now then
    local t = redis.call('TIME')
    now = tonumber(t[1]) + tonumber(t[2]) / 1000000
  end
  return now
end
-- a token bucket stored as {tokens, at}; a missing bucket is a full one
local function refill(key, capacity)
  local state = redis.call('HMGET', key, 'tokens', 'at')
  local tokens = tonumber(state[1])
  if not tokens then return capacity end
  return math.min(capacity, tokens + math.max(0, clock() - tonumber(state[2])) * capacity / 60)
end
local function store(key, capacity, tokens)
  redis.call('HSET', key, 'tokens', tostring(tokens), 'at', tostring(clock()))
  -- full again, the bucket is the same as no bucket: Redis may drop it then
  redis.call('PEXPIRE', key, math.ceil((capacity - tokens) * 60000 / capacity) + 1000)
end
-- when a lease taken (or renewed) now expires: rounded up to a whole second, because Redis stores and compares a
-- whole-number score as an integer, and formats and parses every other score on each insert (most of what a call
-- cost). A lease so lasts up to a second longer, never shorter; the unit stays seconds, as for every version
local function expiry(lease_s) return math.ceil(clock() + lease_s) end
-- the live leases of a set. Expired ones are dropped only when they could make a difference (the set looks full):
-- until then they only take room, and counting first saves a command on every call
local function held(key, max)
  local count = redis.call('ZCARD', key)
  if count >= max then count = count - redis.call('ZREMRANGEBYSCORE', key, '-inf', clock()) end
  return count
end
"""

# KEYS: rpm bucket, tpm bucket, key leases, global leases.
# ARGV: now, lease, lease_s, rpm, tpm, key max concurrency, global max concurrency, charged tokens, want a slot.
# Returns {code, detail}: 0 admitted with a global slot, 1 admitted without one (wait for it), 2 key concurrency
# refused (detail: leases held), 3 rpm refused, 4 tpm refused (detail: seconds until it would pass).
_ADMIT = (
    _PRELUDE
    + """
local lease, lease_s = ARGV[2], tonumber(ARGV[3])
local rpm, tpm, key_max = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local global_max, charge = tonumber(ARGV[7]), tonumber(ARGV[8])
if key_max > 0 then
  local count = held(KEYS[3], key_max)
  if count >= key_max then return {2, tostring(count)} end
end
local rpm_left, tpm_left
if rpm > 0 then
  local tokens = refill(KEYS[1], rpm)
  if tokens < 1 then return {3, tostring((1 - tokens) * 60 / rpm)} end
  rpm_left = tokens - 1
end
if tpm > 0 then
  local tokens = refill(KEYS[2], tpm)
  local needed = math.min(charge, tpm)
  if tokens < needed then return {4, tostring((needed - tokens) * 60 / tpm)} end
  tpm_left = tokens - charge
end
if rpm_left then store(KEYS[1], rpm, rpm_left) end
if tpm_left then store(KEYS[2], tpm, tpm_left) end
local until_s = expiry(lease_s)
local ttl_ms = math.ceil(lease_s * 2000)
if key_max > 0 then
  redis.call('ZADD', KEYS[3], until_s, lease)
  redis.call('PEXPIRE', KEYS[3], ttl_ms)
end
if ARGV[9] == '1' and held(KEYS[4], global_max) < global_max then
  redis.call('ZADD', KEYS[4], until_s, lease)
  redis.call('PEXPIRE', KEYS[4], ttl_ms)
  return {0, '0'}
end
return {1, '0'}
"""
)

# KEYS: global leases. ARGV: now, lease, lease_s, global max concurrency. Returns 1 when the slot was taken.
_TAKE_SLOT = (
    _PRELUDE
    + """
if held(KEYS[1], tonumber(ARGV[4])) >= tonumber(ARGV[4]) then return 0 end
redis.call('ZADD', KEYS[1], expiry(tonumber(ARGV[3])), ARGV[2])
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[3]) * 2000))
return 1
"""
)

# KEYS: tpm bucket, key leases, global leases.
# ARGV: now, lease, tpm, tokens to give back (negative: charge more), held a global slot, global max, channel.
# A slot freed from a full set is announced on the channel, so that gateways with waiting requests retry at once
# (expired leases count as held here: at worst an announcement too many, never one missed).
_RELEASE = (
    _PRELUDE
    + """
local tpm, delta = tonumber(ARGV[3]), tonumber(ARGV[4])
if tpm > 0 and delta ~= 0 then store(KEYS[1], tpm, math.min(tpm, refill(KEYS[1], tpm) + delta)) end
redis.call('ZREM', KEYS[2], ARGV[2])
if ARGV[5] == '1' then
  local full = redis.call('ZCARD', KEYS[3]) >= tonumber(ARGV[6])
  if redis.call('ZREM', KEYS[3], ARGV[2]) == 1 and full then redis.call('PUBLISH', ARGV[7], '1') end
end
return 1
"""
)

# KEYS: lease sets (repeated as needed). ARGV: now, lease_s, then one lease per key. Leases already expired (and
# dropped by another gateway's script) stay dropped: XX only updates members that exist.
_RENEW = (
    _PRELUDE
    + """
local until_s = expiry(tonumber(ARGV[2]))
for i, key in ipairs(KEYS) do redis.call('ZADD', key, 'XX', until_s, ARGV[i + 2]) end
return #KEYS
"""
)


_Call = tuple[str, list[Any], "asyncio.Future[Any]"]  # a script's name, its EVALSHA command, its caller's future


class ScriptBatcher:
    """Calls Lua scripts by hash on a lean connection (resp.py). A call made while no earlier one waits for its
    answer is written at once; calls made while some do are written together at the end of the event loop's turn,
    without waiting for those answers (several writes may be in flight; Redis answers them in order). So the first
    request of a burst is not held back by the others, the rest of the burst goes out in one write, and an admission
    never waits behind the releases of the requests that just ended. Answers reach their callers through callbacks,
    with no task per call. A script missing from Redis's cache (Redis restarted) is loaded again and its calls
    retried once. A failure of the connection fails every call still waiting on it."""

    def __init__(self, connection: RespConnection, sources: dict[str, str]) -> None:
        self._connection = connection
        self._sources = sources
        self._hashes = {name: hashlib.sha1(source.encode()).hexdigest() for name, source in sources.items()}
        self._pending: list[_Call] = []
        self._flush_scheduled = False
        self._in_flight = 0  # writes not answered yet
        self._tasks: set[asyncio.Task[None]] = set()  # sends that wait for a connection or for the scripts' reload
        self.writes = 0  # writes so far, and the calls in them (tests and measurements read them)
        self.calls = 0

    async def load(self) -> None:
        replies = await self._connection.pipeline([("SCRIPT", "LOAD", source) for source in self._sources.values()])
        for reply in replies:
            if isinstance(reply, ReplyError):
                raise reply

    def submit(self, name: str, keys: list[str], args: list[Any]) -> asyncio.Future[Any]:
        """Queue one call; its future gets the script's result (or exception)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._pending.append((name, ["EVALSHA", self._hashes[name], len(keys), *keys, *args], future))
        if not self._in_flight:
            self._flush()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)  # after the callbacks already queued: every call of this turn goes with it
        return future

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        abandoned, self._pending = self._pending, []  # the gateway stops
        for _, _, future in abandoned:
            future.cancel()

    def _flush(self) -> None:
        self._flush_scheduled = False
        batch, self._pending = self._pending, []
        if not batch:
            return
        self.writes += 1
        self.calls += len(batch)
        self._in_flight += 1
        replies = self._connection.send([command for _, command, _ in batch])
        if replies is None:  # no connection yet, or it failed: connect first
            self._spawn(self._connect_and_send(batch))
            return
        replies[-1].add_done_callback(lambda _: self._answered(batch, replies))

    def _answered(self, batch: list[_Call], replies: list[asyncio.Future[Any]]) -> None:
        self._in_flight -= 1  # the last reply is in, so every earlier one is (in order, or failed with it)
        self._deliver(batch, [_outcome(reply) for reply in replies], retry_missing=True)

    async def _connect_and_send(self, batch: list[_Call]) -> None:
        try:
            await self._send(batch, retry_missing=True)
        finally:
            self._in_flight -= 1

    async def _send(self, batch: list[_Call], retry_missing: bool) -> None:
        results: list[Any]
        try:
            results = await self._connection.pipeline([command for _, command, _ in batch])
        except Exception as exc:
            results = [exc] * len(batch)
        except BaseException:  # cancelled: the gateway stops
            for _, _, future in batch:
                future.cancel()
            raise
        self._deliver(batch, results, retry_missing)

    def _deliver(self, batch: list[_Call], results: list[Any], retry_missing: bool) -> None:
        """Give each call its result (an error reply or a failure: as its exception); calls whose script was missing
        go again once it is loaded."""
        missing = []
        for item, result in zip(batch, results, strict=True):
            future = item[2]
            if isinstance(result, ReplyError) and result.no_script and retry_missing:
                missing.append(item)
            elif future.done():
                continue  # its caller went away
            elif isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)
        if missing:
            self._spawn(self._reload_and_send(missing))

    async def _reload_and_send(self, batch: list[_Call]) -> None:
        try:
            await self.load()
        except Exception as exc:
            self._deliver(batch, [exc] * len(batch), retry_missing=False)
            return
        await self._send(batch, retry_missing=False)

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.create_task(coroutine, name="redis-pipeline")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _outcome(reply: asyncio.Future[Any]) -> Any:
    """A reply's value, or the exception that took its place."""
    if reply.cancelled():
        return ConnectionError("the call to Redis was cancelled")
    return reply.exception() or reply.result()


class RedisNames:
    """The Redis keys and channels of one deployment, all under PREFIX (gateways sharing limits share the prefix)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.global_leases = prefix + "leases:global"
        self.revoked = prefix + "revoked"  # hash: key id → unix time of the revocation
        self.revocations = prefix + "revocations"  # channel: a revoked key id
        self.slots = prefix + "slots"  # channel: a global slot was freed from a full set

    def bucket(self, kind: str, key_id: str) -> str:
        return f"{self.prefix}{kind}:{key_id}"

    def key_leases(self, key_id: str) -> str:
        return f"{self.prefix}leases:key:{key_id}"


def redis_where(url: str) -> str:
    """host:port/db of a Redis URL, never its password (for messages and logs)."""
    parts = urlsplit(url)
    return f"{parts.hostname or '?'}:{parts.port or 6379}{parts.path or ''}"


def _redis_failures() -> tuple[type[BaseException], ...]:
    from redis.exceptions import RedisError

    return (RedisError, ReplyError, OSError, asyncio.TimeoutError)


class RedisLimiter:
    """The `Limiter` whose state lives in Redis (see the module docstring); `local` answers while Redis cannot be
    reached, when fail_open is set. Also keeps the set of key ids revoked anywhere (`revoked_ids`)."""

    def __init__(
        self,
        url: str,
        *,
        max_concurrency: int,
        max_queue: int,
        queue_timeout_s: float,
        lease_s: float = 10.0,
        timeout_s: float = 1.0,
        fail_open: bool = False,
        prefix: str = "deepserve:gateway:",
        clock: Clock | None = None,
        local_clock: Clock = time.monotonic,
    ) -> None:
        self.url = url
        self.where = redis_where(url)
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.lease_s = lease_s
        self.timeout_s = timeout_s
        self.fail_open = fail_open
        self.names = RedisNames(prefix)
        self.local = LocalLimiter(max_concurrency, max_queue, queue_timeout_s, local_clock)
        self.revoked_ids: set[str] = set()
        self.up = True
        self.fallbacks = 0  # requests admitted by the local limits because Redis was unreachable
        self.errors = 0  # failed calls to Redis
        self.on_fallback: Callable[[], None] = lambda: None  # the app counts these in its metrics
        self.on_error: Callable[[], None] = lambda: None
        self._clock = clock
        self._local_clock = local_clock
        self._failures = _redis_failures()
        self._down_until = 0.0
        self._timeouts_in_a_row = 0
        self._last_error = ""
        self._lease_ids = itertools.count()
        self._lease_prefix = secrets.token_hex(4) + ":"
        self._held: dict[str, Admission] = {}  # lease → admission, for renewal
        self._waiters: collections.deque[asyncio.Event] = collections.deque()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._releases: set[asyncio.Future[Any]] = set()  # releases not yet answered by Redis
        self._client: Any = None
        self._connection: RespConnection | None = None  # the scripts' (hot path); _client does the rest
        self._scripts: ScriptBatcher | None = None
        self._closing = False

    # ---- lifecycle ----------------------------------------------------------------------------------------------

    async def start(self) -> None:
        import redis.asyncio

        self._client = redis.asyncio.Redis.from_url(
            self.url, socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s, decode_responses=True
        )
        self._connection = RespConnection(self.url, self.timeout_s)
        self._scripts = ScriptBatcher(
            self._connection, {"admit": _ADMIT, "slot": _TAKE_SLOT, "release": _RELEASE, "renew": _RENEW}
        )
        try:
            await self._scripts.load()
            await self.load_revocations()
        except self._failures as exc:
            self.mark_down(exc)
        self._spawn(self._listen(), "redis-listen")
        self._spawn(self._renew_loop(), "redis-lease-renewal")

    async def close(self) -> None:
        self._closing = True  # the listener checks it: redis-py's get_message can swallow a cancellation
        await self.settle(self.timeout_s)  # requests that ended during the drain: their slots and tokens go back
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._scripts is not None:
            await self._scripts.close()
        if self._connection is not None:
            await self._connection.close()
        if self._client is not None:
            await self._client.aclose()

    async def settle(self, timeout_s: float | None = None) -> None:
        """Wait until Redis has answered (or failed) every release sent so far, for at most TIMEOUT_S."""
        if self._releases:
            await asyncio.wait(set(self._releases), timeout=timeout_s)

    def _spawn(self, coroutine: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coroutine, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---- the Limiter interface ----------------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return sum(admission.has_slot for admission in self._held.values()) + self.local.in_flight

    @property
    def waiting(self) -> int:
        return len(self._waiters) + self.local.waiting

    @property
    def shared(self) -> bool:
        return True

    def watch(self, on_fallback: Callable[[], None], on_error: Callable[[], None]) -> None:
        self.on_fallback = on_fallback
        self.on_error = on_error

    async def admit(self, key_id: str | None, limits: KeyLimits | None, charged_tokens: int) -> Admission:
        if not self.reachable():
            return self._fallback(key_id, limits, charged_tokens)
        admission = Admission(key_id, limits, charged_tokens)
        admission.local = False
        admission.lease = lease = self._lease_prefix + str(next(self._lease_ids))
        limits = limits or KeyLimits()
        bucket_id = key_id or "-"
        keys = [
            self.names.bucket("rpm", bucket_id),
            self.names.bucket("tpm", bucket_id),
            self.names.key_leases(bucket_id),
            self.names.global_leases,
        ]
        args = [
            self._now(), lease, self.lease_s, limits.rpm or 0, limits.tpm or 0, limits.max_concurrency or 0,
            self.max_concurrency, charged_tokens, 0 if self._waiters else 1,
        ]  # fmt: skip
        try:
            code, detail = await self._call("admit", keys, args)
        except asyncio.CancelledError:
            self._release_in_background(admission, had_slot=True, delta=0)  # it may have been admitted
            raise
        except self._failures as exc:
            self.mark_down(exc)
            if _is_timeout(exc):  # Redis may have run it after all: give back its leases, if any
                self._release_in_background(admission, had_slot=True, delta=0)
            return self._fallback(key_id, limits, charged_tokens)
        self.mark_up()
        code = int(code)
        if code >= 2:
            raise _refusal(code, float(detail), limits, charged_tokens)
        admission.has_slot = code == 0
        self._held[lease] = admission
        return admission

    async def acquire_slot(self, admission: Admission) -> None:
        if admission.local:
            await self.local.acquire_slot(admission)
            return
        if admission.has_slot:
            return
        if len(self._waiters) >= self.max_queue:
            raise Overloaded(
                f"the gateway is at capacity ({self.max_concurrency} in flight across all gateways, "
                f"{len(self._waiters)} queued here); retry later",
                reason="queue_full",
            )
        await self._wait_for_slot(admission)

    def release(self, admission: Admission, used_tokens: int | None) -> None:
        if admission.local:
            self.local.release(admission, used_tokens)
            return
        assert admission.lease is not None
        self._held.pop(admission.lease, None)
        tpm = admission.limits.tpm if admission.limits else None
        delta = admission.charged_tokens - used_tokens if tpm and used_tokens is not None else 0
        self._release_in_background(admission, admission.has_slot, delta)
        admission.has_slot = False

    # ---- waiting for a global slot ------------------------------------------------------------------------------

    async def _wait_for_slot(self, admission: Admission) -> None:
        """FIFO among this gateway's waiters: only the oldest asks Redis, when woken (a slot was freed here or
        announced by another gateway) or every SLOT_POLL_S; the others wait to become the oldest."""
        deadline = self._local_clock() + self.queue_timeout_s
        woken = asyncio.Event()
        self._waiters.append(woken)
        try:
            while True:
                if self._waiters[0] is woken and await self._take_slot(admission):
                    return
                remaining_s = deadline - self._local_clock()
                if remaining_s <= 0:
                    raise queue_timed_out(self.queue_timeout_s)
                woken.clear()
                wait_s = min(SLOT_POLL_S, remaining_s) if self._waiters[0] is woken else remaining_s
                await wait_for_event(woken, wait_s)
        finally:
            head = self._waiters[0] is woken
            self._waiters.remove(woken)
            if head:
                self._wake_oldest()

    async def _take_slot(self, admission: Admission) -> bool:
        if not self.reachable():
            return await self._local_slot(admission)
        args = [self._now(), admission.lease, self.lease_s, self.max_concurrency]
        try:
            taken = await self._call("slot", [self.names.global_leases], args)
        except asyncio.CancelledError:
            self._release_in_background(admission, had_slot=True, delta=0)
            raise
        except self._failures as exc:
            self.mark_down(exc)
            return await self._local_slot(admission)
        self.mark_up()
        admission.has_slot = bool(int(taken))
        return admission.has_slot

    async def _local_slot(self, admission: Admission) -> bool:
        """Redis went away while this request waited: with fail_open it waits for a local slot instead."""
        if not self.fail_open:
            raise self._unavailable()
        self._count_fallback()
        await self.local.queue.acquire()
        admission.local = True  # from now on it is the local limiter's (its key lease in Redis expires)
        admission.has_slot = True
        assert admission.lease is not None
        self._held.pop(admission.lease, None)
        return True

    def expire_overdue(self) -> None:
        """Make every waiting request look at its deadline now (tests that move the clock call it); the waits on
        local slots (Redis unreachable, fail_open) are timed out the same way."""
        for woken in self._waiters:
            woken.set()
        self.local.expire_overdue()

    def _wake_oldest(self) -> None:
        if self._waiters:
            self._waiters[0].set()

    # ---- talking to Redis ---------------------------------------------------------------------------------------

    def _call(self, name: str, keys: list[str], args: list[Any]) -> asyncio.Future[Any]:
        assert self._scripts is not None, "RedisLimiter.start() was not awaited"
        return self._scripts.submit(name, keys, args)

    def _now(self) -> str:
        return repr(self._clock()) if self._clock is not None else ""

    def _release_in_background(self, admission: Admission, had_slot: bool, delta: int) -> None:
        tpm = admission.limits.tpm if admission.limits else None
        bucket_id = admission.key_id or "-"
        keys = [self.names.bucket("tpm", bucket_id), self.names.key_leases(bucket_id), self.names.global_leases]
        args = [
            self._now(), admission.lease, tpm or 0, delta, 1 if had_slot else 0, self.max_concurrency,
            self.names.slots,
        ]  # fmt: skip
        released = self._call("release", keys, args)
        self._releases.add(released)
        released.add_done_callback(functools.partial(self._released, had_slot))

    def _released(self, had_slot: bool, released: asyncio.Future[Any]) -> None:
        self._releases.discard(released)
        if released.cancelled():  # the gateway stops
            return
        exc = released.exception()
        if exc is not None:  # its leases expire by themselves; only a tpm correction is lost
            if isinstance(exc, self._failures):
                self.mark_down(exc)
            else:
                log.error("releasing a request's limits in Redis failed: %r", exc)
            return
        if had_slot:
            self._wake_oldest()

    async def renew_leases(self) -> None:
        """Push the expiry of every lease this gateway holds lease_s into the future."""
        keys: list[str] = []
        members: list[str] = []
        for lease, admission in self._held.items():
            if admission.limits is not None and admission.limits.max_concurrency and admission.key_id:
                keys.append(self.names.key_leases(admission.key_id))
                members.append(lease)
            if admission.has_slot:
                keys.append(self.names.global_leases)
                members.append(lease)
        if not keys:
            return
        try:
            await self._call("renew", keys, [self._now(), self.lease_s, *members])
        except self._failures as exc:
            self.mark_down(exc)

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            await self.renew_leases()

    async def _listen(self) -> None:
        """Subscribe to slot releases and revocations; after any failure, subscribe again (and re-read the revoked
        set, in case a revocation was published meanwhile)."""
        while not self._closing:
            pubsub = self._client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.names.slots, self.names.revocations)
                await self.load_revocations()
                self.mark_up()
                while not self._closing:
                    message = await pubsub.get_message(timeout=LISTEN_POLL_S)
                    if message is None:
                        continue
                    if message["channel"] == self.names.revocations:
                        self.revoked_ids.add(str(message["data"]))
                    else:
                        self._wake_oldest()
            except self._failures as exc:
                self.mark_down(exc)
                await asyncio.sleep(max(RETRY_S, LISTEN_POLL_S))
            finally:
                with contextlib.suppress(*self._failures):
                    await pubsub.aclose()

    # ---- revocations --------------------------------------------------------------------------------------------

    async def load_revocations(self) -> None:
        self.revoked_ids |= set(await self._client.hkeys(self.names.revoked))

    async def publish_revocation(self, key_id: str, revoked_at: float) -> None:
        """Tell every gateway that KEY_ID is revoked (raises on a Redis failure; the caller retries later)."""
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.hset(self.names.revoked, key_id, repr(revoked_at))
            pipe.publish(self.names.revocations, key_id)
            await pipe.execute()
        self.revoked_ids.add(key_id)

    # ---- Redis unreachable --------------------------------------------------------------------------------------

    def reachable(self) -> bool:
        """Whether to try Redis now: it is up, or it was marked down long enough ago (RETRY_S) to try again."""
        return self.up or self._local_clock() >= self._down_until

    def mark_down(self, exc: BaseException) -> None:
        """A call to Redis failed with EXC: a refused connection takes it out at once, a late answer only the
        TIMEOUTS_TO_DOWN-th in a row."""
        self.errors += 1
        self.on_error()
        self._last_error = f"{type(exc).__name__}: {exc}".rstrip(": ")
        if _is_timeout(exc):
            self._timeouts_in_a_row += 1
            if self._timeouts_in_a_row < TIMEOUTS_TO_DOWN:
                log.warning("the shared limits' Redis at %s answered too late (%s)", self.where, self._last_error)
                return
        self._down_until = self._local_clock() + RETRY_S
        if self.up:
            self.up = False
            then = "this gateway's own limits apply meanwhile" if self.fail_open else "requests get 503 meanwhile"
            log.warning("the shared limits' Redis at %s failed (%s); %s", self.where, self._last_error, then)

    def mark_up(self) -> None:
        """A call to Redis was answered in time."""
        self._timeouts_in_a_row = 0
        if not self.up:
            self.up = True
            log.warning("the shared limits' Redis at %s answers again", self.where)

    def _fallback(self, key_id: str | None, limits: KeyLimits | None, charged_tokens: int) -> Admission:
        if not self.fail_open:
            raise self._unavailable()
        admission = self.local.admit_now(key_id, limits, charged_tokens)
        self._count_fallback()
        return admission

    def _count_fallback(self) -> None:
        self.fallbacks += 1
        self.on_fallback()

    def _unavailable(self) -> LimiterUnavailable:
        return LimiterUnavailable(
            f"the gateway's limits are shared through Redis at {self.where}, which cannot be reached "
            f"({self._last_error or 'no answer'}); requests are refused until it answers (an operator can start "
            "the gateway with --redis-fail-open to fall back to per-gateway limits instead)"
        )


def _is_timeout(exc: BaseException) -> bool:
    from redis.exceptions import TimeoutError as RedisTimeout

    return isinstance(exc, (RedisTimeout, asyncio.TimeoutError, TimeoutError))


def _refusal(code: int, wait_s: float, limits: KeyLimits, charged_tokens: int) -> RateLimited:
    if code == 2:
        return concurrency_refusal(int(wait_s), where=", across all gateways")
    if code == 3:
        return rpm_refusal(limits, wait_s)
    return tpm_refusal(limits, charged_tokens, wait_s)


def publish_revocation_now(url: str, prefix: str, key_id: str, revoked_at: float, timeout_s: float = 2.0) -> None:
    """The same as RedisLimiter.publish_revocation, from a short-lived process (`deepserve keys revoke`)."""
    import redis

    names = RedisNames(prefix)
    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        with client.pipeline(transaction=True) as pipe:
            pipe.hset(names.revoked, key_id, repr(revoked_at))
            pipe.publish(names.revocations, key_id)
            pipe.execute()
    finally:
        client.close()
