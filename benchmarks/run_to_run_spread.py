"""Issue 22's numbers: how much the main metrics move from run to run, and how often the CI gate fails two runs of
the same server (its false-positive rate).

    .venv/bin/python benchmarks/run_to_run_spread.py                                  # the simulator, 2 x 5 runs
    .venv/bin/python benchmarks/run_to_run_spread.py --base-url http://127.0.0.1:8000 # a running server (tiny vLLM)

Against the simulator (default: `deepserve simulate` in its own process, vLLM's scheduler with every engine step
taking --step-ms, so the server's own timing is fixed and what varies is the client, the kernel and the machine) or a
server you started, it runs `deepserve bench --num-runs N` twice (two series of N identical runs, the same seed and
requests) and prints:

1. the spread of the main metrics over the first series: mean, standard deviation, coefficient of variation, the
   half-width of the 95% confidence interval, the range;
2. the gate's false positives on identical runs: every ordered pair of single runs of the first series judged by
   `deepserve runs compare --fail-on` (threshold only: single runs have no interval), and the two N-run series
   against each other both ways (threshold and non-overlapping intervals), each at the thresholds of --fail-on.

Timings on a shared machine are noisy: run it on a quiet one to quote numbers (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from deepserve.net import free_port
from deepserve.results.compare import Span, Threshold, judge, parse_fail_on, span_of
from deepserve.simulate.fixed import simulate_command

METRICS = (
    "request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
    "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms",
)  # fmt: skip
DEFAULT_GATE = ("p99_ttft_ms=+10%", "median_tpot_ms=+10%", "p99_itl_ms=+10%", "output_throughput=-5%")
BENCH = "import sys; from deepserve.cli.main import main; sys.exit(main(sys.argv[1:]))"


@contextlib.contextmanager
def server(args: argparse.Namespace) -> Iterator[str]:
    """ARGS.base_url, or the simulator in its own process for the duration."""
    if args.base_url:
        yield args.base_url
        return
    port = free_port()
    flags = ["--fixed-step-ms", str(args.step_ms), "--max-seconds", "3600"]
    process = subprocess.Popen(simulate_command(port, *flags), stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    if not process.stdout.readline().startswith("READY "):
        process.kill()
        raise RuntimeError("the simulator did not start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(10)


def series(url: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One `deepserve bench --num-runs N` in a fresh process; its result JSON."""
    command = [
        sys.executable, "-c", BENCH, "bench", "--base-url", url, "--num-runs", str(args.runs),
        "--max-concurrency", str(args.concurrency), "--num-prompts", str(args.prompts),
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len), "--ignore-eos",
        "--seed", "0", "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
        "--disable-tqdm", "--endpoint", args.endpoint, *args.bench_flag,
    ]  # fmt: skip
    env = {**os.environ, "DEEPSERVE_RESULTS_DB": str(out.parent / "results.db")}  # not the user's results store
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"deepserve bench failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return dict(json.loads(out.read_text()))


def spread_table(result: dict[str, Any]) -> list[str]:
    rows = [
        "| metric | mean | std | CV | 95% CI ± | min | max |",
        "|---|---|---|---|---|---|---|",
    ]
    for key in METRICS:
        interval = result["confidence_intervals"].get(key)
        if interval is None:
            continue
        values = [run[key] for run in result["runs"]]
        mean, std = interval["mean"], interval["std"]
        rows.append(
            f"| {key} | {mean:,.2f} | {std:,.2f} | {std / mean:.1%} | {interval['ci95_half_width']:,.2f} | "
            f"{min(values):,.2f} | {max(values):,.2f} |"
        )
    return rows


def pairwise_false_positives(result: dict[str, Any], thresholds: list[Threshold]) -> tuple[int, int, list[str]]:
    """Every ordered pair of single runs judged as baseline and candidate: (failed pairs, pairs, why)."""
    failed, reasons = 0, []
    pairs = list(itertools.permutations(range(len(result["runs"])), 2))
    for base, cand in pairs:
        verdicts = [judge(t, _single(result, base, t.metric), _single(result, cand, t.metric)) for t in thresholds]
        bad = [v for v in verdicts if v.regressed]
        failed += bool(bad)
        reasons += [f"runs {base + 1} → {cand + 1}: {v.why}" for v in bad]
    return failed, len(pairs), reasons


def _single(result: dict[str, Any], index: int, metric: str) -> Span | None:
    value = result["runs"][index].get(metric)
    return None if value is None else Span(float(value))


def series_false_positives(first: dict[str, Any], second: dict[str, Any], thresholds: list[Threshold]) -> list[str]:
    lines = []
    for name, base, cand in (("1 → 2", first, second), ("2 → 1", second, first)):
        for threshold in thresholds:
            verdict = judge(threshold, span_of(base, threshold.metric), span_of(cand, threshold.metric))
            lines.append(f"series {name}: {'FAIL' if verdict.regressed else 'pass'}: {verdict.why}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default=None, help="a running server (default: start the simulator)")
    parser.add_argument("--step-ms", type=float, default=10.0, help="the simulator's engine step")
    parser.add_argument("--runs", type=int, default=5, help="runs per series")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--endpoint", default="/v1/completions")
    parser.add_argument("--fail-on", action="append", default=None, help=f"default: {' '.join(DEFAULT_GATE)}")
    parser.add_argument("--bench-flag", action="append", default=[], help="one more `deepserve bench` argument")
    args = parser.parse_args()
    thresholds = [parse_fail_on(text) for text in args.fail_on or DEFAULT_GATE]
    work = Path(tempfile.mkdtemp(prefix="spread-"))
    with server(args) as url:
        first = series(url, args, work / "first.json")
        second = series(url, args, work / "second.json")
    target = args.base_url or f"simulator, {args.step_ms:g} ms steps"
    print(
        f"## Run-to-run spread: {args.runs} runs, concurrency {args.concurrency}, {args.prompts} requests of "
        f"{args.input_len} / {args.output_len} tokens ({target})"
    )
    print("\n".join(spread_table(first)))
    failed, pairs, reasons = pairwise_false_positives(first, thresholds)
    print(f"\n## Gate on identical runs ({', '.join(t.words for t in thresholds)})")
    print(
        f"single runs, every ordered pair of the {args.runs}: {failed} of {pairs} pairs failed ({failed / pairs:.0%})"
    )
    print("\n".join(f"  {reason}" for reason in reasons[:20]))
    print(f"two {args.runs}-run series against each other, both ways (threshold and 95% intervals):")
    print("\n".join(f"  {line}" for line in series_false_positives(first, second, thresholds)))
    print(f"\nresults: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
