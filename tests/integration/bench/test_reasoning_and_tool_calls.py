"""Reasoning and tool calls measured against the simulator, which streams a chat answer's first tokens as reasoning
(--reasoning-tokens, none when chat_template_kwargs turn thinking off) and answers a request that offers tools with
a call of its first tool (--tool-calls), as vLLM does with a reasoning parser and a tool parser."""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path

import pytest

from deepserve.bench.config import BenchConfig
from deepserve.bench.metrics import answer_ttft_ms, reasoning_ttft_ms, ttft_ms
from deepserve.bench.output import console_block
from deepserve.bench.runner import run_benchmark
from tests.helpers import present, simulator_thread

pytestmark = pytest.mark.timeout(120)
AGENT_TRACE = Path(__file__).parents[2] / "fixtures" / "traces" / "agent_trace_small.jsonl"
CHAT = "/v1/chat/completions"


def bench(root_url: str, workload: dict, **target):
    config = BenchConfig.model_validate(
        {"target": {"base_url": root_url, "endpoint": CHAT, **target}, "workload": workload, "load": {}}
    )
    result = run_benchmark(config, display=False)
    data = result.to_json()
    assert data["failed"] == 0, data["errors_by_message"]
    return result, data


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_time_to_the_first_reasoning_and_answer_tokens_and_their_counts(field):
    workload = {"num_prompts": 4, "random_input_len": 32, "random_output_len": 12, "ignore_eos": True}
    with simulator_thread(ttft_ms=20, itl_ms=20, reasoning_tokens=5, reasoning_field=field) as server:
        result, data = bench(server.root_url, workload, chat_template_kwargs='{"thinking": true}')
        _, plain = bench(server.root_url, workload, chat_template_kwargs='{"thinking": false}')
    assert (data["reasoning_requests"], data["mean_reasoning_tokens"], data["mean_answer_tokens"]) == (4, 5.0, 7.0)
    for record in result.records:  # TTFT stays the first token of any kind; the answer starts with the 6th token
        assert reasoning_ttft_ms(record) == ttft_ms(record)
        answer_chunk = list(itertools.accumulate([0, *record.chunk_tokens])).index(5)  # 5 tokens before it
        answer_ms = (record.chunk_times_s[answer_chunk] - record.sent_s) * 1000
        assert answer_ttft_ms(record) == pytest.approx(answer_ms) and answer_ms >= present(ttft_ms(record))
    # 5 reasoning tokens 20 ms apart: the answer 100 ms after the first token. Per request a late simulator thread
    # catches up (shorter gaps), so the timing is checked on the median
    gaps_ms = [present(answer_ttft_ms(record)) - present(ttft_ms(record)) for record in result.records]
    assert statistics.median(gaps_ms) == pytest.approx(100, abs=50)
    assert data["median_answer_ttft_ms"] > data["median_reasoning_ttft_ms"] == data["median_ttft_ms"]
    text = console_block(result)
    assert "Reasoning" in text and "Mean reasoning tokens:                   5.00" in text
    assert "Time to First Answer Token" in text
    assert "reasoning_requests" not in plain and "mean_answer_ttft_ms" not in plain  # thinking off: no reasoning


def test_an_agent_trace_replays_tool_calling_sessions_and_times_the_tool_calls():
    workload = {"dataset_name": "agent_trace", "dataset_path": str(AGENT_TRACE), "trace_time_scale": 0.2}
    with simulator_thread(ttft_ms=20, itl_ms=5, reasoning_tokens=3, tool_calls=True, record_bodies=True) as server:
        result, data = bench(server.root_url, workload)
        bodies = [body for body in server.app.stats.bodies if body.get("max_tokens") != 1]  # not the probe
    assert data["completed"] == 6 and data["num_conversations"] == 2
    # five requests offer tools with a tool_choice other than none; each answers with one call
    assert (data["tool_call_requests"], data["total_tool_calls"]) == (5, 5)
    assert 0 < data["median_tool_call_start_ms"] < data["median_tool_call_end_ms"]
    # thinking is off for the two Lisbon requests (their chat_template_kwargs): the four Paris ones reasoned
    assert data["reasoning_requests"] == 4
    paris = sorted((r for r in result.records if r.conversation == 0), key=lambda r: r.turn or 0)
    assert [r.turn for r in paris] == [1, 2, 3, 4]
    assert all(r.first_tool_call_s is not None and r.first_tool_call_s > (r.first_reasoning_s or 0) for r in paris)
    # what reached the server: the tools, the tool choice, the recorded tool calls and results, the template options
    last = next(body for body in bodies if len(body["messages"]) == 9)
    assert [m["role"] for m in last["messages"]][-3:] == ["assistant", "tool", "tool"]
    assert last["tools"][1]["function"]["name"] == "get_time"
    assert any(body.get("chat_template_kwargs") == {"thinking": False} for body in bodies)
    assert any(body.get("tool_choice") == "none" for body in bodies)
    text = console_block(result)
    assert "Tool Calls" in text and "Time to the Complete Tool Call" in text and "TTFT by Turn" in text
