"""`deepserve plan search`: the layouts enumerated, what is refused and why, the frontier, the ranking, the chosen
candidate's command lines, the chart."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from deepserve.cli import main as cli_main
from deepserve.models import load_spec
from deepserve.plan.layout import Layout
from deepserve.plan.search import (
    SearchConfig,
    chosen_commands,
    layouts,
    pareto_frontier,
    pool_splits,
    search,
)
from deepserve.report.search_chart import draw_search_frontier


@pytest.fixture(scope="module")
def v3():
    return load_spec("deepseek-ai/DeepSeek-V3")


@pytest.fixture(scope="module")
def h200():
    return search(SearchConfig(gpu="h200", gpus=8))


def test_layouts_cover_tp_pp_dp_attention_and_wide_ep(v3) -> None:
    one_node = set(layouts(v3, 8, 8))
    assert {Layout(tp=8), Layout(tp=8, ep=True), Layout(tp=1, dp=8, ep=True), Layout(tp=1, dp=8)} <= one_node
    assert all(layout.pp == 1 for layout in one_node)
    two_nodes = set(layouts(v3, 16, 8))
    assert Layout(tp=8, pp=2) in two_nodes and Layout(tp=16) in two_nodes  # PP across nodes, TP16 over them
    assert Layout(tp=1, dp=16, ep=True) in two_nodes  # wide EP across nodes
    assert Layout(tp=16, dp=1, pp=1, ep=False) in two_nodes and Layout(tp=16, pp=2) not in two_nodes
    splits = list(pool_splits(v3, 32, 8))
    assert {(p.prefill.gpus * p.prefill_replicas, p.decode.gpus * p.decode_replicas) for p in splits} == {
        (8, 24),
        (16, 16),
        (24, 8),
    }


def test_the_frontier_is_not_beaten_on_both_axes(h200) -> None:
    front = pareto_frontier(h200.points)
    assert front
    for point in front:
        assert not any(
            other.tok_s_per_gpu > point.tok_s_per_gpu and other.tok_s_per_user > point.tok_s_per_user
            for other in h200.points
        )
    speeds = [p.tok_s_per_user for p in front]
    assert speeds == sorted(speeds, reverse=True)


def test_ranking_puts_points_within_the_slo_first_and_follows_the_objective(h200) -> None:
    ranked = h200.ranked()
    within = [p.meets_slo for p in ranked]
    assert within == sorted(within, reverse=True)
    best = ranked[0]
    assert best.meets_slo and best.tpot_ms <= 50
    assert all(best.tok_s_per_gpu >= p.tok_s_per_gpu for p in ranked if p.meets_slo)
    latency = search(SearchConfig(gpu="h200", gpus=8, objective="latency", disaggregation=False))
    fastest = latency.ranked()[0]
    assert fastest.tok_s_per_user == max(p.tok_s_per_user for p in latency.points if p.meets_slo)
    assert fastest.concurrency == 1


def test_candidates_that_do_not_fit_are_refused_with_the_reason(v3) -> None:
    result = search(SearchConfig(gpu="h100", gpus=8, weights=["fp8"], speculative=False))  # FP8 V3 needs 16 H100
    assert not result.points and result.refused
    assert all("does not fit" in reason for _, reason in result.refused)
    assert result.chosen is None and chosen_commands(result) is None


def test_published_exports_are_formats_to_search_and_their_commands_load_them() -> None:
    """DeepSeek-V3's FP8 release does not fit 8 x H100; its AWQ export does, without the MTP module it dropped."""
    result = search(SearchConfig(gpu="h100", gpus=8, disaggregation=False))
    assert {p.candidate.weights for p in result.points} == {"awq-int4"}
    assert all(c.speculation is None for c, _ in result.refused if c.weights == "awq-int4")
    assert not any(p.candidate.speculation for p in result.points)
    commands = chosen_commands(result)
    assert commands is not None and commands.deploy_render is not None
    assert commands.serve[0].startswith("deepserve serve --model cognitivecomputations/DeepSeek-V3-AWQ ")
    assert "--model cognitivecomputations/DeepSeek-V3-AWQ " in commands.deploy_render
    v4 = search(SearchConfig(model="deepseek-ai/DeepSeek-V4-Flash", gpu="b200", gpus=4, disaggregation=False))
    assert {p.candidate.weights for p in v4.points} == {"mxfp4", "nvfp4", "fp8"}
    assert any(p.candidate.weights == "nvfp4" and p.candidate.speculation for p in v4.points)  # the repack has MTP


def test_speculative_decoding_and_pools_are_dimensions(h200) -> None:
    kinds = {p.candidate.kind for p in h200.points}
    assert any(kind.endswith("+mtp") for kind in kinds)
    two_nodes = search(SearchConfig(gpu="h200", gpus=16, speculative=False))
    assert any(p.candidate.pools is not None for p in two_nodes.points)
    pool = next(p for p in two_nodes.points if p.candidate.pools is not None)
    assert pool.tok_s_per_gpu > 0 and pool.ttft_ms > 0
    mtp = next(p.candidate.speculation for p in h200.points if p.candidate.speculation)
    assert mtp.method == "mtp" and mtp.acceptance_source.startswith("TensorRT-LLM")  # the published default


