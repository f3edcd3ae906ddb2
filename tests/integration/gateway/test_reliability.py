"""Faults and load: retries, a replica killed under load, a replica that hangs, client disconnects, streams cut at
shutdown, overload, and a 10,000-request soak."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
import httpx
import psutil
import pytest

from deepserve.gateway.app import GatewayApp
from deepserve.gateway.balancing import Replica, rendezvous
from deepserve.gateway.server import running_gateway
from deepserve.simulate.faults import Faults
from deepserve.simulate.server import SimulatorServer
from tests.helpers import FAKE_MODEL, Child, FakeClock, until

from .conftest import gateway_config, ledger_rows, start_gateway, start_upstream, upstream, upstream_and_gateway

CHAT = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
# every generation request answered with an error (error_status, default 500)
FAILING: dict[str, Any] = {"error_fraction": 1.0}


# Upstream options: every stream's 200 head goes out, then the connection closes before any event
DROPS_AFTER_HEAD: dict[str, Any] = {"cut_fraction": 1.0, "cut_after_tokens": 0, "cut_mode": "close"}


def stalling(after_tokens: int) -> dict[str, object]:
    """Upstream options: every stream sends AFTER_TOKENS tokens, then nothing more, its connection left open (a chat
    stream's role chunk comes first, so the client sees AFTER_TOKENS + 1 events)."""
    return {"cut_fraction": 1.0, "cut_mode": "stall", "cut_after_tokens": after_tokens}


@contextlib.asynccontextmanager
async def two_replicas(
    first: dict[str, Any], second: dict[str, Any]
) -> AsyncIterator[tuple[SimulatorServer, SimulatorServer, GatewayApp, httpx.AsyncClient]]:
    """Two upstreams (FIRST's and SECOND's options), a gateway sending to them in turn, and a client of it."""
    async with (
        upstream(**first) as one,
        upstream(**second) as other,
        running_gateway(gateway_config(one.base_url, other.base_url, balancing="round_robin")) as (app, url),
        httpx.AsyncClient(base_url=url) as client,
    ):
        yield one, other, app, client


@pytest.mark.parametrize("stream", [False, True])
async def test_a_failing_replica_is_retried_on_another(stream: bool) -> None:
    async with two_replicas(FAILING, {}) as (broken, good, app, client):
        responses = [await client.post("/chat/completions", json={**CHAT, "stream": stream}) for _ in range(10)]
        assert [response.status_code for response in responses] == [200] * 10
        assert all(response.text.endswith("data: [DONE]\n\n") == stream for response in responses)
        assert broken.app.stats.requests >= 4 and good.app.stats.completed == 10
        assert "deepserve_gateway_retries_total" in app.metrics.render().decode()


async def test_upstream_4xx_is_passed_through_and_not_retried() -> None:
    async with (
        upstream(**FAILING, error_status=422) as first,
        upstream(**FAILING, error_status=422) as second,
        running_gateway(gateway_config(first.base_url, second.base_url)) as (_, url),
        httpx.AsyncClient(base_url=url) as client,
    ):
        response = await client.post("/chat/completions", json=CHAT)
        assert response.status_code == 422
        assert response.json()["error"]["message"] == "injected failure (deepserve simulate)"
        assert first.app.stats.requests + second.app.stats.requests == 1


async def test_a_streams_head_reaches_the_client_as_soon_as_the_engines_does() -> None:
    """The engine sends a stream's head at once and its first token after the prefill; the gateway passes the head
    on when it arrives, so the client has parsed it before the first token (otherwise every stream of an engine
    step waits at its first token for the heads of the streams ahead of it)."""
    request = {**CHAT, "stream": True}
    async with (
        upstream_and_gateway(upstream_options={"ttft_ms": 60_000.0}) as (fake, app, client),
        client.stream("POST", "/chat/completions", json=request) as response,
    ):
        assert response.status_code == 200  # the head, within the client's 30 s timeout: no token for a minute
        assert response.headers["content-type"] == "text/event-stream"
        assert fake.app.stats.completed == 0 and app.requests_in_flight == 1


async def test_a_stream_dropped_after_its_head_is_retried_under_that_head() -> None:
    async with two_replicas(DROPS_AFTER_HEAD, {}) as (dropping, good, app, client):
        responses = [await client.post("/chat/completions", json={**CHAT, "stream": True}) for _ in range(4)]
        for response in responses:
            events = [event for event in response.text.split("\n\n") if event]
            assert response.status_code == 200 and events[-1] == "data: [DONE]"
            assert all("error" not in json.loads(event.removeprefix("data: ")) for event in events[:-1])
        assert dropping.app.stats.requests >= 2 and good.app.stats.completed == 4
        assert "deepserve_gateway_retries_total" in app.metrics.render().decode()


async def test_a_stream_whose_retry_is_refused_ends_with_the_engines_error_as_its_event() -> None:
    async with two_replicas(DROPS_AFTER_HEAD, {**FAILING, "error_status": 422}) as (_, _, app, client):
        responses = [await client.post("/chat/completions", json={**CHAT, "stream": True}) for _ in range(4)]
        in_stream = [response for response in responses if response.status_code == 200]
        assert in_stream, "round robin sent no request to the dropping replica first"
        for response in responses:
            if response.status_code == 200:  # dropped after the 200 head, then refused: the refusal as the event
                event = response.text.strip()
                assert event.startswith("data: ") and "\n" not in event
                error = json.loads(event.removeprefix("data: "))["error"]
            else:  # refused at once: the engine's status and body as they were
                assert response.status_code == 422
                error = response.json()["error"]
            assert error["message"] == "injected failure (deepserve simulate)"
        assert app.ledger is not None and app.ledger.flush()
    assert ledger_rows("status") == [(422,)] * 4


async def test_a_stream_the_only_replica_drops_after_its_head_ends_with_an_error_event() -> None:
    async with upstream_and_gateway(upstream_options=DROPS_AFTER_HEAD) as (fake, app, client):
        response = await client.post("/chat/completions", json={**CHAT, "stream": True})
        assert response.status_code == 200  # the engine's 200 head had gone on to the client
        event = response.text.strip()
        assert event.startswith("data: ") and "\n" not in event
        assert json.loads(event.removeprefix("data: "))["error"]["code"] == "upstream_unavailable"
        # dropped rather than refused: tried again on the same replica, as often as retries are allowed
        assert fake.app.stats.requests == 1 + app.config.max_retries
        assert app.ledger is not None and app.ledger.flush()
    assert ledger_rows("status, completion_tokens") == [(503, None)]  # as the error says, not the head


async def test_client_disconnect_mid_stream_aborts_the_upstream_and_records_the_tokens_delivered() -> None:
    async with upstream_and_gateway(upstream_options=stalling(2)) as (fake, app, client):
        request = {**CHAT, "max_tokens": 200, "stream": True}
        received = b""
        async with client.stream("POST", "/chat/completions", json=request) as response:
            async for chunk in response.aiter_raw():
                received += chunk
                if received.count(b"data:") == 3:
                    break  # three events (the role and two tokens), then hang up
        await until(lambda: app.requests_in_flight == 0)  # the gateway saw the disconnect and accounted for the request
        await until(lambda: fake.app.stats.aborted == 1)  # and closed its stream: the upstream saw its client go
        assert fake.app.stats.completed == 0
        assert 'status="499"' in app.metrics.render().decode()
        assert app.limiter.in_flight == 0 and all(r.outstanding == 0 for r in app.pool.replicas)
        assert app.ledger is not None and app.ledger.flush()
    assert ledger_rows("status, completion_tokens, error") == [(499, 3, "client disconnected")]


async def test_cut_in_flight_ends_streams_with_an_error_event_and_records_them_cut() -> None:
    async with upstream_and_gateway(upstream_options=stalling(1), max_concurrency=1) as (_, app, client):
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
        await until(lambda: app.requests_in_flight == 0)
        assert app.ledger is not None and app.ledger.flush()
    rows = ledger_rows("stream, status, completion_tokens, error")
    assert sorted(rows) == [(0, 503, None, "cut: the test ends it"), (1, 503, 2, "cut: the test ends it")]


async def test_a_queued_request_times_out_by_the_gateways_clock() -> None:
    """The local limiter's queue runs on the clock the app was given: no real wait for the queue timeout."""
    clock = FakeClock()
    async with (
        upstream_and_gateway(clock, stalling(1), max_concurrency=1, queue_timeout_s=30) as (_, app, client),
        client.stream("POST", "/chat/completions", json={**CHAT, "stream": True}) as response,
    ):
        chunks = response.aiter_raw()
        assert b"data:" in await anext(chunks)  # it holds the one slot
        queued = asyncio.create_task(client.post("/chat/completions", json=CHAT))
        await until(lambda: app.limiter.waiting == 1)
        clock.now_s += 30
        app.limiter.expire_overdue()  # what the waiter's timer does
        answer = await queued
        assert answer.status_code == 503 and "within 30 s of queueing" in answer.json()["error"]["message"]


def _session_for(replica: Replica, replicas: Sequence[Replica]) -> str:
    """A session id that session_affinity routes to REPLICA."""
    return next(s for s in (f"session-{n}" for n in range(1000)) if rendezvous(s, replicas) is replica)


async def test_a_silent_replica_is_taken_out_at_its_first_timeout_and_its_waiting_requests_move() -> None:
    """A replica that accepts requests and answers nothing (alive, but silent): a stream waits at most the
    first-byte timeout, the replica leaves rotation at once, and every request waiting on it moves to the other."""
    clock = FakeClock()
    async with upstream() as silent, upstream() as good:
        config = gateway_config(
            silent.base_url, good.base_url, balancing="session_affinity", health_check_interval_s=3600
        )
        app = GatewayApp(config, clock=clock)
        async with running_gateway(config, app) as (_, url), httpx.AsyncClient(base_url=url, timeout=30) as client:
            hung = app.pool.replicas[0]
            session = {"x-session-id": _session_for(hung, app.pool.replicas)}
            silent.app.controls.faults = Faults(hang_fraction=1.0)  # every request accepted, none answered
            plain = asyncio.create_task(client.post("/chat/completions", json=CHAT, headers=session))
            stream_body = {**CHAT, "stream": True}
            streamed = asyncio.create_task(client.post("/chat/completions", json=stream_body, headers=session))
            await until(lambda: app.pool.client.awaiting_head == 2)  # both sent to the silent replica
            assert hung.outstanding == 2
            clock.now_s += config.first_byte_timeout_s
            app.pool.client.check_timeouts()  # what the stream's timer does after first_byte_timeout_s
            for response in await asyncio.gather(plain, streamed):
                assert response.status_code == 200
            assert streamed.result().text.endswith("data: [DONE]\n\n")
            assert not hung.healthy and good.app.stats.completed == 2
            assert "deepserve_gateway_retries_total 2.0" in app.metrics.render().decode()
            assert (await client.post("/chat/completions", json=CHAT, headers=session)).status_code == 200
            assert good.app.stats.completed == 3  # out of rotation: not even tried
            silent.app.controls.faults = Faults()
            await app.pool.check_all()  # its health check passes: back in rotation
            assert hung.healthy
            assert (await client.post("/chat/completions", json=CHAT, headers=session)).status_code == 200
            assert good.app.stats.completed == 3


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
        start_upstream("--fixed-ttft-ms", "300", "--fixed-itl-ms", "20"),
        start_upstream("--fixed-ttft-ms", "300", "--fixed-itl-ms", "20"),
    )
    children += [doomed, survivor]
    config = gateway_config(doomed.url, survivor.url, balancing="round_robin")
    async with running_gateway(config) as (app, url), aiohttp.ClientSession() as session:
        plain = [asyncio.create_task(_post(session, url + "/chat/completions", {**CHAT, "max_tokens": 40}))
                 for _ in range(40)]  # fmt: skip
        started = asyncio.Semaphore(0)
        stream_body = {**CHAT, "max_tokens": 150, "stream": True}  # 3 s of tokens: the doomed ones outlive the start
        streams = [asyncio.create_task(_stream(session, url + "/chat/completions", stream_body, started))
                   for _ in range(10)]  # fmt: skip
        for _ in streams:  # every stream has its first event (300 ms); non-streamed answers take 1.1 s, streams 3.3 s
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
    fake = start_upstream("--fixed-ttft-ms", "200")
    children.append(fake)
    gateway = start_gateway(gateway_config(fake.url, port=0, max_concurrency=8, max_queue=16, queue_timeout_s=0.5))
    children.append(gateway)
    rss_mb: list[float] = []  # after each round; the first is the baseline
    for _ in range(4):
        statuses = await _blast(gateway.url, total=600, concurrency=300, body=CHAT)
        # 8 slots and 16 places in the queue for 300 at once: most are refused at once rather than queued.
        assert set(statuses) <= {200, 503} and statuses.get(503, 0) > 300
        rss_mb.append(_rss_mb(gateway))
    grown_mb = rss_mb[-1] - rss_mb[0]
    assert grown_mb < 15, f"the gateway grew from {rss_mb[0]:.0f} to {rss_mb[-1]:.0f} MiB under overload"
    metrics = httpx.get(gateway.url.removesuffix("/v1") + "/metrics").text
    assert 'deepserve_gateway_rejections_total{reason="queue_full"}' in metrics
    assert gateway.stop() == 0


