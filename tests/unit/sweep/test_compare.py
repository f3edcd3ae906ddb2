"""The comparison form of `deepserve sweep` (--target NAME=URL …) and seed 004's suite: targets parsed and checked,
each aimed at its own directory, one plan for all (the slowest target's), and the suite's points against the seed's
table."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from deepserve.bench.config import BenchConfig
from deepserve.cli.main import main
from deepserve.errors import ConfigError
from deepserve.results.series import OFFLINE, PREFIX_NONE, PREFIX_SHARED
from deepserve.sweep.compare import Target, common_context, common_plan, parse_targets, target_config
from deepserve.sweep.suites import SEED004, SpeedProbe, get_suite, plan_suite

FAST = SpeedProbe(prefill_tok_s=200_000, tpot_s=0.01, peak_output_tok_s=20_000, batched_prefill_tok_s=400_000)
SLOW = SpeedProbe(prefill_tok_s=20_000, tpot_s=0.03, peak_output_tok_s=3_000, batched_prefill_tok_s=40_000)


def test_targets_are_name_equals_url() -> None:
    targets = parse_targets(["sglang-h200=http://10.0.0.5:8000", "vllm_mi300x=https://m:8000/v1"])
    assert targets == [Target("sglang-h200", "http://10.0.0.5:8000"), Target("vllm_mi300x", "https://m:8000/v1")]


@pytest.mark.parametrize(
    "values, message",
    [
        (["http://10.0.0.5:8000"], "give NAME=URL"),
        (["vllm="], "give NAME=URL"),
        (["my engine=http://x"], "must be letters"),
        (["../up=http://x"], "must be letters"),
        (["vllm=10.0.0.5:8000"], "must start with http"),
        (["a=http://x", "a=http://y"], "given twice"),
    ],
)
def test_bad_targets_say_how_to_write_them(values: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_targets(values)


def test_each_target_gets_its_url_label_and_directory(tmp_path: Path) -> None:
    base = BenchConfig.model_validate({"workload": {"random_input_len": 3200}})
    config = target_config(base, Target("trtllm", "http://h200:8000"), tmp_path)
    assert config.target.base_url == "http://h200:8000"
    assert config.output.label == "trtllm" and config.output.result_dir == str(tmp_path / "trtllm")
    assert config.workload.random_input_len == 3200 and base.target.base_url is None  # the base is unchanged


def test_every_target_runs_the_slowest_targets_plan() -> None:
    suite = get_suite("seed004")
    fast, slow = (plan_suite(suite, 32768, 900, probe) for probe in (FAST, SLOW))
    assert slow.length_factor < fast.length_factor  # the slow server's requests must be shortened more
    assert common_plan([fast, slow]) is slow and common_plan([slow, fast]) is slow
    assert common_context([32768, None, 16384]) == 16384 and common_context([None]) is None


def test_seed004_suite_is_the_seeds_table() -> None:
    """Seed 004: input 3,200 throughout; concurrency 4..128 at output 800; output 1,600/3,200/6,400 at 128; 2,000 of
    3,200 tokens a shared prefix at 128; offline batches 32..1,024 at 800 and 256/512/1,024 at 1,600 and 3,200."""
    points = SEED004.points()
    assert {p.input_len for p in points if p.input_len is not None} == {3200}
    online = [p for p in points if p.variant is None and p.output_len == 800]
    assert [p.concurrency for p in online] == [4, 8, 16, 32, 64, 128]
    lengths = [p.output_len for p in points if p.variant is None and p.output_len != 800]
    assert lengths == [1600, 3200, 6400]
    prefix = {p.variant: p for p in points if p.variant in (PREFIX_NONE, PREFIX_SHARED)}
    assert prefix[PREFIX_SHARED].params["shared_prefix_len"] == 2000 and prefix[PREFIX_NONE].concurrency == 128
    offline = [(p.output_len, p.num_prompts) for p in points if p.variant == OFFLINE]
    assert offline == [(800, n) for n in (32, 64, 128, 256, 512, 1024)] + [
        (out, n) for out in (1600, 3200) for n in (256, 512, 1024)
    ]
    assert all(p.concurrency is None and math.isinf(p.request_rate) for p in points if p.variant == OFFLINE)


def test_shrunk_lengths_that_meet_are_run_once() -> None:
    """Shrunk hard for a slow server and a short budget, outputs of 800 and 1,600 both reach the 4-token floor: one
    point, not two with one id."""
    plan = plan_suite(get_suite("seed004"), 32768, 10, SLOW)
    assert {p.output_len for p in plan.points if p.variant is None} >= {4}
    keys = [(tuple(sorted(p.params.items())), p.variant) for p in plan.points]
    assert len(keys) == len(set(keys)) < len(SEED004.points())


def test_the_cli_takes_targets_instead_of_base_url(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["sweep", "--suite", "seed004", "--base-url", "http://x:8000", "--target", "a=http://y:8000"])
    assert code != 0 and "drop --base-url" in capsys.readouterr().err
