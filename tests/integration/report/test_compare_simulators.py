"""`deepserve sweep --suite seed004 --target NAME=URL …`: seed 004's comparison against three simulators on loopback
standing in for three engines (different speeds), with the real benchmark runner, into one report with a line per
target and every chart the seed drew.

The suite runs in miniature: the same experiments (online concurrency sweep, output lengths at one concurrency,
prefix sharing on and off, offline batches at three output lengths) at a tenth of the seed's sizes and counts, with
no time budget (so no probe and no scaling): the whole seed's request counts (5,056 offline requests per target)
take minutes through the real client on this 2-core machine. tests/unit/sweep/test_compare.py checks the real
suite's points against the seed's table, and the plan the probes choose."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import matplotlib.image
import pytest

from deepserve.cli.main import main
from deepserve.report.build import load_sets
from deepserve.results import series as sr
from deepserve.sweep import probe, suites
from deepserve.sweep.suites import OFFLINE, PREFIX_NONE, PREFIX_SHARED, SEED004, Suite
from tests.helpers import simulator_thread

pytestmark = pytest.mark.timeout(600)

# (name, TTFT ms, ITL ms): three "engines" far enough apart that their lines cannot coincide
ENGINES = (("sglang", 30.0, 3.0), ("vllm", 20.0, 2.0), ("trtllm", 10.0, 1.0))
SEED_CHARTS = (
    "throughput_vs_concurrency",  # throughput and end-to-end latency against concurrency
    "ttft_ttlt_vs_concurrency",
    "itl_vs_concurrency",
    "throughput_vs_latency",
    "throughput_vs_output_len",  # ... and against output length
    "latency_vs_output_len",
    "prefix_sharing",  # prefix-cached runs
    "throughput_vs_batch_size",  # offline batch throughput
)


ONLINE = {"dataset_name": "random", "random_input_len": 320, "random_output_len": 16, "ignore_eos": True}
MINIATURE = dataclasses.replace(
    SEED004,
    base=ONLINE,
    parts=(
        Suite("online", "", "", "", ONLINE, {"max_concurrency": [4, 8, 16]}),
        Suite("output", "", "", "", ONLINE | {"max_concurrency": 16}, {"random_output_len": [32, 64]}),
        Suite(
            "prefix",
            "",
            "",
            "",
            ONLINE | {"max_concurrency": 16},
            {},
            variants={
                PREFIX_NONE: {"dataset_name": "random"},
                PREFIX_SHARED: {"dataset_name": "shared_prefix", "shared_prefix_len": 200, "num_prefix_groups": 1},
            },
        ),
        Suite("offline", "", "", "", ONLINE, {"num_prompts": [8, 16, 32]}, variants={OFFLINE: {}}),
        Suite(
            "offline-long",
            "",
            "",
            "",
            ONLINE,
            {"random_output_len": [32, 64], "num_prompts": [8, 16]},
            variants={OFFLINE: {}},
        ),
    ),
)


def test_seed004_comparison_against_three_simulators(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(probe, "local_gpus", lambda: ())
    monkeypatch.setitem(suites.SUITES, "seed004", MINIATURE)
    out = tmp_path / "compare"
    with (
        simulator_thread(ttft_ms=ENGINES[0][1], itl_ms=ENGINES[0][2]) as first,
        simulator_thread(ttft_ms=ENGINES[1][1], itl_ms=ENGINES[1][2]) as second,
        simulator_thread(ttft_ms=ENGINES[2][1], itl_ms=ENGINES[2][2]) as third,
    ):
        servers = (first, second, third)
        command = ["sweep", "--suite", "seed004", "--time-budget-s", "0", "--result-dir", str(out)]
        command += ["--no-stop-at-saturation", "--no-record"]
        for (name, _ttft, _itl), server in zip(ENGINES, servers, strict=True):
            command += ["--target", f"{name}={server.root_url}"]
        started = time.monotonic()
        assert main(command) == 0, capsys.readouterr().err
        elapsed_s = time.monotonic() - started
        printed = capsys.readouterr().err
        requests_after_first = [server.app.stats.requests for server in servers]
        # A second run resumes every target: no new probe, no benchmark point again.
        assert main(command) == 0
        again = capsys.readouterr().err
        assert "Resuming the planned comparison" in again and again.count(": 0 ran,") == 3
        for server, before in zip(servers, requests_after_first, strict=True):
            assert server.app.stats.requests - before < 10  # at most the metadata look-ups

    points = len(MINIATURE.points())
    assert printed.count(f": {points} ran, 0 kept from before, 0 skipped, 0 failed") == 3
    for name, _ttft, _itl in ENGINES:
        index = json.loads((out / name / "index.json").read_text())
        assert index["label"] == name and index["suite"] == "seed004"
        assert [point["status"] for point in index["points"]] == ["done"] * len(MINIATURE.points())
    # every target ran the very same points
    overrides = [
        [point["overrides"] for point in json.loads((out / name / "index.json").read_text())["points"]]
        for name, *_ in ENGINES
    ]
    assert overrides[0] == overrides[1] == overrides[2]

    sets = load_sets([out / name for name, *_ in ENGINES])
    assert [result_set.label for result_set in sets] == ["sglang", "vllm", "trtllm"]
    lines = sr.build_series(sets, sr.is_concurrency_point, sr.concurrency_x, "max_concurrency")
    assert [line.label for line in lines] == ["sglang", "vllm", "trtllm"]  # one line per target
    assert all(line.xs == [4, 8, 16] for line in lines)
    # the faster stand-in is faster, point for point
    slow, _, fast = (line.ys("median_ttft_ms") for line in lines)
    assert all(f < s for f, s in zip(fast, slow, strict=True))

    report = out / "report"
    html = (report / "report.html").read_text()
    for chart in SEED_CHARTS:
        picture = matplotlib.image.imread(report / f"{chart}.png")
        assert picture.shape[1] >= 800, chart
    assert "sglang" in html and "trtllm" in html
    print(f"seed004 comparison of 3 simulators: {elapsed_s:.0f} s")  # shown with -s: the cost of this test
