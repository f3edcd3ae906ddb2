"""How many simulated streams one core sustains: `deepserve simulate` pinned to one CPU, N concurrent streams in
lockstep (--fixed-step-ms: every running stream gets a token each step, vLLM's pattern), read by a lean load
generator pinned to another CPU.

For each N it reports the tokens per second delivered, the simulator's CPU use (share of its one core), its CPU
time per token, how far its event loop fell behind the ideal timeline (`lag`, from /simulate/stats), and the mean
interval between tokens the clients saw against the step time. A level is sustained while CPU stays under 100%,
the loop never falls behind and the clients' intervals stay within 5% of the step.

    .venv/bin/python benchmarks/simulate_streams_per_core.py                    # the table in docs/PERFORMANCE.md
    .venv/bin/python benchmarks/simulate_streams_per_core.py --step-ms 50 --streams 256,1024,4096

It first measures the same work without sockets (the engine, the scheduler and the SSE formatting writing into a
null transport, on a virtual clock), whose CPU time per token is what the simulator costs before the kernel's
share of each write.

The load generator is not `deepserve bench` (whose per-chunk timestamps and parsing would saturate its own core
first): it counts SSE events per stream and their arrival times, nothing else.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import psutil

from deepserve.net import free_port

MODEL = "sim-model"


@dataclass
class Level:
    streams: int
    tokens: int
    wall_s: float
    server_cpu_s: float
    lag_s: float
    mean_interval_ms: float
    errors: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def cpu_share(self) -> float:
        return self.server_cpu_s / self.wall_s

    @property
    def cpu_us_per_token(self) -> float:
        return self.server_cpu_s / max(self.tokens, 1) * 1e6


def start_simulator(port: int, step_ms: float, cpu: int | None) -> subprocess.Popen[str]:
    command = [
        sys.executable, "-m", "deepserve.cli.main", "simulate", "--model", MODEL, "--fixed-step-ms", str(step_ms),
        "--port", str(port), "--max-num-seqs", "100000", "--max-num-batched-tokens", "1000000",
        "--max-model-len", "1000000", "--max-seconds", "3600",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    if cpu is not None:
        os.sched_setaffinity(process.pid, {cpu})
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.startswith("READY"):
        process.kill()
        raise SystemExit(f"the simulator did not start: {line!r}")
    return process


async def stream(host: str, port: int, tokens: int, intervals: list[float]) -> int:
    """One streamed completion of TOKENS tokens; appends the gaps between its events; returns the events seen."""
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": tokens, "stream": True, "ignore_eos": True})
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}"
    ).encode()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(request)
    events, last = 0, None
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            now = time.perf_counter()
            count = data.count(b"data: {")
            if count:
                if last is not None:
                    intervals.append((now - last) / count)
                last = now
                events += count
            if data.endswith(b"0\r\n\r\n"):
                break
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
    return events


async def run_level(host: str, port: int, streams: int, tokens: int, process: psutil.Process) -> Level:
    async with httpx.AsyncClient() as http:
        before = (await http.get(f"http://{host}:{port}/simulate/stats")).json()["engine"]
    cpu_before = sum(process.cpu_times()[:2])
    intervals: list[float] = []
    started = time.perf_counter()
    results = await asyncio.gather(*(stream(host, port, tokens, intervals) for _ in range(streams)),
                                   return_exceptions=True)  # fmt: skip
    wall_s = time.perf_counter() - started
    cpu_s = sum(process.cpu_times()[:2]) - cpu_before
    async with httpx.AsyncClient() as http:
        after = (await http.get(f"http://{host}:{port}/simulate/stats")).json()["engine"]
    events = sum(r for r in results if isinstance(r, int))
    errors = sum(1 for r in results if not isinstance(r, int) or r < tokens)
    return Level(
        streams=streams,
        tokens=events,
        wall_s=wall_s,
        server_cpu_s=cpu_s,
        lag_s=after["lag_s"] - before["lag_s"],
        mean_interval_ms=statistics.fmean(intervals) * 1e3 if intervals else float("nan"),
        errors=errors,
    )


class _NullTransport:
    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass


def engine_only_us_per_token(streams: int, tokens: int) -> float:
    """CPU microseconds per token of the simulator's own work, sockets left out (ManualClock, null transports)."""
    from deepserve.engines.config import EngineConfig
    from deepserve.simulate.app import SimulatorApp
    from deepserve.simulate.clock import ManualClock
    from deepserve.simulate.config import SimulateConfig
    from deepserve.simulate.http import Connection
    from deepserve.simulate.setup import build_engine, resolve

    sim = SimulateConfig(fixed_step_ms=20)
    deployment = resolve(EngineConfig(model=MODEL, max_num_seqs=100_000), sim)
    clock = ManualClock()
    app = SimulatorApp(deployment, sim, build_engine(deployment, sim, clock), clock)
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": tokens, "stream": True}).encode()
    request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    for _ in range(streams):
        connection = Connection(app, set())
        connection.connection_made(_NullTransport())  # type: ignore[arg-type]
        connection.data_received(request)
    started = time.process_time()
    clock.run_until_idle()
    return (time.process_time() - started) / (streams * tokens) * 1e6


