"""The planner against real vLLM on this machine: predicted vs measured TTFT, TPOT and output tokens/s for the tiny
model on vLLM's CPU build, at several concurrency levels and two prompt lengths.

    .venv/bin/python benchmarks/cpu_profile.py [--input-lens 128,512] [--output-len 128] [--concurrency 1,4,16,64]
                                               [--rounds 4] [--repeats N] [--write-profile] [--from-file F]
                                               [--machine median]

1. Measures this machine (copy bandwidth, linear and attention rates on the cores vLLM's CPU worker computes on;
   hardware/host.py) right before each point. Every point is predicted from the median of the run's measurements
   (`--machine median`, the default): each is a probe of a second or two, and on this shared VM the linear rate
   flips between spells (290-960 GFLOP/s within one run), which a probe catches at random while a point's bench
   runs through them. `--machine per-point` predicts each point from its own probe instead.
2. Starts the tiny model with `deepserve serve` on loopback (temporary DEEPSERVE_HOME) and runs `deepserve bench`
   straight at the engine for every (prompt length, concurrency) point, closed loop.
3. Fits the CPU engine profile's parameters (per step, per sequence, per request, and the share of the probe's
   linear rate the engine's prompt path reaches; data/engine_profiles.json) on the TTFT, TPOT and throughput of
   three calibration points (--calibrate; by default one client at both prompt lengths, which tells the cost per
   request from the cost per prompt token, and the most clients at the shorter) and predicts every point with
   them, twice: with the planner's closed-loop formula (what `deepserve plan` prints), a steady-state model,
   against each run's steady part (steady_state(); the fit uses the same figures), and with the same step model
   run through the simulator's scheduler as vLLM's CPU build configures it, in virtual time (what `deepserve
   simulate` serves), for the benchmark's own clients and requests, against the whole run. The other points are
   held out. `--write-profile` stores the fit in the package.

Lengths vary +-50% around their means (--range-ratio), in the benchmark and in the simulation: with fixed lengths
the closed-loop clients of an engine that prefills a whole wave of prompts in one step (vLLM's CPU build runs MLA
without chunked prefill) stay in lockstep, every prompt of a wave waiting for all of them.

Prints a Markdown table (docs/PLANNING.md quotes it) and writes benchmarks/results/cpu_profile_<host>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from deepserve.engines.config import EngineConfig
from deepserve.hardware.catalog import Accelerator, host_accelerator
from deepserve.hardware.host import RATES, HostMeasurement, measure_host
from deepserve.models import load_spec
from deepserve.models.presets import TINY_MODEL_NAME
from deepserve.net import free_port
from deepserve.plan.fit import MIN_TARGETS_PER_PARAMETER, Target, fit_parameters
from deepserve.plan.perf import PerformanceModel, RequestLengths
from deepserve.plan.planner import build_deployment
from deepserve.plan.profiles import EngineParameters, write_parameters
from deepserve.plan.types import Deployment
from deepserve.simulate.closed_loop import run_closed_loop
from deepserve.simulate.config import SimulateConfig
from deepserve.simulate.setup import build_core, resolve

RESULTS = Path(__file__).with_name("results")
TARGET_RATIO_ERROR = 0.25  # issue 11: within 25% on TPOT and throughput
METRICS = ("ttft_ms", "tpot_ms", "output_tok_s")
MAX_MODEL_LEN = 32768  # what `deepserve serve` gives vLLM's CPU build (engines/vllm.py)
MIN_STEADY_REQUESTS = 3
WARMUP_REQUESTS = 2  # sent by the bench before each point's measured run, each prompt led by a mark of its own


@dataclass(frozen=True)
class Point:
    input_len: int
    concurrency: int
    ttft_ms: float
    tpot_ms: float
    output_tok_s: float
    prompts: int
    host: dict[str, Any]  # this machine measured right before the point (HostMeasurement)
    steady: dict[str, float] | None = None  # the same metrics over the run's steady part (steady_state())
    runs: list[float] | None = None  # with --repeats: every run's steady output tok/s (this point is the median)

    def accelerator(self) -> Accelerator:
        return host_accelerator(HostMeasurement(**self.host))

    def in_steady_state(self) -> Point:
        """The point as measured over its steady part (what the closed-loop formula describes); the whole run
        where the run kept too few requests (or an earlier run's file has none)."""
        if not self.steady:
            return self
        return replace(self, **{m: self.steady[m] for m in METRICS})


def steady_state(result: dict[str, Any], concurrency: int) -> dict[str, float] | None:
    """TTFT, TPOT and output tokens/s over the closed loop's steady part, from `--save-detailed`'s lists. Left out:
    each stream's first request (the clients start together, so the engine prefills the whole first wave in one
    step, and that wave decodes with no other prompt between its steps), and every request still running when the
    last one was sent (from then on fewer and fewer streams run). Throughput by Little's law over the requests kept:
    concurrency x mean output tokens / mean latency."""
    starts, latencies = result["start_times"], result["latencies"]
    ttfts, outputs = result["ttfts"], result["output_lens"]
    last_sent = max(starts)
    by_start = sorted(range(len(starts)), key=starts.__getitem__)
    kept = [i for i in by_start[concurrency:] if starts[i] + latencies[i] <= last_sent and outputs[i] > 1]
    if len(kept) < MIN_STEADY_REQUESTS:
        return None
    mean_latency = statistics.fmean(latencies[i] for i in kept)
    return {
        "ttft_ms": 1e3 * statistics.fmean(ttfts[i] for i in kept),
        "tpot_ms": 1e3 * statistics.fmean((latencies[i] - ttfts[i]) / (outputs[i] - 1) for i in kept),
        "output_tok_s": concurrency * statistics.fmean(outputs[i] for i in kept) / mean_latency,
        "requests": len(kept),
    }


def start_service(home: Path) -> tuple[subprocess.Popen[str], list[str]]:
    env = {**os.environ, "DEEPSERVE_HOME": str(home)}
    command = [sys.executable, "-m", "deepserve.cli.main", "serve", "--port", str(free_port())]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("READY "):
            return process, line.split()
    raise SystemExit(f"deepserve serve exited with {process.wait()} before it was ready")


def bench(engine_url: str, input_len: int, concurrency: int, args: argparse.Namespace, out: Path) -> Point:
    """One closed-loop point. Each point draws its prompts with a seed of its own: the same seed gives the same first
    prompts at every point, and where vLLM keeps a prefix cache (its CPU build on a CPU with AMX, every GPU) a later
    point's first requests would find their whole prompt cached. The bench's warm-ups lead their prompts with a mark
    of their own, so they cannot warm the measured prompts' cache either."""
    host = measure_host(probes=1).to_json()  # one probe a point; --machine median takes the median over points
    name = f"in{input_len}-c{concurrency}.json"
    prompts = max(args.min_prompts, concurrency * args.rounds)
    seed = input_len * 1000 + concurrency
    common = [
        sys.executable, "-m", "deepserve.cli.main", "bench", "--base-url", engine_url.removesuffix("/v1"),
        "--dataset-name", "random", "--random-input-len", str(input_len),
        "--random-output-len", str(args.output_len), "--random-range-ratio", str(args.range_ratio), "--ignore-eos",
        "--max-concurrency", str(concurrency), "--disable-tqdm",
    ]  # fmt: skip
    measured = ["--num-prompts", str(prompts), "--num-warmups", str(WARMUP_REQUESTS), "--seed", str(seed)]
    measured += ["--save-result", "--save-detailed"]
    measured += ["--result-dir", str(out), "--result-filename", name]
    subprocess.run(common + measured, check=True, stdout=subprocess.DEVNULL, timeout=3600)
    result = json.loads((out / name).read_text())
    return Point(
        input_len=input_len,
        concurrency=concurrency,
        ttft_ms=float(result["mean_ttft_ms"]),
        tpot_ms=float(result["mean_tpot_ms"]),
        output_tok_s=float(result["output_throughput"]),
        prompts=prompts,
        host=host,
        steady=steady_state(result, concurrency),
    )


def deployment_for(point: Point, output_len: int) -> Deployment:
    return build_deployment(
        load_spec(TINY_MODEL_NAME),
        "host",
        1,
        workload=RequestLengths(point.input_len, output_len),
        max_model_len=MAX_MODEL_LEN,
        accelerator=point.accelerator(),
    )


def predicted(point: Point, output_len: int, parameters: EngineParameters) -> dict[str, float]:
    deployment = deployment_for(point, output_len)
    model = _model(deployment, parameters)
    p = model.predict(point.concurrency, RequestLengths(point.input_len, output_len), deployment.running_cap)
    return {"ttft_ms": p.ttft_ms, "tpot_ms": p.tpot_ms, "output_tok_s": p.output_throughput_tok_s}


def simulated(point: Point, args: argparse.Namespace, parameters: EngineParameters) -> dict[str, float]:
    """The same step model run through the simulator's scheduler as vLLM's CPU build configures it (prompts
    prefilled whole, a token budget of max_model_len; simulate/setup.py), in virtual time: the point's clients,
    requests and length spreads, each client sending its next request when its last one ended."""
    engine = EngineConfig(model=TINY_MODEL_NAME, max_model_len=MAX_MODEL_LEN)
    sim = SimulateConfig(gpu="host", gpus=1)
    steps = _model(deployment_for(point, args.output_len), parameters)
    deployment = replace(resolve(engine, sim), model_of_steps=steps)
    result = run_closed_loop(
        build_core(deployment, sim),
        point.concurrency,
        point.input_len,
        args.output_len,
        point.prompts,
        output_spread=args.range_ratio,
        input_spread=args.range_ratio,
    )
    return {
        "ttft_ms": result.mean_ttft_ms,
        "tpot_ms": result.mean_tpot_ms,
        "output_tok_s": result.output_throughput_tok_s,
    }


def _model(deployment: Deployment, parameters: EngineParameters) -> PerformanceModel:
    engine = deployment.select_engine(across_engines=False)
    assert engine is not None, "data/engine_profiles.json lacks the vllm-cpu profile"
    return deployment.performance_model(engine.with_parameters(parameters, "fit"))


def targets(points: list[Point], output_len: int) -> list[Target]:
    """TTFT, TPOT and throughput of each calibration point as fit targets (TTFT for the per-request overhead: the
    API server's and the engine core's work on a new request, which vLLM's worker waits for)."""
    result = []
    for point in points:
        deployment = deployment_for(point, output_len)
        workload = RequestLengths(point.input_len, output_len)
        cap = deployment.running_cap

        def model(parameters: EngineParameters, d: Deployment = deployment) -> PerformanceModel:
            return _model(d, parameters)

        label = f"c={point.concurrency} in={point.input_len}"
        result.append(Target(f"{label} ttft", point.ttft_ms, _metric(point.concurrency, workload, cap, "ttft"), model))
        result.append(Target(f"{label} tpot", point.tpot_ms, _metric(point.concurrency, workload, cap, "tpot"), model))
        result.append(
            Target(f"{label} tok/s", point.output_tok_s, _metric(point.concurrency, workload, cap, "tput"), model)
        )
    return result


def _metric(concurrency: int, workload: RequestLengths, cap: int, which: str) -> Callable[[PerformanceModel], float]:
    def value(model: PerformanceModel) -> float:
        prediction = model.predict(concurrency, workload, cap)
        by_metric = {"ttft": prediction.ttft_ms, "tpot": prediction.tpot_ms, "tput": prediction.output_throughput_tok_s}
        return by_metric[which]

    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input-lens", default="128,512")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--rounds", type=int, default=4, help="prompts per stream (closed loop)")
    parser.add_argument(
        "--range-ratio",
        type=float,
        default=0.5,
        help="lengths drawn within +-ratio of the mean, so the clients fall out of step (see the doc string)",
    )
    parser.add_argument("--min-prompts", type=int, default=8)
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every point this many times, in rounds, and keep the median run (a shared machine's speed drifts)",
    )
    parser.add_argument("--calibrate", default="", help="points to fit on, as c:input_len,... (default: see doc)")
    parser.add_argument("--write-profile", action="store_true", help="store the fit in data/engine_profiles.json")
    parser.add_argument(
        "--from-file", type=Path, help="refit and print from an earlier run's JSON (no vLLM; the file is not changed)"
    )
    parser.add_argument(
        "--machine",
        choices=("per-point", "median"),
        default="median",
        help="predict every point from the median of the run's machine measurements (default: one short "
        "measurement on a shared machine catches a passing spike or lull), or each from its own",
    )
    args = parser.parse_args()
    lens = [int(x) for x in args.input_lens.split(",")]
    levels = [int(x) for x in args.concurrency.split(",")]
    calibration = (
        [tuple(int(v) for v in item.split(":")) for item in args.calibrate.split(",")]
        if args.calibrate
        else default_calibration(lens, levels)
    )
    command = " ".join(sys.argv)
    if args.from_file:
        saved = json.loads(args.from_file.read_text())
        points = [Point(**p) for p in saved["points"]]
        command = saved.get("command", command)
    else:
        points = run_points(lens, levels, args)
    report(points, calibration, args, command)


