"""The planner's part: the EngineConfig → PlanConfig mapping, forecasts, pruning and the order of points."""

from __future__ import annotations

import math

import pytest

from deepserve.bench.config import BenchConfig
from deepserve.engines.config import EngineConfig
from deepserve.results.slo import parse_slo
from deepserve.tune.grid import expand, parse_axis
from deepserve.tune.predict import (
    Forecast,
    LoadShape,
    default_planner_gpu,
    forecast,
    load_shape,
    plan_config_for,
    prune_reason,
)
from deepserve.tune.spec import plan_order
from tests.helpers import present

SHAPE = LoadShape(input_len=1024, output_len=256, num_prompts=200, max_concurrency=64, request_rate=math.inf)
ITL_50 = parse_slo("p99_itl_ms=50")


def bench(**load) -> BenchConfig:
    return BenchConfig.model_validate({"workload": {"random_input_len": 512, "random_output_len": 64}, "load": load})


def test_engine_config_maps_to_the_planners_question():
    config = EngineConfig(
        tensor_parallel_size=8,
        max_num_seqs=128,
        max_num_batched_tokens=4096,
        gpu_memory_utilization=0.85,
        kv_cache_dtype="fp8_e4m3",
        quantization="fp8",
        max_model_len=16384,
    )
    question = plan_config_for(config, "deepseek-ai/DeepSeek-V3", "h100", SHAPE)
    assert (question.gpus, question.tp, question.pp, question.dp) == (8, 8, 1, 1)
    assert (question.max_num_seqs, question.max_num_batched_tokens) == (128, 4096)
    assert (question.gpu_memory_utilization, question.kv_dtype, question.weights) == (0.85, "fp8", "fp8-dynamic")
    assert (question.input_len, question.output_len, question.concurrency) == (1024, 256, [64])
    assert question.max_model_len == 16384


def test_load_shape_from_the_benchmark():
    shape, _ = load_shape(bench(max_concurrency=16))
    assert shape == LoadShape(512, 64, 1000, 16, math.inf)
    assert shape.concurrency_levels() == [16]
    open_loop, _ = load_shape(bench(request_rate=4.0, duration_s=30))
    assert open_loop is not None and open_loop.num_prompts == 120
    levels = open_loop.concurrency_levels()
    assert levels[0] == 1 and levels[-1] == 120 and levels == sorted(set(levels))
    none, why = load_shape(BenchConfig.model_validate({"workload": {"dataset_name": "sharegpt"}}))
    assert none is None and "fixed-length" in why


def test_a_point_that_cannot_fit_is_pruned():
    # DeepSeek-V3 in FP8 needs about 700 GB of weights: one H100 holds 80.
    one_gpu = forecast(EngineConfig(), "deepseek-ai/DeepSeek-V3", "h100", SHAPE, "")
    assert one_gpu.fits is False and not one_gpu.predicted
    assert present(prune_reason(one_gpu, [ITL_50], 2.0)).startswith("cannot fit")
    eight = forecast(
        EngineConfig(tensor_parallel_size=8, quantization="awq"), "deepseek-ai/DeepSeek-V3", "h100", SHAPE, ""
    )
    assert eight.fits is True and eight.predicted
    assert eight.output_tok_s and eight.tpot_ms and eight.ttft_ms and eight.e2el_ms


def test_no_hardware_or_no_shape_means_no_prediction_and_no_pruning():
    unknown = forecast(EngineConfig(), "tiny", None, SHAPE, "no profile for this CPU")
    assert unknown.fits is None and unknown.note == "no profile for this CPU"
    assert prune_reason(unknown, [ITL_50], 2.0) is None
    broken = forecast(EngineConfig(tensor_parallel_size=3), "deepseek-ai/DeepSeek-V3", "h100", SHAPE, "")
    assert broken.fits is None and broken.note.startswith("the planner cannot model this point")


def test_slo_pruning_uses_the_margin():
    slow = Forecast(fits=True, output_tok_s=100.0, tpot_ms=120.0, ttft_ms=500.0, e2el_ms=1000.0)
    reason = prune_reason(slow, [ITL_50], 2.0)
    assert reason == "predicted P99 ITL about 120 ms, more than 2 × the SLO's 50 ms"
    assert prune_reason(slow, [ITL_50], 3.0) is None
    assert prune_reason(slow, [ITL_50], None) is None
    assert prune_reason(slow, [parse_slo("std_itl_ms=1")], 2.0) is None  # a spread is not predicted


