"""`deepserve gateway --workers N`: worker processes sharing one port, one limit (in memory, or in Redis), one
ledger, one /metrics, each with the connection limits; a worker that dies is replaced, and workers stop when their
supervisor dies.

Waits here are for real processes (spawned interpreters, signals): their bounds are generous, for a machine at load
10-20, and no assertion depends on how long anything took."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import re
import signal
import socket
import sqlite3
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psutil

from deepserve.gateway.keys import KeyStore
from deepserve.gateway.ledger import UsageLedger, UsageRow, default_ledger_path, summarise
from deepserve.gateway.limits import KeyLimits
from deepserve.gateway.server import EXIT_LEDGER_ROWS_LOST
from tests.helpers import FAKE_MODEL, Child, until

from .conftest import RedisServer, gateway_config, ledger_rows, start_gateway, start_upstream

BODY = {"model": FAKE_MODEL, "prompt": "hi", "max_tokens": 1}
# Bounds for what processes do (start, restart, notice their supervisor died, stop); seconds when the machine is idle.
PROCESS_BOUND_S = 90.0


def worker_processes(gateway: Child) -> list[psutil.Process]:
    """The supervisor's live worker processes (not multiprocessing's resource tracker, nor a dead worker)."""
    workers = []
    for child in psutil.Process(gateway.pid).children():
        try:
            if "spawn_main" in " ".join(child.cmdline()) and child.status() != psutil.STATUS_ZOMBIE:
                workers.append(child)
        except psutil.Error:  # it just exited
            continue
    return workers


def cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def fresh_connections() -> httpx.Client:
    return httpx.Client(timeout=30, limits=httpx.Limits(max_keepalive_connections=0))


def oversized_head_answer(url: str, max_header_bytes: int) -> bytes:
    """What the gateway answers, on a connection of its own, to request headers larger than MAX_HEADER_BYTES."""
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    head = b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nX-Big: " + b"a" * (2 * max_header_bytes) + b"\r\n\r\n"
    answer = b""
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        with contextlib.suppress(OSError):  # closed after the answer: it is still in our receive buffer
            sock.sendall(head)
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                answer += chunk
    return answer


def sample(metrics: str, series: str) -> float:
    """The value of SERIES (its name and labels, as exposed) in METRICS; 0 when absent."""
    found = re.search(re.escape(series) + r" ([0-9.e+]+)\n", metrics)
    return float(found.group(1)) if found else 0.0


async def test_workers_share_the_port_the_limits_the_metrics_and_the_ledger(
    redis_server: RedisServer, children: list[Child]
) -> None:
    fake = start_upstream()
    children.append(fake)
    config = gateway_config(fake.url, workers=2, redis_url=redis_server.url, max_header_bytes=8192)
    gateway = start_gateway(config)
    children.append(gateway)
    workers = worker_processes(gateway)
    assert len(workers) == 2
    before = [cpu_s(worker) for worker in workers]
    with fresh_connections() as client:  # a new connection each time: the kernel spreads them over the workers
        statuses = [client.post(gateway.url + "/completions", json=BODY).status_code for _ in range(200)]
        assert statuses == [200] * 200
        used = [cpu_s(worker) - start for worker, start in zip(workers, before, strict=True)]
        # both workers served: each request costs a worker 0.3-1 ms of CPU (about 0.05 s for half of them), an idle
        # worker's health checks a few ms over the run
        assert min(used) > 0.02, used
        root = gateway.url.removesuffix("/v1")
        served = f'deepserve_gateway_requests_total{{key="anonymous",model="{FAKE_MODEL}",status="200"}} 200.0'
        for _ in range(4):  # whichever worker answers, /metrics adds up every worker's counts
            text = client.get(root + "/metrics").text
            assert served in text
            assert 'deepserve_gateway_upstream_healthy{replica="' + fake.url + '"} 1.0' in text

        _, secret = KeyStore().create("shared", KeyLimits(rpm=5))
        started = time.monotonic()
        limited = [
            client.post(gateway.url + "/completions", json=BODY, headers={"Authorization": f"Bearer {secret}"})
            for _ in range(12)
        ]
        admitted = sum(response.status_code == 200 for response in limited)
        assert 5 <= admitted <= 5 + int((time.monotonic() - started) / 12)  # one limit for both workers

        # Every worker applies the connection limits: 12 fresh connections (spread over both by the kernel) with
        # headers over the limit all get 431, and /metrics adds up both workers' refusals once each published them.
        answers = [oversized_head_answer(gateway.url, config.max_header_bytes) for _ in range(12)]
        assert all(answer.startswith(b"HTTP/1.1 431") for answer in answers), answers
        refused = 'deepserve_gateway_connections_refused_total{reason="header_too_large"}'
        await until(lambda: sample(client.get(root + "/metrics").text, refused) == 12, PROCESS_BOUND_S, 0.2)
        # The ledger's counts too: every worker's rows (212 requests in all) once written and published.
        written = "deepserve_gateway_ledger_rows_written_total"
        await until(lambda: sample(client.get(root + "/metrics").text, written) == 212, PROCESS_BOUND_S, 0.2)

    assert gateway.stop() == 0
    assert not any(worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE for worker in workers)
    assert sum(row.requests for row in summarise(default_ledger_path())) == 212  # both workers' rows, none lost


async def test_workers_without_redis_share_one_limit_and_a_dead_workers_requests_give_theirs_back(
    children: list[Child],
) -> None:
    fake = start_upstream("--fixed-itl-ms", "20")
    children.append(fake)
    gateway = start_gateway(gateway_config(fake.url, workers=2))  # the limits in memory both workers map
    children.append(gateway)
    _, rpm_secret = KeyStore().create("rpm", KeyLimits(rpm=5))
    _, single_secret = KeyStore().create("single", KeyLimits(max_concurrency=1))
    with fresh_connections() as client:
        started = time.monotonic()
        statuses = [
            client.post(gateway.url + "/completions", json=BODY, headers=bearer(rpm_secret)).status_code
            for _ in range(12)
        ]
        assert set(statuses) == {200, 429}
        assert 5 <= statuses.count(200) <= 5 + int((time.monotonic() - started) / 12)  # one limit for both workers

    long_stream = {"model": FAKE_MODEL, "prompt": "hi", "max_tokens": 3000, "stream": True}  # a minute of tokens
    async with (
        httpx.AsyncClient(base_url=gateway.url, timeout=60) as streamer,
        streamer.stream("POST", "/completions", json=long_stream, headers=bearer(single_secret)) as response,
    ):
        assert response.status_code == 200
        holder = serving_worker(gateway, response.extensions["network_stream"].get_extra_info("client_addr")[1])
        with fresh_connections() as client:  # whichever worker gets them, the key's one request is in flight
            for _ in range(6):
                refused = client.post(gateway.url + "/completions", json=BODY, headers=bearer(single_secret))
                assert refused.status_code == 429 and "in flight" in refused.text
        holder.send_signal(signal.SIGKILL)  # the request dies with it; the supervisor zeroes its counts
    await replaced_and_ready(gateway, holder)
    with fresh_connections() as client:
        answers = [
            client.post(gateway.url + "/completions", json=BODY, headers=bearer(single_secret)) for _ in range(6)
        ]
        assert [answer.status_code for answer in answers] == [200] * 6
    assert gateway.stop() == 0


async def replaced_and_ready(gateway: Child, dead: psutil.Process) -> None:
    """Until the supervisor has replaced the DEAD worker (two live workers, neither of them DEAD) and /ready answers."""
    await until(
        lambda: len(worker_processes(gateway)) == 2 and dead.pid not in [w.pid for w in worker_processes(gateway)],
        PROCESS_BOUND_S,
        0.1,
    )
    with fresh_connections() as client:
        await until(lambda: client.get(gateway.url.removesuffix("/v1") + "/ready").status_code == 200, PROCESS_BOUND_S)


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def serving_worker(gateway: Child, client_port: int) -> psutil.Process:
    """The worker that holds the connection from CLIENT_PORT open to the gateway's port."""
    port = urlsplit(gateway.url).port
    holders = [
        worker
        for worker in worker_processes(gateway)
        if any(c.laddr.port == port and c.raddr and c.raddr.port == client_port for c in worker.net_connections("tcp"))
    ]
    assert len(holders) == 1, holders
    return holders[0]


