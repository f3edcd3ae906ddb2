"""What the gateway adds: the same streaming and non-streaming load sent straight to a fast simulated upstream,
through deepserve's gateway, and through LiteLLM's proxy (the peer), side by side in one run.

Every server is its own process on loopback: the upstream (`deepserve simulate` with fixed timings), the gateway
(`deepserve gateway`, one process), LiteLLM's proxy (one worker, in its own virtualenv, created on demand), and this
load generator (aiohttp on uvloop). On a small shared machine all of them compete for the same cores, so read the
*differences and ratios* between the columns of one run, not the absolute numbers.

    .venv/bin/python benchmarks/gateway_overhead.py                  # the table in docs/PERFORMANCE.md
    .venv/bin/python benchmarks/gateway_overhead.py --no-litellm     # without the peer

`--lockstep` makes the simulator emit tokens the way vLLM does: one engine step every --itl-ms (its
`--fixed-step-ms`), in which every running stream gets its next token (bursts), instead of each stream on its own
timer (staggered); a request's first token comes at the end of its prefill step, and requests/s is not measured.
`--wave` (with `--lockstep`) sends each round's streams all at once instead of staggering the workers: the streams of
a wave arrive together, stream in lockstep and end in the same engine step, so the next wave arrives as a burst too
(issue 22: what a gateway in front of vLLM sees when many clients start together). The table gives each level's
chunk rate (streams x 1000 / --itl-ms events per second) and how much of one core the path's process used, which
is the curve of what one gateway worker sustains before it adds latency. With `--wave` two more tables compare
waves with waves: each wave's median and slowest stream, and the TTFT by place in the wave (its fastest stream, alone
in the engine's first step, against those that share the second).
`--baseline-src DIR` adds the gateway of another checkout's `src/` (e.g. `git archive main src | tar -x -C /tmp/b`)
as a path of its own, so that a change is measured against the code before it in the same run.
`--workers` adds `--workers 2` with the limits in memory both workers map (`workers=2`, what one host runs without
Redis). `--redis` adds two paths: the gateway with its limits in Redis (`--redis-url`, a redis-server this benchmark
starts on loopback) and `--workers 2` with Redis (`w=2+redis`). Every deepserve path sends a key with (generous) rpm,
tpm and concurrency limits, so that the whole admission path runs; `--latency-requests N` times N sequential
non-streamed requests per path, which shows what the Redis round trips add to each request. With `--baseline-src`
too, the other checkout's gateway gets the two Redis paths as well (`base+redis`, `base+w=2`, on a redis-server of
their own, since the two versions' scripts may keep their state differently), and after the tables Redis's own
account of each Redis path (`INFO commandstats`, reset before each batch: script calls per stream, µs per call, and
the commands the scripts ran). `--paths` measures only the paths named (and `direct`, which every difference needs).
`--proxy-cpus 1` runs every gateway (and LiteLLM) on the CPUs named and the upstream, Redis and this load generator
on the others, as a deployment gives its gateway cores of its own: what is left is the hop itself (two more
wake-ups and the gateway's work), not the gateway and the engine waiting for each other's core.
`--floors` adds two proxies that do less than the gateway, as yardsticks for the hop: `byte-relay`
(benchmarks/byte_relay.py, bytes copied on uvloop, no HTTP) and `haproxy` (one thread, HTTP mode, when installed).
`--load-nice -10` gives this load generator priority over the servers once they run: on fewer cores than busy
processes it otherwise waits on the run queue while a proxy relays an engine step (benchmarks/lockstep_trace.py
measures that wait), which a client on another machine does not.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gc
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil

from deepserve.gateway.config import GatewayConfig, gateway_argv
from deepserve.net import free_port
from deepserve.simulate.fixed import FAKE_MODEL, simulate_command

REPO = Path(__file__).resolve().parent.parent
LITELLM_VENV = REPO / ".bench-venvs" / "litellm"


# ---- processes ----------------------------------------------------------------------------------------------------


@dataclass
class Server:
    name: str
    url: str  # base URL ending in /v1
    process: subprocess.Popen[str]
    output: list[str] = field(default_factory=list)
    api_key: str = "sk-bench-master-key"  # what the load generator sends (LiteLLM's master key by default)
    redis_url: str | None = None  # the Redis that holds this gateway's limits (its commands are counted)

    def cpu_s(self) -> float:
        """CPU seconds used so far by the server and its children."""
        try:
            root = psutil.Process(self.process.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0.0
        total = 0.0
        for proc in procs:
            try:
                times = proc.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += times.user + times.system
        return total

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_server(
    name: str,
    argv: list[str],
    ready_line: str | None,
    url: str,
    health: str,
    timeout_s: float,
    env: dict[str, str] | None = None,
    cpus: set[int] | None = None,
) -> Server:
    """Start ARGV (on CPUS only, when given); ready when READY_LINE is printed (if given) and HEALTH answers 200."""
    process = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env or dict(os.environ),
        preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus),
    )
    server = Server(name, url, process)
    seen = threading.Event()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            server.output = [*server.output[-50:], line.rstrip()]
            if ready_line and line.startswith(ready_line):
                seen.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        if (ready_line is None or seen.is_set()) and _answers(health):
            return server
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"{name} did not start:\n" + "\n".join(server.output[-30:]))


def _answers(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def start_upstream(itl_ms: float, ttft_ms: float = 0.0, lockstep: bool = False) -> Server:
    """The upstream: `deepserve simulate` with fixed timings (each stream on its own timer, or with LOCKSTEP one
    engine step of ITL_MS for all running streams; vLLM's max_num_seqs raised so that no stream waits)."""
    port = free_port()
    if lockstep:
        timing = ["--fixed-step-ms", str(itl_ms), "--max-num-seqs", "8192", "--max-num-batched-tokens", "1048576"]
    else:
        timing = ["--fixed-ttft-ms", str(ttft_ms), "--fixed-itl-ms", str(itl_ms)]
    argv = simulate_command(port, *timing, "--max-seconds", "7200")
    url = f"http://127.0.0.1:{port}"
    return start_server("simulated upstream", argv, "READY ", url + "/v1", url + "/health", 30)


PROXY_CPUS: set[int] | None = None  # --proxy-cpus: where the gateways and LiteLLM run (None: wherever they like)


def start_gateway(upstream: str, api_key: str, src: Path | None = None, **fields: object) -> Server:
    """A gateway process (from SRC, another checkout's src/, when given: only flags it knows are passed)."""
    port = free_port()
    config = GatewayConfig.model_validate(
        {"upstream": [upstream], "port": port, "max_concurrency": 8192, "max_queue": 8192, **fields}
    )
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(src or REPO / "src")}
    server = start_server("deepserve gateway", gateway_argv(config, sys.executable), "GATEWAY READY", url + "/v1",
                          url + "/ready", 90, env, PROXY_CPUS)  # fmt: skip
    server.api_key = api_key
    return server