def print_table(levels: list[Level], step_ms: float) -> None:
    print(f"\nsimulated streams on one core (lockstep, one token per stream every {step_ms:g} ms)")
    print("| streams | tokens/s | simulator CPU | CPU us/token | loop lag (s) | client interval ms | sustained |")
    print("|---:|---:|---:|---:|---:|---:|:---:|")
    for level in levels:
        ok = (
            level.errors == 0
            and level.lag_s == 0
            and level.cpu_share < 0.95
            and abs(level.mean_interval_ms / step_ms - 1) <= 0.05
        )
        print(
            f"| {level.streams} | {level.tokens_per_s:,.0f} | {level.cpu_share:.0%} | {level.cpu_us_per_token:.1f} | "
            f"{level.lag_s:.2f} | {level.mean_interval_ms:.1f} | {'yes' if ok else 'no'} |"
        )
    best = min((lv.cpu_us_per_token for lv in levels if lv.tokens), default=float("nan"))
    print(
        f"\nat its cheapest, {best:.1f} us of simulator CPU per token: one core delivers about {1e6 / best:,.0f} "
        f"tokens/s, i.e. {1e6 / best * step_ms / 1e3:,.0f} streams at {step_ms:g} ms per token"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", default="64,256,512,1024,2048", help="comma-separated stream counts")
    parser.add_argument("--step-ms", type=float, default=20.0, help="simulated engine step (= the token interval)")
    parser.add_argument("--tokens", type=int, default=150, help="tokens per stream")
    parser.add_argument("--server-cpu", type=int, default=0, help="CPU the simulator is pinned to (-1: none)")
    parser.add_argument("--client-cpu", type=int, default=1, help="CPU this load generator is pinned to (-1: none)")
    args = parser.parse_args()
    own = engine_only_us_per_token(1024, 100)
    print(f"without sockets: {own:.1f} us of CPU per token (1024 lockstep streams, 100 tokens each)", flush=True)
    if args.client_cpu >= 0:
        os.sched_setaffinity(0, {args.client_cpu})
    port = free_port()
    process = start_simulator(port, args.step_ms, args.server_cpu if args.server_cpu >= 0 else None)
    levels = []
    try:
        with contextlib.suppress(ImportError):
            import uvloop

            uvloop.install()
        for streams in (int(n) for n in args.streams.split(",")):
            level = asyncio.run(run_level("127.0.0.1", port, streams, args.tokens, psutil.Process(process.pid)))
            levels.append(level)
            print(f"{streams} streams: {level.tokens_per_s:,.0f} tokens/s, CPU {level.cpu_share:.0%}", flush=True)
    finally:
        process.terminate()
        process.wait(10)
    print_table(levels, args.step_ms)


if __name__ == "__main__":
    main()
