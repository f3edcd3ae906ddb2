"""Faults and load: retries, a replica killed under load, a replica that hangs, client disconnects, streams cut at
shutdown, overload, and a 10,000-request soak."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import httpx
import psutil
import pytest

from deepserve.gateway.app import GatewayApp
from deepserve.gateway.balancing import rendezvous
from deepserve.gateway.fake_upstream import FAKE_MODEL, FakeBehaviour, FakeUpstream, running_fake_upstream
from deepserve.gateway.server import running_gateway

from .conftest import Child, FakeClock, fake_and_gateway, gateway_config, ledger_rows, start_fake, start_gateway, until

CHAT = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_failing_replica_is_retried_on_another(stream: bool) -> None:
    async with (
        running_fake_upstream(FakeBehaviour(fail_status=500)) as (broken, broken_url),
        running_fake_upstream() as (good, good_url),
        running_gateway(gateway_config(broken_url, good_url, balancing="round_robin")) as (app, url),
        httpx.AsyncClient(base_url=url) as client,
    ):
        responses = [await client.post("/chat/completions", json={**CHAT, "stream": stream}) for _ in range(10)]
        assert [response.status_code for response in responses] == [200] * 10
        assert all(response.text.endswith("data: [DONE]\n\n") == stream for response in responses)
        assert broken.stats.requests >= 4 and good.stats.completed == 10
        assert "deepserve_gateway_retries_total" in app.metrics.render().decode()


async def test_upstream_4xx_is_passed_through_and_not_retried() -> None:
    async with (
        running_fake_upstream(FakeBehaviour(fail_status=422)) as (first, first_url),
        running_fake_upstream(FakeBehaviour(fail_status=422)) as (second, second_url),
        running_gateway(gateway_config(first_url, second_url)) as (_, url),
        httpx.AsyncClient(base_url=url) as client,
    ):
        response = await client.post("/chat/completions", json=CHAT)
        assert response.status_code == 422
        assert response.json()["error"]["message"] == "injected failure"
        assert first.stats.requests + second.stats.requests == 1


async def test_client_disconnect_mid_stream_aborts_the_upstream_and_records_the_tokens_delivered() -> None:
    gate = asyncio.Semaphore(3)  # the fake produces three tokens, then one per release
    async with fake_and_gateway(FakeBehaviour(token_gate=gate)) as (fake, app, client):
        request = {**CHAT, "max_tokens": 200, "stream": True}
        received = b""
        async with client.stream("POST", "/chat/completions", json=request) as response:
            async for chunk in response.aiter_raw():
                received += chunk
                if received.count(b"data:") == 3:
                    break  # three tokens, then hang up
        await until(lambda: not app._in_flight)  # the gateway saw the disconnect and accounted for the request
        for _ in range(200):
            gate.release()  # let the fake go on: it finds its client gone
        await until(lambda: fake.stats.aborted == 1)
        assert fake.stats.completed == 0
        assert 'status="499"' in app.metrics.render().decode()
        assert app.limiter.in_flight == 0 and all(r.outstanding == 0 for r in app.pool.replicas)
        assert app.ledger is not None and app.ledger.flush()
    assert ledger_rows("status, completion_tokens, error") == [(499, 3, "client disconnected")]


async def test_cut_in_flight_ends_streams_with_an_error_event_and_records_them_cut() -> None:
    gate = asyncio.Semaphore(2)
    async with fake_and_gateway(FakeBehaviour(token_gate=gate), max_concurrency=1) as (_, app, client):
        received = b""
        async with client.stream("POST", "/chat/completions", json={**CHAT, "stream": True}) as response:
            chunks = response.aiter_raw()
            while received.count(b"data:") < 2:
                received += await asyncio.wait_for(anext(chunks), 10)
            queued = asyncio.create_task(client.post("/chat/completions", json=CHAT))  # waits for the one slot
            await until(lambda: app.limiter.waiting == 1)
            assert app.cut_in_flight("the test ends it") == 2  # what the drain does when the grace period ends
            received += b"".join([chunk async for chunk in chunks])  # ends cleanly: the chunked terminator came
        events = [event for event in received.split(b"\n\n") if event]
        error = json.loads(events[-1].removeprefix(b"data: "))["error"]
        assert error["code"] == "gateway_shutdown" and "the test ends it" in error["message"]
        answer = await queued
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "gateway_shutdown"
        await until(lambda: not app._in_flight)
        assert app.ledger is not None and app.ledger.flush()
    rows = ledger_rows("stream, status, completion_tokens, error")
    assert sorted(rows) == [(0, 503, None, "cut: the test ends it"), (1, 503, 2, "cut: the test ends it")]


async def test_a_queued_request_times_out_by_the_gateways_clock() -> None:
    """The local limiter's queue runs on the clock the app was given: no real wait for the queue timeout."""
    clock = FakeClock()
    gate = asyncio.Semaphore(1)
    behaviour = FakeBehaviour(token_gate=gate)
    async with (
        fake_and_gateway(behaviour, clock=clock, max_concurrency=1, queue_timeout_s=30) as (_, app, client),
        client.stream("POST", "/chat/completions", json={**CHAT, "stream": True}) as response,
    ):
        chunks = response.aiter_raw()
        assert b"data:" in await anext(chunks)  # it holds the one slot
        queued = asyncio.create_task(client.post("/chat/completions", json=CHAT))
        await until(lambda: app.limiter.waiting == 1)
        clock.now_s += 30
        app.limiter.expire_overdue()  # type: ignore[attr-defined]  # what the waiter's timer does
        answer = await queued
        for _ in range(100):
            gate.release()
        assert answer.status_code == 503 and "within 30 s of queueing" in answer.json()["error"]["message"]