def start_floors(upstream: str, workdir: Path, servers: list[Server]) -> dict[str, Server]:
    """The proxies that do less than the gateway, as yardsticks for its hop: a uvloop relay that copies bytes (no
    HTTP, no keys, no limits) and HAProxy (C, one thread, HTTP mode) when the machine has it; each is appended to
    SERVERS as soon as it runs, so that it is stopped whatever happens next."""
    host_port = upstream.removeprefix("http://").removesuffix("/v1")
    floors: dict[str, Server] = {}
    port = free_port()
    argv = [sys.executable, str(REPO / "benchmarks" / "byte_relay.py"), "--port", str(port), "--upstream", host_port]
    url = f"http://127.0.0.1:{port}"
    floors["byte-relay"] = start_server("byte relay", argv, "RELAY READY", url + "/v1", url + "/health", 30,
                                        cpus=PROXY_CPUS)  # fmt: skip
    servers.append(floors["byte-relay"])
    binary = shutil.which("haproxy", path=os.environ.get("PATH", "") + ":/usr/sbin")
    if binary is None:
        print("note: HAProxy skipped: not installed (apt-get install haproxy)", flush=True)
        return floors
    port = free_port()
    config = workdir / "haproxy.cfg"
    config.write_text(HAPROXY_CONFIG.format(port=port, upstream=host_port))
    url = f"http://127.0.0.1:{port}"
    floors["haproxy"] = start_server("haproxy", [binary, "-db", "-f", str(config)], None, url + "/v1",
                                     url + "/health", 30, cpus=PROXY_CPUS)  # fmt: skip
    servers.append(floors["haproxy"])
    return floors


# One thread, as one gateway worker; http-no-delay so that a streamed event is sent when it arrives, not merged with
# what follows (HAProxy's advice for interactive HTTP); timeouts longer than any run.
HAPROXY_CONFIG = """global
    nbthread 1
    maxconn 8192
defaults
    mode http
    option http-no-delay
    timeout connect 5s
    timeout client 600s
    timeout server 600s
frontend bench
    bind 127.0.0.1:{port}
    default_backend engine
backend engine
    server engine {upstream}
"""


def bench_key() -> str:
    """A key whose limits every request passes but which makes the gateway run its whole admission path."""
    from deepserve.gateway.keys import KeyStore
    from deepserve.gateway.limits import KeyLimits

    store = KeyStore()
    try:
        _, secret = store.create("bench", KeyLimits(rpm=10**9, tpm=10**12, max_concurrency=10**6))
    finally:
        store.close()
    return secret


def start_redis() -> Server:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (Debian: apt-get install -y redis-server)")
    port = free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    server = Server("redis", f"redis://127.0.0.1:{port}/0", process)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            if sock.recv(16).startswith(b"+PONG"):
                return server
        time.sleep(0.05)
    server.stop()
    raise RuntimeError("redis-server did not answer PING")


def redis_reset_stats(url: str) -> None:
    import redis

    with redis.Redis.from_url(url) as client:
        client.config_resetstat()


def redis_command_stats(url: str) -> dict[str, tuple[int, float]]:
    """Redis's own count of each command since the last reset: name → (calls, µs). Redis 7 counts the commands a
    Lua script calls too, each under its own name, besides the EVALSHA that ran the script."""
    import redis

    with redis.Redis.from_url(url) as client:
        stats = client.info("commandstats")
        reads = int(client.info("stats")["total_reads_processed"])  # what the clients wrote, in Redis's reads
    commands = {name.removeprefix("cmdstat_"): (int(v["calls"]), float(v["usec"])) for name, v in stats.items()}
    return {**commands, "reads": (reads, 0.0)}