def default_calibration(lens: list[int], levels: list[int]) -> list[tuple[int, int]]:
    """One client at the shortest and the longest prompt (the per-request cost against the per-prompt-token one),
    and the most clients at the shortest (the per-sequence cost): (concurrency, prompt length) pairs."""
    chosen = [(min(levels), min(lens)), (max(levels), min(lens)), (min(levels), max(lens))]
    return list(dict.fromkeys(chosen))


def calibration_points(points: list[Point], calibration: list[tuple[int, ...]], fitted: int) -> list[Point]:
    """The measured POINTS that CALIBRATION names, enough for FITTED parameters (each point gives targets() one
    target per metric; the fitter wants MIN_TARGETS_PER_PARAMETER a parameter), or an exit that says what is
    missing."""
    measured = {(p.concurrency, p.input_len) for p in points}
    unknown = [c for c in calibration if c not in measured]
    if unknown:
        names = ", ".join(f"{c[0]}:{c[1]}" for c in unknown)
        have = ", ".join(f"{c}:{n}" for c, n in sorted(measured))
        raise SystemExit(f"--calibrate names {names}, which this run did not measure; it has {have}")
    chosen = [p for p in points if (p.concurrency, p.input_len) in calibration]
    needed = -(-MIN_TARGETS_PER_PARAMETER * fitted // len(METRICS))
    if len(chosen) < needed:
        raise SystemExit(
            f"--calibrate gives {len(chosen)} points for the CPU profile's {fitted} fitted parameters: name at least "
            f"{needed}, one client at two prompt lengths among them (the default: see --help)"
        )
    return chosen


def with_median_machine(points: list[Point]) -> list[Point]:
    """POINTS, each with the median of all their machine measurements in place of its own."""
    typical = dict(points[0].host)
    for name in RATES:
        values = [p.host[name] for p in points if p.host.get(name) is not None]
        typical[name] = statistics.median(values) if values else None
    return [replace(point, host=typical) for point in points]


def run_points(lens: list[int], levels: list[int], args: argparse.Namespace) -> list[Point]:
    with tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        process, fields = start_service(Path(tmp) / "home")
        print(f"engine ready after {time.monotonic() - started:.0f} s", file=sys.stderr)
        engine_url = fields[3]
        try:
            runs: dict[tuple[int, int], list[Point]] = {}
            for _ in range(args.repeats):  # rounds over every point, so that a slow spell of the machine is shared
                for input_len in lens:
                    for concurrency in levels:
                        point = bench(engine_url, input_len, concurrency, args, Path(tmp))
                        runs.setdefault((input_len, concurrency), []).append(point)
                        print(f"measured {point}", file=sys.stderr)
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=120)
    return [median_run(points) for points in runs.values()]


