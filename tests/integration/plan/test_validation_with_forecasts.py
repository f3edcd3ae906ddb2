"""`plan validate` as the CLI runs it: every finite run (a request rate, everything at once, a counted closed loop)
forecast through the simulator's scheduler in virtual time, each source held out."""

from __future__ import annotations

import json
import time

import pytest

from deepserve.plan.track_record import TRACK_RECORD_PATH, summarise
from deepserve.plan.validate import TARGET_MAPE_PCT, track_record_figures, validate
from deepserve.simulate.forecast import SimulatorForecaster


@pytest.fixture(scope="module")
def forecast_validation():
    started = time.monotonic()
    result = validate(forecaster=SimulatorForecaster())
    return result, time.monotonic() - started


def test_finite_runs_are_scored_as_they_ran(forecast_validation) -> None:
    result, _seconds = forecast_validation
    assert not result.not_held_out  # with the simulator every expressible row is predicted held-out
    finite = [r for r in result.held_out.results if r.row.scored_as == "finite"]
    assert {r.row.source_id for r in finite} >= {"sglang-5571-h200", "sglang-3602-h200", "lmsys-amd-mtp-mi300x"}
    data_parallel = [r for r in finite if r.row.source_id == "sglang-5571-h200" and r.row.metric == "ttft_mean"]
    assert data_parallel and data_parallel[0].predicted > 2_000  # 50 prompts of 10K at 10/s queue on 8 ranks


def test_leave_one_source_out_stays_within_what_was_measured(forecast_validation) -> None:
    """A guard against regressions: the closed-loop NVIDIA rows as docs/PLANNING.md section 6 records them (the
    issue's targets, TARGET_MAPE_PCT, are the goal)."""
    result, seconds = forecast_validation
    headline = result.held_out.headline
    assert len(headline.results) >= 90
    # after section 6's step 9 (the engines' own all-reduce inside a node): 17.0% and 13.9%; after step 16 (an NVL72
    # rack's trays one NVLink domain, SGLang refitted on the GB200 decode rows it moved): 17.3% and 14.3%; after
    # step 18 (Blackwell's MLA decode measured): 17.39% and 14.35%
    assert headline.mape_pct("throughput") <= 17.5 and headline.mape_pct("tpot") <= 14.5
    assert headline.mape_pct("ttft") <= TARGET_MAPE_PCT["ttft"]
    off = result.held_out.off_by_more_than_2x
    guarded_alone = {"inferencex-3318-mi325x", "lmsys-amd-mtp-mi300x", "sglang-v4-cookbook"}
    # eight rows beyond 2x outside the sources guarded on their own below (docs/PLANNING.md section 6): GB200's
    # decode row 109 (0.43 with its 12 trays read as 12 machines on the network) is 0.90 since step 16
    assert len([r for r in off if r.row.source_id not in guarded_alone]) <= 8
    gb200 = [r for r in result.held_out.results if r.row.source_id in ("lmsys-gb200-1", "lmsys-gb200-2")]
    assert len(gb200) == 3 and all(0.5 <= r.ratio <= 2.0 for r in gb200)
    # InferenceX's MI325X sweep: its throughputs and TPOTs within 2x held out, only its 4-client mean first token
    # (row 435: 1,025 ms published, about 440 predicted) beyond
    assert [r.row.number for r in off if r.row.source_id == "inferencex-3318-mi325x"] == [435]
    # with AITER's kernel figures at DeepSeek's shapes (step 17): 20.4% throughput and 16.0% TPOT MAPE (30.4 / 21.8
    # with CDNA3's whole-GPU ceilings split by Hopper's shares)
    mi325x = result.held_out.where(lambda r: r.row.source_id == "inferencex-3318-mi325x")
    assert mi325x.mape_pct("throughput") <= 21.0 and mi325x.mape_pct("tpot") <= 17.0
    # the AMD MTP blog (SGLang 0.4.10 on MI300X), predicted with sglang-rocm fitted on the MI325X sweep and the 0.4
    # series' 20 ms per step that dstack measured on SGLang 0.4.2 (section 6, step 12): 0.56-1.76, none beyond 2x
    # (0.14-0.45 without the step)
    amd_mtp = [r for r in result.held_out.results if r.row.source_id == "lmsys-amd-mtp-mi300x"]
    assert len(amd_mtp) == 14 and all(0.5 <= r.ratio <= 2.0 for r in amd_mtp)
    # SGLang's V4 cookbook: its low-latency cells (TP, MTP, 1 and 16 clients) at 1.01-1.49 of their throughput and
    # 0.63-1.02 of their TPOT; its cells at 64 clients and more are section 6, steps 10 and 11's V4 findings
    cookbook = [r for r in result.held_out.results if r.row.source_id == "sglang-v4-cookbook"]
    assert len(cookbook) == 126
    low_latency = [r for r in cookbook if (r.row.concurrency or 0) <= 16 and r.group in ("throughput", "tpot")]
    assert len(low_latency) == 28 and all(0.6 <= r.ratio <= 1.5 for r in low_latency)
    # V4-Flash at 1,024 and 4,096 clients runs at SGLang's own cap for V4 (256 requests over the DP ranks) and, on
    # 8 x H100, at what its sliding-window pool holds: TPOT 0.61-0.87 held out, throughput 1.13-1.93 (without the
    # cap: TPOT 2-10x, throughput 1.8-4x)
    flash = [r for r in cookbook if r.row.model == "DeepSeek-V4-Flash" and (r.row.concurrency or 0) >= 1024]
    tpot = [r.ratio for r in flash if r.group == "tpot"]
    assert len(tpot) == 8 and all(0.58 <= ratio <= 1.15 for ratio in tpot)
    assert max(r.ratio for r in flash if r.group == "throughput") <= 2.0
    # V4-Pro on 8 x H200 (TP8) holds a few dozen requests in SGLang's sliding-window pool (step 13): its TPOTs at
    # 64-4,096 clients 0.58-0.91 held out (4.3-6.9x with vLLM's cache model), none of its rows beyond 2.5x
    pro_h200 = [r for r in cookbook if r.row.model == "DeepSeek-V4-Pro" and r.row.hardware.startswith("H200")]
    assert all(0.55 <= r.ratio <= 1.0 for r in pro_h200 if r.group == "tpot" and (r.row.concurrency or 0) >= 64)
    assert all(0.4 <= r.ratio <= 2.5 for r in pro_h200)
    # V4-Pro's MegaMoE cells on Blackwell (DP8 attention, EP8): each rank prefills SGLang's share of the chunk
    # (step 15), TPOT 2.8-2.9x held out (3.2-3.4x with the whole chunk on every rank)
    mega = [r for r in cookbook if r.row.model == "DeepSeek-V4-Pro" and r.row.ep == 8 and r.row.spec in ("", "none")]
    assert mega and max(r.ratio for r in mega if r.group == "tpot") <= 3.0
    assert len([r for r in off if r.row.source_id == "sglang-v4-cookbook"]) <= 24  # 38 before step 13, 25 before 15
    # SGLang PR 5571's run without DeepGEMM (its dense FP8 GEMMs at Triton's fractions): throughput 1.8x -> 1.6x
    pr_5571 = [r for r in result.held_out.results if r.row.source_id == "sglang-5571-h200"]
    assert pr_5571 and max(r.ratio for r in pr_5571) <= 1.65
    # vLLM's V3.2 recipe read as the 141 GB H20 it ran on, with V3.2's FP8 cache: every row within 2x (on the 96 GB
    # part its cache held ten of the 100 requests and the rows were 0.01-6x)
    assert not [r.row.number for r in off if r.row.source_id == "vllm-recipe-v32-h20"]
    # seed 002's saturated runs, once 1.37-1.39x its throughput with the latent cache read at FlashMLA's rate, are
    # within 10% with Triton's, the kernel its --block-size 1 leaves vLLM on Blackwell
    saturated = [r for r in result.held_out.results if r.row.source_id == "seed-002" and r.row.concurrency >= 512]
    assert len(saturated) == 4 and all(0.9 <= r.ratio <= 1.1 for r in saturated)
    # TensorRT-LLM's two sources, each predicted by the trtllm profile fitted on the other: InferenceX's B200 sweep
    # within 1.3x on throughput and TPOT (0.78-0.96 and 1.07-1.28); NVIDIA's H200 guide at 1,024 in flight 1.56x
    # (its finite run's forecast: section 6, step 8), guarded against getting worse
    b200 = [r for r in result.held_out.results if r.row.source_id == "inferencex-3317-b200-trt"]
    assert b200 and all(1 / 1.3 <= r.ratio <= 1.3 for r in b200 if r.group in ("throughput", "tpot"))
    guide = [r for r in result.held_out.results if r.row.source_id == "trtllm-best-perf"]
    assert guide and max(r.ratio for r in guide) <= 1.6
    # the V4 cookbook's runs of 1,024 and 4,096 clients (up to 4,096 requests each, simulated step by step) take
    # most of it: about 165-310 s on a quiet machine
    assert seconds < 600


