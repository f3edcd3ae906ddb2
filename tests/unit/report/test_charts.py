from __future__ import annotations

from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from deepserve.report.charts import draw_charts
from deepserve.results import series as sr
from deepserve.results.slo import Slo
from deepserve.results.sweepdir import load_result_set

FIXTURES = Path(__file__).parents[2] / "fixtures" / "results"
ALL_SETS = (
    "h100_vllm_concurrency",
    "h100_sglang_concurrency",
    "h100_v3_rate",
    "h100_r1_rate",
    "h200_vllm_output_length",
    "h200_vllm_prefix",
)


def sets_of(*names: str):
    return [load_result_set(FIXTURES / name) for name in names]


def assert_drawn(path: Path) -> None:
    """A real picture: a PNG of the expected size with more than a blank canvas in it."""
    image = matplotlib.image.imread(path)
    height, width = image.shape[:2]
    assert width >= 800 and height >= 450
    not_white = np.any(image[:, :, :3] < 0.9, axis=2).mean()
    assert not_white > 0.03, f"{path.name} is almost blank"
    colours = len(np.unique((image[:, :, :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0))
    assert colours > 20, f"{path.name} has only {colours} colours"


def test_every_chart_the_issue_asks_for_is_drawn(tmp_path: Path):
    charts = draw_charts(sets_of(*ALL_SETS), [Slo("p99_itl_ms", 50)], tmp_path)
    names = {chart.name for chart in charts}
    assert {
        "throughput_vs_concurrency",
        "itl_vs_concurrency",
        "ttft_ttlt_vs_concurrency",
        "completed_vs_offered_rate",
        "ttft_ttlt_vs_rate",
        "throughput_vs_output_len",
        "latency_vs_output_len",
        "throughput_vs_latency",
        "prefix_sharing",
    } <= names
    for chart in charts:
        assert chart.path == tmp_path / f"{chart.name}.png"
        assert_drawn(chart.path)


def test_pareto_cost_and_limit_charts_are_drawn(tmp_path: Path):
    from deepserve.report.build import build_report
    from deepserve.report.deployment import DeploymentOptions

    sets = sets_of("h100_vllm_concurrency", "h100_v3_rate", "b200_vllm_loose")
    report = build_report(sets, tmp_path, [], deployment=DeploymentOptions(gpus=8, gpu_hour_usd=2.0))
    charts = {chart.name: chart for chart in report.charts}
    for name in ("pareto", "cost_per_million_tokens", "decode_vs_hardware_limit"):
        assert_drawn(charts[name].path)
    # one line per set on the Pareto chart; the B200 files have no hardware, so no limit line for them
    assert "b200_vllm_loose: 8 (--gpus)" in charts["pareto"].caption
    assert "b200" not in charts["decode_vs_hardware_limit"].caption


def test_workload_lines_join_every_load_level_of_one_workload():
    lines = sr.build_workload_series(sets_of("h100_vllm_concurrency", "h200_vllm_output_length"), _speed, "duration")
    assert [line.label for line in lines] == [
        "H100 vLLM V3",
        "H200 vLLM R1 · out 800",
        "H200 vLLM R1 · out 1600",
        "H200 vLLM R1 · out 3200",
        "H200 vLLM R1 · out 6400",
    ]
    assert len(lines[0].points) == 13 and lines[0].xs == sorted(lines[0].xs)


def _speed(point):
    tpot = point.metric("median_tpot_ms")
    return 1000 / tpot if tpot else None


def test_only_charts_with_data_are_drawn(tmp_path: Path):
    charts = draw_charts(sets_of("h100_v3_rate"), [], tmp_path)
    assert {chart.name for chart in charts} == {
        "completed_vs_offered_rate",
        "ttft_ttlt_vs_rate",
        "throughput_vs_completed_rate",
    }
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(f"{c.name}.png" for c in charts)


def test_overlaid_sets_get_one_line_each_named_by_label():
    sets = sets_of("h100_vllm_concurrency", "h100_sglang_concurrency")
    lines = sr.build_series(sets, sr.is_concurrency_point, sr.concurrency_x, "max_concurrency")
    assert [line.label for line in lines] == ["H100 vLLM V3", "H100 SGLang V3"]
    assert lines[1].xs == sorted(lines[1].xs) and lines[1].xs[0] == 1 and lines[1].xs[-1] == 14


def test_lines_within_a_set_are_named_by_what_differs():
    [result_set] = sets_of("h200_vllm_output_length")
    lines = sr.build_series([result_set], sr.is_closed_loop, sr.output_len_x, "output_len")
    assert [line.label for line in lines] == ["H200 vLLM R1"]
    assert lines[0].xs == [800, 1600, 3200, 6400]
    # Along concurrency the same points are four one-point lines, named by output length, and dropped: one point
    # is not a curve.
    assert sr.build_series([result_set], sr.is_concurrency_point, sr.concurrency_x, "max_concurrency") == []
    lines = sr.build_series([result_set], sr.is_concurrency_point, sr.concurrency_x, "max_concurrency", min_points=1)
    assert [line.label for line in lines] == [f"H200 vLLM R1 · out {n}" for n in (800, 1600, 3200, 6400)]


@pytest.mark.parametrize("name", ["itl_vs_concurrency"])
def test_slo_line_changes_the_chart(tmp_path: Path, name: str):
    sets = sets_of("h100_vllm_concurrency")
    [with_slo] = [c for c in draw_charts(sets, [Slo("p99_itl_ms", 400)], tmp_path / "a") if c.name == name]
    [without] = [c for c in draw_charts(sets, [], tmp_path / "b") if c.name == name]
    red = [
        np.sum((img[:, :, 0] > 0.8) & (img[:, :, 1] < 0.2) & (img[:, :, 2] < 0.2))
        for img in (matplotlib.image.imread(with_slo.path), matplotlib.image.imread(without.path))
    ]
    assert red[0] > red[1] + 200  # the red SLO line is there only when asked for
