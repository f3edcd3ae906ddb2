"""Speculative decoding on the tiny model with an MTP layer, on vLLM's CPU build: measured beside the simulator and
the plan. For MTP off and 1, 2, 3 draft tokens, at concurrency 1, 4 and 16: output tokens/s, TPOT and the
acceptance vLLM counts (its spec_decode counters, differenced over each run), and what `deepserve simulate` and
`deepserve plan` predict for the same point with `--gpu host` (this machine as measured).

    .venv/bin/python benchmarks/spec_decode_tiny.py [--model deepserve/tiny-deepseek-v3-mtp] [--tokens 0,1,2,3]
        [--concurrency 1,4,16] [--input-len 128] [--output-len 128] [--rounds 4] [--acceptance RATES]
        [--from-file F]

The model is the tiny V3 with one MTP layer (`deepserve model tiny` with MTP: the preset name, or its directory).
Each K starts the engine once with `deepserve serve --no-gateway --num-speculative-tokens K` (about a minute) and
runs `deepserve bench` straight at it, closed loop, fixed lengths (`--ignore-eos`), greedy. The simulator and the
plan are given the acceptance per position vLLM measured at that point (or `--acceptance`, the model's known rate),
so what they are checked on is the cost of a speculative step, not the acceptance. Prints a Markdown table
(docs/PERFORMANCE.md quotes it) and writes benchmarks/results/spec_decode_tiny_<host>.json.
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from deepserve.engines import vllm_metrics as names
from deepserve.engines.config import EngineConfig
from deepserve.hardware.host import measured_host
from deepserve.net import free_port
from deepserve.plan.perf import RequestLengths
from deepserve.plan.speculative import acceptance_per_position, parse_acceptance
from deepserve.simulate.closed_loop import run_closed_loop
from deepserve.simulate.config import SimulateConfig
from deepserve.simulate.setup import build_core, resolve

RESULTS = Path(__file__).with_name("results")
DEFAULT_MODEL = "deepserve/tiny-deepseek-v3-mtp"  # the tiny V3 with one MTP layer (models/tiny.py)
MAX_MODEL_LEN = 4096


@dataclass(frozen=True)
class SpecCounters:
    """vLLM's spec-decode counters at one moment (zeros where the engine exports none: speculation off)."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_position: tuple[float, ...] = ()

    def minus(self, before: SpecCounters) -> SpecCounters:
        earlier = before.per_position + (0.0,) * (len(self.per_position) - len(before.per_position))
        return SpecCounters(
            self.drafts - before.drafts,
            self.draft_tokens - before.draft_tokens,
            self.accepted - before.accepted,
            tuple(now - then for now, then in zip(self.per_position, earlier, strict=False)),
        )

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + accepted / drafts, vLLM's "mean acceptance length" (None when nothing was drafted)."""
        return 1 + self.accepted / self.drafts if self.drafts else None

    @property
    def acceptance_per_position(self) -> tuple[float, ...]:
        return tuple(count / self.drafts for count in self.per_position) if self.drafts else ()