async def test_a_worker_that_dies_is_replaced_and_the_port_keeps_answering(
    redis_server: RedisServer, children: list[Child]
) -> None:
    fake = start_upstream()
    children.append(fake)
    gateway = start_gateway(gateway_config(fake.url, workers=2, redis_url=redis_server.url))
    children.append(gateway)
    victim = worker_processes(gateway)[0]
    victim.send_signal(signal.SIGKILL)
    await replaced_and_ready(gateway, victim)
    with fresh_connections() as client:
        assert all(client.post(gateway.url + "/completions", json=BODY).status_code == 200 for _ in range(20))
    assert "starting another" in "\n".join(gateway.output)
    workers = worker_processes(gateway)
    gateway.kill()  # the supervisor dies outright: its workers notice and stop by themselves (draining as usual)
    await until(
        lambda: not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers), PROCESS_BOUND_S, 0.1
    )


async def test_on_sigterm_every_worker_drains_cuts_cleanly_and_logs_access(
    redis_server: RedisServer, children: list[Child]
) -> None:
    fake = start_upstream("--fixed-itl-ms", "20")
    children.append(fake)
    config = gateway_config(fake.url, workers=2, redis_url=redis_server.url, shutdown_grace_s=0.5, access_log=True)
    gateway = start_gateway(config)
    children.append(gateway)
    long_stream = {"model": FAKE_MODEL, "prompt": "hi", "max_tokens": 3000, "stream": True}  # a minute of tokens
    received = b""
    async with (
        httpx.AsyncClient(base_url=gateway.url, timeout=60) as client,
        client.stream("POST", "/completions", json=long_stream) as response,
    ):
        async for chunk in response.aiter_raw():  # raises if the chunked body ends without its terminator
            received += chunk
            if received.count(b"data:") == 3 and gateway.process.poll() is None:
                gateway.process.send_signal(signal.SIGTERM)  # to the supervisor, which stops its workers
    events = [event for event in received.split(b"\n\n") if event]
    error = json.loads(events[-1].removeprefix(b"data: "))["error"]
    assert error["code"] == "gateway_shutdown"
    assert gateway.wait() == 0
    ((status, completion_tokens, cut),) = ledger_rows("status, completion_tokens, error")
    assert status == 503 and completion_tokens == len(events) - 1 and cut.startswith("cut: ")
    access = [line for line in gateway.output if " access " in line and "/v1/completions" in line]
    assert len(access) == 1 and '" 503 ' in access[0], gateway.output[-20:]


