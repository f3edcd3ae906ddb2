from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from deepserve.results.points import ResultsError, params_from_result
from deepserve.results.sweepdir import load_result_set, read_index
from tests.helpers import present

FIXTURES = Path(__file__).parents[2] / "fixtures" / "results"


def test_sweep_directory_reads_points_with_the_index_params():
    result_set = load_result_set(FIXTURES / "h100_v3_rate")
    assert result_set.label == "H100 V3"
    assert result_set.metadata["engine"] == "vllm"
    assert result_set.metadata["suite"] == "request-rate"
    rates = sorted(point.params.request_rate for point in result_set.points)
    assert rates == [1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 16, 18, 20]
    assert all(point.params.input_len == 1024 for point in result_set.points)


def test_loose_vllm_result_files_read_without_an_index():
    result_set = load_result_set(FIXTURES / "b200_vllm_loose", label="B200")
    assert result_set.label == "B200"
    by_concurrency = {present(point.params.max_concurrency): point for point in result_set.points}
    assert sorted(by_concurrency) == [1, 8, 16, 32, 64, 128, 256, 512, 1024]
    # vLLM writes no input length: the mean per request stands in for it.
    assert by_concurrency[64].params.input_len == 2048
    assert by_concurrency[64].metric("p99_itl_ms") == 143.82


def test_one_result_file_is_a_set_of_one(tmp_path: Path):
    source = next((FIXTURES / "b200_vllm_loose").glob("*.json"))
    result_set = load_result_set(source)
    assert len(result_set.points) == 1


def test_points_not_done_or_deleted_are_left_out(tmp_path: Path):
    copy = tmp_path / "sweep"
    shutil.copytree(FIXTURES / "h100_vllm_concurrency", copy)
    index = json.loads((copy / "index.json").read_text())
    index["points"][0]["status"] = "skipped"
    (copy / "index.json").write_text(json.dumps(index))
    (copy / index["points"][1]["result_file"]).unlink()
    assert len(load_result_set(copy).points) == len(index["points"]) - 2
    assert read_index(copy) is not None


def test_unreadable_inputs_say_what_is_wrong(tmp_path: Path):
    with pytest.raises(ResultsError, match="does not exist"):
        load_result_set(tmp_path / "missing")
    (tmp_path / "notes.json").write_text('{"hello": 1}')
    with pytest.raises(ResultsError, match="no index.json and no benchmark result"):
        load_result_set(tmp_path)
    with pytest.raises(ResultsError, match="not a benchmark result"):
        load_result_set(tmp_path / "notes.json")


def test_vllm_inf_rate_and_given_params():
    params = params_from_result({"request_rate": "inf", "max_concurrency": 4, "completed": 0, "duration": 1})
    assert math.isinf(params.request_rate) and params.max_concurrency == 4
    assert params.input_len is None  # nothing completed, nothing to average
    given = params_from_result({"request_rate": 3.0, "completed": 2, "duration": 1}, {"request_rate": None})
    assert math.isinf(given.request_rate)  # the index's "unlimited" wins over the result's number
