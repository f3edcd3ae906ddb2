"""Issue 2's numbers for the tiny CPU default: time from `deepserve serve` to ready, and output tokens/s at
concurrency 1 and 16, through the gateway and straight to the engine, measured with `deepserve bench`.

    .venv/bin/python benchmarks/serve_tiny.py [--input-len 128] [--output-len 128]

Starts one service on a free loopback port in a temporary DEEPSERVE_HOME, runs bounded benchmarks against it, stops
it, and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from deepserve.net import free_port

CONCURRENCIES = (1, 16)


def start_service(home: Path) -> tuple[subprocess.Popen[str], float, list[str]]:
    """Returns the process, the seconds until its READY line, and that line's fields."""
    env = {**os.environ, "DEEPSERVE_HOME": str(home)}
    command = [sys.executable, "-m", "deepserve.cli.main", "serve", "--port", str(free_port())]
    started = time.monotonic()
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("READY "):
            return process, time.monotonic() - started, line.split()
    raise SystemExit(f"deepserve serve exited with {process.wait()} before it was ready")


def bench(base_url: str, concurrency: int, args: argparse.Namespace, out: Path) -> dict[str, float]:
    name = f"c{concurrency}-{abs(hash(base_url))}.json"
    prompts = max(8, concurrency * args.prompts_per_stream)
    command = [
        sys.executable, "-m", "deepserve.cli.main", "bench", "--base-url", base_url.removesuffix("/v1"),
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--random-range-ratio", "0", "--ignore-eos",
        "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--num-warmups", "2",
        "--save-result", "--result-dir", str(out), "--result-filename", name, "--disable-tqdm",
    ]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, timeout=1200)
    return json.loads((out / name).read_text())  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prompts-per-stream", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        process, ready_s, fields = start_service(Path(tmp) / "home")
        _, public_url, model, engine_url = fields
        try:
            rows = [
                (c, bench(public_url, c, args, Path(tmp)), bench(engine_url, c, args, Path(tmp))) for c in CONCURRENCIES
            ]
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=120)
    print(f"model {model}; input {args.input_len} / output {args.output_len} tokens; ready after {ready_s:.1f} s\n")
    print("| concurrency | output tok/s via gateway | output tok/s direct | median TPOT ms | median TTFT ms |")
    print("|---:|---:|---:|---:|---:|")
    for concurrency, gateway, direct in rows:
        print(
            f"| {concurrency} | {gateway['output_throughput']:.1f} | {direct['output_throughput']:.1f} "
            f"| {gateway['median_tpot_ms']:.1f} | {gateway['median_ttft_ms']:.1f} |"
        )


if __name__ == "__main__":
    main()
