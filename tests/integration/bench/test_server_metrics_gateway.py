"""Server-side metrics through deepserve's gateway: two simulated vLLM replicas serving Prometheus text a test sets,
the gateway's /metrics/engines in front, and `deepserve bench --base-url <gateway>` finding the engines' series on
its own."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deepserve.bench import server_metrics
from deepserve.bench.config import BenchConfig
from deepserve.bench.output import console_block
from deepserve.bench.runner import run_benchmark
from deepserve.bench.server_metrics import GATEWAY_ENGINES_MAX_AGE_S, GATEWAY_FRESH_WAIT_S, ServerMetricsScraper
from deepserve.gateway.config import GatewayConfig
from deepserve.gateway.engine_metrics import CACHE_S
from deepserve.gateway.server import running_gateway
from deepserve.simulate.thread import SimulatorThread
from tests.helpers import metric_total, scrape, simulator_thread

pytestmark = pytest.mark.timeout(120)


def vllm_metrics(running: int, waiting: int, kv: float, queries: int, hits: int, preemptions: int) -> str:
    labels = 'engine="0",model_name="fake-model"'
    return "\n".join(
        [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {running}.0",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} {waiting}.0",
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{labels}}} {kv}",
            "# TYPE vllm:prefix_cache_queries_total counter",
            f"vllm:prefix_cache_queries_total{{{labels}}} {queries}.0",
            "# TYPE vllm:prefix_cache_hits_total counter",
            f"vllm:prefix_cache_hits_total{{{labels}}} {hits}.0",
            "# TYPE vllm:num_preemptions_total counter",
            f"vllm:num_preemptions_total{{{labels}}} {preemptions}.0",
            "",
        ]
    )


@contextlib.contextmanager
def gateway_in_thread(*upstreams: str) -> Iterator[str]:
    """The gateway on its own event loop in a thread (run_benchmark runs its own loop); yields its base URL."""
    config = GatewayConfig.model_validate({"upstream": list(upstreams), "port": 0, "health_check_interval_s": 0.2})
    ready, stop, urls = threading.Event(), threading.Event(), []

    async def serve() -> None:
        async with running_gateway(config) as (_, url):
            urls.append(url)
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.02)

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    try:
        assert ready.wait(30), "the gateway did not start"
        yield urls[0]
    finally:
        stop.set()
        thread.join(30)


@pytest.fixture
def two_replicas() -> Iterator[tuple[SimulatorThread, SimulatorThread, str]]:
    with simulator_thread(itl_ms=10) as first, simulator_thread(itl_ms=10) as second:
        first.control({"metrics_text": vllm_metrics(3, 1, 0.25, 100, 40, 2)})
        second.control({"metrics_text": vllm_metrics(2, 0, 0.5, 50, 10, 1)})
        with gateway_in_thread(first.base_url, second.base_url) as url:
            yield first, second, url


def test_gateway_serves_every_replicas_series_labelled_by_replica(two_replicas):
    _, _, gateway = two_replicas
    root = gateway.removesuffix("/v1")
    text = httpx.get(root + "/metrics/engines").text
    assert httpx.get(root + "/metrics").text.count("vllm:") == 0  # the gateway's own series only
    running_lines = [line for line in text.splitlines() if line.startswith("vllm:num_requests_running")]
    assert len(running_lines) == 2 and all('{replica="http://127.0.0.1:' in line for line in running_lines)
    assert text.count("# TYPE vllm:kv_cache_usage_perc gauge") == 1  # one header per family, samples together
    lines = text.splitlines()
    kv = [i for i, line in enumerate(lines) if "kv_cache_usage_perc" in line]
    assert kv == list(range(kv[0], kv[0] + len(kv)))
    families = {family.name: family for family in text_string_to_metric_families(text)}  # valid exposition format
    assert sorted(sample.value for sample in families["vllm:kv_cache_usage_perc"].samples) == [0.25, 0.5]


def test_scraper_finds_the_engines_behind_the_gateway_and_combines_replicas(two_replicas):
    first, second, gateway = two_replicas
    root = gateway.removesuffix("/v1")

    async def scrape() -> dict:
        scraper = ServerMetricsScraper(root + "/metrics", 0.05, fallback_url=root + "/metrics/engines")
        await scraper.start()
        first.control({"metrics_text": vllm_metrics(4, 2, 0.3, 160, 70, 2)})  # 60 queries, 30 hits, 0 preemptions
        second.control({"metrics_text": vllm_metrics(1, 0, 0.75, 90, 30, 3)})  # 40 queries, 20 hits, 2 preemptions
        await asyncio.sleep(0.3)
        return (await scraper.stop()).to_json()

    summary = asyncio.run(scrape())
    assert summary["available"] is True and summary["url"] == root + "/metrics/engines"
    assert summary["peak_kv_cache_usage_perc"] == 0.75  # the fullest replica, never a sum of fractions
    assert summary["peak_running"] == 5.0  # 4 + 1 (and 3 + 2 before): requests add up
    assert summary["peak_waiting"] == 2.0
    assert (summary["prefix_cache_queries"], summary["prefix_cache_hits"]) == (100.0, 50.0)
    assert summary["prefix_cache_hit_rate"] == 0.5
    assert summary["preemptions"] == 2.0


def test_bench_through_the_gateway_reports_the_engines_metrics_and_where_they_came_from(two_replicas):
    _, _, gateway = two_replicas
    config = BenchConfig.model_validate(
        {
            "target": {"base_url": gateway},
            "workload": {"random_input_len": 16, "random_output_len": 5, "num_prompts": 6},
            "load": {"max_concurrency": 2},
            "metrics": {"server_metrics_interval_s": 0.1},
        }
    )
    result = run_benchmark(config, display=False)
    summary = result.to_json()["server_metrics"]
    assert sum(record.success for record in result.records) == 6
    assert summary["url"] == gateway.removesuffix("/v1") + "/metrics/engines"
    assert summary["peak_kv_cache_usage_perc"] == 0.5 and summary["peak_running"] == 5.0
    assert f"from {summary['url']}" in console_block(result)


def test_without_a_gateway_the_servers_own_metrics_are_used():
    with simulator_thread() as server:
        server.control({"metrics_text": vllm_metrics(1, 0, 0.1, 0, 0, 0)})

        async def scrape() -> dict:
            scraper = ServerMetricsScraper(server.root_url + "/metrics", 0.05, fallback_url=server.root_url + "/x")
            await scraper.start()
            return (await scraper.stop()).to_json()

        summary = asyncio.run(scrape())
    assert summary["url"] == server.root_url + "/metrics" and summary["peak_kv_cache_usage_perc"] == 0.1


def test_through_the_gateway_the_runs_counters_grow_by_what_the_engine_counted():
    """The gateway answers /metrics/engines from a scrape up to a quarter second old: the run's last sample waits
    that out, so the run counts the drafts of its last requests too (the whole run here takes a few tens of
    milliseconds: a stale last sample would miss most of them)."""
    with (
        simulator_thread(step_ms=2, engine={"num_speculative_tokens": 2}, spec_acceptance=[1.0]) as server,
        gateway_in_thread(server.base_url) as gateway,
    ):
        config = BenchConfig.model_validate(
            {
                "target": {"base_url": gateway},
                "workload": {"random_input_len": 16, "random_output_len": 31, "num_prompts": 8, "ignore_eos": True},
                "load": {"max_concurrency": 4, "num_warmups": 0},
            }
        )
        before = metric_total(scrape(server.root_url + "/metrics"), "vllm:spec_decode_num_drafts_total")
        spec = run_benchmark(config, display=False).to_json()["server_metrics"]["spec_decode"]
        after = metric_total(scrape(server.root_url + "/metrics"), "vllm:spec_decode_num_drafts_total")
    assert spec["drafts"] == after - before > 0


def test_the_bench_waits_out_as_long_as_the_gateway_may_cache_the_engines_metrics():
    assert GATEWAY_ENGINES_MAX_AGE_S == CACHE_S < GATEWAY_FRESH_WAIT_S


def test_a_replica_out_of_rotation_is_named_by_the_gateway_and_in_the_benchs_summary(two_replicas):
    """The gateway does not scrape a replica its health checks took out (it may be unreachable): it names it with
    the reason, and the bench says how many of its samples lacked that replica, so a peak read from the others alone
    is not taken for the whole deployment's."""
    first, _, gateway = two_replicas
    root = gateway.removesuffix("/v1")
    first.control({"healthy": False})
    deadline = time.monotonic() + 10
    while "left out" not in (text := httpx.get(root + "/metrics/engines").text) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert f"# replica {first.base_url} left out: out of rotation (health check failed: /health answered 503)" in text
    assert f'replica="{first.base_url}"' not in text  # not scraped

    async def scrape() -> dict:
        scraper = ServerMetricsScraper(root + "/metrics", 0.05, fallback_url=root + "/metrics/engines")
        await scraper.start()
        await asyncio.sleep(0.3)
        return (await scraper.stop()).to_json()

    summary = asyncio.run(scrape())
    assert summary["peak_kv_cache_usage_perc"] == 0.5  # the healthy replica's alone
    scrapes = summary["scrapes"]
    reason = "out of rotation (health check failed: /health answered 503)"
    why = f"missing from {scrapes} of {scrapes} samples (last: {reason})"
    assert summary["replicas_left_out"] == {first.base_url: why}
    assert f"{first.base_url} {why}" in summary["note"]


