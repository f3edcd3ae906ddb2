"""What one request's admission costs in each kind of gateway limits: a key with rpm, tpm and concurrency limits
admitted, given a global slot and released, N times in a loop, with the limits in the process (one worker) and in
the memory that `--workers N` share on one host (host_limits.py). Redis's cost is a round trip and is measured by
benchmarks/gateway_overhead.py instead.

    .venv/bin/python benchmarks/limiter_admission.py            # about 5 seconds
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from deepserve.gateway.host_limits import HostLimiter, LimitZone
from deepserve.gateway.limits import KeyLimits, Limiter, LocalLimiter

LIMITS = KeyLimits(rpm=10**9, tpm=10**12, max_concurrency=10**6)


async def microseconds_per_request(limiter: Limiter, requests: int) -> float:
    started = time.perf_counter()
    for _ in range(requests):
        admission = await limiter.admit("bench", LIMITS, 100)
        await limiter.acquire_slot(admission)
        limiter.release(admission, 50)
    return (time.perf_counter() - started) / requests * 1e6


async def main(requests: int, repeats: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        zone = LimitZone.create(Path(tmp) / "limits.zone", workers=2, capacity=65536)
        limiters: dict[str, Limiter] = {
            "one worker (in the process)": LocalLimiter(8192, 8192, 10.0),
            "--workers 2 (shared memory)": HostLimiter(
                LimitZone.attach(zone.path), 0, max_concurrency=8192, max_queue=8192, queue_timeout_s=10.0
            ),
        }
        print(f"| limits | µs per request (admit, slot, release), best of {repeats} x {requests:,} |")
        print("|---|---:|")
        for name, limiter in limiters.items():
            best = min([await microseconds_per_request(limiter, requests) for _ in range(repeats)])
            print(f"| {name} | {best:.2f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(main(args.requests, args.repeats))
