"""The benchmark's speculative-decoding figures end to end against the simulator speculating as vLLM does: the run's
acceptance from vLLM's spec-decode counters differenced over the run, per draft position, and the client's tokens
per chunk (with token ids) matching the mean acceptance length. The arithmetic itself is tested on vLLM's own
exposition in tests/unit/bench/test_server_metrics.py."""

from __future__ import annotations

from typing import Any

import pytest

from deepserve.bench.config import BenchConfig
from deepserve.bench.runner import run_benchmark
from tests.helpers import simulator_thread

pytestmark = pytest.mark.timeout(120)


def bench_spec(server_options: dict[str, Any]) -> dict[str, Any]:
    with simulator_thread(step_ms=2, **server_options) as server:
        config = BenchConfig.model_validate(
            {
                "target": {"base_url": server.root_url, "return_token_ids": "on"},
                "workload": {"num_prompts": 8, "random_input_len": 16, "random_output_len": 31, "ignore_eos": True},
                "load": {"max_concurrency": 4},
            }
        )
        data: dict[str, Any] = run_benchmark(config, display=False).to_json()
    return data


def test_every_draft_accepted_gives_k_plus_one_tokens_a_step() -> None:
    data = bench_spec({"engine": {"num_speculative_tokens": 2}, "spec_acceptance": [1.0]})
    spec = data["server_metrics"]["spec_decode"]
    assert spec is not None and spec["source"] == "counters" and spec["drafts"] > 0
    assert spec["acceptance_rate"] == pytest.approx(1.0) and spec["mean_acceptance_length"] == pytest.approx(3.0)
    assert spec["acceptance_by_position"] == pytest.approx([1.0, 1.0])
    # the prompt's step samples one token, every later step 3; the last step stops at the output length
    assert data["mean_tokens_per_chunk"] == pytest.approx(31 / 11, rel=0.01)


def test_acceptance_per_position_is_the_simulators() -> None:
    """vLLM's per-position rates 0.8 and 0.5 (a draft counts only with every one before it): over 8 requests of
    30 verified steps the run's figures are the simulator's rates within sampling noise."""
    data = bench_spec({"engine": {"num_speculative_tokens": 2}, "spec_acceptance": [0.8, 0.5], "spec_seed": 7})
    spec = data["server_metrics"]["spec_decode"]
    first, second = spec["acceptance_by_position"]
    assert first == pytest.approx(0.8, abs=0.12) and second == pytest.approx(0.5, abs=0.12)
    assert spec["mean_acceptance_length"] == pytest.approx(1 + first + second, rel=0.01)
    assert spec["acceptance_rate"] == pytest.approx((first + second) / 2, rel=0.01)
