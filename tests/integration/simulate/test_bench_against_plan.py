"""`deepserve bench` against `deepserve simulate` reproduces `deepserve plan`: within 15% on TPOT and output
throughput at concurrency 1 and 32 (DeepSeek-V3-0324 AWQ on 8 x H100, 1024 in / 256 out), as issue 11 asks.

The simulator runs at four times real speed (--time-scale 0.25) to keep the test short; the benchmark's wall-clock
figures are converted back to simulated time. It runs as users run it: its own process, announced by its READY
line, the benchmark counting tokens with the simulator's /tokenize.

Output lengths vary +-50% around 256 (`--random-range-ratio '{"input": 0, "output": 0.5}'`), so the 32 clients fall
out of step into the steady state the planner's formula describes: with equal lengths they move in waves, each
wave's prompts prefilled in steps of their own, and TPOT falls about a sixth below the plan's (docs/SIMULATE.md;
tests/unit/simulate/test_engine.py checks both regimes in virtual time).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from deepserve.cli.main import main
from deepserve.engines.config import EngineConfig
from deepserve.plan.perf import RequestLengths
from deepserve.simulate.config import SimulateConfig
from deepserve.simulate.setup import resolve
from tests.helpers import start_simulator

pytestmark = pytest.mark.timeout(300)
MODEL, GPU = "cognitivecomputations/DeepSeek-V3-0324-AWQ", "h100"
TIME_SCALE = 0.25
INPUT_LEN, OUTPUT_LEN = 1024, 256
TOLERANCE = 0.15


@pytest.fixture(scope="module")
def simulated() -> Iterator[str]:
    server = start_simulator("--gpu", GPU, "--time-scale", str(TIME_SCALE), "--max-seconds", "280", model=MODEL)
    try:
        ready = next(line for line in server.output if line.startswith("READY "))
        _, base_url, model, engine_url = ready.split()
        assert (model, engine_url) == (MODEL, base_url) and base_url == server.url
        yield base_url
    finally:
        server.stop()


@pytest.mark.parametrize(("concurrency", "prompts"), [(1, 4), (32, 320)])
def test_bench_reproduces_the_planners_prediction(simulated: str, tmp_path: Path, concurrency: int, prompts: int):
    flags = [
        "bench", "--base-url", simulated.removesuffix("/v1"), "--model", MODEL, "--dataset-name", "random",
        "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN), "--ignore-eos",
        "--random-range-ratio", '{"input": 0, "output": 0.5}',
        "--max-concurrency", str(concurrency), "--num-prompts", str(prompts), "--disable-tqdm", "--save-result",
        "--result-dir", str(tmp_path), "--result-filename", "r.json", "--no-server-metrics",
    ]  # fmt: skip
    assert main(flags) == 0
    measured = json.loads((tmp_path / "r.json").read_text())
    assert measured["completed"] == prompts and measured["total_input_tokens"] == prompts * INPUT_LEN
    sim = SimulateConfig(gpu=GPU)
    predicted = resolve(EngineConfig(model=MODEL), sim).predict(concurrency, RequestLengths(INPUT_LEN, OUTPUT_LEN))
    tpot_ms = measured["mean_tpot_ms"] / TIME_SCALE
    throughput = measured["output_throughput"] * TIME_SCALE
    engine = httpx.get(simulated.removesuffix("/v1") + "/simulate/stats").json()["engine"]
    why = f"simulated time lost by a loop that fell behind so far: {engine['lag_s']} s"  # a busy machine, not the model
    assert tpot_ms == pytest.approx(predicted.tpot_ms, rel=TOLERANCE), why
    assert throughput == pytest.approx(predicted.output_throughput_tok_s, rel=TOLERANCE), why
