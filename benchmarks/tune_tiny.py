"""Issue 13's numbers: `deepserve tune` on the tiny model over max_num_seqs x max_num_batched_tokens (6 points, one of
them vLLM's defaults), with vLLM's CPU build.

    .venv/bin/python benchmarks/tune_tiny.py [--out DIR] [--slo p99_itl_ms=100 ...]     # about 10-15 minutes

Runs the tune in a temporary DEEPSERVE_HOME (each point starts vLLM on the tiny model, benchmarks it at concurrency
32, stops it), then prints a Markdown table: per point, the engine's start, benchmark and stop times, output tokens/s
and goodput under the SLOs, and the planner's forecast; then how many points the planner skipped and the best
point's goodput and throughput against the point that leaves both fields to vLLM. Re-running with the same --out and
another --slo re-judges the measured points without starting vLLM again.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GRID = ("max_num_seqs=default,8,32", "max_num_batched_tokens=default,512")
WORKLOAD = (
    "--set", "max_model_len=512", "--max-concurrency", "32", "--num-prompts", "96", "--random-input-len", "256",
    "--random-output-len", "64", "--ignore-eos",
)  # fmt: skip
DEFAULT_SLOS = ("p99_ttft_ms=3000", "p99_itl_ms=100")
DEFAULTS = "max_num_seqs=default max_num_batched_tokens=default"


def run_tune(out: Path, slos: list[str], home: Path) -> tuple[int, float]:
    command = [sys.executable, "-m", "deepserve.cli.main", "tune", *WORKLOAD, "--out", str(out)]
    for axis in GRID:
        command += ["--grid", axis]
    for slo in slos:
        command += ["--slo", slo]
    started = time.monotonic()
    done = subprocess.run(command, env={**os.environ, "DEEPSERVE_HOME": str(home)}, timeout=3600, check=False)
    return done.returncode, time.monotonic() - started


def table(out: Path) -> list[str]:
    index = json.loads((out / "index.json").read_text())
    scored = {item["point_id"]: item for item in index["metadata"].get("scored") or []}
    rows = [
        "| point | status | start s | benchmark s | stop s | output tok/s | goodput tok/s | SLOs | predicted tok/s |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for entry in index["points"]:
        timings: dict[str, Any] = {}
        if entry.get("result_file"):
            timings = json.loads((out / entry["result_file"]).read_text())["tune"].get("timings_s") or {}
        item = scored.get(entry["point_id"]) or {}
        predicted = (entry.get("predicted") or {}).get("output_tok_s")
        status = entry["status"] if entry["status"] != "skipped" else f"skipped: {entry['note']}"
        rows.append(
            f"| {entry['params']['variant']} | {status} | {_n(timings.get('startup'))} | "
            f"{_n(timings.get('benchmark'))} | {_n(timings.get('stop'))} | {_n(item.get('output_tok_s'))} | "
            f"{_n(_goodput(item))} | {'hold' if item.get('slos_hold') else 'missed' if item else '–'} | "
            f"{_n(predicted)} |"
        )
    return rows


def summary(out: Path) -> list[str]:
    index = json.loads((out / "index.json").read_text())
    scored = index["metadata"].get("scored") or []
    skipped = [entry for entry in index["points"] if entry["status"] == "skipped"]
    best = index["metadata"].get("best")
    default = next((item for item in scored if item["engine"] == DEFAULTS), None)
    lines = [
        f"points: {len(index['points'])}, measured: {len(scored)}, skipped by the planner: {len(skipped)}"
        + (f" ({'; '.join(entry['note'] for entry in skipped)})" if skipped else ""),
        f"planner: {index['metadata'].get('planner', {}).get('note') or 'predicted every point'}",
    ]
    if best and default:
        lines.append(
            f"best: {best['engine']}: goodput {_goodput(best):,.0f} tok/s, output {best['output_tok_s']:,.0f} "
            f"tok/s; vLLM's defaults: goodput {_goodput(default):,.0f}, output {default['output_tok_s']:,.0f} "
            f"({_ratio(_goodput(best), _goodput(default))} goodput, "
            f"{_ratio(best['output_tok_s'], default['output_tok_s'])} output)"
        )
    elif not best:
        lines.append("no point met every SLO")
    return lines


def _n(value: float | None) -> str:
    return "–" if value is None else f"{value:,.1f}" if value < 100 else f"{value:,.0f}"


def _ratio(value: float, reference: float) -> str:
    return f"{value / reference:.2f}x" if reference else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="the tune directory (default: a temporary one)")
    parser.add_argument("--slo", action="append", default=None, help=f"default: {' '.join(DEFAULT_SLOS)}")
    args = parser.parse_args()
    slos = args.slo or list(DEFAULT_SLOS)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp) / "tune"
        home = out.parent / "deepserve-home" if args.out else Path(tmp) / "home"
        code, wall_s = run_tune(out, slos, home)
        print(f"\n`deepserve tune` exited {code} after {wall_s:.0f} s; SLOs: {', '.join(slos)}\n")
        print("\n".join(table(out)))
        print()
        print("\n".join(summary(out)))


if __name__ == "__main__":
    main()


def _goodput(item: dict) -> float | None:
    """A scored point's goodput (output tokens/s): its key was goodput_tok_s in tune directories written earlier."""
    return item.get("goodput_output_tok_s", item.get("goodput_tok_s"))