def test_the_summary_counts_the_samples_taken_while_requests_were_in_flight():
    """Only a sample taken while the client's requests ran can show their peak: the summary counts them, and says
    when there was none (a run shorter than one scrape), rather than passing the idle server's values off as the
    run's peaks."""
    with simulator_thread() as server:
        server.control({"metrics_text": vllm_metrics(1, 0, 0.1, 0, 0, 0)})
        url = server.root_url + "/metrics"

        async def sampled(in_run: bool) -> dict:
            scraper = ServerMetricsScraper(url, 60.0)  # no timed sample: only the ones this test provokes
            await scraper.start()  # the baseline, before any request
            if in_run:
                scraper.client_in_flight(1)  # a new high: a sample while it runs
                await asyncio.sleep(0.3)
            scraper.client_in_flight(0)
            return (await scraper.stop()).to_json()

        with_one = asyncio.run(sampled(True))
        without = asyncio.run(sampled(False))
        never_told = asyncio.run(_summary_without_driver(url))
    assert (with_one["scrapes"], with_one["samples_in_run"]) == (3, 1)
    assert "no sample was taken while requests were in flight" not in with_one["note"]
    assert (without["scrapes"], without["samples_in_run"]) == (2, 0)
    assert without["note"].startswith("no sample was taken while requests were in flight")
    assert never_told["samples_in_run"] is None and never_told["note"] == ""  # several workers: not known