async def test_soak_10000_requests_without_growth(children: list[Child]) -> None:
    fake = start_upstream()
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
    async with upstream() as flaky, upstream() as steady:
        config = gateway_config(flaky.base_url, steady.base_url, balancing="round_robin", health_check_interval_s=3600)
        async with running_gateway(config) as (app, url), httpx.AsyncClient(base_url=url) as client:
            await _leave_and_return(app, flaky, client)


async def _leave_and_return(app: GatewayApp, flaky: SimulatorServer, client: httpx.AsyncClient) -> None:
    """The health checks are called by the test (the loop's interval is an hour)."""
    flaky.app.controls.healthy = False  # /health answers 503
    await app.pool.check_all()  # what the health loop does every interval
    assert not app.pool.replicas[0].healthy
    before = flaky.app.stats.requests
    for _ in range(6):
        assert (await client.post("/chat/completions", json=CHAT)).status_code == 200
    assert flaky.app.stats.requests == before  # out of rotation
    flaky.app.controls.healthy = True
    await app.pool.check_all()
    assert app.pool.replicas[0].healthy
    for _ in range(6):
        assert (await client.post("/chat/completions", json=CHAT)).status_code == 200
    assert flaky.app.stats.requests == before + 3  # back in rotation


async def test_prefix_affinity_keeps_a_prompt_on_one_replica() -> None:
    async with (
        upstream() as first,
        upstream() as second,
        running_gateway(gateway_config(first.base_url, second.base_url, balancing="prefix_affinity")) as (_, url),
        httpx.AsyncClient(base_url=url) as client,
    ):
        for index in range(8):
            before = (first.app.stats.requests, second.app.stats.requests)
            system = {"role": "system", "content": f"system prompt number {index} " * 8}
            for question in ("a", "b", "c"):
                body = {**CHAT, "messages": [system, {"role": "user", "content": question}]}
                assert (await client.post("/chat/completions", json=body)).status_code == 200
            grew = (first.app.stats.requests - before[0], second.app.stats.requests - before[1])
            assert grew in ((3, 0), (0, 3))
        assert first.app.stats.requests and second.app.stats.requests  # different prompts spread over both