@pytest.mark.parametrize(
    ("predicted", "expected"),
    [
        # predicted to meet, by goodput; then unpredicted in grid order; then predicted to miss, by throughput
        ([(500, 30), None, (900, 40), (2000, 60), None, (1000, 70)], ["c", "a", "b", "e", "d", "f"]),
    ],
)
def test_points_run_most_promising_first(predicted, expected):
    points = expand([parse_axis("max_num_seqs=1,2,3,4,5,6")], EngineConfig())
    forecasts = [
        Forecast(fits=None) if item is None else Forecast(True, item[0], item[1], 100.0, 1000.0) for item in predicted
    ]
    planned = plan_order(points, forecasts, [ITL_50], margin=2.0)
    names = {point.point_id: "abcdef"[index] for index, point in enumerate(points)}
    assert [names[p.point.point_id] for p in planned] == expected


def test_skipped_points_go_last_with_their_reason():
    points = expand([parse_axis("max_num_seqs=1,2")], EngineConfig())
    forecasts = [Forecast(True, 5000.0, 500.0, 1.0, 1.0), Forecast(fits=None)]
    planned = plan_order(points, forecasts, [ITL_50], margin=2.0, refused={})
    assert planned[0].point.config.max_num_seqs == 2 and planned[0].skip_reason is None
    assert planned[1].skip_reason is not None and "500 ms" in planned[1].skip_reason


def test_on_a_cpu_machine_the_planner_models_this_host():
    assert default_planner_gpu(on_cpu=True) == ("host", "")


# ---- speculative decoding as a grid dimension -----------------------------------------------------------------------


def test_the_number_of_draft_tokens_is_a_grid_dimension_the_planner_forecasts():
    """`--grid num_speculative_tokens=0,1,2,3`: 0 is off, K the model's own MTP with K drafts; the forecast of each
    point comes from the plan's speculative step (one user gains, a full batch gains less)."""
    axis = parse_axis("num_speculative_tokens=0,1,2,3")
    points = expand([axis], EngineConfig(model="deepseek-ai/DeepSeek-R1", tensor_parallel_size=8))
    question = plan_config_for(points[2].config, "deepseek-ai/DeepSeek-R1", "h200", SHAPE, (0.9, 0.7, 0.5))
    assert (question.num_speculative_tokens, question.spec_acceptance) == (2, [0.9, 0.7, 0.5])
    one_user = LoadShape(1024, 256, 8, 1, math.inf)
    tpots = [present(forecast(p.config, "deepseek-ai/DeepSeek-R1", "h200", one_user, "").tpot_ms) for p in points]
    assert tpots[0] > tpots[1] > tpots[2]  # 1.92, 2.58 tokens a step (published MTP acceptance)
    ngram = EngineConfig(
        model="deepseek-ai/DeepSeek-R1", tensor_parallel_size=8, speculative_method="ngram", num_speculative_tokens=3
    )
    unknown = forecast(ngram, "deepseek-ai/DeepSeek-R1", "h200", one_user, "")
    assert unknown.fits is None and "--spec-acceptance" in unknown.note  # never pruned for lack of a forecast
    assert forecast(ngram, "deepseek-ai/DeepSeek-R1", "h200", one_user, "", (0.5,)).predicted


def test_a_speculating_point_the_plan_shows_missing_the_slo_is_pruned(monkeypatch):
    """On this CPU's profile speculation is slower than none (shared/DESIGN.md): with a TPOT SLO between the two,
    the speculating points are skipped and the plain one runs first."""
    from deepserve.hardware import host

    measured = host.HostMeasurement("box", "Test CPU", 2, 26.0, 140.0, 15.2, "2026-11-23T00:00:00Z")
    monkeypatch.setattr(host, "measured_host", lambda refresh=False: measured)
    points = expand([parse_axis("num_speculative_tokens=0,3")], EngineConfig(max_model_len=512))
    shape = LoadShape(128, 64, 8, 1, math.inf)
    tiny_forecasts = [forecast(p.config, _tiny_mtp(), "host", shape, "") for p in points]
    plain, speculating = (f.tpot_ms for f in tiny_forecasts)
    assert plain is not None and speculating is not None and speculating > plain
    slo = parse_slo(f"mean_tpot_ms={(plain + speculating) / 4:.3f}")  # a margin of 2 puts the limit between them
    planned = plan_order(points, tiny_forecasts, [slo], 2.0)
    assert [p.point.describe() for p in planned] == ["num_speculative_tokens=0", "num_speculative_tokens=3"]
    assert planned[1].skip_reason is not None and "predicted" in planned[1].skip_reason


def _tiny_mtp() -> str:
    """A tiny V3 with one MTP layer (config.json only: the planner reads nothing else)."""
    import json
    import tempfile
    from pathlib import Path

    from deepserve.models.tiny import tiny_config

    directory = Path(tempfile.mkdtemp(prefix="tiny-mtp-"))
    (directory / "config.json").write_text(json.dumps(tiny_config() | {"num_nextn_predict_layers": 1}))
    return str(directory)
