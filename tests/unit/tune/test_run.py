"""The tune's loop with a fake point runner (no engine): order, pruning, failures, Ctrl-C, budgets, resume, and
what it leaves behind (point files, index, best.yaml that `serve` accepts, results store, a report)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from deepserve.bench.config import BenchConfig
from deepserve.cli.main import main
from deepserve.config import load_section
from deepserve.engines.config import EngineConfig
from deepserve.errors import ConfigError
from deepserve.report.build import build_report, load_sets
from deepserve.results.slo import parse_slo
from deepserve.results.store import ResultsStore
from deepserve.results.sweepdir import read_index
from deepserve.tune.grid import expand, parse_axis
from deepserve.tune.predict import Forecast
from deepserve.tune.run import TuneOptions, extra, run_tune
from deepserve.tune.spec import TuneSpec, plan_order
from tests.helpers import tiny_config_dir
from tests.unit.tune.fake_points import FakeEngine

TTFT_400 = (parse_slo("p99_ttft_ms=400"),)
BENCH = BenchConfig.model_validate(
    {"workload": {"num_prompts": 32, "random_input_len": 16, "random_output_len": 16}, "load": {"max_concurrency": 16}}
)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return tiny_config_dir(tmp_path / "model")


def spec_for(model_dir: Path, grid: list[str], forecasts: list[Forecast] | None = None, signature="s1") -> TuneSpec:
    base = EngineConfig(model=str(model_dir), device="cpu", max_model_len=256)
    points = expand([parse_axis(text) for text in grid], base)
    planned = plan_order(points, forecasts or [Forecast(fits=None)] * len(points), TTFT_400, margin=2.0)
    params = {"max_concurrency": 16, "request_rate": None, "input_len": 16, "output_len": 16, "num_prompts": 32}
    return TuneSpec("tiny tune", signature, planned, params, {"model": "tiny"})


def options(tmp_path: Path, **kw) -> TuneOptions:
    return TuneOptions(slos=TTFT_400, db_path=tmp_path / "results.db", **kw)


def by_variant(out: Path) -> dict[str, str]:
    index = read_index(out)
    assert index is not None
    return {entry.params["variant"]: entry.status for entry in index.points}


def test_tune_picks_the_point_with_the_highest_goodput_and_leaves_a_servable_config(tmp_path, model_dir, capsys):
    out, engine = tmp_path / "tune", FakeEngine()
    spec = spec_for(model_dir, ["max_num_seqs=2,16"])
    outcome = run_tune(out, spec, BENCH, engine, options(tmp_path), progress=lambda line: None)

    assert outcome.best is not None and outcome.best.description == "max_num_seqs=16"
    assert outcome.counts == {"ran": 2, "kept": 0, "skipped": 0, "failed": 0}
    config = load_section(EngineConfig, "engine", outcome.best_path)
    assert (config.max_num_seqs, config.model, config.max_model_len, config.device) == (16, str(model_dir), 256, "cpu")
    assert config.port == EngineConfig().port  # the tune's loopback port is not part of the config
    assert main(["serve", "--config", str(outcome.best_path), "--dry-run"]) == 0
    assert "--max-num-seqs 16" in capsys.readouterr().out

    index = read_index(out)
    assert index is not None and index.suite == "tune" and index.metadata["best"]["engine"] == "max_num_seqs=16"
    for entry in index.points:
        result = json.loads((out / (entry.result_file or "")).read_text())
        assert result["tune"]["engine"] == extra(entry, "engine")
        assert result["variant"] == entry.params["variant"]
        assert len(result["ttfts"]) == 32  # the per-request lists that goodput is counted from
    runs = ResultsStore(tmp_path / "results.db").list_runs(suite="tune")
    assert sorted(run.point_id or "" for run in runs) == sorted(entry.point_id for entry in index.points)

    report = build_report(load_sets([out]), tmp_path / "report", TTFT_400)
    html = report.html_path.read_text()
    assert "Tuned points: predicted against measured" in html
    assert "tune_predicted_vs_measured" in [chart.name for chart in report.charts]


def test_points_run_most_promising_first_and_pruned_points_never_start(tmp_path, model_dir):
    forecasts = [
        Forecast(fits=False, note="no room for a KV cache"),
        Forecast(True, 100.0, 10.0, 5000.0, 6000.0),  # predicted TTFT 12.5 x the SLO
        Forecast(True, 900.0, 10.0, 50.0, 200.0),
        Forecast(True, 2000.0, 10.0, 80.0, 250.0),
    ]
    spec = spec_for(model_dir, ["max_num_seqs=1,2,8,16"], forecasts)
    lines: list[str] = []
    engine = FakeEngine()
    outcome = run_tune(tmp_path / "tune", spec, BENCH, engine, options(tmp_path, record=False), lines.append)
    started = [spec.points[0].point.point_id, spec.points[1].point.point_id]
    assert engine.started == started
    assert [p.point.config.max_num_seqs for p in spec.points[:2]] == [16, 8]
    assert by_variant(tmp_path / "tune") == {
        "max_num_seqs=1": "skipped",
        "max_num_seqs=2": "skipped",
        "max_num_seqs=8": "done",
        "max_num_seqs=16": "done",
    }
    assert outcome.counts["skipped"] == 2
    assert any("skipped, cannot fit: no room for a KV cache" in line for line in lines)
    assert any("predicted P99 TTFT about 5,000 ms, more than 2 × the SLO's 400 ms" in line for line in lines)


def test_an_engine_that_fails_is_recorded_with_its_log_and_the_tune_goes_on(tmp_path, model_dir):
    spec = spec_for(model_dir, ["max_num_batched_tokens=128,512"])
    engine = FakeEngine()
    outcome = run_tune(tmp_path / "tune", spec, BENCH, engine, options(tmp_path, record=False), lambda line: None)
    assert by_variant(tmp_path / "tune") == {
        "max_num_batched_tokens=128": "failed",
        "max_num_batched_tokens=512": "done",
    }
    index = read_index(tmp_path / "tune")
    assert index is not None
    failed = next(entry for entry in index.points if entry.status == "failed")
    assert failed.note.startswith("the engine exited with code 1")
    assert "is smaller than max_model_len" in extra(failed, "log_tail")[0]
    assert outcome.best is not None and outcome.best.description == "max_num_batched_tokens=512"

    # Kept as failed on the next run, unless asked to retry.
    again = FakeEngine()
    run_tune(tmp_path / "tune", spec, BENCH, again, options(tmp_path, record=False), lambda line: None)
    assert again.started == []
    retry = FakeEngine()
    run_tune(tmp_path / "tune", spec, BENCH, retry, options(tmp_path, record=False, retry_failed=True), print)
    assert retry.started == [failed.point_id]


def test_a_benchmark_error_fails_the_point_only(tmp_path, model_dir):
    spec = spec_for(model_dir, ["max_num_seqs=2,16"])
    engine = FakeEngine(bench_error_at=spec.points[0].point.point_id)
    outcome = run_tune(tmp_path / "tune", spec, BENCH, engine, options(tmp_path, record=False), lambda line: None)
    assert outcome.counts == {"ran": 1, "kept": 0, "skipped": 0, "failed": 1}
    index = read_index(tmp_path / "tune")
    assert index is not None
    assert index.points[0].note == "could not be measured: the server closed every connection"


def test_ctrl_c_keeps_what_was_measured_and_a_rerun_resumes_there(tmp_path, model_dir):
    spec = spec_for(model_dir, ["max_num_seqs=2,4,16"])
    second = spec.points[1].point.point_id
    out = tmp_path / "tune"
    stopped = run_tune(out, spec, BENCH, FakeEngine(interrupt_at=second), options(tmp_path), lambda line: None)
    assert stopped.interrupted
    assert list(by_variant(out).values()) == ["done", "pending", "pending"]
    index = read_index(out)
    assert index is not None and index.stopped_reason is not None and "interrupted" in index.stopped_reason
    assert index.points[1].note.startswith("interrupted")

    engine = FakeEngine()
    resumed = run_tune(out, spec, BENCH, engine, options(tmp_path), lambda line: None)
    assert engine.started == [second, spec.points[2].point.point_id]
    assert resumed.counts == {"ran": 2, "kept": 1, "skipped": 0, "failed": 0}
    assert not resumed.interrupted and resumed.best is not None
    assert len(ResultsStore(tmp_path / "results.db").list_runs(suite="tune")) == 3  # each point once


def test_max_points_counts_every_point_measured_in_the_directory(tmp_path, model_dir):
    spec = spec_for(model_dir, ["max_num_seqs=2,4,8,16"])
    out = tmp_path / "tune"
    first = FakeEngine()
    run_tune(out, spec, BENCH, first, options(tmp_path, record=False, max_points=2), lambda line: None)
    assert len(first.started) == 2
    assert list(by_variant(out).values()).count("skipped") == 2
    index = read_index(out)
    assert index is not None and "--max-points 2" in index.points[-1].note
    second = FakeEngine()
    run_tune(out, spec, BENCH, second, options(tmp_path, record=False, max_points=3), lambda line: None)
    assert len(second.started) == 1


def test_no_point_starts_once_the_time_budget_is_spent(tmp_path, model_dir):
    ticks = itertools.count(step=100.0)  # every clock reading is 100 s after the last
    spec = spec_for(model_dir, ["max_num_seqs=2,4,16"])
    engine = FakeEngine()
    outcome = run_tune(
        tmp_path / "tune", spec, BENCH, engine, options(tmp_path, record=False, budget_s=150), lambda line: None,
        clock=lambda: next(ticks),
    )  # fmt: skip
    assert len(engine.started) == 1  # read at 100 s: starts; at 200 s: over the budget
    assert outcome.counts["skipped"] == 2


def test_a_directory_holding_another_tune_is_refused(tmp_path, model_dir):
    out = tmp_path / "tune"
    run_tune(out, spec_for(model_dir, ["max_num_seqs=2"]), BENCH, FakeEngine(), options(tmp_path), lambda line: None)
    other = spec_for(model_dir, ["max_num_seqs=4"], signature="s2")
    with pytest.raises(ConfigError, match="already holds a different sweep"):
        run_tune(out, other, BENCH, FakeEngine(), options(tmp_path), lambda line: None)


def test_no_point_meeting_the_slos_writes_no_best(tmp_path, model_dir):
    spec = spec_for(model_dir, ["max_num_seqs=1,2"])
    strict = TuneOptions(slos=(parse_slo("p99_ttft_ms=1"),), record=False)
    outcome = run_tune(tmp_path / "tune", spec, BENCH, FakeEngine(), strict, lambda line: None)
    assert outcome.best is None and outcome.best_path is None
    assert not (tmp_path / "tune" / "best.yaml").exists()
    assert len(outcome.scored) == 2 and not any(item.holds for item in outcome.scored)


def test_changed_slos_rejudge_the_kept_points_without_running_them(tmp_path, model_dir):
    spec = spec_for(model_dir, ["max_num_seqs=2,16"])
    out = tmp_path / "tune"
    run_tune(out, spec, BENCH, FakeEngine(), options(tmp_path, record=False), lambda line: None)
    loose = TuneOptions(slos=(parse_slo("p99_ttft_ms=100000"),), record=False, tie_margin=0.0)
    engine = FakeEngine()
    outcome = run_tune(out, spec, BENCH, engine, loose, lambda line: None)
    assert engine.started == []
    assert all(item.holds for item in outcome.scored)
