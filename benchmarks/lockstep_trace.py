"""Where a lockstep engine step's first tokens spend their time on the way to the client, direct and through the
gateway: one clock (CLOCK_MONOTONIC, shared by every process) stamped in the engine fake when it hands a step's
tokens to its streams and when it has written them all, in the gateway when it relays a stream's first event, and
in the load generator when a stream's first token arrives; with the load generator's time spent runnable but
waiting for a core (/proc/self/schedstat) per wave.

    .venv/bin/python benchmarks/lockstep_trace.py                      # about 1 minute
    .venv/bin/python benchmarks/lockstep_trace.py --load-nice -10      # the load generator preferred (root)

Waves of CONCURRENCY streams are sent at once (as benchmarks/gateway_overhead.py --lockstep --wave does): the first
request starts engine step 1 alone and the others join step 2, whose end hands CONCURRENCY - 1 first tokens out
together. Times are milliseconds after that hand-out (the engine's step 2), medians over the counted waves.

The stamps come from hooks that a `sitecustomize` module installs in the engine fake and the gateway (a temporary
directory on their PYTHONPATH); they wrap two functions and add list appends, nothing else."""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gateway_overhead as harness

REPO = Path(__file__).resolve().parent.parent

# Installed in the servers' processes: stamps kept in memory, appended to TRACE_DIR/<pid>.txt twice a second.
HOOKS = """
import os, threading, time
_stamps = []
_path = os.path.join(os.environ["TRACE_DIR"], f"{os.getpid()}.txt")
_clock = time.perf_counter

def _dump():
    while True:
        time.sleep(0.5)
        taken, _stamps[:] = list(_stamps), []
        if taken:
            with open(_path, "a") as out:
                out.writelines(f"{kind} {at:.7f}\\n" for kind, at in taken)

threading.Thread(target=_dump, daemon=True).start()

import deepserve.simulate.engine as _engine
_deliver = _engine._deliver
def _stamped_deliver(outputs, now_s):
    _stamps.append(("engine", _clock()))
    _deliver(outputs, now_s)
    _stamps.append(("engine_written", _clock()))
_engine._deliver = _stamped_deliver

import deepserve.gateway.relay as _relay
_messages = _relay.StreamRelay._messages
def _stamped_messages(self, data):
    first = not self._exchange.response_started
    at = _clock()
    messages = _messages(self, data)
    if first and messages:
        _stamps.append(("gateway", at))
    return messages
_relay.StreamRelay._messages = _stamped_messages
"""


def hooked_src(trace_dir: Path) -> Path:
    """A src/ directory for the servers: this checkout's package and the hooks."""
    src = trace_dir / "src"
    src.mkdir()
    (src / "deepserve").symlink_to(REPO / "src" / "deepserve")
    (src / "sitecustomize.py").write_text(HOOKS)
    return src


def run_queue_wait_s() -> float:
    """Seconds this process has spent runnable but not running."""
    with open("/proc/self/schedstat") as stat:
        return int(stat.read().split()[1]) / 1e9


async def waves(url: str, api_key: str, concurrency: int, count: int) -> list[tuple[float, float, list[float]]]:
    """COUNT waves after one uncounted: (sent at, run-queue wait during the wave, first-token times). Each stream is
    read as gateway_overhead.py reads it, so a first token here is the one its TTFT counts."""
    body = harness.stream_body(50)
    headers = harness.headers_for(api_key)
    out = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        for index in range(count + 1):
            sent, waited = time.perf_counter(), run_queue_wait_s()
            wave = await asyncio.gather(
                *(harness.one_stream(session, url + "/chat/completions", body, headers) for _ in range(concurrency))
            )
            failed = [result.error for result in wave if not result.ok]
            if failed:
                raise RuntimeError(f"{url}: {len(failed)} of {concurrency} streams failed, e.g. {failed[0]}")
            if index:
                out.append((sent, run_queue_wait_s() - waited, sorted(result.first_at_s for result in wave)))
    return out


def read_stamps(trace_dir: Path) -> dict[str, list[float]]:
    stamps: dict[str, list[float]] = {"engine": [], "engine_written": [], "gateway": []}
    for path in trace_dir.glob("*.txt"):
        for line in path.read_text().splitlines():
            kind, at = line.split()
            stamps[kind].append(float(at))
    return {kind: sorted(times) for kind, times in stamps.items()}