def median_run(points: list[Point]) -> Point:
    """Of one point's repeated runs, the one whose steady throughput is the median (the lower middle one of an
    even number): a whole run, so that its TTFT, TPOT, throughput and machine stay one measurement."""
    ranked = sorted(points, key=lambda p: p.in_steady_state().output_tok_s)
    chosen = ranked[(len(ranked) - 1) // 2]
    return replace(chosen, runs=[p.in_steady_state().output_tok_s for p in points]) if len(points) > 1 else chosen


Row = tuple[Point, dict[str, float], dict[str, float], bool]  # point, prediction, ratios, calibration point


def report(measured: list[Point], calibration: list[tuple[int, ...]], args: argparse.Namespace, command: str) -> None:
    points = with_median_machine(measured) if args.machine == "median" else measured
    steady = [p.in_steady_state() for p in points]
    host = points[0].host
    deployment = deployment_for(points[0], args.output_len)
    base = deployment.select_engine(across_engines=False)
    assert base is not None
    chosen = calibration_points(steady, calibration, len(base.engine.fitted))
    fit = fit_parameters(base, targets(chosen, args.output_len))
    print(
        f"host {host['cpu_model']} x{host['cores']} (bf16 units: {host.get('native_bf16')}); fitted "
        f"{', '.join(f'{n} {getattr(fit.parameters, n):.3g}' for n in fit.fitted)} on {len(chosen)} points; "
        f"output {args.output_len} tokens (+-{args.range_ratio:.0%})"
    )
    formula = score(steady, calibration, lambda p: predicted(p, args.output_len, fit.parameters))
    print_table(
        "the planner's closed-loop formula (`deepserve plan`), against each run's steady part (steady_state())",
        formula,
        steady=True,
    )
    simulation = score(points, calibration, lambda p: simulated(p, args, fit.parameters))
    print_table(
        "the same step model through the simulated scheduler (`deepserve simulate`), the same clients and "
        "requests as the benchmark, against the whole run",
        simulation,
    )
    payload = {
        "command": command,
        "output_len": args.output_len,
        "range_ratio": args.range_ratio,
        "machine": args.machine,
        "calibration": [list(c) for c in calibration],
        "fitted": {n: getattr(fit.parameters, n) for n in fit.fitted},
        "points": [asdict(p) for p in measured],
        "predicted": [guess for _, guess, _, _ in formula],
        "simulated": [guess for _, guess, _, _ in simulation],
    }
    if args.from_file is None:  # a stored run is printed again, never overwritten
        save(payload, host)
    if args.write_profile:
        fit_inputs = {
            "generated_by": "benchmarks/cpu_profile.py --write-profile",
            "generated_on": time.strftime("%Y-%m-%d"),
            "fitted_on": f"{len(chosen)} measured points on {host['host']} ({host['cpu_model']} x{host['cores']})",
            "values": payload["fitted"],
            "rms_log_error": round(fit.rms_log_error, 4),
            "points": [asdict(p) for p in points],  # as fitted: with the machine the predictions used
            "calibration": payload["calibration"],
            "output_len": args.output_len,
        }
        path = write_parameters("vllm-cpu", payload["fitted"], fit_inputs)
        print(f"wrote {path}")


def score(
    points: list[Point], calibration: list[tuple[int, ...]], predict: Callable[[Point], dict[str, float]]
) -> list[Row]:
    rows = []
    for point in points:
        guess = predict(point)
        ratios = {m: guess[m] / getattr(point, m) for m in METRICS}
        rows.append((point, guess, ratios, (point.concurrency, point.input_len) in calibration))
    return rows


def print_table(title: str, rows: list[Row], steady: bool = False) -> None:
    print(f"\nPredicted by {title}:\n")
    print(
        "| prompt | concurrency | machine: copy GB/s, linear / attention GFLOP/s "
        "| TTFT ms measured / predicted (ratio) | TPOT ms measured / predicted (ratio) "
        "| output tok/s measured / predicted (ratio) | |"
    )
    print("|---:|---:|---|---:|---:|---:|---|")
    held_errors = []
    for point, guess, ratios, calibrating in rows:
        measured = HostMeasurement(**point.host)
        attention = f" / {measured.attention_gflops:.1f}" if measured.attention_gflops else ""
        machine = f"{measured.memory_bandwidth_gb_s:.1f}, {measured.engine_gflops:.1f}{attention}"
        cells = [f"{getattr(point, m):,.1f} / {guess[m]:,.1f} ({ratios[m]:.2f})" for m in METRICS]
        print(
            f"| {point.input_len} | {point.concurrency} | {machine} | "
            + " | ".join(cells)
            + f" | {'fit on' if calibrating else 'held out'}{_kept(point) if steady else ''} |"
        )
        if not calibrating:
            held_errors += [abs(ratios["tpot_ms"] - 1), abs(ratios["output_tok_s"] - 1)]
    worst = max(held_errors, default=0.0)
    verdict = "meets" if worst <= TARGET_RATIO_ERROR else "MISSES"
    print(f"\nheld-out points: worst TPOT/throughput error {worst:.0%} ({verdict} the {TARGET_RATIO_ERROR:.0%} target)")


def _kept(point: Point) -> str:
    return f", {point.steady['requests']:.0f} of {point.prompts} requests" if point.steady else ", whole run"


def save(payload: dict[str, Any], host: dict[str, Any]) -> None:
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"cpu_profile_{host['host']}.json"
    out.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
