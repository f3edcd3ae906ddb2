"""`deepserve tune`'s flags: what it refuses and why, and --dry-run (the plan, nothing started)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepserve.cli.main import main
from tests.helpers import tiny_config_dir


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return tiny_config_dir(tmp_path / "model")


def tune(tmp_path: Path, model_dir: Path, *args: str) -> list[str]:
    common = ["tune", "--set", f"model={model_dir}", "--set", "device=cpu", "--out", str(tmp_path / "out")]
    return [*common, *args]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--grid", "max_num_seqs=2", "--base-url", "http://x:1"], "--base-url: the tune starts the engine itself"),
        (["--grid", "max_num_seqs=2", "--model", "tiny"], "--model: the tune starts the engine itself"),
        ([], "give at least one --grid"),
        (["--grid", "max_num_seqs=2", "--set", "max_num_seqs=4"], "max_num_seqs is in both --set and --grid"),
        (
            ["--grid", "max_num_seqs=2", "--find-max-concurrency"],
            "--find-max-concurrency starts from --max-concurrency",
        ),
        (["--grid", "max_num_seq=2"], "unknown engine-config field 'max_num_seq'"),
        (["--grid", "max_num_seqs=2", "--slo", "p99_foo_ms=5"], "is not a latency key"),
    ],
)
def test_bad_flags_fail_before_anything_starts(tmp_path, model_dir, capsys, args, message):
    assert main(tune(tmp_path, model_dir, *args)) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_dry_run_prints_the_plan_and_the_engine_commands(tmp_path, model_dir, capsys):
    args = tune(tmp_path, model_dir, "--grid", "max_num_seqs=2,16", "--set", "max_model_len=512", "--dry-run")
    args.append("--no-planner")  # the planner's view of this machine is measured once per host: not in a unit test
    assert main([*args, "--", "--enforce-eager"]) == 0
    err = capsys.readouterr().err
    assert "2 points, SLOs P99 ITL ≤ 50 ms" in err  # the seeds' SLO when none is given
    assert "no predictions: the planner is off (--no-planner)" in err
    assert "1. max_num_seqs=2: run" in err and "2. max_num_seqs=16: run" in err
    assert "--max-model-len 512 --max-num-seqs 16" in err and "--enforce-eager" in err
    assert not (tmp_path / "out").exists()


def test_dry_run_with_a_planner_gpu_predicts_and_prunes(tmp_path, capsys):
    args = [
        "tune", "--set", "model=deepseek-ai/DeepSeek-V3", "--set", "device=cpu", "--planner-gpu", "h100",
        "--grid", "quantization=default,awq", "--set", "tensor_parallel_size=1", "--max-concurrency", "8",
        "--out", str(tmp_path / "out"), "--dry-run",
    ]  # fmt: skip
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "quantization=default: skip, cannot fit" in err  # 671B parameters in FP8 on one H100
    assert "quantization=awq: skip, this machine cannot start it: these flags need a GPU" in err


def test_a_point_the_memory_plan_refuses_is_skipped_before_anything_starts(tmp_path, model_dir, capsys):
    args = tune(tmp_path, model_dir, "--grid", "kv_cache_memory_gib=1,100000", "--dry-run", "--no-planner")
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "kv_cache_memory_gib=1: run" in err
    assert "kv_cache_memory_gib=100000: skip, cannot fit: does not fit:" in err and "GB is available" in err
