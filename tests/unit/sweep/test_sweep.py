"""The sweep's bookkeeping: grids, point ids, resume, early stop at saturation, failures. The point runner here is
a small analytic server model (throughput rising to a plateau), so these tests need no server; the real runner is
exercised end to end in tests/e2e/test_sweep_suite.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from deepserve.bench.config import BenchConfig
from deepserve.errors import ConfigError, DeepserveError
from deepserve.results.store import ResultsStore
from deepserve.results.sweepdir import load_result_set, read_index
from deepserve.sweep.grid import apply_overrides, grid_spec, parse_list, point_id, template_variants
from deepserve.sweep.run import SweepOptions, run_sweep, saturation_reason
from tests.helpers import present

PEAK_OUTPUT_TOK_S = 400.0


class ModelServer:
    """Output throughput c/(c+8) of the peak in closed loop; completes min(rate, 2) requests/s in open loop."""

    def __init__(self) -> None:
        self.calls: list[BenchConfig] = []
        self.fail_at_call: int | None = None

    def __call__(self, config: BenchConfig) -> dict:
        self.calls.append(config)
        if self.fail_at_call is not None and len(self.calls) == self.fail_at_call:
            raise DeepserveError("cannot reach the server")
        load, workload = config.load, config.workload
        concurrency = load.max_concurrency or 1
        output = PEAK_OUTPUT_TOK_S * concurrency / (concurrency + 8)
        rate = min(load.request_rate, 2.0) if math.isfinite(load.request_rate) else output / workload.random_output_len
        return {
            "completed": 20,
            "failed": 0,
            "duration": 20 / rate,
            "max_concurrency": load.max_concurrency,
            "request_rate": load.request_rate if math.isfinite(load.request_rate) else "inf",
            "request_throughput": rate,
            "output_throughput": rate * workload.random_output_len if math.isfinite(load.request_rate) else output,
            "p99_itl_ms": 1000 * concurrency / output,
        }


def base() -> BenchConfig:
    return BenchConfig.model_validate({"target": {"base_url": "http://127.0.0.1:9"}})


def options(**kw) -> SweepOptions:
    return SweepOptions(record=kw.pop("record", False), **kw)


def test_grid_is_every_combination_with_the_axis_varying_fastest():
    spec = grid_spec({"max_concurrency": [1, 2, 4], "random_input_len": [128, 512]}, "g", {})
    assert spec.sweep_axis == "max_concurrency"
    assert [(p.overrides["random_input_len"], p.overrides["max_concurrency"]) for p in spec.points] == [
        (128, 1),
        (128, 2),
        (128, 4),
        (512, 1),
        (512, 2),
        (512, 4),
    ]
    assert len({p.point_id for p in spec.points}) == 6


def test_chat_template_options_given_several_times_run_every_point_once_with_each():
    variants = template_variants(['{"thinking": true}', '{"thinking": false}'])
    assert list(variants) == ["thinking=true", "thinking=false"]
    spec = grid_spec({"max_concurrency": [1, 4]}, "g", {}, variants)
    assert [(p.variant, p.overrides["max_concurrency"]) for p in spec.points] == [
        ("thinking=true", 1), ("thinking=true", 4), ("thinking=false", 1), ("thinking=false", 4),
    ]  # fmt: skip
    chat = base().model_copy(update={"target": base().target.model_copy(update={"endpoint": "/v1/chat/completions"})})
    config = apply_overrides(chat, spec.points[2].overrides)
    assert config.target.template_kwargs() == {"thinking": False}
    assert spec.signature != grid_spec({"max_concurrency": [1, 4]}, "g", {}).signature
    for bad in ("[1]", "{not json"):
        with pytest.raises(ConfigError, match="--chat-template-kwargs"):
            template_variants([bad, "{}"])


def test_point_ids_are_readable_and_change_with_any_parameter():
    one = point_id({"max_concurrency": 16, "random_input_len": 1024, "random_output_len": 256}, None)
    assert one.startswith("c16-i1024-o256-")
    assert one == point_id({"random_output_len": 256, "max_concurrency": 16, "random_input_len": 1024}, None)
    assert one != point_id({"max_concurrency": 16, "random_input_len": 1024, "random_output_len": 256, "seed": 1}, None)


def test_parse_list():
    assert parse_list("max_concurrency", "1, 2,4", int) == [1, 2, 4]
    assert parse_list("request_rate", "0.5,inf", float) == [0.5, math.inf]
    assert parse_list("max_concurrency", None, int) is None
    for bad in ("1,x", "0,1", ","):
        with pytest.raises(ConfigError):
            parse_list("max_concurrency", bad, int)


def test_overrides_land_in_their_sections():
    config = apply_overrides(base(), {"max_concurrency": 8, "random_input_len": 64, "request_rate": None})
    assert config.load.max_concurrency == 8 and config.workload.random_input_len == 64
    assert math.isinf(config.load.request_rate)
    with pytest.raises(ConfigError, match="not a field"):
        apply_overrides(base(), {"no_such_flag": 1})
    with pytest.raises(ConfigError, match="invalid sweep point"):
        apply_overrides(base(), {"max_concurrency": 0})


def test_sweep_writes_a_point_file_each_and_resumes(tmp_path: Path):
    server = ModelServer()
    spec = grid_spec({"max_concurrency": [1, 2, 4]}, "model", {"base": 1})
    outcome = run_sweep(tmp_path, spec, base(), server, options(stop_at_saturation=False), progress=lambda _: None)
    assert (outcome.ran, outcome.kept, len(server.calls)) == (3, 0, 3)
    assert sorted(p.name for p in (tmp_path / "points").iterdir()) == sorted(f"{p.point_id}.json" for p in spec.points)
    assert [c.load.max_concurrency for c in server.calls] == [1, 2, 4]

    again = run_sweep(tmp_path, spec, base(), server, options(stop_at_saturation=False), progress=lambda _: None)
    assert (again.ran, again.kept, len(server.calls)) == (0, 3, 3)  # nothing re-run

    (tmp_path / "points" / f"{spec.points[1].point_id}.json").unlink()  # a lost result file is re-run
    third = run_sweep(tmp_path, spec, base(), server, options(stop_at_saturation=False), progress=lambda _: None)
    assert (third.ran, third.kept) == (1, 2)
    assert server.calls[-1].load.max_concurrency == 2
    assert len(load_result_set(tmp_path).points) == 3


def test_a_failed_point_stops_the_sweep_and_the_rerun_resumes_there(tmp_path: Path):
    server = ModelServer()
    server.fail_at_call = 2
    spec = grid_spec({"max_concurrency": [1, 2, 4]}, "model", {})
    first = run_sweep(tmp_path, spec, base(), server, options(stop_at_saturation=False), progress=lambda _: None)
    assert (first.ran, first.failed) == (1, 1)
    index = present(read_index(tmp_path), "the sweep index")
    assert [e.status for e in index.points] == ["done", "failed", "pending"]
    assert "cannot reach the server" in index.points[1].note
    server.fail_at_call = None
    second = run_sweep(tmp_path, spec, base(), server, options(stop_at_saturation=False), progress=lambda _: None)
    assert (second.ran, second.kept, second.failed) == (2, 1, 0)


def test_an_interrupted_point_is_not_kept(tmp_path: Path):
    def interrupted(config: BenchConfig) -> dict:
        return ModelServer()(config) | {"incomplete": True}

    spec = grid_spec({"max_concurrency": [1, 2]}, "model", {})
    outcome = run_sweep(tmp_path, spec, base(), interrupted, options(), progress=lambda _: None)
    assert outcome.failed == 1 and not (tmp_path / "points").exists()


def test_a_different_sweep_in_the_same_directory_is_refused(tmp_path: Path):
    run_sweep(tmp_path, grid_spec({"max_concurrency": [1]}, "a", {}), base(), ModelServer(), options(), lambda _: None)
    with pytest.raises(ConfigError, match="already holds a different sweep"):
        run_sweep(tmp_path, grid_spec({"max_concurrency": [2]}, "b", {}), base(), ModelServer(), options(), print)


def test_concurrency_line_stops_once_throughput_stops_rising(tmp_path: Path):
    server = ModelServer()
    concurrencies = [1, 2, 4, 8, 16, 64, 256, 1024, 4096, 16384]
    spec = grid_spec({"max_concurrency": concurrencies}, "model", {})
    lines: list[str] = []
    outcome = run_sweep(tmp_path, spec, base(), server, options(min_gain=0.05), progress=lines.append)
    ran = [c.load.max_concurrency for c in server.calls]
    # 400·c/(c+8): 256 → 388, 1024 → 397, 4096 → 399: two points in a row within 5% of the best before them.
    assert ran == [1, 2, 4, 8, 16, 64, 256, 1024, 4096]
    assert outcome.skipped == 1
    assert any("skipped, saturated: output tokens/s stopped rising" in line for line in lines)


def test_rate_lines_saturate_separately(tmp_path: Path):
    server = ModelServer()
    spec = grid_spec({"request_rate": [1, 2, 3, 4, 5], "random_output_len": [16, 32]}, "model", {})
    assert spec.sweep_axis == "request_rate"
    run_sweep(tmp_path, spec, base(), server, options(), progress=lambda _: None)
    ran = [(c.workload.random_output_len, c.load.request_rate) for c in server.calls]
    # Completed rate min(rate, 2): 1, 2, 2, 2 → stops after two flat points, on each line.
    assert ran == [(16, 1), (16, 2), (16, 3), (16, 4), (32, 1), (32, 2), (32, 3), (32, 4)]


def test_errors_end_a_line():
    line = [
        (1.0, {"completed": 10, "failed": 0, "output_throughput": 10}),
        (2.0, {"completed": 5, "failed": 5, "output_throughput": 20}),
    ]
    reason = saturation_reason(line, "max_concurrency", SweepOptions())
    assert reason == "errors: 5 of 10 requests failed at concurrency 2"


def test_the_time_budget_skips_points_that_would_start_late(tmp_path: Path):
    spec = grid_spec({"max_concurrency": [1, 2, 4]}, "model", {})
    outcome = run_sweep(tmp_path, spec, base(), ModelServer(), options(time_budget_s=0.0), progress=lambda _: None)
    assert outcome.skipped == 3
    assert all("time budget" in e.note for e in present(read_index(tmp_path), "the sweep index").points)


def test_points_the_budget_cut_off_run_when_the_sweep_is_run_again(tmp_path: Path):
    spec = grid_spec({"max_concurrency": [1, 2, 4]}, "model", {})
    server = ModelServer()
    run_sweep(tmp_path, spec, base(), server, options(time_budget_s=0.0), progress=lambda _: None)
    again = run_sweep(tmp_path, spec, base(), server, options(time_budget_s=60.0), progress=lambda _: None)
    assert (again.ran, again.kept, again.skipped) == (3, 0, 0) and len(server.calls) == 3
    third = run_sweep(tmp_path, spec, base(), server, options(time_budget_s=60.0), progress=lambda _: None)
    assert (third.ran, third.kept) == (0, 3) and len(server.calls) == 3


def test_points_are_recorded_in_the_store(tmp_path: Path, isolated_home: Path):
    spec = grid_spec({"max_concurrency": [1, 2]}, "recorded", {})
    run_sweep(tmp_path / "s", spec, base(), ModelServer(), options(record=True), progress=lambda _: None)
    runs = ResultsStore().list_runs()
    assert [r.label for r in runs] == ["recorded", "recorded"]
    assert {r.point_id for r in runs} == {p.point_id for p in spec.points}
    assert runs[0].sweep_dir == str((tmp_path / "s").resolve())
    index = json.loads((tmp_path / "s" / "index.json").read_text())
    assert index["label"] == "recorded"


def test_cli_lists_suites_and_rejects_bad_lists(capsys):
    from deepserve.cli.main import main

    assert main(["sweep", "--list-suites"]) == 0
    listed = capsys.readouterr().out
    for name in (
        "concurrency",
        "request-rate",
        "input-length",
        "output-length",
        "long-prompt",
        "mixed-inputs",
        "concurrency-2k",
        "prefix-cache",
        "offline",
    ):
        assert f"{name} " in listed
    assert main(["sweep", "--base-url", "http://127.0.0.1:9", "--max-concurrency", "1,x"]) == 2
    assert "'x' is not an integer" in capsys.readouterr().err
    code = main(["sweep", "--base-url", "http://127.0.0.1:9", "--suite", "concurrency", "--max-concurrency", "1,2"])
    assert code == 2
    assert "with --suite, --max-concurrency take one value" in capsys.readouterr().err
    assert main(["sweep", "--base-url", "http://127.0.0.1:9", "--suite", "nope"]) == 2
    assert "unknown suite 'nope'; valid:" in capsys.readouterr().err
