"""Issue 14's numbers: the tiny model served by one node against two "nodes" on loopback (vLLM's native multi-node
runtime, pipeline parallel 2, each node its own `deepserve serve`): time from start to ready, and output tokens/s at
concurrency 1 and 16 through the gateway, measured with `deepserve bench`.

    .venv/bin/python benchmarks/multi_node_tiny.py [--input-len 128] [--output-len 128]

Both setups run one after the other on free loopback ports in a temporary DEEPSERVE_HOME, each stopped before the
next starts; prints a Markdown table. On one 2-core host the two "nodes" share the cores, so the two-node numbers
show the cost of the pipeline hand-off, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from deepserve.net import free_port

CONCURRENCIES = (1, 16)


def start(home: Path, *args: str, marker: str = "READY") -> tuple[subprocess.Popen[str], list[str]]:
    env = {**os.environ, "DEEPSERVE_HOME": str(home)}
    command = [sys.executable, "-m", "deepserve.cli.main", "serve", *args]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith(marker + " "):
            return process, line.split()
    raise SystemExit(f"`deepserve serve {' '.join(args)}` exited with {process.wait()} before it was ready")


def stop(*processes: subprocess.Popen[str]) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        process.wait(timeout=120)


def bench(base_url: str, concurrency: int, args: argparse.Namespace, out: Path) -> dict[str, float]:
    name = f"c{concurrency}-{time.monotonic_ns()}.json"
    command = [
        sys.executable, "-m", "deepserve.cli.main", "bench", "--base-url", base_url.removesuffix("/v1"),
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--random-range-ratio", "0", "--ignore-eos",
        "--num-prompts", str(max(8, concurrency * 4)), "--max-concurrency", str(concurrency), "--num-warmups", "2",
        "--save-result", "--result-dir", str(out), "--result-filename", name, "--disable-tqdm",
    ]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, timeout=1200)
    return json.loads((out / name).read_text())  # type: ignore[no-any-return]


def measure(home: Path, args: argparse.Namespace, nodes: int) -> dict[str, object]:
    common = ["--max-model-len", "4096"]
    started = time.monotonic()
    if nodes == 1:
        head, fields = start(home, "--port", str(free_port()), *common)
        workers: list[subprocess.Popen[str]] = []
    else:
        layout = [
            *common, "--pipeline-parallel-size", str(nodes), "--nnodes", str(nodes), "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), "--join-port", str(free_port()),
        ]  # fmt: skip
        results: dict[int, tuple[subprocess.Popen[str], list[str]]] = {}

        def start_worker(rank: int) -> None:
            results[rank] = start(home, "--node-rank", str(rank), *layout, marker="WORKER")

        threads = [threading.Thread(target=start_worker, args=(rank,)) for rank in range(1, nodes)]
        for thread in threads:
            thread.start()
        head, fields = start(home, "--port", str(free_port()), *layout)
        for thread in threads:
            thread.join()
        workers = [results[rank][0] for rank in range(1, nodes)]
    ready_s = time.monotonic() - started
    try:
        throughput = {c: bench(fields[1], c, args, home)["output_throughput"] for c in CONCURRENCIES}
    finally:
        stop(head, *workers)
    return {"nodes": nodes, "ready_s": ready_s, **{f"c{c}": v for c, v in throughput.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(Path(tmp) / f"home{n}", args, n) for n in (1, 2)]
    print(f"tiny model; input {args.input_len} / output {args.output_len} tokens; through the gateway\n")
    print("| setup | ready after s | output tok/s at concurrency 1 | output tok/s at concurrency 16 |")
    print("|---|---:|---:|---:|")
    for row in rows:
        setup = "one node" if row["nodes"] == 1 else f"{row['nodes']} nodes on loopback, PP {row['nodes']}"
        print(f"| {setup} | {row['ready_s']:.1f} | {row['c1']:.1f} | {row['c16']:.1f} |")


if __name__ == "__main__":
    main()