def spec_counters(metrics_text: str) -> SpecCounters:
    """The spec-decode counters in a /metrics page (vllm/v1/spec_decode/metrics.py), summed over engines."""
    totals = {names.SPEC_DECODE_DRAFTS: 0.0, names.SPEC_DECODE_DRAFT_TOKENS: 0.0,
              names.SPEC_DECODE_ACCEPTED_TOKENS: 0.0}  # fmt: skip
    positions: dict[int, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
            elif sample.name == names.SPEC_DECODE_ACCEPTED_PER_POSITION:
                position = int(sample.labels[names.SPEC_DECODE_POSITION_LABEL])
                positions[position] = positions.get(position, 0.0) + sample.value
    return SpecCounters(
        totals[names.SPEC_DECODE_DRAFTS],
        totals[names.SPEC_DECODE_DRAFT_TOKENS],
        totals[names.SPEC_DECODE_ACCEPTED_TOKENS],
        tuple(positions[p] for p in sorted(positions)),
    )


@dataclass(frozen=True)
class Point:
    tokens: int  # K (0: off)
    concurrency: int
    output_tok_s: float
    tpot_ms: float
    counted: SpecCounters  # over the run
    prompts: int
    assumed_acceptance: tuple[float, ...] = ()  # what the simulator and the plan were given
    plan: dict[str, float] = field(default_factory=dict)  # output_tok_s, tpot_ms, tokens_per_step
    sim: dict[str, float] = field(default_factory=dict)  # output_tok_s, tpot_ms, mean_acceptance_length


def predictions(point: Point, model: str, input_len: int, output_len: int, seed: int = 0) -> Point:
    """POINT with the plan's and the simulator's figures for it, both with --gpu host (this machine as deepserve
    measures it) and the acceptance the point assumes."""
    engine = EngineConfig(model=model, max_model_len=MAX_MODEL_LEN, num_speculative_tokens=point.tokens or None)
    sim = SimulateConfig(gpu="host", gpus=1, spec_acceptance=list(point.assumed_acceptance), spec_seed=seed)
    deployment = resolve(engine, sim)
    planned = deployment.predict(point.concurrency, RequestLengths(input_len, output_len))
    core = build_core(deployment, sim)
    simulated = run_closed_loop(core, point.concurrency, input_len, output_len, point.prompts)
    spec = core.scheduler.spec_counters
    length = 1 + spec.accepted_tokens / spec.drafts if spec and spec.drafts else 1.0
    per_step = deployment.speculation.tokens_per_step if deployment.speculation else 1.0
    plan = {"output_tok_s": planned.output_throughput_tok_s, "tpot_ms": planned.tpot_ms, "tokens_per_step": per_step}
    sim_figures = {
        "output_tok_s": simulated.output_throughput_tok_s,
        "tpot_ms": simulated.mean_tpot_ms,
        "mean_acceptance_length": length,
    }
    return _with(point, plan=plan, sim=sim_figures)


def _with(point: Point, **changes: Any) -> Point:
    return Point(**{**asdict(point), "counted": point.counted, **changes})


def assumed_acceptance(tokens: int, counted: SpecCounters, given: tuple[float, ...]) -> tuple[float, ...]:
    """The acceptance to predict with: the model's known rate (--acceptance) or what vLLM measured."""
    if tokens == 0:
        return ()
    if given:
        return acceptance_per_position(given, tokens)
    measured = counted.acceptance_per_position
    if len(measured) < tokens:
        raise SystemExit(f"vLLM counted no drafts with {tokens} draft tokens: is the model's MTP layer loaded?")
    # a measured rate may rise by noise from one position to the next; vLLM's definition cannot
    return tuple(min(measured[: i + 1]) for i in range(tokens))


def table(points: list[Point]) -> str:
    lines = [
        "| draft tokens | concurrency | output tok/s measured / sim / plan | TPOT ms measured / sim / plan "
        "| acceptance length measured / sim / plan | acceptance per position (measured) |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    for p in points:
        measured_length = p.counted.mean_acceptance_length
        lengths = (
            f"{measured_length:.2f} / {p.sim['mean_acceptance_length']:.2f} / {p.plan['tokens_per_step']:.2f}"
            if measured_length is not None
            else "-"
        )
        rates = ", ".join(f"{rate:.2f}" for rate in p.counted.acceptance_per_position) or "-"
        lines.append(
            f"| {p.tokens or 'off'} | {p.concurrency} | "
            f"{p.output_tok_s:,.1f} / {p.sim['output_tok_s']:,.1f} / {p.plan['output_tok_s']:,.1f} | "
            f"{p.tpot_ms:,.2f} / {p.sim['tpot_ms']:,.2f} / {p.plan['tpot_ms']:,.2f} | {lengths} | {rates} |"
        )
    return "\n".join(lines)


# ---- measuring ---------------------------------------------------------------------------------------------------


def start_engine(home: Path, model: str, tokens: int) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "DEEPSERVE_HOME": str(home)}
    command = [sys.executable, "-m", "deepserve.cli.main", "serve", "--no-gateway", "--model", model,
               "--max-model-len", str(MAX_MODEL_LEN), "--port", str(free_port())]  # fmt: skip
    if tokens:
        command += ["--speculative-method", "mtp", "--num-speculative-tokens", str(tokens)]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("READY "):
            return process, line.split()[3]
    raise SystemExit(f"deepserve serve exited with {process.wait()} before it was ready ({' '.join(command)})")


def measure(engine_url: str, tokens: int, concurrency: int, args: argparse.Namespace, out: Path) -> Point:
    root = engine_url.removesuffix("/v1")
    before = spec_counters(httpx.get(root + "/metrics", timeout=30).text)
    name = f"k{tokens}-c{concurrency}.json"
    prompts = max(8, concurrency * args.rounds)
    command = [
        sys.executable, "-m", "deepserve.cli.main", "bench", "--base-url", root, "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len), "--ignore-eos",
        "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--num-warmups", "0",
        "--temperature", "0", "--save-result", "--result-dir", str(out), "--result-filename", name, "--disable-tqdm",
    ]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, timeout=3600)
    counted = spec_counters(httpx.get(root + "/metrics", timeout=30).text).minus(before)
    result = json.loads((out / name).read_text())
    return Point(tokens, concurrency, float(result["output_throughput"]), float(result["mean_tpot_ms"]), counted,
                 prompts)  # fmt: skip