def _session_for(replica: object, replicas: list[object]) -> str:
    """A session id that session_affinity routes to REPLICA."""
    return next(s for s in (f"session-{n}" for n in range(1000)) if rendezvous(s, replicas) is replica)  # type: ignore[arg-type]


async def test_a_silent_replica_is_taken_out_at_its_first_timeout_and_its_waiting_requests_move() -> None:
    """A replica that accepts requests and answers nothing (alive, but silent): a stream waits at most the
    first-byte timeout, the replica leaves rotation at once, and every request waiting on it moves to the other."""
    clock = FakeClock()
    async with (
        running_fake_upstream() as (silent, silent_url),
        running_fake_upstream() as (good, good_url),
    ):
        config = gateway_config(silent_url, good_url, balancing="session_affinity", health_check_interval_s=3600)
        app = GatewayApp(config, clock=clock)
        async with running_gateway(config, app) as (_, url), httpx.AsyncClient(base_url=url, timeout=30) as client:
            hung = app.pool.replicas[0]
            session = {"x-session-id": _session_for(hung, app.pool.replicas)}
            silent.behaviour.silent = True
            plain = asyncio.create_task(client.post("/chat/completions", json=CHAT, headers=session))
            stream_body = {**CHAT, "stream": True}
            streamed = asyncio.create_task(client.post("/chat/completions", json=stream_body, headers=session))
            waiting = app.pool.client._all
            await until(lambda: sum(c.awaiting_head for c in waiting) == 2)  # both sent to the silent replica
            assert hung.outstanding == 2
            clock.now_s += config.first_byte_timeout_s
            app.pool.client.check_timeouts()  # what the stream's timer does after first_byte_timeout_s
            for response in await asyncio.gather(plain, streamed):
                assert response.status_code == 200
            assert streamed.result().text.endswith("data: [DONE]\n\n")
            assert not hung.healthy and good.stats.completed == 2
            assert "deepserve_gateway_retries_total 2.0" in app.metrics.render().decode()
            assert (await client.post("/chat/completions", json=CHAT, headers=session)).status_code == 200
            assert good.stats.completed == 3  # out of rotation: not even tried
            silent.behaviour.silent = False
            await app.pool.check_all()  # its health check passes: back in rotation
            assert hung.healthy
            assert (await client.post("/chat/completions", json=CHAT, headers=session)).status_code == 200
            assert good.stats.completed == 3


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, object]) -> tuple[int, bytes]:
    async with session.post(url, json=body) as response:
        return response.status, await response.read()


