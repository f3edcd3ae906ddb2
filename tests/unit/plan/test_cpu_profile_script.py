"""benchmarks/cpu_profile.py: the steady part of a closed-loop run (what the planner's formula is scored against),
the median of repeated runs, and prompts no two runs share."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.helpers import load_benchmark_script


@pytest.fixture
def script(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_benchmark_script("cpu_profile", monkeypatch)


def _run(requests: list[tuple[float, float, float, int]]) -> dict[str, list[float]]:
    """--save-detailed lists from (start s, ttft s, latency s, output tokens) per request."""
    return {
        "start_times": [r[0] for r in requests],
        "ttfts": [r[1] for r in requests],
        "latencies": [r[2] for r in requests],
        "output_lens": [r[3] for r in requests],
    }


def test_first_wave_and_drain_are_left_out(script: ModuleType) -> None:
    # Two streams, A and B. The first wave (t=0) waits 1 s for its prompts, the steady requests 0.1 s. A's fourth
    # request is the last one sent (t=7.2); B's third, sent at 5.6, is still running then (it ends at 7.7).
    stream_a = [(0.0, 1.0, 3.0, 21), (3.0, 0.1, 2.1, 21), (5.1, 0.1, 2.1, 21), (7.2, 0.1, 1.1, 11)]
    stream_b = [(0.0, 1.0, 3.5, 21), (3.5, 0.1, 2.1, 21), (5.6, 0.1, 2.1, 31)]
    result = script.steady_state(_run(stream_b + stream_a), concurrency=2)
    assert result["requests"] == 3
    assert result["ttft_ms"] == pytest.approx(100.0)
    assert result["tpot_ms"] == pytest.approx(100.0)  # (2.1 - 0.1) s over 20 intervals
    assert result["output_tok_s"] == pytest.approx(2 * 21 / 2.1)  # Little's law: two streams, 2.1 s a request


def test_too_short_a_run_has_no_steady_part(script: ModuleType) -> None:
    assert script.steady_state(_run([(0.0, 0.1, 1.0, 10), (1.0, 0.1, 1.0, 10)]), concurrency=1) is None


def test_a_point_without_a_steady_part_is_scored_on_the_whole_run(script: ModuleType) -> None:
    point = script.Point(128, 4, 200.0, 15.0, 230.0, 16, {}, None)
    assert point.in_steady_state() is point
    measured = script.Point(
        128, 4, 200.0, 15.0, 230.0, 16, {}, {"ttft_ms": 90.0, "tpot_ms": 16.0, "output_tok_s": 220.0}
    )
    assert (measured.in_steady_state().ttft_ms, measured.in_steady_state().output_tok_s) == (90.0, 220.0)


def test_repeated_runs_keep_the_median_run_whole(script: ModuleType) -> None:
    def run(tok_s: float, ttft_ms: float) -> object:
        steady = {"ttft_ms": ttft_ms, "tpot_ms": 10.0, "output_tok_s": tok_s}
        return script.Point(128, 4, 2 * ttft_ms, 10.0, tok_s, 16, {"bf16_gflops": tok_s}, steady)

    chosen = script.median_run([run(300.0, 30.0), run(500.0, 50.0), run(400.0, 40.0)])
    assert (chosen.output_tok_s, chosen.ttft_ms, chosen.host["bf16_gflops"]) == (400.0, 80.0, 400.0)
    assert chosen.runs == [300.0, 500.0, 400.0]
    assert script.median_run([run(300.0, 30.0), run(500.0, 50.0)]).output_tok_s == 300.0  # the lower middle
    single = run(300.0, 30.0)
    assert script.median_run([single]) is single


def test_every_point_draws_prompts_of_its_own_and_warms_up_inside_its_bench(
    script: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Where vLLM keeps a prefix cache, a point that drew the same first prompts as an earlier point would find them
    cached: every bench the script runs has a seed no other has. Its warm-ups are the bench's own (their prompts
    marked apart from the measured ones), not a run of their own."""
    seeds: list[str] = []
    warm_ups: list[str] = []

    def bench_run(command: list[str], **_: object) -> None:
        seeds.append(command[command.index("--seed") + 1])
        warm_ups.append(command[command.index("--num-warmups") + 1])
        if "--result-filename" in command:
            result = {"mean_ttft_ms": 1.0, "mean_tpot_ms": 1.0, "output_throughput": 1.0}
            (tmp_path / command[command.index("--result-filename") + 1]).write_text(json.dumps(result))

    monkeypatch.setattr(script.subprocess, "run", bench_run)
    probe = script.HostMeasurement("h", "cpu", 2, 1.0, 1.0, 1.0, "t")
    monkeypatch.setattr(script, "measure_host", lambda probes: probe)
    monkeypatch.setattr(script, "steady_state", lambda result, concurrency: None)
    args = argparse.Namespace(min_prompts=8, rounds=4, output_len=128, range_ratio=0.5)
    for input_len in (128, 512):
        for concurrency in (1, 4, 16, 64):
            script.bench("http://127.0.0.1:1/v1", input_len, concurrency, args, tmp_path)
    assert len(seeds) == 8 and len(set(seeds)) == 8
    assert warm_ups == [str(script.WARMUP_REQUESTS)] * 8