def test_samples_in_the_run_that_all_found_the_engine_idle_are_named_not_passed_off_as_peaks():
    """On a machine short of CPU, vLLM's API server may answer /metrics only while its engine idles: samples taken
    while the client's requests were in flight then all show nothing running. The summary says so; one sample with
    a request running is enough for the peaks to stand."""
    with simulator_thread() as server:
        url = server.root_url + "/metrics"

        async def in_run(running: int) -> dict:
            server.control({"metrics_text": vllm_metrics(running, 0, 0.1 * running, 0, 0, 0)})
            scraper = ServerMetricsScraper(url, 60.0)
            await scraper.start()
            scraper.client_in_flight(2)
            await asyncio.sleep(0.3)
            scraper.client_in_flight(0)
            return (await scraper.stop()).to_json()

        idle = asyncio.run(in_run(0))
        busy = asyncio.run(in_run(2))
    assert idle["samples_in_run"] == 1 and idle["peak_running"] == 0
    assert idle["note"].startswith("the engine reported no request running or waiting in any sample")
    assert busy["samples_in_run"] == 1 and busy["peak_running"] == 2 and busy["note"] == ""


def test_a_client_that_waited_for_a_cpu_says_how_long(monkeypatch: pytest.MonkeyPatch):
    """The client's own run-queue wait over the run is in the summary; where it is a good share of the run, the note
    says the samples (and the send times) fell where the client got a CPU. The kernel's figures are replaced here so
    that the test does not depend on the machine's load; the reading itself is tested below."""
    waits = iter([0.0, 0.65])  # the scraper's start, its stop

    monkeypatch.setattr(server_metrics, "run_queue_wait_s", lambda: next(waits))
    with simulator_thread() as server:
        server.control({"metrics_text": vllm_metrics(1, 0, 0.1, 0, 0, 0)})
        starved = asyncio.run(_summary_without_driver(server.root_url + "/metrics", in_run_s=0.8))
        waits = iter([1.0, 1.4])  # under half a second: not worth a note
        served = asyncio.run(_summary_without_driver(server.root_url + "/metrics", in_run_s=0.3))
    assert starved["client_cpu_wait_s"] == pytest.approx(0.65)
    assert "this client waited 0.7 s of " in starved["note"] and "for a CPU" in starved["note"]
    assert served["client_cpu_wait_s"] == pytest.approx(0.4) and served["note"] == ""


def test_the_run_queue_wait_is_the_calling_threads_own():
    """A thread that shares its only CPU with a busy process waits for it; the reading grows by that wait."""
    if server_metrics.run_queue_wait_s() is None:
        pytest.skip("this kernel has no /proc/thread-self/schedstat")
    cpu = min(os.sched_getaffinity(0))
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    grown: list[float] = []

    def spin_beside_it() -> None:
        os.sched_setaffinity(0, {cpu})  # this thread only
        before = server_metrics.run_queue_wait_s()
        end = time.monotonic() + 0.6
        while time.monotonic() < end:
            pass
        after = server_metrics.run_queue_wait_s()
        assert before is not None and after is not None
        grown.append(after - before)

    try:
        os.sched_setaffinity(busy.pid, {cpu})
        time.sleep(0.2)  # the busy loop is running
        thread = threading.Thread(target=spin_beside_it)
        thread.start()
        thread.join()
    finally:
        busy.kill()
        busy.wait()
    assert grown and grown[0] > 0.1  # about half of the 0.6 s


async def _summary_without_driver(url: str, in_run_s: float = 0.0) -> dict:
    scraper = ServerMetricsScraper(url, 60.0)
    await scraper.start()
    await asyncio.sleep(in_run_s)
    return (await scraper.stop()).to_json()


def test_a_server_with_no_engine_series_at_either_url_is_named_once_beside_the_other_notes():
    with simulator_thread() as server:
        server.control({"metrics_text": "process_open_fds 3.0\n"})
        fallback = server.root_url + "/metrics/engines"  # the simulator has no such route

        async def sampled() -> dict:
            scraper = ServerMetricsScraper(server.root_url + "/metrics", 60.0, fallback_url=fallback)
            await scraper.start()
            scraper.client_in_flight(0)  # the driver reports; no request ran while a sample was taken
            return (await scraper.stop()).to_json()

        note = asyncio.run(sampled())["note"]
    series, _, rest = note.partition(f" (nor has {fallback})")
    assert series == "the server's /metrics has none of the vLLM series we report"
    assert rest.startswith("; no sample was taken while requests were in flight")
