"""Limits shared through a real Redis (`--redis-url`): several gateways enforce one rpm/tpm/concurrency limit, slots
of a dead gateway expire, a revocation on one host is honoured by the others, and an unreachable Redis fails closed
(or open, when asked), and a gateway that stops gives back what its requests held. Gateways run in this process with
a shared injected clock, so that no test waits for a bucket to refill; the process-level tests use Redis's own clock
and bound what they assert by the time they took. Messages between gateways travel through a real Redis: a test
waits for them with a bound for a loaded machine, not a measurement."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from deepserve.cli.main import main
from deepserve.gateway import shared_limits
from deepserve.gateway.app import GatewayApp
from deepserve.gateway.keys import KeyRing, KeyStore
from deepserve.gateway.ledger import UsageLedger
from deepserve.gateway.limits import KeyLimits, make_limiter
from deepserve.gateway.server import running_gateway
from deepserve.gateway.shared_limits import RedisLimiter
from deepserve.net import free_port
from tests.helpers import FAKE_MODEL, Child, FakeClock, until

from .conftest import (
    RedisServer,
    gateway_config,
    prompt_estimate,
    start_gateway,
    start_redis_server,
    start_upstream,
    stop_redis_server,
    upstream,
)

CHAT = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


# How long a message through Redis (a revocation) may take to arrive on a machine at load 10-20.
DELIVERY_BOUND_S = 30.0


@contextlib.asynccontextmanager
async def shared_gateway(
    upstream: str, redis_url: str, clock: FakeClock | None, home: Path | None = None, **fields: object
) -> AsyncIterator[tuple[GatewayApp, httpx.AsyncClient]]:
    """A gateway in this process whose limits live in REDIS_URL (keys from HOME's database, if given)."""
    config = gateway_config(upstream, redis_url=redis_url, **fields)
    keyring = KeyRing(KeyStore(home / "keys.sqlite")) if home else None
    ledger = UsageLedger(home / "usage.sqlite") if home else None
    app = GatewayApp(config, keyring=keyring, ledger=ledger, limiter=make_limiter(config, shared_clock=clock))
    try:
        async with running_gateway(config, app) as (_, url), httpx.AsyncClient(base_url=url, timeout=30) as client:
            yield app, client
    finally:
        if ledger is not None:
            ledger.close()
        if keyring is not None:
            keyring.source.close()


def copy_key_database(source: Path, target: Path) -> None:
    with sqlite3.connect(source) as original, sqlite3.connect(target) as copy:
        original.backup(copy)


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def test_two_gateways_on_one_rpm_5_key_let_5_requests_through_together(redis_server: RedisServer) -> None:
    _, secret = KeyStore().create("shared", KeyLimits(rpm=5))
    clock = FakeClock()
    async with (
        upstream() as fake,
        shared_gateway(fake.base_url, redis_server.url, clock) as (_, first),
        shared_gateway(fake.base_url, redis_server.url, clock) as (_, second),
    ):
        statuses = [
            (await client.post("/chat/completions", json=CHAT, headers=bearer(secret))).status_code
            for _ in range(10)
            for client in (first, second)
        ]
        assert statuses.count(200) == 5 and statuses.count(429) == 15
        assert fake.app.stats.requests == 5
        refused = await second.post("/chat/completions", json=CHAT, headers=bearer(secret))
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert refused.headers["retry-after"] == "12"  # one request every 60/5 s
        clock.now_s += 12  # one more token in the shared bucket: one more request, through either gateway
        assert (await first.post("/chat/completions", json=CHAT, headers=bearer(secret))).status_code == 200
        assert (await second.post("/chat/completions", json=CHAT, headers=bearer(secret))).status_code == 429


async def test_tokens_per_minute_are_shared_and_corrected_with_the_real_usage(redis_server: RedisServer) -> None:
    _, secret = KeyStore().create("tokens", KeyLimits(tpm=1000))
    clock = FakeClock()
    big = {**CHAT, "max_tokens": 700}  # charged 700 + the prompt's estimate on admission
    async with (
        upstream() as served,
        shared_gateway(served.base_url, redis_server.url, clock) as (_, first),
        shared_gateway(served.base_url, redis_server.url, clock) as (_, second),
    ):
        admitted = await first.post("/chat/completions", json={**big, "stream": True}, headers=bearer(secret))
        assert admitted.status_code == 200  # the fake used all 700 tokens, and reported them
        refused = await second.post("/chat/completions", json=big, headers=bearer(secret))
        assert refused.status_code == 429 and "tokens per minute" in refused.json()["error"]["message"]
        small = {**CHAT, "max_tokens": 5}
        assert (await second.post("/chat/completions", json=small, headers=bearer(secret))).status_code == 200


async def test_a_keys_concurrency_is_counted_across_gateways(redis_server: RedisServer) -> None:
    _, secret = KeyStore().create("one-at-a-time", KeyLimits(max_concurrency=1))
    async with (
        upstream(itl_ms=20) as served,
        shared_gateway(served.base_url, redis_server.url, FakeClock()) as (_, first),
        shared_gateway(served.base_url, redis_server.url, FakeClock()) as (_, second),
    ):
        request = {**CHAT, "max_tokens": 150, "stream": True}  # 3 s of tokens: the other gateway's call falls within
        async with first.stream("POST", "/chat/completions", json=request, headers=bearer(secret)) as streaming:
            assert streaming.status_code == 200
            busy = await second.post("/chat/completions", json=CHAT, headers=bearer(secret))
            assert busy.status_code == 429 and "in flight" in busy.json()["error"]["message"]
            await streaming.aread()
        assert (await second.post("/chat/completions", json=CHAT, headers=bearer(secret))).status_code == 200


async def test_global_concurrency_is_one_limit_and_a_freed_slot_wakes_the_other_gateway(
    redis_server: RedisServer,
) -> None:
    async with (
        upstream(itl_ms=20) as fake,
        shared_gateway(fake.base_url, redis_server.url, None, max_concurrency=1) as (_, first),
        shared_gateway(fake.base_url, redis_server.url, None, max_concurrency=1) as (second_app, second),
    ):
        request = {**CHAT, "max_tokens": 150, "stream": True}  # 3 s of tokens: the other request queues meanwhile
        async with first.stream("POST", "/chat/completions", json=request) as streaming:
            assert streaming.status_code == 200
            queued = asyncio.create_task(second.post("/chat/completions", json=CHAT))
            await until(lambda: second_app.limiter.waiting == 1)
            assert fake.app.stats.requests == 1  # it waits: the one slot is taken
            await streaming.aread()
        response = await queued
        assert response.status_code == 200 and fake.app.stats.requests == 2
        assert second_app.limiter.in_flight == 0 and second_app.limiter.waiting == 0


async def test_a_stream_cut_at_shutdown_gives_back_its_slot_and_is_billed_what_it_delivered(
    redis_server: RedisServer,
) -> None:
    """The drain on a gateway whose limits live in Redis: a stream cut after 2 events (its role chunk and a token:
    the upstream stalls after one) is charged its prompt estimate plus those 2 (the rest of its admission charge goes
    back), a request cut while it waited for the one global slot is charged nothing, and the slot is free again."""
    _, secret = KeyStore().create("tokens", KeyLimits(tpm=1000))
    clock = FakeClock()  # the shared buckets do not refill while the test runs
    async with (
        upstream(cut_fraction=1.0, cut_mode="stall", cut_after_tokens=1) as served,
        shared_gateway(served.base_url, redis_server.url, clock, max_concurrency=1) as (app, client),
    ):
        stream = {**CHAT, "max_tokens": 900, "stream": True}
        received = b""
        async with client.stream("POST", "/chat/completions", json=stream, headers=bearer(secret)) as response:
            chunks = response.aiter_raw()
            while received.count(b"data:") < 2:
                received += await anext(chunks)
            queued = asyncio.create_task(
                client.post("/chat/completions", json={**CHAT, "max_tokens": 50}, headers=bearer(secret))
            )
            await until(lambda: app.limiter.waiting == 1)
            assert app.cut_in_flight("the test ends it") == 2  # what the drain does when the grace period ends
            received += b"".join([chunk async for chunk in chunks])
        assert b'"gateway_shutdown"' in received and (await queued).status_code == 503
        await until(lambda: app.requests_in_flight == 0)
        await app.limiter.settle()
        assert app.limiter.in_flight == 0 and app.limiter.waiting == 0
        estimate = prompt_estimate(CHAT)
        left = 1000 - (estimate + 2)  # what the cut stream cost; the queued request cost nothing
        over = await client.post("/chat/completions", json={**CHAT, "max_tokens": left - estimate + 1},
                                 headers=bearer(secret))  # fmt: skip
        assert over.status_code == 429
        exact = {**CHAT, "max_tokens": left - estimate}
        assert (await client.post("/chat/completions", json=exact, headers=bearer(secret))).status_code == 200


async def test_closing_sends_the_releases_still_on_their_way(redis_server: RedisServer) -> None:
    """A gateway that stops right after its last requests ended (the drain) gives their slots back at once instead
    of leaving them to expire with their leases."""
    import redis

    limiter = RedisLimiter(redis_server.url, max_concurrency=4, max_queue=4, queue_timeout_s=5, lease_s=600)
    await limiter.start()
    admission = await limiter.admit("k", KeyLimits(max_concurrency=1), 1)
    await limiter.acquire_slot(admission)
    assert admission.has_slot and not admission.local
    limiter.release(admission, 1)
    await limiter.close()  # at once: the release has not even been sent yet
    client = redis.Redis.from_url(redis_server.url)
    try:
        assert client.zcard(limiter.names.global_leases) == 0
        assert client.zcard(limiter.names.key_leases("k")) == 0
    finally:
        client.close()


async def test_a_queued_request_times_out_by_the_gateways_clock(redis_server: RedisServer) -> None:
    """The wait for a global slot is timed by the gateway's injected clock (local_clock), here and in the local
    fallback: the test moves it past the queue timeout and asks the waiters to look."""
    from deepserve.gateway.errors import Overloaded

    local_clock = FakeClock()
    limiter = RedisLimiter(
        redis_server.url, max_concurrency=1, max_queue=4, queue_timeout_s=30, local_clock=local_clock
    )
    await limiter.start()
    try:
        holder = await limiter.admit(None, None, 1)
        await limiter.acquire_slot(holder)
        waiter = await limiter.admit(None, None, 1)
        waiting = asyncio.create_task(limiter.acquire_slot(waiter))
        await until(lambda: limiter.waiting == 1)
        local_clock.now_s += 29.9
        limiter.expire_overdue()
        await asyncio.wait({waiting}, timeout=0.3)  # it asks Redis again, is refused, and waits on
        assert not waiting.done()
        local_clock.now_s += 0.1
        limiter.expire_overdue()
        with pytest.raises(Overloaded, match="within 30 s"):
            await waiting
        limiter.release(waiter, None)
        limiter.release(holder, None)
    finally:
        await limiter.close()


async def test_a_dead_gateways_slots_expire_and_a_live_ones_are_renewed(redis_server: RedisServer) -> None:
    clock = FakeClock()
    limits = KeyLimits(max_concurrency=1)
    alive = RedisLimiter(redis_server.url, max_concurrency=8, max_queue=8, queue_timeout_s=5, lease_s=10, clock=clock)
    dying = RedisLimiter(redis_server.url, max_concurrency=8, max_queue=8, queue_timeout_s=5, lease_s=10, clock=clock)
    await alive.start()
    await dying.start()
    try:
        held = await dying.admit("k", limits, 1)
        await dying.acquire_slot(held)
        await dying.close()  # the process dies: nothing released, nothing renewed
        with pytest.raises(Exception, match="in flight"):
            await alive.admit("k", limits, 1)
        clock.now_s += 10.5  # past the lease
        mine = await alive.admit("k", limits, 1)
        for _ in range(5):  # 25 s: far past one lease, but renewed every 5 s
            clock.now_s += 5
            await alive.renew_leases()
        with pytest.raises(Exception, match="in flight"):
            await alive.admit("k", limits, 1)
        alive.release(mine, None)
        await alive.settle()  # the release is sent in the background
        assert (await alive.admit("k", limits, 1)).lease is not None
    finally:
        await alive.close()


async def test_hundreds_of_concurrent_requests_go_through_a_few_connections(redis_server: RedisServer) -> None:
    """Each script call on its own pooled connection ran out of redis-py's 100 connections at about 64 concurrent
    requests (MaxConnectionsError: every request a 503); calls made together go out in one pipeline instead."""
    import redis

    limiter = RedisLimiter(redis_server.url, max_concurrency=10_000, max_queue=10, queue_timeout_s=5)
    await limiter.start()
    limits = KeyLimits(rpm=10**6, tpm=10**9, max_concurrency=10**4)
    try:

        async def one() -> bool:
            admission = await limiter.admit("busy", limits, 10)
            await limiter.acquire_slot(admission)
            await asyncio.sleep(0)
            limiter.release(admission, 5)
            return admission.has_slot is False and not admission.local

        assert all(await asyncio.gather(*(one() for _ in range(500))))
        assert limiter.errors == 0 and limiter.up
        client = redis.Redis.from_url(redis_server.url)
        try:
            assert len(client.client_list()) <= 4  # the pipeline's, the subscriber's, and this one
        finally:
            client.close()
    finally:
        await limiter.close()


async def test_a_bursts_first_call_goes_at_once_and_the_rest_in_one_write_without_waiting(
    redis_server: RedisServer,
) -> None:
    """The first request of a burst is not held back by the others, and the others do not wait for its answer (nor
    for any earlier write's: e.g. the releases of the requests that just ended)."""
    from deepserve.gateway.resp import RespConnection

    from .test_resp_connection import BUSY_SCRIPT

    connection = RespConnection(redis_server.url, 5.0)
    batcher = shared_limits.ScriptBatcher(connection, {"busy": BUSY_SCRIPT, "echo": "return ARGV[1]"})
    try:
        await batcher.load()
        busy = batcher.submit("busy", [], [])
        assert (batcher.writes, batcher.calls) == (1, 1)  # written before this turn of the loop ends
        echoes = [batcher.submit("echo", [], [i]) for i in range(10)]
        await asyncio.sleep(0)
        assert (batcher.writes, batcher.calls) == (2, 11)  # the rest of the turn, together
        assert not busy.done()  # ... while Redis still runs the first
        assert await asyncio.gather(busy, *echoes) == ["done", *map(str, range(10))]
        later = batcher.submit("echo", [], ["alone"])
        assert batcher.writes == 3 and await later == "alone"  # idle again: at once
    finally:
        await batcher.close()
        await connection.close()


async def test_leases_expire_on_a_whole_second_and_expired_ones_go_when_the_set_is_full(
    redis_server: RedisServer,
) -> None:
    import redis

    clock = FakeClock(1000.25)
    limits = KeyLimits(max_concurrency=2)
    alive = RedisLimiter(redis_server.url, max_concurrency=8, max_queue=8, queue_timeout_s=5, lease_s=10, clock=clock)
    dying = RedisLimiter(redis_server.url, max_concurrency=8, max_queue=8, queue_timeout_s=5, lease_s=10, clock=clock)
    await alive.start()
    await dying.start()
    client = redis.Redis.from_url(redis_server.url)
    key_leases = alive.names.key_leases("k")
    try:
        held = await dying.admit("k", limits, 1)
        lease = held.lease
        assert held.has_slot and lease is not None
        # 1010.25 rounded up: a whole-number score (cheap for Redis), never a shorter lease
        assert client.zscore(key_leases, lease) == client.zscore(alive.names.global_leases, lease) == 1011
        await dying.close()  # dies holding it
        clock.now_s += 11  # past its lease
        first = await alive.admit("k", limits, 1)
        assert client.zcard(key_leases) == 2  # the expired lease made no difference yet: still there
        second = await alive.admit("k", limits, 1)  # the set looked full: the expired lease went, then it counted
        assert client.zcard(key_leases) == 2 and client.zscore(key_leases, lease) is None
        with pytest.raises(Exception, match="2 requests in flight"):
            await alive.admit("k", limits, 1)
        for admission in (first, second):
            alive.release(admission, None)
        await alive.settle()
        assert client.zcard(key_leases) == 0 and client.zcard(alive.names.global_leases) == 1  # the dead one's
    finally:
        client.close()
        await alive.close()


async def test_scripts_lost_by_a_restarted_redis_are_loaded_again(redis_server: RedisServer) -> None:
    import redis

    limiter = RedisLimiter(redis_server.url, max_concurrency=100, max_queue=10, queue_timeout_s=5)
    await limiter.start()
    try:
        for together in (1, 20):  # one call alone, and calls sent together in a pipeline
            client = redis.Redis.from_url(redis_server.url)
            client.script_flush()  # what a Redis restart does to the script cache
            client.close()
            admissions = await asyncio.gather(*(limiter.admit("k", KeyLimits(rpm=1000), 1) for _ in range(together)))
            assert all(admission.has_slot and not admission.local for admission in admissions)
            for admission in admissions:
                limiter.release(admission, 1)
        assert limiter.errors == 0
    finally:
        await limiter.close()


async def test_a_revocation_on_one_host_is_pushed_to_another(redis_server: RedisServer, tmp_path: Path) -> None:
    host_a, host_b = tmp_path / "a", tmp_path / "b"
    host_a.mkdir()
    host_b.mkdir()
    store = KeyStore(host_a / "keys.sqlite")
    _, secret = store.create("team")
    _, other = store.create("other")
    store.close()
    copy_key_database(host_a / "keys.sqlite", host_b / "keys.sqlite")  # host B has a copy, as a deployment would
    async with (
        upstream() as served,
        shared_gateway(served.base_url, redis_server.url, None, home=host_a, require_keys=True) as (app_a, first),
        shared_gateway(served.base_url, redis_server.url, None, home=host_b, require_keys=True) as (app_b, second),
    ):
        assert (await second.post("/chat/completions", json=CHAT, headers=bearer(secret))).status_code == 200
        KeyStore(host_a / "keys.sqlite").revoke("team")  # `deepserve keys revoke team` on host A
        await app_a.refresh_keys()  # what gateway A's once-a-second poll does
        assert (await first.post("/chat/completions", json=CHAT, headers=bearer(secret))).status_code == 401
        shared = app_b.limiter.revoked_ids
        await until(lambda: bool(shared), DELIVERY_BOUND_S)  # pushed by Redis (pub/sub): no poll interval to wait
        status = (await second.post("/chat/completions", json=CHAT, headers=bearer(secret))).status_code
        assert status == 401  # host B's database still lists the key as active
        assert (await second.post("/chat/completions", json=CHAT, headers=bearer(other))).status_code == 200


async def test_keys_revoke_with_redis_url_tells_the_gateways_at_once(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    other_host = tmp_path / "other-host"
    other_host.mkdir()
    _, secret = KeyStore().create("team")
    copy_key_database(KeyStore().path, other_host / "keys.sqlite")
    async with (
        upstream() as served,
        shared_gateway(served.base_url, redis_server.url, None, home=other_host, require_keys=True) as (app, client),
    ):
        assert (await client.post("/chat/completions", json=CHAT, headers=bearer(secret))).status_code == 200
        assert main(["keys", "revoke", "team", "--redis-url", redis_server.url]) == 0
        assert "published the revocation" in capsys.readouterr().out
        await until(lambda: bool(app.limiter.revoked_ids), DELIVERY_BOUND_S)
        assert (await client.post("/chat/completions", json=CHAT, headers=bearer(secret))).status_code == 401


def test_a_late_answer_fails_its_own_calls_and_only_three_in_a_row_take_redis_out() -> None:
    """On a busy host one answer later than --redis-timeout-s must not refuse every request for a second; a refused
    connection, or three late answers in a row, do."""
    import redis

    limiter = RedisLimiter("redis://127.0.0.1:1/0", max_concurrency=1, max_queue=1, queue_timeout_s=1)
    for _ in range(2):
        limiter.mark_down(redis.exceptions.TimeoutError("Timeout reading from socket"))
    assert limiter.up and limiter.reachable() and limiter.errors == 2
    limiter.mark_up()  # an answer in time resets the count
    for _ in range(2):
        limiter.mark_down(redis.exceptions.TimeoutError("Timeout reading from socket"))
    assert limiter.up
    limiter.mark_down(redis.exceptions.TimeoutError("Timeout reading from socket"))
    assert not limiter.up and not limiter.reachable()
    refused = RedisLimiter("redis://127.0.0.1:1/0", max_concurrency=1, max_queue=1, queue_timeout_s=1)
    refused.mark_down(redis.exceptions.ConnectionError("Connection refused"))
    assert not refused.up and not refused.reachable()


async def test_unreachable_redis_fails_closed_with_a_clear_503() -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    async with (
        upstream() as fake,
        shared_gateway(fake.base_url, dead, None) as (app, client),
    ):
        response = await client.post("/chat/completions", json=CHAT)
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        error = response.json()["error"]
        assert error["code"] == "limiter_unavailable"
        assert "Redis at 127.0.0.1" in error["message"] and "--redis-fail-open" in error["message"]
        assert fake.app.stats.requests == 0
        metrics = app.metrics.render().decode()
        assert "deepserve_gateway_redis_up 0.0" in metrics
        assert 'deepserve_gateway_rejections_total{reason="limiter_unavailable"}' in metrics


async def test_fail_open_uses_local_limits_with_a_warning_and_a_metric_and_recovers(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(shared_limits, "RETRY_S", 0.0)  # try Redis again on every request
    port = free_port()
    _, secret = KeyStore().create("limited", KeyLimits(rpm=2))
    async with (
        upstream() as fake,
        shared_gateway(fake.base_url, f"redis://127.0.0.1:{port}/0", None, redis_fail_open=True) as (app, client),
    ):
        statuses = [
            (await client.post("/chat/completions", json=CHAT, headers=bearer(secret))).status_code for _ in range(3)
        ]
        assert statuses == [200, 200, 429]  # the key's limits still hold, in this process
        assert "this gateway's own limits apply" in caplog.text
        metrics = app.metrics.render().decode()
        assert "deepserve_gateway_limiter_fallbacks_total 2.0" in metrics
        assert "deepserve_gateway_redis_errors_total" in metrics
        server = start_redis_server(port)  # Redis comes back
        try:
            response = await client.post("/chat/completions", json=CHAT)
            assert response.status_code == 200 and app.limiter.up
            assert "answers again" in caplog.text
        finally:
            stop_redis_server(server)
        assert fake.app.stats.requests == 3


def test_two_gateway_processes_share_one_rpm_limit(redis_server: RedisServer, children: list[Child]) -> None:
    """Real processes on Redis's clock: 5 admitted at once, and at most one more per 12 s the test took."""
    _, secret = KeyStore().create("processes", KeyLimits(rpm=5))
    fake = start_upstream()
    children.append(fake)
    gateways = [start_gateway(gateway_config(fake.url, redis_url=redis_server.url)) for _ in range(2)]
    children.extend(gateways)
    started = time.monotonic()
    statuses = []
    with httpx.Client(timeout=30) as client:
        for index in range(16):
            url = gateways[index % 2].url + "/chat/completions"
            body = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            statuses.append(client.post(url, json=body, headers=bearer(secret)).status_code)
    refills = int((time.monotonic() - started) / 12)
    assert 5 <= statuses.count(200) <= 5 + refills
    assert statuses.count(200) + statuses.count(429) == 16