async def test_a_slow_health_check_is_not_death_until_it_repeats() -> None:
    async with upstream_and_gateway(health_check_interval_s=3600) as (fake, app, _):  # the test calls the checks
        app.pool.health_timeout_s = 0.2
        replica = app.pool.replicas[0]
        fake.app.controls.health_delay_s = 5.0  # beyond the health timeout
        for failed in (1, 2):
            await app.pool.check_all()
            assert replica.failed_checks == failed and replica.healthy  # slow answers: still in rotation
        await app.pool.check_all()
        assert replica.failed_checks == 3 and not replica.healthy
        fake.app.controls.health_delay_s = 0.0
        app.pool.health_timeout_s = 10.0  # the prompt answer must not miss a short timeout on a loaded machine
        await app.pool.check_all()
        assert replica.healthy and replica.failed_checks == 0


async def test_a_replica_slow_to_answer_its_first_check_is_in_rotation_when_the_gateway_starts() -> None:
    """A busy engine answers the gateway's first /health after its timeout: checked again at once, the gateway
    starts with it in rotation instead of announcing itself ready with no healthy replica for an interval."""
    async with upstream(health_delay_s=5.0) as fake:  # beyond the health timeout (0.5 s at a 0.2 s interval)
        app = GatewayApp(gateway_config(fake.base_url, health_check_interval_s=0.2))
        starting = asyncio.create_task(app.start())
        try:
            await until(lambda: fake.app.stats.health_checks >= 1)
            fake.app.controls.health_delay_s = 0.0  # the engine catches up
            await starting
            assert app.pool.ready() and app.pool.models and app.pool.replicas[0].failed_checks == 0
        finally:
            await app.close()


async def test_the_only_replica_failing_shows_its_error() -> None:
    async with upstream_and_gateway(upstream_options=FAILING) as (fake, _, client):
        response = await client.post("/chat/completions", json=CHAT)
        assert response.status_code == 502
        error = response.json()["error"]
        assert error["code"] == "upstream_bad_status" and "injected failure" in error["message"]
        assert fake.app.stats.requests == 1  # a 5xx is not retried on the same replica