def test_the_chosen_candidate_has_serve_and_deploy_lines(h200) -> None:
    commands = chosen_commands(h200)
    assert commands is not None and h200.chosen is not None
    assert commands.serve and commands.serve[0].startswith("deepserve serve")
    assert commands.deploy_render and commands.deploy_render.startswith("deepserve deploy render --target kubernetes")
    layout = h200.chosen.candidate.layout
    assert f"--tensor-parallel-size {layout.tp}" in commands.serve[0] or layout.tp == 1
    engine = h200.chosen.candidate.engine  # the lines run the engine the candidate's figures are for
    assert (
        ("--engine sglang" in commands.serve[0])
        == (engine == "sglang")
        == ("--engine sglang" in commands.deploy_render)
    )
    sglang = search(SearchConfig(gpu="h200", gpus=8, engines=["sglang"], disaggregation=False))
    chosen = chosen_commands(sglang)
    assert chosen is not None and chosen.serve[0].startswith("deepserve serve --engine sglang ")


def test_chosen_pools_get_role_lines_a_gateway_line_and_a_render_line() -> None:
    result = search(SearchConfig(gpu="h100", gpus=16))  # AWQ pools of one node each lead at high load
    chosen = result.chosen
    assert chosen is not None and chosen.candidate.pools is not None
    pools = chosen.candidate.pools
    commands = chosen_commands(result)
    assert commands is not None
    prefill, decode = commands.serve
    assert prefill.startswith("# prefill pool, 1 replica(s): deepserve serve ") and "--role prefill" in prefill
    assert decode.startswith("# decode pool, 1 replica(s): deepserve serve ") and "--role decode" in decode
    assert all("--kv-connector NixlConnector" in line and "--host 0.0.0.0" in line for line in commands.serve)
    assert "--speculative-method" not in prefill  # the prefill pool was evaluated without drafts
    assert any(
        note.startswith("in front of the pools: deepserve gateway --prefill-upstream") for note in commands.notes
    )
    if pools.prefill == pools.decode:
        assert commands.deploy_render is not None
        assert commands.deploy_render.endswith("--prefill-replicas 1 --replicas 1 --kv-connector NixlConnector")
    different = replace(pools, decode=Layout(tp=2, dp=4))
    other = replace(chosen, candidate=replace(chosen.candidate, pools=different))
    split = chosen_commands(replace(result, points=(other,)))
    assert split is not None and split.deploy_render is None
    assert any("deploy render gives both pools one layout, and these differ" in note for note in split.notes)


def test_a_search_is_quick_and_says_how_long_it_took(h200) -> None:
    assert h200.candidates >= 40 and 0 < h200.seconds < 30


def test_the_frontier_chart_is_drawn(h200, tmp_path: Path) -> None:
    path = draw_search_frontier(h200, tmp_path / "frontier.png")
    assert path.stat().st_size > 10_000 and path.read_bytes()[:4] == b"\x89PNG"


def test_each_point_shows_how_its_layout_kind_has_fared_held_out(h200) -> None:
    """The ranking and the frontier carry each layout kind's median held-out throughput ratio (plan/track_record.py),
    so a candidate whose kind has run high says so beside its figures."""
    from deepserve.cli.plan_search import search_markdown
    from deepserve.plan.track_record import record_for

    lines = [line for line in search_markdown(h200).splitlines() if line.startswith(("| best", "| frontier"))]
    assert lines and all(line.rstrip(" |").endswith("x") for line in lines)
    record = record_for("dp-attention+tp-experts", "nvidia", "mla")
    assert record is not None
    metric = record.metric("throughput")
    assert metric is not None
    expected = f"{'~' if record.instead_of else ''}{metric.median_ratio:.2f}x"
    data_parallel = [line for line in lines if "DP-attention" in line and "experts split" in line]
    assert data_parallel and all(line.rstrip(" |").endswith(" " + expected) for line in data_parallel)


def test_search_command(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cli_main, "COMMANDS", ("plan",))
    chart = tmp_path / "chart.png"
    argv = ["plan", "search", "--gpu", "h200", "--gpus", "8", "--engines", "vllm", "--json", "--chart", str(chart)]
    assert cli_main.main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["chosen"]["meets_slo"] and data["commands"]["serve"] and chart.is_file()
    assert {p["candidate"].split()[0] for p in data["ranked"]} == {"vllm"}
    # beside the chosen layout: how far held-out forecasts of its kind on NVIDIA GPUs have been
    record = data["track_record"]
    assert record["vendor"] == "nvidia" and record["metrics"]["throughput"]["figures"] >= 5
    with pytest.raises(SystemExit) as refused:
        cli_main.main(["plan", "search", "--gpu", "h200", "--gpus", "8", "--objective", "cheap"])
    assert refused.value.code == 2 and "choose from 'throughput', 'cost', 'latency'" in capsys.readouterr().err