async def _stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, object], started: asyncio.Semaphore
) -> tuple[int, bytes]:
    """Like _post, releasing STARTED once the first bytes of the stream arrived (waiting for them, not for a fixed
    time, keeps the test right on a loaded machine)."""
    async with session.post(url, json=body) as response:
        parts = [await response.content.readany()]
        started.release()
        parts += [chunk async for chunk in response.content.iter_any()]
        return response.status, b"".join(parts)


async def test_replica_killed_under_load(children: list[Child]) -> None:
    """Non-streamed requests in flight on the dead replica are retried; its streams end with an error event;
    new requests avoid it at once."""
    doomed, survivor = (
        start_fake("--ttft-ms", "300", "--itl-ms", "20"),
        start_fake("--ttft-ms", "300", "--itl-ms", "20"),
    )
    children += [doomed, survivor]
    config = gateway_config(doomed.url, survivor.url, balancing="round_robin")
    async with running_gateway(config) as (app, url), aiohttp.ClientSession() as session:
        plain = [asyncio.create_task(_post(session, url + "/chat/completions", {**CHAT, "max_tokens": 40}))
                 for _ in range(40)]  # fmt: skip
        started = asyncio.Semaphore(0)
        stream_body = {**CHAT, "max_tokens": 40, "stream": True}
        streams = [asyncio.create_task(_stream(session, url + "/chat/completions", stream_body, started))
                   for _ in range(10)]  # fmt: skip
        for _ in streams:  # every stream has its first event (300 ms); non-streamed answers take 1.1 s
            await asyncio.wait_for(started.acquire(), timeout=10)
        doomed.kill()
        assert [status for status, _ in await asyncio.gather(*plain)] == [200] * 40
        endings = []
        for status, body in await asyncio.gather(*streams):
            assert status == 200
            endings.append([event for event in body.split(b"\n\n") if event][-1])
        errors = [json.loads(end[6:]) for end in endings if end != b"data: [DONE]"]
        assert len(errors) == 5 and all(error["error"]["code"] == "upstream_unavailable" for error in errors)
        dead = app.pool.replicas[0]
        assert not dead.healthy
        after = await asyncio.gather(*(_post(session, url + "/chat/completions", CHAT) for _ in range(10)))
        assert [status for status, _ in after] == [200] * 10
        assert dead.outstanding == 0


def _rss_mb(child: Child) -> float:
    return psutil.Process(child.pid).memory_info().rss / 2**20


def _connections(child: Child) -> int:
    return len(psutil.Process(child.pid).net_connections(kind="tcp"))


async def _blast(url: str, total: int, concurrency: int, body: dict[str, object]) -> dict[int, int]:
    statuses: dict[int, int] = {}
    sent = 0
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            nonlocal sent
            while sent < total:
                sent += 1
                status, _ = await _post(session, url + "/chat/completions", body)
                statuses[status] = statuses.get(status, 0) + 1

        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(concurrency))), timeout=120)
    return statuses


async def test_overload_is_refused_promptly_with_bounded_memory(children: list[Child]) -> None:
    fake = start_fake("--ttft-ms", "200")
    children.append(fake)
    gateway = start_gateway(gateway_config(fake.url, port=0, max_concurrency=8, max_queue=16, queue_timeout_s=0.5))
    children.append(gateway)
    baseline_mb = None
    for _ in range(4):
        statuses = await _blast(gateway.url, total=600, concurrency=300, body=CHAT)
        # 8 slots and 16 places in the queue for 300 at once: most are refused at once rather than queued.
        assert set(statuses) <= {200, 503} and statuses.get(503, 0) > 300
        rss_mb = _rss_mb(gateway)
        baseline_mb = baseline_mb or rss_mb
    assert rss_mb - baseline_mb < 15, f"the gateway grew from {baseline_mb:.0f} to {rss_mb:.0f} MiB under overload"
    metrics = httpx.get(gateway.url.removesuffix("/v1") + "/metrics").text
    assert 'deepserve_gateway_rejections_total{reason="queue_full"}' in metrics
    assert gateway.stop() == 0


