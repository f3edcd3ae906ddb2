"""CPU per request and per stream of the gateway's upstream client against aiohttp's, side by side in one process.

Both clients send the same requests to the same upstream (`deepserve simulate` with fixed timings, its own process on
loopback): non-streamed 1-token chat completions, then 20-token streams (an event every millisecond, so that each
arrives on its own, as from an engine) read to the end, at a fixed concurrency,
in alternating rounds (ours, aiohttp, aiohttp, ours, ...). The figure is this process's CPU time (user + system)
per request, which is what the client costs the gateway; wall-clock rates depend on the upstream and the machine.

    .venv/bin/python benchmarks/upstream_client.py           # the figures quoted in docs/PERFORMANCE.md (Gateway)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import aiohttp

from deepserve.gateway.http_client import HttpClient, Origin
from deepserve.simulate.fixed import FAKE_MODEL, simulate_command

Send = Callable[[bytes], Awaitable[int]]  # sends one request body, returns the bytes of response body read


def start_upstream(port: int, itl_ms: float) -> subprocess.Popen[str]:
    argv = simulate_command(port, "--fixed-itl-ms", str(itl_ms), "--max-seconds", "7200")
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("READY "):
            return process
    raise RuntimeError(f"the simulated upstream did not start (exit {process.wait()})")


def body(tokens: int, stream: bool) -> bytes:
    message = [{"role": "user", "content": "hello"}]
    return json.dumps({"model": FAKE_MODEL, "messages": message, "max_tokens": tokens, "stream": stream}).encode()


def ours(client: HttpClient, origin: Origin) -> Send:
    async def send(payload: bytes) -> int:
        response = await client.request("POST", origin, "/v1/chat/completions", payload)
        size = 0
        async for chunk in response.chunks():
            size += len(chunk)
        response.release()
        return size

    return send


def theirs(session: aiohttp.ClientSession, url: str) -> Send:
    async def send(payload: bytes) -> int:
        headers = {"Content-Type": "application/json"}
        async with session.post(url + "/v1/chat/completions", data=payload, headers=headers) as response:
            size = 0
            async for chunk in response.content.iter_any():
                size += len(chunk)
            return size

    return send


async def cpu_us_per_request(send: Send, payload: bytes, requests: int, concurrency: int) -> float:
    remaining = requests

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            if not await send(payload):
                raise RuntimeError("empty response")

    started = time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return (time.process_time() - started) * 1e6 / requests


async def run(args: argparse.Namespace) -> dict[tuple[str, str], list[float]]:
    origin = Origin("127.0.0.1", args.port, False)
    client = HttpClient(connect_timeout_s=5, read_timeout_s=60, idle_s=30)
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=args.concurrency))
    senders = {"deepserve": ours(client, origin), "aiohttp": theirs(session, f"http://127.0.0.1:{args.port}")}
    loads = {"request": body(1, False), "stream": body(20, True)}
    results: dict[tuple[str, str], list[float]] = {}
    try:
        for load, payload in loads.items():
            for send in senders.values():  # warm-up: connections opened, code paths hot
                await cpu_us_per_request(send, payload, args.concurrency * 4, args.concurrency)
            for round_index in range(args.rounds):
                order = list(senders) if round_index % 2 == 0 else list(reversed(senders))
                for name in order:
                    value = await cpu_us_per_request(senders[name], payload, args.requests, args.concurrency)
                    results.setdefault((load, name), []).append(value)
    finally:
        await client.close()
        await session.close()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=18931, help="loopback port for the simulated upstream")
    parser.add_argument("--requests", type=int, default=3000, help="requests per client per round")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument(
        "--itl-ms", type=float, default=1.0, help="gap between stream events (each arrives in its own read)"
    )
    args = parser.parse_args()
    upstream = start_upstream(args.port, args.itl_ms)
    try:
        import uvloop

        results = uvloop.run(run(args))
    finally:
        upstream.terminate()
        upstream.wait(10)
    print(
        f"\n{args.requests} requests per round, {args.rounds} rounds alternating, concurrency {args.concurrency}, "
        f"stream events {args.itl_ms} ms apart"
    )
    print("| load | client | CPU µs per request (median) | by round |")
    print("|---|---|---|---|")
    for (load, name), values in results.items():
        rounds = " / ".join(f"{v:.0f}" for v in values)
        label = "1-token request" if load == "request" else "20-token stream"
        print(f"| {label} | {name} | {statistics.median(values):.0f} | {rounds} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
