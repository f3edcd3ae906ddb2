"""`deepserve gateway --workers N`: worker processes sharing one port, one limit (Redis), one ledger, one /metrics."""

from __future__ import annotations

import multiprocessing
import signal
import sqlite3
import time
from pathlib import Path

import httpx
import psutil

from deepserve.gateway.fake_upstream import FAKE_MODEL
from deepserve.gateway.keys import KeyStore
from deepserve.gateway.ledger import UsageLedger, UsageRow, default_ledger_path, summarise
from deepserve.gateway.limits import KeyLimits

from .conftest import Child, RedisServer, gateway_config, start_fake, start_gateway, wait_until

BODY = {"model": FAKE_MODEL, "prompt": "hi", "max_tokens": 1}


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


def test_workers_share_the_port_the_limits_the_metrics_and_the_ledger(
    redis_server: RedisServer, children: list[Child]
) -> None:
    fake = start_fake()
    children.append(fake)
    gateway = start_gateway(gateway_config(fake.url, workers=2, redis_url=redis_server.url))
    children.append(gateway)
    workers = worker_processes(gateway)
    assert len(workers) == 2
    before = [cpu_s(worker) for worker in workers]
    with fresh_connections() as client:  # a new connection each time: the kernel spreads them over the workers
        statuses = [client.post(gateway.url + "/completions", json=BODY).status_code for _ in range(200)]
        assert statuses == [200] * 200
        used = [cpu_s(worker) - start for worker, start in zip(workers, before, strict=True)]
        assert min(used) > 0.05, used  # both workers served (each request costs about a millisecond)
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

    assert gateway.stop() == 0
    assert not any(worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE for worker in workers)
    assert sum(row.requests for row in summarise(default_ledger_path())) == 212  # both workers' rows, none lost


def test_a_worker_that_dies_is_replaced_and_the_port_keeps_answering(
    redis_server: RedisServer, children: list[Child]
) -> None:
    fake = start_fake()
    children.append(fake)
    gateway = start_gateway(gateway_config(fake.url, workers=2, redis_url=redis_server.url))
    children.append(gateway)
    victim = worker_processes(gateway)[0]
    victim.send_signal(signal.SIGKILL)
    assert wait_until(
        lambda: len(worker_processes(gateway)) == 2 and victim.pid not in [w.pid for w in worker_processes(gateway)],
        timeout_s=30,
    )
    with fresh_connections() as client:
        assert wait_until(lambda: client.get(gateway.url.removesuffix("/v1") + "/ready").status_code == 200, 30)
        assert all(client.post(gateway.url + "/completions", json=BODY).status_code == 200 for _ in range(20))
    assert "starting another" in "\n".join(gateway.output)
    workers = worker_processes(gateway)
    gateway.kill()  # the supervisor dies outright: its workers notice and stop by themselves
    assert wait_until(lambda: not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers), 10)


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
