"""CPU per request and per stream of two builds of the gateway, side by side against one simulated upstream.

The gateway of this checkout and a baseline build (another checkout's `src/`, e.g. `git archive main src | tar -x
-C /tmp/base`) run as two processes in front of the same upstream (`deepserve simulate` with fixed
timings). The load generator sends them the same
bursts in alternating order (A B, B A, ...), so that whatever else the machine does hits both alike, and reads each
gateway process's CPU time (user + system) around its bursts. CPU time per request barely depends on the machine's
load, unlike latency; read the medians side by side, not against another run.

    .venv/bin/python benchmarks/gateway_cpu_ab.py --baseline-src /tmp/base/src
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import aiohttp
import psutil

from deepserve.net import free_port
from deepserve.simulate.fixed import FAKE_MODEL, simulate_command


def start(argv: list[str], env: dict[str, str], ready: str) -> subprocess.Popen[str]:
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith(ready):
            return process
    raise RuntimeError(f"{argv} did not start (exit {process.wait()})")


def cpu_s(process: subprocess.Popen[str]) -> float:
    times = psutil.Process(process.pid).cpu_times()
    return times.user + times.system


async def burst(session: aiohttp.ClientSession, url: str, body: dict[str, object], total: int, workers: int) -> None:
    sent = 0

    async def worker() -> None:
        nonlocal sent
        while sent < total:
            sent += 1
            async with session.post(url, json=body) as response:
                await response.read()

    await asyncio.gather(*(worker() for _ in range(workers)))


async def measure(
    gateways: dict[str, tuple[str, subprocess.Popen[str]]], body: dict[str, object], args: argparse.Namespace
) -> dict[str, list[float]]:
    """{build: µs of gateway CPU per request, one value per round}."""
    per_request: dict[str, list[float]] = {name: [] for name in gateways}
    total = args.requests if not body["stream"] else args.streams
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=args.concurrency * 2)) as session:
        for url, _ in gateways.values():
            await burst(session, url, body, 200, args.concurrency)  # warm up, not counted
        names = list(gateways)
        for index in range(args.rounds):
            for name in names if index % 2 == 0 else names[::-1]:
                url, process = gateways[name]
                before_s = cpu_s(process)
                await burst(session, url, body, total, args.concurrency)
                per_request[name].append((cpu_s(process) - before_s) / total * 1e6)
    return per_request


async def run(args: argparse.Namespace, home: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    this_src = Path(__file__).resolve().parent.parent / "src"  # not the virtualenv's editable install's
    fake_port = free_port()
    fake_argv = simulate_command(fake_port, "--fixed-itl-ms", str(args.itl_ms), "--max-seconds", "7200")
    processes = [start(fake_argv, env, "READY ")]
    gateways: dict[str, tuple[str, subprocess.Popen[str]]] = {}
    try:
        for name, src in (("this checkout", this_src), ("baseline", args.baseline_src)):
            port = free_port()
            gateway_env = {**env, "DEEPSERVE_HOME": str(home / str(port)), "PYTHONPATH": str(src)}
            argv = [sys.executable, "-m", "deepserve.cli.main", "gateway", "--port", str(port),
                    "--upstream", f"http://127.0.0.1:{fake_port}/v1"]  # fmt: skip
            process = start(argv, gateway_env, "GATEWAY READY")
            processes.append(process)
            gateways[name] = (f"http://127.0.0.1:{port}/v1/chat/completions", process)
        chat = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "hello"}]}
        plain = await measure(gateways, {**chat, "max_tokens": 1, "stream": False}, args)
        streams = await measure(gateways, {**chat, "max_tokens": args.tokens, "stream": True}, args)
    finally:
        for process in reversed(processes):
            process.terminate()
            process.wait(timeout=30)
    print(f"\ngateway CPU (user + system), {args.rounds} alternating rounds, concurrency {args.concurrency}")
    print("| build | µs per non-streamed request (median) | by round | µs per stream (median) | by round |")
    print("|---|---|---|---|---|")
    for name in gateways:
        print(
            f"| {name} | {statistics.median(plain[name]):.0f} | {' / '.join(f'{v:.0f}' for v in plain[name])} "
            f"| {statistics.median(streams[name]):.0f} | {' / '.join(f'{v:.0f}' for v in streams[name])} |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-src", type=Path, required=True, help="the src/ directory of the baseline build")
    parser.add_argument("--rounds", type=int, default=12, help="bursts per build and kind, in alternating order")
    parser.add_argument("--requests", type=int, default=2000, help="non-streamed requests per burst")
    parser.add_argument("--streams", type=int, default=400, help="streams per burst")
    parser.add_argument("--tokens", type=int, default=20, help="tokens per stream")
    parser.add_argument("--itl-ms", type=float, default=5.0, help="the fake upstream's inter-token latency")
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    if not (args.baseline_src / "deepserve").is_dir():
        parser.error(f"--baseline-src {args.baseline_src} has no deepserve package; give a checkout's src/ directory")
    with tempfile.TemporaryDirectory() as home:
        asyncio.run(run(args, Path(home)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