def wave_figures(wave: tuple[float, float, list[float]], stamps: dict[str, list[float]]) -> dict[str, float] | None:
    """One wave's times in ms after the engine's step-2 hand-out; None when the wave did not split into a step of
    one stream and a step of the rest (a busy machine delayed the first request's step)."""
    sent, waited, firsts = wave
    steps = [at for at in stamps["engine"] if sent <= at <= firsts[-1]]
    if len(steps) < 2:
        return None
    step1, step2 = steps[0], steps[1]
    second = [at for at in firsts if at > step2]
    if len(second) != len(firsts) - 1:
        return None
    relayed = [at for at in stamps["gateway"] if step2 <= at <= firsts[-1]]
    written = next(at for at in stamps["engine_written"] if at >= step2)
    ms = 1000.0
    figures = {
        "load generator waiting for a core (ms/wave)": waited * ms,
        "step 1: first token at the client": (firsts[0] - step1) * ms,
        "step 2: the engine fake has written every stream's token": (written - step2) * ms,
        "step 2: first stream's token at the client": (second[0] - step2) * ms,
        "step 2: median stream's token at the client": (statistics.median(second) - step2) * ms,
        "step 2: last stream's token at the client": (second[-1] - step2) * ms,
    }
    if relayed:
        figures["step 2: gateway relays the first stream's token"] = (relayed[0] - step2) * ms
        figures["step 2: gateway relays the median stream's"] = (statistics.median(relayed) - step2) * ms
        figures["step 2: gateway relays the last stream's"] = (relayed[-1] - step2) * ms
    return figures


async def measure(args: argparse.Namespace, trace_dir: Path) -> dict[str, list[dict[str, float]]]:
    os.environ["TRACE_DIR"] = str(trace_dir)
    src = hooked_src(trace_dir)
    os.environ["PYTHONPATH"] = str(src)  # the engine fake's process, started next, loads the hooks too
    upstream = harness.start_upstream(args.itl_ms, lockstep=True)
    servers = [upstream]
    try:
        key = harness.bench_key()
        gateway = harness.start_gateway(upstream.url, key, src=src)
        servers.append(gateway)
        if args.load_nice is not None:
            harness.prioritise_load(args.load_nice)
        raw: dict[str, list[tuple[float, float, list[float]]]] = {"direct": [], "gateway": []}
        for repeat in range(args.repeats):  # alternating, as gateway_overhead.py does
            for name in ("direct", "gateway") if repeat % 2 == 0 else ("gateway", "direct"):
                server = upstream if name == "direct" else gateway
                raw[name] += await waves(server.url, server.api_key, args.concurrency, args.waves)
        time.sleep(1.2)  # the hooks' last dump
    finally:
        for server in reversed(servers):
            server.stop()
    stamps = read_stamps(trace_dir)
    return {name: [f for f in (wave_figures(w, stamps) for w in got) if f is not None] for name, got in raw.items()}


def print_table(measured: dict[str, list[dict[str, float]]]) -> None:
    print("| after the engine's step 2 hands out its first tokens (ms, median over waves) | direct | gateway | added |")
    print("|---|---:|---:|---:|")
    keys = list(dict.fromkeys(key for figures in measured["gateway"] for key in figures))
    for key in keys:
        cells = []
        for name in ("direct", "gateway"):
            values = [figures[key] for figures in measured[name] if key in figures]
            cells.append(statistics.median(values) if values else None)
        direct, via = cells
        shown = [f"{v:.2f}" if v is not None else "–" for v in cells]
        added = f"{via - direct:+.2f}" if direct is not None and via is not None else "–"
        print(f"| {key} | {shown[0]} | {shown[1]} | {added} |")
    print(f"waves counted: direct {len(measured['direct'])}, gateway {len(measured['gateway'])}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=32, help="streams per wave")
    parser.add_argument("--waves", type=int, default=5, help="counted waves per repeat and path")
    parser.add_argument("--repeats", type=int, default=4, help="alternating runs of each path")
    parser.add_argument("--itl-ms", type=float, default=20.0, help="the engine fake's step")
    parser.add_argument("--load-nice", type=int, default=None, help="as gateway_overhead.py --load-nice")
    args = parser.parse_args()
    if args.concurrency < 2:
        parser.error("--concurrency must be at least 2: step 2 needs the streams that did not start step 1")
    import uvloop

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["DEEPSERVE_HOME"] = tmp
        trace_dir = Path(tmp) / "trace"
        trace_dir.mkdir()
        measured = uvloop.run(measure(args, trace_dir))
    print_table(measured)
    return 0


if __name__ == "__main__":
    sys.exit(main())