def run(args: argparse.Namespace) -> list[Point]:
    given = parse_acceptance(args.acceptance)
    points = []
    with tempfile.TemporaryDirectory() as tmp:
        for tokens in [int(k) for k in args.tokens.split(",")]:
            started = time.monotonic()
            process, engine_url = start_engine(Path(tmp) / "home", args.model, tokens)
            print(f"K={tokens}: engine ready after {time.monotonic() - started:.0f} s", file=sys.stderr)
            try:
                for concurrency in [int(c) for c in args.concurrency.split(",")]:
                    point = measure(engine_url, tokens, concurrency, args, Path(tmp))
                    point = _with(point, assumed_acceptance=assumed_acceptance(tokens, point.counted, given))
                    points.append(predictions(point, args.model, args.input_len, args.output_len))
                    print(f"measured {points[-1]}", file=sys.stderr)
            finally:
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=120)
    return points


def load(path: Path) -> list[Point]:
    saved = json.loads(path.read_text())
    points = []
    for raw in saved["points"]:
        counted = raw.pop("counted")
        counted["per_position"] = tuple(counted["per_position"])
        raw["assumed_acceptance"] = tuple(raw["assumed_acceptance"])
        points.append(Point(**raw, counted=SpecCounters(**counted)))
    return points


def save(points: list[Point], command: str) -> Path:
    RESULTS.mkdir(exist_ok=True)
    host = measured_host()
    out = RESULTS / f"spec_decode_tiny_{host.host}.json"
    rows = [asdict(point) for point in points]
    out.write_text(json.dumps({"command": command, "host": host.to_json(), "points": rows}, indent=1) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the tiny model with an MTP layer (preset or dir)")
    parser.add_argument("--tokens", default="0,1,2,3", help="draft tokens per step to try (0: speculation off)")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4, help="prompts per stream (closed loop)")
    parser.add_argument("--acceptance", default=None, help="the model's known acceptance (default: as measured)")
    parser.add_argument("--from-file", type=Path, help="print an earlier run's table again (no vLLM)")
    args = parser.parse_args()
    if args.from_file:
        points = load(args.from_file)
    else:
        points = run(args)
        print(f"wrote {save(points, ' '.join(sys.argv))}", file=sys.stderr)
    print(table(points))


if __name__ == "__main__":
    main()