def test_the_default_calibration_has_one_client_at_both_prompt_lengths(script: ModuleType) -> None:
    """A per-request cost and a per-prompt-token cost only part where one client sends prompts of two lengths; the
    most clients at the shorter prompt give the per-sequence cost."""
    assert script.default_calibration([128, 512], [1, 4, 16, 64]) == [(1, 128), (64, 128), (1, 512)]
    assert script.default_calibration([256], [1, 8]) == [(1, 256), (8, 256)]


def test_points_are_predicted_from_the_runs_median_machine_and_stored_as_probed(
    script: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A probe of a second or two catches the shared machine in a spell (290 or 960 GFLOP/s): every point is
    predicted from the median of the run's probes, while the run's file keeps what each probe measured."""
    stored = json.loads((script.RESULTS / "cpu_profile_vm_2026-11-29_amx_repeats5.json").read_text())
    points = [script.Point(**p) for p in stored["points"] if p["concurrency"] in (1, 4) and p["input_len"] == 128]
    points += [script.Point(**p) for p in stored["points"] if (p["concurrency"], p["input_len"]) == (1, 512)]
    probes = [p.host["bf16_gflops"] for p in points]
    assert len(set(probes)) == 3
    typical = script.with_median_machine(points)
    assert [p.host["bf16_gflops"] for p in typical] == [sorted(probes)[1]] * 3
    saved: list[dict[str, Any]] = []
    monkeypatch.setattr(script, "save", lambda payload, host: saved.append(payload))
    args = argparse.Namespace(machine="median", output_len=128, range_ratio=0.5, from_file=None, write_profile=False)
    script.report(points, [(1, 128), (1, 512), (4, 128)], args, "test")
    assert [p["host"]["bf16_gflops"] for p in saved[0]["points"]] == probes
    base = script.deployment_for(typical[0], 128).select_engine(across_engines=False)
    fitted = base.parameters.with_values(saved[0]["fitted"])
    assert saved[0]["predicted"] == [script.predicted(p.in_steady_state(), 128, fitted) for p in typical]


def test_a_calibration_the_run_cannot_give_is_refused_with_what_it_has(script: ModuleType) -> None:
    points = [script.Point(n, c, 20.0, 6.0, 160.0, 8, {}) for n in (128, 512) for c in (1, 64)]
    assert len(script.calibration_points(points, [(1, 128), (64, 128), (1, 512)], fitted=4)) == 3
    with pytest.raises(SystemExit, match=r"names 64:999, which this run did not measure; it has 1:128, 1:512"):
        script.calibration_points(points, [(1, 128), (64, 999)], fitted=4)
    with pytest.raises(SystemExit, match=r"gives 2 points for the CPU profile's 4 fitted parameters: name at least 3"):
        script.calibration_points(points, [(1, 128), (64, 128)], fitted=4)
