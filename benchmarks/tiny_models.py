"""Issue 18's numbers for the tiny models: time from `deepserve serve --model M` to ready, and output tokens/s at
concurrency 1 and 16 (through the gateway, measured with `deepserve bench`), for the tiny DeepSeek-V4 against the
tiny DeepSeek-V3 on this machine.

    .venv/bin/python benchmarks/tiny_models.py [--models tiny-v4 tiny] [--input-len 128] [--output-len 128]

Starts one service at a time on a free loopback port in a temporary DEEPSERVE_HOME (so each model is generated as
a user's first run would, and that time is included in time to ready), runs bounded benchmarks against it, stops
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
from dataclasses import dataclass
from pathlib import Path

from deepserve.net import free_port

CONCURRENCIES = (1, 16)


@dataclass
class ModelRun:
    model: str
    ready_s: float
    results: dict[int, dict[str, float]]  # concurrency -> deepserve bench's JSON result


def start_service(home: Path, model: str) -> tuple[subprocess.Popen[str], float, str]:
    """The process, the seconds until its READY line, and its public base URL."""
    env = {**os.environ, "DEEPSERVE_HOME": str(home)}
    command = [sys.executable, "-m", "deepserve.cli.main", "serve", "--model", model, "--port", str(free_port())]
    started = time.monotonic()
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("READY "):
            return process, time.monotonic() - started, line.split()[1]
    raise SystemExit(f"deepserve serve --model {model} exited with {process.wait()} before it was ready")


def bench(base_url: str, concurrency: int, args: argparse.Namespace, out: Path) -> dict[str, float]:
    name = f"c{concurrency}-{time.monotonic_ns()}.json"
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


def measure(model: str, args: argparse.Namespace, tmp: Path) -> ModelRun:
    process, ready_s, base_url = start_service(tmp / f"home-{model}", model)
    try:
        results = {c: bench(base_url, c, args, tmp) for c in CONCURRENCIES}
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)
    return ModelRun(model, ready_s, results)


def table(runs: list[ModelRun]) -> str:
    header = "| model | ready s | " + " | ".join(f"out tok/s c={c} | TPOT ms c={c}" for c in CONCURRENCIES) + " |"
    lines = [header, "|---|---:|" + "---:|---:|" * len(CONCURRENCIES)]
    for run in runs:
        cells = [f"{r['output_throughput']:.1f} | {r['median_tpot_ms']:.1f}" for r in run.results.values()]
        lines.append(f"| {run.model} | {run.ready_s:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny-v4", "tiny"], help="presets to compare, in order")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prompts-per-stream", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = [measure(model, args, Path(tmp)) for model in args.models]
    print(f"input {args.input_len} / output {args.output_len} tokens, random prompts, through the gateway\n")
    print(table(runs))


if __name__ == "__main__":
    main()