async def test_the_supervisor_exits_non_zero_when_a_worker_lost_usage_rows(
    redis_server: RedisServer, children: list[Child]
) -> None:
    fake = start_upstream()
    children.append(fake)
    gateway = start_gateway(gateway_config(fake.url, workers=2, redis_url=redis_server.url))
    children.append(gateway)
    locker = sqlite3.connect(default_ledger_path(), isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")  # someone holds the ledger's write lock until the gateway has stopped
    try:
        with fresh_connections() as client:
            assert client.post(gateway.url + "/completions", json=BODY).status_code == 200
        assert gateway.stop() == EXIT_LEDGER_ROWS_LOST
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    assert any("1 usage rows could not be written" in line for line in gateway.output), gateway.output[-10:]


def _write_rows(path: str, writer: int, rows: int) -> None:
    ledger = UsageLedger(Path(path))
    for index in range(rows):
        ledger.record(UsageRow(time.time(), f"w{writer}", "m", "/v1/completions", False, 200, index, 1, 1.0, None,
                               "u", None))  # fmt: skip
        if index % 50 == 0:
            time.sleep(0.01)  # batches interleave with the other writers'
    ledger.close()


def test_ledger_writers_in_several_processes_lose_and_corrupt_nothing(tmp_path: Path) -> None:
    path = tmp_path / "usage.sqlite"
    UsageLedger(path).close()  # created (and in WAL mode) before the writers start, as the first worker would
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_write_rows, args=(str(path), index, 400)) for index in range(4)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(60)
        assert writer.exitcode == 0
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    assert db.execute("SELECT key, count(*) FROM usage GROUP BY key ORDER BY key").fetchall() == [
        (f"w{index}", 400) for index in range(4)
    ]
