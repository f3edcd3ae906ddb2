"""Pareto frontier, throughput per GPU and per user, cost per million tokens and the hardware's decode limit: each
against hand-computed values, and where each number's inputs come from."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from deepserve.errors import ConfigError
from deepserve.hardware.catalog import get_accelerator
from deepserve.models.spec import ModelSpec
from deepserve.plan.cost import usd_per_million_output_tokens
from deepserve.report import derived as dv
from deepserve.report.build import build_report, load_sets
from deepserve.report.deployment import DeploymentOptions, SetDeployment, resolve_deployment
from deepserve.report.hardware_limit import cpu_limit, gpu_limit
from deepserve.results.points import PointParams, ResultPoint, ResultSet

FIXTURES = Path(__file__).parents[2] / "fixtures" / "results"

# A dense two-layer model small enough to count by hand.
DENSE = ModelSpec(
    name="dense",
    model_type="llama",
    num_layers=2,
    hidden_size=64,
    vocab_size=100,
    num_attention_heads=4,
    num_kv_heads=4,
    intermediate_size=128,
    max_position_embeddings=4096,
    head_dim=16,
)


def test_pareto_frontier_keeps_the_points_nothing_beats_on_both_axes():
    points = [(1.0, 10.0), (2.0, 9.0), (2.0, 5.0), (3.0, 9.5), (4.0, 2.0), (0.5, 8.0)]
    # (2, 9) is beaten by (3, 9.5); (2, 5) and (0.5, 8) by (1, 10); (4, 2) is the fastest per user.
    assert dv.pareto_frontier(points) == [0, 3, 4]
    assert dv.pareto_frontier([]) == []
    assert dv.pareto_frontier([(1.0, 1.0)]) == [0]


def test_per_gpu_per_user_and_cost_by_hand():
    assert dv.per_user_tok_s(25.0) == 40.0  # 1000 / 25 ms
    assert dv.per_user_tok_s(None) is None
    assert dv.per_gpu_tok_s(800.0, 8) == 100.0
    # 8 GPUs at $2/h = $16/h; 800 tok/s = 2.88M tok/h: $16 / 2.88 = $5.5556 per million
    assert usd_per_million_output_tokens(800.0, 8, 2.0) == pytest.approx(16 / 2.88)
    assert usd_per_million_output_tokens(800.0, 8, None) is None
    assert usd_per_million_output_tokens(0.0, 8, 2.0) is None


def test_decode_batch_is_littles_law_over_the_decode_phase():
    # 4 requests/s, each 2,000 ms in decode (2,500 ms end to end, 500 ms to the first token): 8 decoding at once
    assert dv.decode_batch(4.0, 2500.0, 500.0) == pytest.approx(8.0)
    assert dv.decode_batch(0.1, 600.0, 100.0) == 1.0  # an idle server still decodes one sequence at a time
    assert dv.decode_batch(None, 600.0, 100.0) is None


def test_decode_limit_of_a_dense_model_by_hand():
    limit = cpu_limit(DENSE, 10.0, "measured")
    # Weights read per step: per layer 2 norms (128) + attention 4 x 64 x 64 (16,384) + MLP 3 x 64 x 128
    # (24,576) = 41,088 parameters, two layers, plus the output head 100 x 64 = 6,400 (the embedding is only
    # looked up): 88,576 parameters in bf16 = 177,152 bytes. KV cache: 2 x 4 heads x 16 = 128 values x 2 bytes x
    # 2 layers = 512 bytes per token; 4 sequences x 100 tokens = 204,800 bytes.
    assert limit.bytes_per_step(4, 100) == pytest.approx(177_152 + 204_800)
    assert limit.step_floor_s(4, 100) == pytest.approx(381_952 / 10e9)
    assert limit.tokens_per_s(4, 100) == pytest.approx(4 / (381_952 / 10e9))
    assert "the CPU host (10 GB/s, measured)" in limit.describe()


def test_moe_limit_reads_only_the_experts_a_batch_touches():
    from deepserve.models.presets import preset_spec

    tiny = preset_spec("tiny")  # 16 routed experts, 4 per token
    limit = cpu_limit(tiny, 10.0, "measured")
    one, many = limit.bytes_per_step(1, 0), limit.bytes_per_step(64, 0)
    per_expert = tiny.expert_params * 2
    # One token touches 4 of 16 experts in each MoE layer; 64 tokens touch 16 x (1 - (3/4)^64) ≈ all 16.
    expected_extra = tiny.num_moe_layers * per_expert * 16 * ((1 - 0.75**64) - 0.25)
    assert many - one == pytest.approx(expected_extra, rel=1e-9)


def test_gpu_limit_splits_the_weights_over_tensor_parallel_gpus():
    h100 = get_accelerator("h100")
    one, eight = gpu_limit(DENSE, h100, 1), gpu_limit(DENSE, h100, 8)
    assert (eight.layout.tp, eight.layout.pp) == (8, 1)
    assert eight.bytes_per_step(1, 0) < one.bytes_per_step(1, 0)
    sixteen = gpu_limit(DENSE, h100, 16)
    assert (sixteen.layout.tp, sixteen.layout.pp) == (8, 2)  # TP inside a node of 8, PP across the two
    assert "catalog (datasheet)" in eight.describe() and "3,350 GB/s each" in eight.describe()


def _point(**result: float) -> ResultPoint:
    return ResultPoint("p", PointParams(max_concurrency=8, input_len=100, output_len=50), dict(result))


def test_derive_fills_every_value_the_result_supports():
    deployment = SetDeployment(2, "--gpus", 3.0, "--gpu-hour-usd", cpu_limit(DENSE, 10.0, "m"), "", False)
    point = _point(
        output_throughput=400.0,
        median_tpot_ms=20.0,
        mean_tpot_ms=25.0,
        request_throughput=4.0,
        mean_e2el_ms=2500.0,
        mean_ttft_ms=500.0,
        completed=10,
        total_input_tokens=1000,
        total_output_tokens=500,
    )
    values = dv.derive(point, deployment)
    assert values[dv.GPUS] == 2 and values[dv.PER_GPU] == 200.0 and values[dv.PER_USER] == 50.0
    assert values[dv.COST] == pytest.approx(2 * 3.0 / (400 * 3600) * 1e6)
    assert values[dv.DECODE_BATCH] == pytest.approx(8.0)
    assert values[dv.DECODE_TOK_S] == pytest.approx(8 * 1000 / 25.0)  # 320
    ceiling = deployment.limit.tokens_per_s(8.0, 125.0) if deployment.limit else math.nan  # context 100 + 50 / 2
    assert values[dv.LIMIT_TOK_S] == pytest.approx(ceiling)
    assert values[dv.LIMIT_FRACTION] == pytest.approx(320 / ceiling)


def test_derive_leaves_out_what_the_result_lacks():
    deployment = SetDeployment(1, "assumed", None, "", None, "unknown", False)
    values = dv.derive(_point(output_throughput=100.0), deployment)
    assert values == {dv.GPUS: 1.0, dv.PER_GPU: 100.0}


def test_gpus_come_from_the_record_then_the_flag_then_one_with_a_note():
    recorded = load_sets([FIXTURES / "h100_vllm_concurrency"])[0]
    loose = load_sets([FIXTURES / "b200_vllm_loose"])[0]
    options = DeploymentOptions(gpus=4, gpu_hour_usd=2.0)
    assert resolve_deployment(recorded, options).gpus == 8  # the run's own record wins for its set
    flagged = resolve_deployment(loose, options)
    assert (flagged.gpus, flagged.gpus_source, flagged.gpu_hour_usd) == (4, "--gpus", 2.0)
    assumed = resolve_deployment(loose, DeploymentOptions())
    assert assumed.gpus == 1 and assumed.gpus_assumed and "pass --gpus N" in assumed.gpus_source
    assert assumed.limit is None and "hardware is unknown" in assumed.limit_note
    priced = ResultSet("x", [], {**recorded.metadata, "gpu_hour_usd": "1.25"})
    assert resolve_deployment(priced, options).gpu_hour_usd == 1.25  # recorded price wins over the flag


def test_bad_flags_are_config_errors():
    with pytest.raises(ConfigError, match="--gpus 0"):
        DeploymentOptions(gpus=0)
    with pytest.raises(ConfigError, match="--gpu-hour-usd -2"):
        DeploymentOptions(gpu_hour_usd=-2.0)


def test_report_answers_cost_and_limit_in_words(tmp_path: Path):
    sets = load_sets([FIXTURES / "h100_vllm_concurrency", FIXTURES / "b200_vllm_loose"], ["H100", "B200"])
    report = build_report(sets, tmp_path, [], deployment=DeploymentOptions(gpu_hour_usd=2.0))
    texts = report.answer_texts()
    limit = next(text for text in texts if "memory-bandwidth limit" in text)
    assert limit.startswith("H100: decode runs at") and "8x h100-sxm" in limit and "awq-int4" in limit
    costs = [text for text in texts if "per million output tokens" in text]
    assert len(costs) == 2
    assert "8 x $2.00 per hour" in costs[0]
    assert "1 GPU assumed" in costs[1]  # B200's files record no GPU count
    # the cheapest H100 point: the highest output throughput (c=200), 8 GPUs x $2/h
    best = max(point.metric("output_throughput") or 0 for point in sets[0].points)
    assert f"${8 * 2.0 / (best * 3600) * 1e6:,.2f} per million" in costs[0]
    names = {chart.name for chart in report.charts}
    assert {"pareto", "cost_per_million_tokens", "decode_vs_hardware_limit"} <= names
    pareto = next(chart for chart in report.charts if chart.name == "pareto")
    assert "H100: 8 (recorded hardware" in pareto.caption and "B200: 1 (assumed" in pareto.caption


def test_without_a_price_there_is_no_cost_chart_or_column(tmp_path: Path):
    sets = load_sets([FIXTURES / "b200_vllm_loose"])
    report = build_report(sets, tmp_path, [])
    names = {chart.name for chart in report.charts}
    assert "pareto" in names and "cost_per_million_tokens" not in names and "decode_vs_hardware_limit" not in names
    html = report.html_path.read_text()
    assert "tok/s per user" in html and "USD per M output tok" not in html and "% of limit" not in html


def test_a_point_without_per_token_gaps_has_no_speed_per_user_nor_limit_ratio():
    """Median TPOT 0 (every response in one write; older files) or null: no per-user speed, no Pareto point, no
    decode-limit ratio, where they once read as 'thousands of tokens/s per user' and '443% of the limit'."""
    limit = cpu_limit(DENSE, 10.0, "measured")
    deployment = SetDeployment(1, "--gpus", None, "", limit, "", is_cpu_host=True)
    for tpot in (0.0, None):
        result = {
            "completed": 4, "duration": 1.0, "request_throughput": 4.0, "output_throughput": 400.0,
            "total_input_tokens": 400, "total_output_tokens": 400, "mean_ttft_ms": 10.0, "mean_e2el_ms": 12.0,
            "median_tpot_ms": tpot, "mean_tpot_ms": tpot,
        }  # fmt: skip
        derived = dv.derive(ResultPoint("c1", PointParams(max_concurrency=1), result), deployment)
        assert dv.PER_USER not in derived and dv.LIMIT_FRACTION not in derived and dv.DECODE_TOK_S not in derived
        assert derived[dv.PER_GPU] == 400.0
