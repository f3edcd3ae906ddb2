"""benchmarks/spec_decode_tiny.py without vLLM: vLLM's counters read and differenced, the acceptance the simulator
and the plan are given, their predictions, the table, and a saved run read back."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from deepserve.models.tiny import tiny_config
from tests.helpers import load_benchmark_script

# vLLM 0.32's exposition of the spec-decode counters (vllm/v1/spec_decode/metrics.py), two draft positions
METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 100.0
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 200.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 150.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 90.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 60.0
"""


@pytest.fixture
def script(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    from deepserve.hardware import host

    measured = host.HostMeasurement("box", "Test CPU", 2, 26.0, 140.0, 15.2, "2026-11-23T00:00:00Z")
    monkeypatch.setattr(host, "measured_host", lambda refresh=False: measured)
    module = load_benchmark_script("spec_decode_tiny", monkeypatch)
    monkeypatch.setattr(module, "measured_host", lambda refresh=False: measured)
    return module


def test_counters_are_read_and_differenced(script: ModuleType) -> None:
    earlier = script.SpecCounters(40, 80, 50, (30.0, 20.0))
    counted = script.spec_counters(METRICS).minus(earlier)
    assert (counted.drafts, counted.draft_tokens, counted.accepted) == (60, 120, 100)
    assert counted.acceptance_per_position == pytest.approx((1.0, 40 / 60))
    assert counted.mean_acceptance_length == pytest.approx(1 + 100 / 60)
    assert script.spec_counters("").mean_acceptance_length is None  # speculation off: no series
    assert script.spec_counters(METRICS).minus(script.SpecCounters()).per_position == (90.0, 60.0)


def test_the_acceptance_given_to_the_predictions(script: ModuleType) -> None:
    noisy = script.SpecCounters(100, 300, 150, (60.0, 62.0, 28.0))
    assert script.assumed_acceptance(3, noisy, ()) == (0.6, 0.6, 0.28)  # a rate cannot rise with the position
    assert script.assumed_acceptance(2, noisy, (0.9,)) == pytest.approx((0.9, 0.81))  # the model's known rate
    assert script.assumed_acceptance(0, noisy, ()) == ()
    with pytest.raises(SystemExit, match="counted no drafts"):
        script.assumed_acceptance(2, script.SpecCounters(), ())


def test_predictions_table_and_a_saved_run(script: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "config.json").write_text(json.dumps(tiny_config() | {"num_nextn_predict_layers": 1}))
    model = str(tmp_path)
    off = script.Point(0, 1, 150.0, 6.0, script.SpecCounters(), 8)
    on = script.Point(2, 1, 140.0, 12.0, script.SpecCounters(50, 100, 100, (50.0, 50.0)), 8, (1.0, 1.0))
    points = [script.predictions(p, model, 64, 32) for p in (off, on)]
    assert points[1].plan["tokens_per_step"] == pytest.approx(3.0)
    assert points[1].sim["mean_acceptance_length"] == pytest.approx(3.0)  # every draft accepted
    assert points[0].plan["output_tok_s"] > points[1].plan["output_tok_s"]  # slower on this CPU, as measured
    text = script.table(points)
    assert text.splitlines()[2].startswith("| off | 1 | 150.0 / ")
    assert "| 2 | 1 | 140.0 / " in text and "| 3.00 / 3.00 / 3.00 | 1.00, 1.00 |" in text
    monkeypatch.setattr(script, "RESULTS", tmp_path / "results")
    saved = script.save(points, "command")
    assert script.table(script.load(saved)) == text