def ensure_litellm() -> Path | None:
    """LiteLLM's proxy in its own virtualenv (created on first use); None, with a note, if that fails."""
    binary = LITELLM_VENV / "bin" / "litellm"
    if binary.exists():
        return binary
    print(f"creating {LITELLM_VENV} and installing litellm[proxy] (once; a few minutes) …", flush=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(LITELLM_VENV)], check=True)
        pip = [str(LITELLM_VENV / "bin" / "pip"), "install", "-q", "litellm[proxy]"]
        subprocess.run(pip, check=True, timeout=900)
    except (subprocess.SubprocessError, OSError) as exc:
        print(f"note: LiteLLM skipped: could not install it into {LITELLM_VENV} ({exc})", flush=True)
        return None
    return binary if binary.exists() else None


def start_litellm(binary: Path, upstream: str, workdir: Path) -> Server:
    port = free_port()
    config = workdir / "litellm.yaml"
    config.write_text(
        json.dumps(
            {
                "model_list": [
                    {
                        "model_name": FAKE_MODEL,
                        "litellm_params": {"model": "openai/" + FAKE_MODEL, "api_base": upstream, "api_key": "none"},
                    }
                ],
                "litellm_settings": {"telemetry": False},
                # LiteLLM refuses to start open; the load generator sends this key to every target
                "general_settings": {"master_key": "sk-bench-master-key"},
            }
        )
    )
    argv = [str(binary), "--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"]
    url = f"http://127.0.0.1:{port}"
    os.environ.setdefault("LITELLM_LOG", "ERROR")
    return start_server("LiteLLM proxy", argv, None, url + "/v1", url + "/health/liveliness", 180, cpus=PROXY_CPUS)


# ---- load ---------------------------------------------------------------------------------------------------------


@dataclass
class StreamResult:
    ttft_s: float
    itl_s: float | None  # mean gap between events after the first
    error: str | None = None  # why the stream failed (a failure is data, not an exception)
    first_at_s: float = 0.0  # when the first token arrived (time.perf_counter), to line up with other processes

    @property
    def ok(self) -> bool:
        return self.error is None


def headers_for(api_key: str) -> dict[str, str]:
    return {"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"}


def stream_body(tokens: int) -> bytes:
    """A streamed chat request for TOKENS tokens."""
    return json.dumps(
        {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": tokens, "stream": True}
    ).encode()


async def one_stream(session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str]) -> StreamResult:
    started = time.perf_counter()
    first = last = 0.0
    events = 0
    try:
        async with session.post(url, data=body, headers=headers) as response:
            if response.status != 200:
                detail = (await response.read())[:120].decode(errors="replace")
                return StreamResult(0.0, None, f"HTTP {response.status}: {detail}")
            async for chunk in response.content.iter_any():
                now = time.perf_counter()
                if b'"error"' in chunk:
                    return StreamResult(0.0, None, "error event: " + chunk[:160].decode(errors="replace"))
                count = chunk.count(b"data:") - chunk.count(b'"role"')  # a chat stream's role chunk is no token
                if not count:
                    continue
                if not events:
                    first = now
                events += count
                last = now
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return StreamResult(0.0, None, f"{type(exc).__name__}: {exc}")
    # [DONE] is an event but no token; the gaps are between token events
    tokens = events - 1
    itl = (last - first) / (tokens - 1) if tokens > 1 else None
    return StreamResult(first - started, itl, None if tokens > 0 else "no tokens", first)


async def stream_load(
    url: str, concurrency: int, rounds: int, tokens: int, stream_s: float, api_key: str
) -> list[StreamResult]:
    """CONCURRENCY streams at all times, ROUNDS each; the first round (connection set-up) is not counted. Workers
    start spread over one stream's duration (STREAM_S), so that arrivals are steady rather than one burst."""
    body = stream_body(tokens)
    results: list[StreamResult] = []
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def worker(offset_s: float) -> None:
            await asyncio.sleep(offset_s)
            for round_index in range(rounds):
                result = await one_stream(session, url + "/chat/completions", body, headers_for(api_key))
                if round_index:
                    results.append(result)

        await asyncio.gather(*(worker(stream_s * index / concurrency) for index in range(concurrency)))
    return results


async def wave_load(url: str, concurrency: int, rounds: int, tokens: int, api_key: str) -> list[StreamResult]:
    """ROUNDS waves of CONCURRENCY streams, each wave sent all at once when the one before has ended (all of its
    streams end in the same engine step); the first wave (connection set-up) is not counted."""
    body = stream_body(tokens)
    results: list[StreamResult] = []
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=120)
    headers = headers_for(api_key)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        for round_index in range(rounds):
            wave = await asyncio.gather(
                *(one_stream(session, url + "/chat/completions", body, headers) for _ in range(concurrency))
            )
            if round_index:
                results += wave
    return results