def test_the_packaged_track_record_is_what_validation_gives(forecast_validation) -> None:
    """`plan` prints data/track_record.json beside its figures: it must be the current model's held-out record
    (after a change to the model, the profiles or the rows: `deepserve plan validate --write-track-record`)."""
    result, _seconds = forecast_validation
    stored = json.loads(TRACK_RECORD_PATH.read_text())["records"]
    current = summarise(track_record_figures(result.held_out))["records"]
    assert [(r["layout_kind"], r["vendor"]) for r in stored] == [(r["layout_kind"], r["vendor"]) for r in current]
    for old, new in zip(stored, current, strict=True):
        assert old["metrics"].keys() == new["metrics"].keys(), old["layout_kind"]
        for group, values in new["metrics"].items():
            for name, value in values.items():
                assert old["metrics"][group][name] == pytest.approx(value, abs=0.002), (old["layout_kind"], group)


def test_forecast_closed_loops_carry_the_steady_formula_the_steady_validation_gives(forecast_validation) -> None:
    """Every held-out closed loop forecast as its run also carries the steady formula's figure, the one `plan
    validate --steady` scores; finite runs (no steady state to compare) carry none."""
    result, _seconds = forecast_validation
    steady_run = {r.row.number: r.predicted for r in validate().held_out.results}
    closed = [r for r in result.held_out.results if r.row.scored_as in ("closed_loop", "sweep_peak")]
    forecast = [r for r in closed if r.steady is not None]
    assert len(forecast) >= 100
    for r in forecast:
        assert r.steady == pytest.approx(steady_run[r.row.number], rel=1e-9), r.row.label()
    assert all(r.steady is None for r in result.held_out.results if r.row.scored_as == "finite")
    # TensorRT-LLM's attention-DP run of 5,120 equal requests (row 158): the forecast's ranks prefill in step,
    # in waves; the steady formula spreads the prompts over the ranks at random (docs/PLANNING.md section 6)
    row_158 = next(r for r in forecast if r.row.number == 158)
    assert row_158.ratio > 1.4 and row_158.steady_ratio is not None and 0.9 < row_158.steady_ratio < 1.25
