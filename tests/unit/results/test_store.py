from __future__ import annotations

import json
import math
import sqlite3
from pathlib import Path

import pytest

from deepserve.cli.main import main
from deepserve.results.points import PointParams, ResultsError
from deepserve.results.store import ResultsStore, default_db_path, record_run

FIXTURES = Path(__file__).parents[2] / "fixtures" / "results"


def a_result(concurrency: int = 8, output_throughput: float = 500.0) -> dict:
    return json.loads((FIXTURES / "h100_vllm_concurrency" / "points" / "c8-i1024-o256.json").read_text()) | {
        "max_concurrency": concurrency,
        "output_throughput": output_throughput,
    }


def test_default_location_is_under_deepserve_home_and_env_overrides(isolated_home: Path, monkeypatch, tmp_path):
    assert default_db_path() == isolated_home / "results" / "results.db"
    monkeypatch.setenv("DEEPSERVE_RESULTS_DB", str(tmp_path / "elsewhere.db"))
    assert default_db_path() == tmp_path / "elsewhere.db"
    record_run(a_result())
    assert (tmp_path / "elsewhere.db").is_file()


def test_record_then_read_back_every_key(isolated_home: Path):
    result = a_result()
    run_id = record_run(result, label="H100", metadata={"engine": "vllm"})
    stored = ResultsStore().get(run_id)
    assert stored.result == result
    assert stored.label == "H100"
    assert stored.model == "cognitivecomputations/DeepSeek-V3-AWQ"
    assert stored.metadata == {"engine": "vllm"}
    assert stored.params.max_concurrency == 8
    assert math.isinf(stored.params.request_rate)
    assert stored.params.input_len == 1024 and stored.params.output_len == 256
    assert stored.metric("output_throughput") == 500.0


def test_list_newest_first_with_filters_and_limit(isolated_home: Path):
    store = ResultsStore()
    first = store.add(a_result(1), label="a")
    second = store.add(a_result(2), label="b", suite="concurrency")
    third = store.add(a_result(4), label="a")
    assert [run.run_id for run in store.list_runs()] == [third, second, first]
    assert [run.run_id for run in store.list_runs(label="a")] == [third, first]
    assert [run.run_id for run in store.list_runs(suite="concurrency")] == [second]
    assert [run.run_id for run in store.list_runs(limit=1)] == [third]


def test_rm_deletes_and_refuses_unknown_ids(isolated_home: Path):
    store = ResultsStore()
    keep, drop = store.add(a_result(1)), store.add(a_result(2))
    with pytest.raises(ResultsError, match="no run with id 999"):
        store.remove([drop, 999])
    assert len(store.list_runs()) == 2  # nothing deleted when one id is wrong
    assert store.remove([drop]) == 1
    assert [run.run_id for run in store.list_runs()] == [keep]


def test_explicit_params_win_over_what_the_result_says(isolated_home: Path):
    params = PointParams(max_concurrency=3, request_rate=2.5, input_len=77, output_len=9, variant="shared prefix")
    run = ResultsStore().get(record_run(a_result(), params=params))
    assert run.params.request_rate == 2.5
    assert run.params.variant == "shared prefix"
    assert run.params.input_len == 77


def test_a_newer_schema_is_refused(tmp_path: Path):
    path = tmp_path / "future.db"
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA user_version = 99")
    with pytest.raises(ResultsError, match="newer"):
        ResultsStore(path).list_runs()


def test_cli_list_show_compare_rm(isolated_home: Path, capsys):
    slow = record_run(a_result(1, 100.0), label="slow")
    fast = record_run(a_result(1, 250.0), label="fast")
    assert main(["runs", "list"]) == 0
    listing = capsys.readouterr().out
    assert "slow" in listing and "fast" in listing
    assert main(["runs", "list", "--json", "--label", "fast"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["id"] for row in rows] == [fast]
    assert rows[0]["output_throughput"] == 250.0
    assert main(["runs", "show", str(slow), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["output_throughput"] == 100.0
    assert main(["runs", "compare", str(slow), str(fast)]) == 0
    assert "2.50×" in capsys.readouterr().out  # 250 / 100 output tokens/s
    assert main(["runs", "rm", str(slow)]) == 0
    assert main(["runs", "show", str(slow)]) == 2
    assert "no run with id" in capsys.readouterr().err


def test_cli_db_flag_picks_another_store(isolated_home: Path, tmp_path: Path, capsys):
    other = tmp_path / "other.db"
    record_run(a_result(), label="elsewhere", db_path=other)
    assert main(["runs", "--db", str(other), "list", "--json"]) == 0
    assert "elsewhere" in capsys.readouterr().out
    assert main(["runs", "list", "--json"]) == 0
    assert capsys.readouterr().out == ""
