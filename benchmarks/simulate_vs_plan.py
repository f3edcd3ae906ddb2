"""`deepserve simulate` against `deepserve plan`: the discrete scheduler over the planner's step model, and the
planner's analytic closed-loop formula, at the same concurrency levels, side by side.

Three measurements per level:
- `plan`: PerformanceModel.predict, the analytic steady state.
- `sim, equal lengths`: the simulated engine in virtual time (closed_loop.py), C clients each sending its next
  request 1 ms after its last one ended, every request INPUT in / OUTPUT out: the planner's own workload.
- `sim, staggered`: the same with output lengths spread uniformly over OUTPUT x (1 +- 0.5) (vLLM's
  --random-range-ratio 0.5 on the output side), 20 requests per client: the desynchronised steady state the
  analytic formula assumes.
- `published`: seed 002's table (vLLM 0.16 serving DeepSeek-V3-0324 with --quantization fp8 on 8 x B200, TP8,
  random dataset 2048 in / 512 out, concurrency 1-256: output tok/s, mean TTFT, mean TPOT), beside the plan and the
  simulator (equal lengths) for the same deployment. The factors were fitted to its throughput and TPOT rows, and
  to its TTFT at concurrency 1 only: TTFT at 8 and more is out of sample for both.
- with --bench, `bench`: `deepserve bench` (equal lengths, --ignore-eos) against `deepserve simulate` running in
  its own process at --time-scale (wall seconds per simulated second), converted back to simulated time.

    .venv/bin/python benchmarks/simulate_vs_plan.py                                   # both profiles, virtual time
    .venv/bin/python benchmarks/simulate_vs_plan.py --bench --time-scale 0.25         # and through the server
    .venv/bin/python benchmarks/simulate_vs_plan.py --model deepseek-ai/DeepSeek-V3-0324 --gpu h200
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx

from deepserve.engines.config import EngineConfig
from deepserve.net import free_port
from deepserve.plan.perf import Prediction, RequestLengths
from deepserve.simulate.closed_loop import ClosedLoopResult, run_closed_loop
from deepserve.simulate.config import SimulateConfig
from deepserve.simulate.setup import SimulatedDeployment, build_core, resolve

# seed 002 (8 x B200, vLLM 0.16, TP8, 2048 in / 512 out): concurrency -> (output tok/s, mean TTFT ms, mean TPOT ms)
SEED_002 = {
    1: (106, 92, 9.28), 8: (503, 1311, 13.36), 16: (930, 618, 16.0), 32: (1382, 931, 21.34),
    64: (2281, 843, 26.39), 128: (3545, 1263, 33.52), 256: (4010, 2607, 58.45),
}  # fmt: skip
PROFILES = (("cognitivecomputations/DeepSeek-V3-0324-AWQ", "h100"), ("deepseek-ai/DeepSeek-V3-0324", "h200"))
STAGGER = 0.5


@dataclass
class Row:
    concurrency: int
    plan: Prediction
    equal: ClosedLoopResult
    staggered: ClosedLoopResult
    bench: dict[str, float] | None = None


def measure(deployment: SimulatedDeployment, sim: SimulateConfig, concurrency: int, workload: RequestLengths, per: int):
    core = build_core(deployment, sim)
    equal = run_closed_loop(core, concurrency, workload.input_len, workload.output_len, max(per * concurrency, 8))
    staggered = run_closed_loop(
        build_core(deployment, sim),
        concurrency,
        workload.input_len,
        workload.output_len,
        max(20 * concurrency, 40),
        output_spread=STAGGER,
    )
    return Row(concurrency, deployment.predict(concurrency, workload), equal, staggered)


def bench_through_server(
    model: str, gpu: str, gpus: int, levels: list[int], workload: RequestLengths, per: int, time_scale: float
) -> dict[int, dict[str, float]]:
    """`deepserve bench` at each level against one `deepserve simulate` process (prefix caching off: the planner
    does not model it, and random prompts of one seed would hit their own earlier copies)."""
    port = free_port()
    command = [
        sys.executable, "-m", "deepserve.cli.main", "simulate", "--model", model, "--gpu", gpu, "--gpus", str(gpus),
        "--port", str(port), "--time-scale", str(time_scale), "--no-enable-prefix-caching", "--max-seconds", "3600",
    ]  # fmt: skip
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert server.stdout is not None
    if not server.stdout.readline().startswith("READY"):
        server.kill()
        raise SystemExit("deepserve simulate did not start")
    results: dict[int, dict[str, float]] = {}
    try:
        with tempfile.TemporaryDirectory() as directory:
            for concurrency in levels:
                flags = [
                    sys.executable, "-m", "deepserve.cli.main", "bench", "--base-url", f"http://127.0.0.1:{port}",
                    "--model", model, "--dataset-name", "random", "--random-input-len", str(workload.input_len),
                    "--random-output-len", str(workload.output_len), "--ignore-eos", "--max-concurrency",
                    str(concurrency), "--num-prompts", str(max(per * concurrency, 8)), "--seed", str(concurrency),
                    "--disable-tqdm", "--no-server-metrics", "--save-result", "--result-dir", directory,
                    "--result-filename", f"c{concurrency}.json",
                ]  # fmt: skip
                subprocess.run(flags, check=True, stdout=subprocess.DEVNULL)
                data = json.loads((Path(directory) / f"c{concurrency}.json").read_text())
                lag = httpx.get(f"http://127.0.0.1:{port}/simulate/stats").json()["engine"]["lag_s"]
                results[concurrency] = {
                    "lag_s": lag - sum(r["lag_s"] for r in results.values()),
                    "tpot_ms": data["mean_tpot_ms"] / time_scale,
                    "ttft_ms": data["mean_ttft_ms"] / time_scale,
                    "output_throughput_tok_s": data["output_throughput"] * time_scale,
                }
                print(f"  bench at concurrency {concurrency}: done", file=sys.stderr, flush=True)
    finally:
        server.terminate()
        server.wait(10)
    return results


def ratio(value: float, reference: float) -> str:
    return f"{value / reference:.2f}"


def print_table(title: str, rows: list[Row]) -> None:
    print(f"\n{title}")
    header = (
        "| c | plan TPOT ms | plan tok/s | plan TTFT ms | sim TPOT ms (ratio) | sim tok/s (ratio) | sim TTFT ms "
        "| staggered TPOT, tok/s ratios | staggered TTFT ms after the first wave |"
    )
    bench = any(row.bench for row in rows)
    if bench:
        header += " bench TPOT ms (ratio) | bench tok/s (ratio) | simulator lag s |"
    print(header)
    print("|" + "---:|" * (12 if bench else 9))
    for row in rows:
        p, e, s = row.plan, row.equal, row.staggered
        line = (
            f"| {row.concurrency} | {p.tpot_ms:.1f} | {p.output_throughput_tok_s:,.0f} | {p.ttft_ms:,.0f} "
            f"| {e.mean_tpot_ms:.1f} ({ratio(e.mean_tpot_ms, p.tpot_ms)}) "
            f"| {e.output_throughput_tok_s:,.0f} ({ratio(e.output_throughput_tok_s, p.output_throughput_tok_s)}) "
            f"| {e.mean_ttft_ms:,.0f} | {ratio(s.mean_tpot_ms, p.tpot_ms)}, "
            f"{ratio(s.output_throughput_tok_s, p.output_throughput_tok_s)} | {s.steady_ttft_ms:,.0f} |"
        )
        if row.bench:
            b = row.bench
            line += (
                f" {b['tpot_ms']:.1f} ({ratio(b['tpot_ms'], p.tpot_ms)}) | {b['output_throughput_tok_s']:,.0f} "
                f"({ratio(b['output_throughput_tok_s'], p.output_throughput_tok_s)}) | {b['lag_s']:.2f} |"
            )
        print(line)


def print_published() -> None:
    """Seed 002's measurements beside the plan and the simulator for the same deployment."""
    sim = SimulateConfig(gpu="b200", weights="fp8-dynamic")
    engine = EngineConfig(model="deepseek-ai/DeepSeek-V3-0324", max_model_len=32768, enable_prefix_caching=False)
    deployment = resolve(engine, sim)
    workload = RequestLengths(2048, 512)
    print("\nseed 002: DeepSeek-V3-0324, --quantization fp8, 8 x B200, vLLM 0.16, 2048 in / 512 out")
    print("| c | published tok/s | plan | sim | published TTFT ms | plan | sim | published TPOT ms | plan | sim |")
    print("|" + "---:|" * 10)
    for concurrency, (tokens, ttft, tpot) in SEED_002.items():
        p = deployment.predict(concurrency, workload)
        core = build_core(deployment, sim)
        s = run_closed_loop(core, concurrency, 2048, 512, max(4 * concurrency, 8))
        print(
            f"| {concurrency} | {tokens:,} | {p.output_throughput_tok_s:,.0f} | {s.output_throughput_tok_s:,.0f} "
            f"| {ttft:,} | {p.ttft_ms:,.0f} | {s.mean_ttft_ms:,.0f} | {tpot:.2f} | {p.tpot_ms:.2f} | "
            f"{s.mean_tpot_ms:.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="one preset (default: the AWQ/H100 and FP8/H200 profiles)")
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--concurrency", default="1,8,32,128")
    parser.add_argument("--requests-per-client", type=int, default=4, help="equal-length runs: requests per client")
    parser.add_argument("--bench", action="store_true", help="also run deepserve bench against deepserve simulate")
    parser.add_argument("--time-scale", type=float, default=0.25, help="--bench: wall seconds per simulated second")
    args = parser.parse_args()
    workload = RequestLengths(args.input_len, args.output_len)
    levels = [int(level) for level in args.concurrency.split(",")]
    profiles = [(args.model, args.gpu)] if args.model else list(PROFILES)
    for model, gpu in profiles:
        sim = SimulateConfig(gpu=gpu, gpus=args.gpus)
        deployment = resolve(EngineConfig(model=model, enable_prefix_caching=False), sim)
        rows = [measure(deployment, sim, level, workload, args.requests_per_client) for level in levels]
        if args.bench:
            measured = bench_through_server(
                model, gpu, args.gpus, levels, workload, args.requests_per_client, args.time_scale
            )
            for row in rows:
                row.bench = measured[row.concurrency]
        title = f"{model} on {args.gpus} x {gpu}, {workload.input_len} in / {workload.output_len} out"
        print_table(title, rows)
    if not args.model:
        print_published()


if __name__ == "__main__":
    main()