async def request_rate(
    url: str,
    concurrency: int,
    duration_s: float,
    warm_s: float = 2.0,
    cpu_s: Callable[[], float] = lambda: 0.0,
    api_key: str = "sk-bench-master-key",
) -> tuple[float, int, float]:
    """Non-streamed 1-token requests, CONCURRENCY at a time: completions that END inside a window of DURATION_S
    (after WARM_S) per second, so that slow servers are measured fairly. Returns (requests/s, failures in the
    window, CPU µs the server (CPU_S) used per request completed in the window). Requests still in flight at the
    end are abandoned."""
    body = json.dumps({"model": FAKE_MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    headers = headers_for(api_key)
    done = failed = 0
    reasons: collections.Counter[str] = collections.Counter()
    connector = aiohttp.TCPConnector(limit=concurrency)
    window_start = time.perf_counter() + warm_s
    window_end = window_start + duration_s
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:

        async def worker() -> None:
            nonlocal done, failed
            while time.perf_counter() < window_end:
                reason = None
                try:
                    async with session.post(url + "/completions", data=body, headers=headers) as response:
                        answer = await response.read()
                        if response.status != 200:
                            reason = f"HTTP {response.status}: {answer[:160].decode(errors='replace')}"
                except aiohttp.ClientError as exc:
                    reason = f"{type(exc).__name__}: {exc}"
                if window_start <= time.perf_counter() < window_end:
                    done += reason is None
                    failed += reason is not None
                    if reason is not None:
                        reasons[reason] += 1

        workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
        await asyncio.sleep(window_start - time.perf_counter())
        cpu_start = cpu_s()
        await asyncio.sleep(window_end - time.perf_counter())
        cpu_us = (cpu_s() - cpu_start) * 1e6 / max(1, done)
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    for reason, count in reasons.most_common(3):
        print(f"        {count} failed: {reason}", flush=True)
    return done / duration_s, failed, cpu_us


async def request_latencies(url: str, requests: int, api_key: str) -> list[float]:
    """REQUESTS non-streamed 1-token requests one after the other on one connection: each one's latency in ms."""
    body = json.dumps({"model": FAKE_MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    latencies: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
        for _ in range(requests):
            started = time.perf_counter()
            async with session.post(url + "/completions", data=body, headers=headers_for(api_key)) as response:
                await response.read()
                if response.status == 200:
                    latencies.append((time.perf_counter() - started) * 1000)
    return latencies


# ---- metrics and table --------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (Q in 0..100), as numpy's default."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass
class StreamSummary:
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_mean_ms: float
    failures: int
    count: int
    proxy_cpu_ms_per_stream: float = float("nan")  # CPU of the process the requests went to, per stream
    core_share: float = float("nan")  # that CPU over the wall time of the batches: the share of one core it used
    repeats: list[StreamSummary] = field(default_factory=list)  # each repeat's own, in run order
    # With --wave: the median over waves of each wave's median TTFT, and of its slowest stream's
    wave_median_ms: float = float("nan")
    wave_slowest_ms: float = float("nan")
    wave_places_ms: dict[int, float] = field(default_factory=dict)  # place in the wave (0: fastest) → median TTFT


def summarise(results: list[StreamResult]) -> StreamSummary:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s * 1000 for r in ok]
    itls = [r.itl_s * 1000 for r in ok if r.itl_s is not None]
    return StreamSummary(
        percentile(ttfts, 50), percentile(ttfts, 99), statistics.fmean(itls) if itls else float("nan"),
        len(results) - len(ok), len(results),
    )  # fmt: skip


def wave_ttfts(results: list[StreamResult], concurrency: int) -> tuple[float, float]:
    """RESULTS in waves of CONCURRENCY (as wave_load returns them): the median over the waves of each wave's median
    TTFT and of its slowest stream's, in ms (waves with a failure left out). Unlike a percentile of all streams
    together, it compares waves with waves: a lockstep engine runs a wave in two steps or, when every request of it
    arrived before the first step was formed, in one, and a few one-step waves on one path move its pooled p50 by
    a whole step."""
    waves = complete_waves(results, concurrency)
    if not waves:
        return float("nan"), float("nan")
    return statistics.median(statistics.median(wave) for wave in waves), statistics.median(wave[-1] for wave in waves)


def complete_waves(results: list[StreamResult], concurrency: int) -> list[list[float]]:
    """RESULTS in waves of CONCURRENCY (as wave_load returns them): each wave's TTFTs in ms, fastest first, for the
    waves in which no stream failed."""
    return [
        sorted(result.ttft_s * 1000 for result in results[start : start + concurrency])
        for start in range(0, len(results) - concurrency + 1, concurrency)
        if all(result.ok for result in results[start : start + concurrency])
    ]


def wave_places(concurrency: int) -> list[int]:
    """The places within a wave shown by place (0: its fastest stream): the first, a quarter in, the middle, the
    last. On a lockstep engine the fastest is alone in the first step (or one of the first two or three, where the
    client sent them before the step began) and the others share the second, so the first place shows what the
    burst's first request costs and the others what the shared step's relay costs."""
    return sorted({0, concurrency // 4, concurrency // 2, concurrency - 1})


def wave_place_ttfts(results: list[StreamResult], concurrency: int) -> dict[int, float]:
    """RESULTS in waves of CONCURRENCY: for each place of `wave_places`, the median over waves of the TTFT (ms) of
    the stream at that place in its wave (waves with a failure left out)."""
    waves = complete_waves(results, concurrency)
    if not waves:
        return {}
    return {place: statistics.median(wave[place] for wave in waves) for place in wave_places(concurrency)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256, 1000], help="concurrent streams")
    parser.add_argument("--tokens", type=int, default=20, help="tokens per stream")
    parser.add_argument("--itl-ms", type=float, default=50.0, help="the upstream's inter-token latency")
    # 4 repeats of 4 counted rounds: 4,096 counted streams per path at 256, so that p99 is decided by ~40 values
    parser.add_argument("--rounds", type=int, default=5, help="streams per worker (the first is warm-up)")
    parser.add_argument("--repeats", type=int, default=4, help="runs per path and concurrency, in alternating order")
    parser.add_argument("--rate-concurrency", type=int, default=64, help="concurrency of the requests/s test")
    parser.add_argument("--rate-duration-s", type=float, default=8.0)
    parser.add_argument("--litellm-max-streams", type=int, default=64, help="LiteLLM only up to this concurrency")
    parser.add_argument("--no-litellm", action="store_true")
    parser.add_argument("--lockstep", action="store_true", help="the upstream emits every stream's token in one step")
    parser.add_argument(
        "--wave", action="store_true", help="with --lockstep: each round's streams arrive together (a burst per wave)"
    )
    parser.add_argument(
        "--baseline-src", type=Path, default=None, help="another checkout's src/: its gateway as a path of its own"
    )
    parser.add_argument("--ttft-ms", type=float, default=0.0, help="the upstream's time to first token")
    parser.add_argument("--workers", action="store_true", help="add --workers 2 with its limits in shared memory")
    parser.add_argument(
        "--redis", action="store_true", help="add the gateway with Redis limits and --workers 2 with Redis limits"
    )
    parser.add_argument("--latency-requests", type=int, default=0, help="sequential requests per path, timed")
    parser.add_argument("--no-rate", action="store_true", help="skip the requests/s measurement")
    parser.add_argument(
        "--paths", nargs="+", choices=PATHS[1:], default=None, help="only these paths (and direct, always measured)"
    )
    parser.add_argument(
        "--floors",
        action="store_true",
        help="add the hop's floors: a byte relay on uvloop (byte_relay.py) and HAProxy in HTTP mode, if installed",
    )
    parser.add_argument(
        "--load-nice",
        type=int,
        default=None,
        help="the load generator's nice value once the servers run (e.g. -10: its wake-ups do not queue behind a busy "
        "proxy on a machine with fewer cores than processes; below 0 needs root or CAP_SYS_NICE)",
    )
    parser.add_argument(
        "--proxy-cpus", default=None, help="CPUs for the gateways and LiteLLM (e.g. 1 or 2-3); the rest run elsewhere"
    )
    args = parser.parse_args()
    if args.proxy_cpus is not None:
        try:
            pin_proxies(args.proxy_cpus)
        except ValueError as exc:
            parser.error(f"--proxy-cpus {args.proxy_cpus}: {exc}")
    floors_named = sorted({"byte-relay", "haproxy"} & set(args.paths or ()))
    if floors_named and not args.floors:
        parser.error(f"--paths {' '.join(floors_named)} needs --floors, which starts those proxies")
    if args.wave and not args.lockstep:
        parser.error("--wave needs --lockstep: waves end together only when the engine steps every stream together")
    if args.baseline_src is not None and not (args.baseline_src / "deepserve").is_dir():
        parser.error(f"--baseline-src {args.baseline_src} has no deepserve package; give a checkout's src/ directory")
    if args.lockstep and args.ttft_ms:
        parser.error("--ttft-ms does not apply with --lockstep: the first token comes at the end of the prefill step")
    if args.lockstep and not args.no_rate:
        # every request takes an engine step or two: requests/s would measure the steps, not the servers
        print("--lockstep: no requests/s measurement (run it without --lockstep)", file=sys.stderr)
        args.no_rate = True
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["DEEPSERVE_HOME"] = tmp  # the gateway's ledger and keys go to a throw-away home
        return runner(_run(args, Path(tmp)))


def pin_proxies(spec: str) -> None:
    """Run the proxies on the CPUs of SPEC ("1", "2-3", "1,3") and this process (and the upstream and Redis it
    starts) on every other CPU it may use."""
    global PROXY_CPUS
    allowed = os.sched_getaffinity(0)
    cpus: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        if not first.strip().isdigit() or (last and not last.strip().isdigit()):
            raise ValueError(f"{part!r} is not a CPU number or range (e.g. 1 or 2-3)")
        cpus.update(range(int(first), int(last or first) + 1))
    if not cpus <= allowed:
        raise ValueError(
            f"CPUs {sorted(cpus - allowed)} are not available here (this process may use {sorted(allowed)})"
        )
    if not allowed - cpus:
        raise ValueError("no CPU would be left for the upstream and the load generator")
    os.sched_setaffinity(0, allowed - cpus)
    PROXY_CPUS = cpus


def prioritise_load(nice: int) -> None:
    """Give this process (the load generator; the servers it started keep theirs) the nice value NICE. On a machine
    with fewer cores than busy processes, Linux lets a running process keep its core for a while after it woke
    another (EEVDF's run to parity): the load generator, woken by a proxy's first relayed event, waits on the run
    queue until the proxy has relayed the whole engine step, which a client on another machine would not."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except PermissionError as exc:
        why = f"--load-nice {nice}: not permitted ({exc}); a negative value needs root or CAP_SYS_NICE"
        raise SystemExit(why) from None
    print(f"load generator at nice {os.getpriority(os.PRIO_PROCESS, 0)}; the servers at their own", flush=True)


async def _run(args: argparse.Namespace, workdir: Path) -> int:
    placement = (
        f"gateways on CPUs {sorted(PROXY_CPUS)}, upstream and load generator on {sorted(os.sched_getaffinity(0))}"
        if PROXY_CPUS
        else "shared"
    )
    print(f"machine: {os.cpu_count()} CPUs ({placement}); every server is one process on loopback", flush=True)
    upstream = start_upstream(args.itl_ms, args.ttft_ms, args.lockstep)
    servers = [upstream]
    try:
        targets = {"direct": upstream}
        key = bench_key()
        gateway = start_gateway(upstream.url, key)
        servers.append(gateway)
        targets["gateway"] = gateway
        if args.workers:
            in_memory = start_gateway(upstream.url, key, workers=2)
            servers.append(in_memory)
            targets["workers=2"] = in_memory
        if args.baseline_src is not None:
            baseline = start_gateway(upstream.url, key, src=args.baseline_src)
            servers.append(baseline)
            targets["baseline"] = baseline
        if args.redis:
            redis = start_redis()
            servers.append(redis)
            shared = start_gateway(upstream.url, key, redis_url=redis.url)
            servers.append(shared)
            targets["gw+redis"] = shared
            workers = start_gateway(upstream.url, key, redis_url=redis.url, workers=2)
            servers.append(workers)
            targets["w=2+redis"] = workers
            for server in (shared, workers):
                server.redis_url = redis.url
        if args.redis and args.baseline_src is not None:
            # a Redis of its own: the two versions' scripts may store their state differently
            base_redis = start_redis()
            servers.append(base_redis)
            for name, fields in (("base+redis", {}), ("base+w=2", {"workers": 2})):
                server = start_gateway(upstream.url, key, src=args.baseline_src, redis_url=base_redis.url, **fields)
                server.redis_url = base_redis.url
                servers.append(server)
                targets[name] = server
        if args.floors:
            targets.update(start_floors(upstream.url, workdir, servers))
        if args.paths:
            targets = {name: server for name, server in targets.items() if name == "direct" or name in args.paths}
        binary = None if args.no_litellm else ensure_litellm()
        if binary is not None:
            try:
                litellm = start_litellm(binary, upstream.url, workdir)
                servers.append(litellm)
                targets["litellm"] = litellm
            except RuntimeError as exc:
                print(f"note: LiteLLM skipped: {exc}", flush=True)
        if args.load_nice is not None:
            prioritise_load(args.load_nice)
        rows = await _measure(args, targets)
    finally:
        for server in reversed(servers):
            server.stop()
    _print_tables(args, rows)
    return 0


async def _measure(args: argparse.Namespace, targets: dict[str, Server]) -> dict[str, object]:
    """Each path in turn under the same load. For the proxies, also the CPU the proxy process itself used per
    request: unlike latency, that does not depend on what else the shared cores are doing."""
    rows: dict[str, object] = {}
    redis_stats: dict[str, dict[str, list[float]]] = collections.defaultdict(dict)  # "32/gw+redis" → command stats
    redis_streams: collections.Counter[str] = collections.Counter()
    rows["redis"] = (redis_stats, redis_streams)
    stream_s = (args.ttft_ms + args.tokens * args.itl_ms) / 1000
    for server in targets.values():  # warm every path (imports, connection pools, caches) before anything counts
        await request_rate(server.url, 16, 1.0, warm_s=0.0, api_key=server.api_key)
    # The load generator's own long-lived objects out of the collector's reach: its full collections would pause
    # the timing of whichever path runs at that moment (the gateway does the same in its own process)
    gc.collect()
    gc.freeze()
    for concurrency in args.concurrency:
        names = [name for name in targets if name != "litellm" or concurrency <= args.litellm_max_streams]
        results: dict[str, list[StreamResult]] = {name: [] for name in names}
        by_repeat: dict[str, list[StreamSummary]] = {name: [] for name in names}

        for name in names:  # not counted: the first run at a new concurrency (pools and buffers growing) was slower
            await _load(args, targets[name], concurrency, 2, stream_s)
        cpu_s: dict[str, float] = dict.fromkeys(names, 0.0)
        wall_s: dict[str, float] = dict.fromkeys(names, 0.0)
        for repeat in range(args.repeats):
            # alternate the order (A B, B A, …) so that a change in the machine's load hits every path alike
            for name in names if repeat % 2 == 0 else names[::-1]:
                server = targets[name]
                if server.redis_url:
                    redis_reset_stats(server.redis_url)
                started, cpu_before = time.perf_counter(), server.cpu_s()
                batch = await _load(args, server, concurrency, args.rounds, stream_s)
                elapsed_s = time.perf_counter() - started
                if server.redis_url:
                    _add_redis_stats(redis_stats, f"{concurrency}/{name}", redis_command_stats(server.redis_url))
                    redis_streams[f"{concurrency}/{name}"] += concurrency * args.rounds
                cpu_s[name] += (server.cpu_s() - cpu_before) * (args.rounds - 1) / args.rounds
                wall_s[name] += elapsed_s * (args.rounds - 1) / args.rounds
                results[name] += batch
                one = summarise(batch)
                by_repeat[name].append(one)
                for reason, count in collections.Counter(r.error for r in batch if r.error).most_common(3):
                    print(f"        {count} failed: {reason}", flush=True)
                print(f"  {concurrency:>5} streams via {name:<8} TTFT p50 {one.ttft_p50_ms:.2f} ms, "
                      f"p99 {one.ttft_p99_ms:.2f} ms, ITL {one.itl_mean_ms:.2f} ms, "
                      f"{one.failures}/{one.count} failed ({elapsed_s:.1f} s)", flush=True)  # fmt: skip
        for name in names:
            summary = summarise(results[name])
            summary.proxy_cpu_ms_per_stream = cpu_s[name] * 1000 / max(1, len(results[name]))
            summary.core_share = cpu_s[name] / wall_s[name] if wall_s[name] else float("nan")
            summary.repeats = by_repeat[name]
            if args.wave:
                summary.wave_median_ms, summary.wave_slowest_ms = wave_ttfts(results[name], concurrency)
                summary.wave_places_ms = wave_place_ttfts(results[name], concurrency)
            rows[f"stream/{concurrency}/{name}"] = summary
    if args.latency_requests:
        latencies: dict[str, list[float]] = {name: [] for name in targets if name != "litellm"}
        for repeat in range(4):  # alternating order, as for the streams
            for name in list(latencies) if repeat % 2 == 0 else list(latencies)[::-1]:
                server = targets[name]
                latencies[name] += await request_latencies(server.url, args.latency_requests // 4, server.api_key)
        rows["latency"] = latencies
    for name, server in targets.items():
        if args.no_rate:
            break
        rate, failed, cpu_us = await request_rate(
            server.url, args.rate_concurrency, args.rate_duration_s, cpu_s=server.cpu_s, api_key=server.api_key
        )
        rows[f"rate/{name}"] = (rate, failed, cpu_us)
        print(f"  requests/s via {name:<8} {rate:,.0f} ({failed} failed), {cpu_us:,.0f} µs CPU per request "
              "in that process", flush=True)  # fmt: skip
    return rows


def _add_redis_stats(into: dict[str, dict[str, list[float]]], path: str, stats: dict[str, tuple[int, float]]) -> None:
    for command, (calls, usec) in stats.items():
        total = into[path].setdefault(command, [0, 0.0])
        total[0] += calls
        total[1] += usec


async def _load(
    args: argparse.Namespace, server: Server, concurrency: int, rounds: int, stream_s: float
) -> list[StreamResult]:
    if args.wave:
        return await wave_load(server.url, concurrency, rounds, args.tokens, server.api_key)
    return await stream_load(server.url, concurrency, rounds, args.tokens, stream_s, server.api_key)


def _print_redis_stats(measured: object) -> None:
    """What each Redis path cost Redis per stream (every measured batch, warm-up wave included): the scripts
    (EVALSHA) and, inside them, the commands they called."""
    if not isinstance(measured, tuple) or not measured[0]:
        return
    stats, streams = measured
    print()
    print("Redis's own time (INFO commandstats, reset before each batch): per stream, and per call")
    print("| streams/path | EVALSHA per stream | µs per EVALSHA | Redis µs per stream | Redis reads per stream "
          "| commands inside the scripts (calls per stream × µs per call) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---|")
    for path, commands in stats.items():
        count = max(1, streams[path])
        calls, usec = commands.get("evalsha", (0, 0.0))
        skip = ("evalsha", "reads", "config|resetstat", "info")
        top = sorted(((name, c, u) for name, (c, u) in commands.items() if name not in skip), key=lambda item: -item[2])
        inside = ", ".join(f"{name} {c / count:.1f}×{u / max(1, c):.2f}" for name, c, u in top[:8])
        reads = commands.get("reads", (0, 0.0))[0]
        print(f"| {path} | {calls / count:.2f} | {usec / max(1, calls):.2f} | {usec / count:.1f} | {reads / count:.2f} "
              f"| {inside} |")  # fmt: skip


def _spread_row(concurrency: int, name: str, summary: StreamSummary, direct: StreamSummary) -> str:
    """One path's added TTFT per repeat, so that a reader sees how much of a difference is the machine's noise."""
    pairs = list(zip(summary.repeats, direct.repeats, strict=True))
    p50s = [via.ttft_p50_ms - base.ttft_p50_ms for via, base in pairs]
    p99s = [via.ttft_p99_ms - base.ttft_p99_ms for via, base in pairs]
    return (f"| {concurrency} | {name} | {' / '.join(f'{v:+.2f}' for v in p50s)} | "
            f"{' / '.join(f'{v:+.2f}' for v in p99s)} | {min(p99s):+.2f} … {max(p99s):+.2f} |")  # fmt: skip


PATHS = (
    "direct", "gateway", "workers=2", "baseline", "gw+redis", "w=2+redis", "base+redis", "base+w=2", "litellm",
    "byte-relay", "haproxy",
)  # fmt: skip


def _measured_paths(
    args: argparse.Namespace, rows: dict[str, object]
) -> Iterator[tuple[int, str, StreamSummary, StreamSummary]]:
    """(concurrency, path, its summary, direct's summary) for every path measured, in the tables' order."""
    for concurrency in args.concurrency:
        direct = rows.get(f"stream/{concurrency}/direct")
        for name in PATHS:
            summary = rows.get(f"stream/{concurrency}/{name}")
            if isinstance(summary, StreamSummary) and isinstance(direct, StreamSummary):
                yield concurrency, name, summary, direct


def _print_wave_table(args: argparse.Namespace, rows: dict[str, object]) -> None:
    print()
    print("By wave (see wave_ttfts): the median over waves of each wave's median TTFT and of its slowest stream's")
    print("| streams | path | waves | wave median TTFT ms | added ms | wave's slowest TTFT ms | added ms |")
    print("|---|---|---|---|---|---|---|")
    for concurrency, name, summary, direct in _measured_paths(args, rows):
        added = (
            (f"{summary.wave_median_ms - direct.wave_median_ms:+.2f}",
             f"{summary.wave_slowest_ms - direct.wave_slowest_ms:+.2f}")
            if name != "direct" else ("–", "–")
        )  # fmt: skip
        print(f"| {concurrency} | {name} | {summary.count // concurrency} | {summary.wave_median_ms:.2f} | "
              f"{added[0]} | {summary.wave_slowest_ms:.2f} | {added[1]} |")  # fmt: skip


def _print_place_table(args: argparse.Namespace, rows: dict[str, object]) -> None:
    print()
    print("By place in the wave (see wave_places): the median over waves of the TTFT of the wave's k-th fastest "
          "stream, and what the path added to it")  # fmt: skip
    print("| streams | path | TTFT ms by place (added ms) |")
    print("|---|---|---|")
    for concurrency, name, summary, direct in _measured_paths(args, rows):
        cells = []
        for place, ttft_ms in summary.wave_places_ms.items():
            added = "" if name == "direct" else f" ({ttft_ms - direct.wave_places_ms.get(place, float('nan')):+.2f})"
            cells.append(f"{place + 1}: {ttft_ms:.2f}{added}")
        print(f"| {concurrency} | {name} | {' / '.join(cells)} |")


def _print_tables(args: argparse.Namespace, rows: dict[str, object]) -> None:
    print()
    mode = "lockstep (one engine step for all streams)" if args.lockstep else "staggered"
    if args.wave:
        mode += ", arriving in waves (each wave at once, when the one before ended)"
    print(f"Streams of {args.tokens} tokens, upstream TTFT {args.ttft_ms:g} ms, ITL {args.itl_ms:g} ms, {mode}; "
          "added = via − direct, same run")  # fmt: skip
    print("| streams | chunks/s | path | TTFT p50 ms | TTFT p99 ms | ITL mean ms | added TTFT p50 ms "
          "| added TTFT p99 ms | added ITL ms | server CPU ms/stream | server core % | failed |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    spreads = []
    for concurrency, name, summary, direct in _measured_paths(args, rows):
        added = (
            f"{summary.ttft_p50_ms - direct.ttft_p50_ms:+.2f} | {summary.ttft_p99_ms - direct.ttft_p99_ms:+.2f} | "
            f"{summary.itl_mean_ms - direct.itl_mean_ms:+.2f}"
            if name != "direct" else "– | – | –"
        )  # fmt: skip
        chunk_rate = concurrency * 1000 / args.itl_ms
        print(f"| {concurrency} | {chunk_rate:,.0f} | {name} | {summary.ttft_p50_ms:.2f} | "
              f"{summary.ttft_p99_ms:.2f} | {summary.itl_mean_ms:.2f} | {added} | "
              f"{summary.proxy_cpu_ms_per_stream:.2f} | {summary.core_share * 100:.0f} | "
              f"{summary.failures}/{summary.count} |")  # fmt: skip
        if name != "direct":
            spreads.append(_spread_row(concurrency, name, summary, direct))
    if args.wave:
        _print_wave_table(args, rows)
        _print_place_table(args, rows)
    print()
    print("Added TTFT of each repeat on its own (that repeat's path minus the same repeat's direct), in run order:")
    print("| streams | path | added TTFT p50 ms by repeat | added TTFT p99 ms by repeat | p99 range |")
    print("|---|---|---|---|---|")
    for row in spreads:
        print(row)
    _print_redis_stats(rows.get("redis"))
    latency = rows.get("latency")
    if isinstance(latency, dict):
        print()
        print("Non-streamed 1-token completions one after the other on one connection: latency per request")
        print("| path | requests | p50 ms | p99 ms | p50 − direct ms | p50 − gateway ms | p99 − gateway ms |")
        print("|---|---|---|---|---|---|---|")
        direct_p50 = percentile(latency.get("direct") or [], 50)
        base = latency.get("gateway") or []
        for name, values in latency.items():
            p50, p99 = percentile(values, 50), percentile(values, 99)
            versus_gateway = (
                f"{p50 - percentile(base, 50):+.3f} | {p99 - percentile(base, 99):+.3f}"
                if name not in ("direct", "gateway") else "– | –"
            )  # fmt: skip
            versus_direct = f"{p50 - direct_p50:+.3f}" if name != "direct" else "–"
            print(f"| {name} | {len(values)} | {p50:.3f} | {p99:.3f} | {versus_direct} | {versus_gateway} |")
    if args.no_rate:
        return
    print()
    print(f"Non-streamed 1-token completions, {args.rate_concurrency} concurrent, {args.rate_duration_s:g} s")
    print(
        "| path | requests/s | failed | vs LiteLLM | server CPU µs/request | requests/s per server core | vs LiteLLM |"
    )
    print("|---|---|---|---|---|---|---|")
    litellm = rows.get("rate/litellm")
    for name in PATHS:
        value = rows.get(f"rate/{name}")
        if not isinstance(value, tuple):
            continue
        ratio = cpu_ratio = "–"
        if isinstance(litellm, tuple) and litellm[0]:
            ratio = f"{value[0] / litellm[0]:.1f}×"
            cpu_ratio = f"{litellm[2] / value[2]:.1f}×"
        print(f"| {name} | {value[0]:,.0f} | {value[1]} | {ratio} | {value[2]:,.0f} | {1e6 / value[2]:,.0f} | "
              f"{cpu_ratio} |")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
