"""Trace replay and multi-turn conversations end to end against the simulator on loopback: requests
leave at the trace's times with its lengths; each turn carries the answer the server actually sent, after the
think time, and the result reports TTFT by turn."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepserve.bench.config import BenchConfig
from deepserve.bench.output import console_block
from deepserve.bench.runner import run_benchmark
from deepserve.simulate.tokenizer import generated_text
from tests.helpers import present, simulator_thread

pytestmark = pytest.mark.timeout(180)

TRACE = Path(__file__).parents[2] / "fixtures" / "traces" / "mooncake_small.jsonl"


def trace_lines() -> list[dict]:
    return [json.loads(line) for line in TRACE.read_text().splitlines() if line.strip()]


def bench(base_url: str, workload: dict, load: dict | None = None, endpoint: str = "/v1/completions") -> BenchConfig:
    return BenchConfig.model_validate(
        {
            "target": {"base_url": base_url, "endpoint": endpoint},
            "workload": workload,
            "load": load or {},
            "metrics": {"server_metrics": False},
        }
    )


def test_a_mooncake_trace_is_replayed_at_its_times_with_its_lengths():
    workload = {
        "dataset_name": "mooncake",
        "dataset_path": str(TRACE),
        "trace_block_size": 16,
        "trace_time_scale": 0.2,  # the 2.1 s trace in 0.42 s
    }
    with simulator_thread(itl_ms=2, record_bodies=True) as server:
        result = run_benchmark(bench(server.root_url, workload), display=False)
        bodies = [body for body in server.app.stats.bodies if body["max_tokens"] > 1]  # not the token-ids probe
    lines = trace_lines()
    data = result.to_json()
    assert data["completed"] == len(lines) and data["workload"]["self_timed"] is True
    records = sorted(result.records, key=lambda record: record.index)
    assert [r.scheduled_s for r in records] == pytest.approx([line["timestamp"] / 1000 * 0.2 for line in lines])
    assert all(r.sent_s >= r.scheduled_s for r in records)  # never before its time
    assert [r.output_len for r in records] == [line["output_length"] for line in lines]
    assert [r.prompt_len for r in records] == [line["input_length"] for line in lines]  # the server's usage
    assert all(body["ignore_eos"] is True for body in bodies)
    prompts = {body["max_tokens"]: body["prompt"] for body in bodies}  # output lengths are distinct here
    assert prompts[4].startswith(prompts[8][:31])  # lines 0 and 1 share 2 blocks: BOS + 31 bytes of text


def test_multi_turn_conversations_carry_their_history_and_report_ttft_by_turn():
    workload = {
        "dataset_name": "multi_turn",
        "num_prompts": 4,
        "multi_turn_num_turns": 3,
        "random_input_len": 24,
        "multi_turn_input_len": 6,
        "random_output_len": 5,
        "multi_turn_think_time_s": 0.05,
    }
    load = {"max_concurrency": 2}
    with simulator_thread(itl_ms=2, record_bodies=True) as server:
        result = run_benchmark(bench(server.root_url, workload, load, "/v1/chat/completions"), display=False)
        bodies = list(server.app.stats.bodies)
    data = result.to_json()
    assert (data["completed"], data["failed"], data["num_conversations"], data["turns_not_sent"]) == (12, 0, 4, 0)
    assert set(data["ttft_by_turn_ms"]) == {"1", "2", "3"}
    assert all(stats["count"] == 4 for stats in data["ttft_by_turn_ms"].values())
    assert data["mean_input_tokens_by_turn"]["3"] > data["mean_input_tokens_by_turn"]["2"]
    assert data["max_concurrent_requests"] <= 2  # two conversations at a time, one turn each
    assert "TTFT by Turn" in console_block(result)
    by_turn = {(present(record.conversation), present(record.turn)): record for record in result.records}
    for (conversation, turn), record in by_turn.items():
        if turn > 1:  # sent after the previous answer ended and the think time passed
            assert record.sent_s >= present(by_turn[(conversation, turn - 1)].end_s) + 0.05
    third_turns = [body for body in bodies if len(body["messages"]) == 5]
    assert len(third_turns) == 4
    for body in third_turns:  # the answers the simulator sent, 5 tokens each
        assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user", "assistant", "user"]
        assert body["messages"][1]["content"] == body["messages"][3]["content"] == generated_text(0, 5)


def test_a_failed_turn_ends_its_conversation():
    workload = {
        "dataset_name": "multi_turn",
        "num_prompts": 2,
        "multi_turn_num_turns": 3,
        "random_input_len": 24,
        "multi_turn_input_len": 6,
        "random_output_len": 3,
    }
    load = {"max_concurrency": 1}  # arrival order: the token-ids probe, then conversation 0's turns: 1, 2, 3
    with simulator_thread() as server:
        server.control({"faults": {"error_indices": [2]}})  # conversation 0's second turn
        result = run_benchmark(bench(server.root_url, workload, load), display=False)
    data = result.to_json()
    assert (data["completed"], data["failed"], data["turns_not_sent"]) == (4, 1, 1)
    failed = [record for record in result.records if not record.success]
    assert [(record.conversation, record.turn) for record in failed] == [(0, 2)]
    assert "Turns not sent (after a failed turn):" in console_block(result)