async def test_soak_10000_requests_without_growth(children: list[Child]) -> None:
    fake = start_fake()
    children.append(fake)
    gateway = start_gateway(gateway_config(fake.url, port=0))
    children.append(gateway)
    stream_body = {**CHAT, "stream": True}
    await _blast(gateway.url, total=2000, concurrency=32, body=CHAT)
    warm_mb, warm_connections = _rss_mb(gateway), _connections(gateway)
    for body in (CHAT, stream_body, CHAT, stream_body):
        statuses = await _blast(gateway.url, total=2000, concurrency=32, body=body)
        assert statuses == {200: 2000}
    rss_mb, connections = _rss_mb(gateway), _connections(gateway)
    assert rss_mb - warm_mb < 8, f"the gateway grew from {warm_mb:.1f} to {rss_mb:.1f} MiB over 8,000 requests"
    assert connections <= max(warm_connections, 2 * 32 + 8)
    assert gateway.stop() == 0


async def test_an_unhealthy_replica_leaves_and_returns() -> None:
    async with running_fake_upstream() as (flaky, flaky_url), running_fake_upstream() as (_, steady_url):
        config = gateway_config(flaky_url, steady_url, balancing="round_robin", health_check_interval_s=3600)
        async with running_gateway(config) as (app, url), httpx.AsyncClient(base_url=url) as client:
            await _leave_and_return(app, flaky, client)


async def _leave_and_return(app: GatewayApp, flaky: FakeUpstream, client: httpx.AsyncClient) -> None:
    """The health checks are called by the test (the loop's interval is an hour)."""
    flaky.behaviour.healthy = False
    await app.pool.check_all()  # what the health loop does every interval
    assert not app.pool.replicas[0].healthy
    before = flaky.stats.requests
    for _ in range(6):
        assert (await client.post("/chat/completions", json=CHAT)).status_code == 200
    assert flaky.stats.requests == before  # out of rotation
    flaky.behaviour.healthy = True
    await app.pool.check_all()
    assert app.pool.replicas[0].healthy
    for _ in range(6):
        assert (await client.post("/chat/completions", json=CHAT)).status_code == 200
    assert flaky.stats.requests == before + 3  # back in rotation


async def test_prefix_affinity_keeps_a_prompt_on_one_replica() -> None:
    async with (
        running_fake_upstream() as (first, first_url),
        running_fake_upstream() as (second, second_url),
        running_gateway(gateway_config(first_url, second_url, balancing="prefix_affinity")) as (_, url),
        httpx.AsyncClient(base_url=url) as client,
    ):
        for index in range(8):
            before = (first.stats.requests, second.stats.requests)
            system = {"role": "system", "content": f"system prompt number {index} " * 8}
            for question in ("a", "b", "c"):
                body = {**CHAT, "messages": [system, {"role": "user", "content": question}]}
                assert (await client.post("/chat/completions", json=body)).status_code == 200
            grew = (first.stats.requests - before[0], second.stats.requests - before[1])
            assert grew in ((3, 0), (0, 3))
        assert first.stats.requests and second.stats.requests  # different prompts spread over both


async def test_a_slow_health_check_is_not_death_until_it_repeats() -> None:
    async with fake_and_gateway(health_check_interval_s=3600) as (fake, app, _):  # the test calls the checks
        app.pool.health_timeout_s = 0.2
        replica = app.pool.replicas[0]
        fake.behaviour.health_delay_s = 5.0  # beyond the health timeout
        for failed in (1, 2):
            await app.pool.check_all()
            assert replica.failed_checks == failed and replica.healthy  # slow answers: still in rotation
        await app.pool.check_all()
        assert replica.failed_checks == 3 and not replica.healthy
        fake.behaviour.health_delay_s = 0.0
        await app.pool.check_all()
        assert replica.healthy and replica.failed_checks == 0


async def test_the_only_replica_failing_shows_its_error() -> None:
    async with fake_and_gateway(FakeBehaviour(fail_status=500)) as (fake, _, client):
        response = await client.post("/chat/completions", json=CHAT)
        assert response.status_code == 502
        error = response.json()["error"]
        assert error["code"] == "upstream_bad_status" and "injected failure" in error["message"]
        assert fake.stats.requests == 1  # a 5xx is not retried on the same replica
