"""Reasoning and tool calls in a stream: which chunks carried what, the per-request times and token counts built
from them, and their statistics. Times below are hand-set arrivals of each SSE event (seconds from the run's start;
every request is sent at 0)."""

from __future__ import annotations

import orjson
import pytest

from deepserve.bench import metrics as m
from deepserve.bench.client import RawResponse
from deepserve.bench.records import Phases, UncountedOutput, build_record, finish_records
from deepserve.bench.types import RequestRecord


def delta(content=None, ids=1, finish=None, **fields):
    body = {**({"content": content} if content is not None else {}), **fields}
    choice = {"index": 0, "delta": body, "finish_reason": finish}
    if ids:
        choice["token_ids"] = list(range(ids))
    return {"choices": [choice]}


def usage(completion, reasoning=None):
    body = {"prompt_tokens": 5, "completion_tokens": completion}
    if reasoning is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return {"choices": [], "usage": body}


def response(*timed_events):
    raw = RawResponse(status=200, end_s=timed_events[-1][0] + 0.001)
    for arrived_s, event in timed_events:
        raw.event_payloads.append(orjson.dumps(event))
        raw.event_times.append(arrived_s)
    return raw


def record_of_events(*timed_events) -> RequestRecord:
    record, _ = build_record(0, 5, 0.0, 0.0, response(*timed_events), 0.0)
    return record


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_reasoning_then_answer_times_and_tokens_by_chunk(field):
    # role header at 0.05; reasoning chunks of 1, 2 tokens at 0.10, 0.20; answer chunks of 1, 1 at 0.30, 0.40
    record = record_of_events(
        (0.05, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}),
        (0.10, delta(ids=1, **{field: "Let"})),
        (0.20, delta(ids=2, **{field: " me think"})),
        (0.30, delta("The", ids=1)),
        (0.40, delta(" end", ids=1, finish="stop")),
        (0.40, usage(5)),
    )
    assert record.first_token_s == pytest.approx(0.10)  # TTFT: the first token of any kind, as vLLM's
    assert (record.first_reasoning_s, record.first_answer_s) == (pytest.approx(0.10), pytest.approx(0.30))
    assert (record.reasoning_tokens, record.answer_tokens) == (3, 2)
    assert m.reasoning_ttft_ms(record) == pytest.approx(100.0) and m.answer_ttft_ms(record) == pytest.approx(300.0)
    assert record.tool_calls == 0 and m.tool_call_start_ms(record) is None


def test_the_servers_reasoning_count_wins_and_a_mixed_chunk_is_split_by_text():
    events = [
        (0.10, delta(ids=2, reasoning="abcd")),
        (0.20, delta("xy", ids=4, reasoning="ab")),  # 2 of 4 characters reasoning: 2 of its 4 tokens
        (0.30, delta("z", ids=1, finish="stop")),
    ]
    record = record_of_events(*events, (0.30, usage(7)))
    assert (record.reasoning_tokens, record.answer_tokens) == (4, 3)
    assert record.first_answer_s == pytest.approx(0.20)
    counted = record_of_events(*events, (0.30, usage(7, reasoning=5)))  # vLLM's completion_tokens_details
    assert (counted.reasoning_tokens, counted.answer_tokens) == (5, 2)


def test_a_plain_answer_has_no_reasoning_figures():
    record = record_of_events((0.1, delta("a")), (0.2, delta("b", finish="stop")), (0.2, usage(2)))
    assert record.reasoning_tokens is None and record.first_reasoning_s is None and record.first_answer_s is None
    assert m.reasoning_summary([record]) == {}


def tool_delta(index, ids=1, name=None, arguments="", call_id=None, finish=None):
    function = {"arguments": arguments, **({"name": name} if name else {})}
    call = {"index": index, "function": function, **({"id": call_id, "type": "function"} if call_id else {})}
    return delta(ids=ids, finish=finish, tool_calls=[call])


def test_tool_call_start_end_and_count():
    # a short answer, then two tool calls streamed in pieces; the finish reason comes on its own chunk at 0.50
    record = record_of_events(
        (0.10, delta("ok", ids=1)),
        (0.20, tool_delta(0, name="get_weather", call_id="call_0")),
        (0.25, tool_delta(0, arguments='{"city": "Paris"}', ids=5)),
        (0.30, tool_delta(1, name="get_time", call_id="call_1")),
        (0.40, tool_delta(1, arguments="{}", ids=2)),
        (0.50, delta("", ids=0, finish="tool_calls")),
        (0.50, usage(10)),
    )
    assert record.tool_calls == 2
    assert m.tool_call_start_ms(record) == pytest.approx(200.0)
    assert m.tool_call_end_ms(record) == pytest.approx(500.0)  # complete when the finish reason said so
    assert record.output_len == 10 and record.reasoning_tokens is None
    summary = m.summarize([record], 1.0)
    assert (summary["tool_call_requests"], summary["total_tool_calls"]) == (1, 2)
    assert summary["median_tool_call_start_ms"] == pytest.approx(200.0)
    assert summary["median_tool_call_end_ms"] == pytest.approx(500.0)


def test_without_usage_reasoning_and_arguments_are_counted_by_the_tokenizer_too():
    class Words:
        source = "words"

        def count(self, text: str) -> int:
            return len(text.split())

    events = [(0.1, delta(ids=0, reasoning="one two three")), (0.2, delta("four five", ids=0, finish="stop"))]
    record, decoded = build_record(0, 5, 0.0, 0.0, response(*events), 0.0)
    assert record.output_len_source == "tokenizer" and decoded.text == "four five"

    phases = Phases.of(decoded, 0.0)
    uncounted = {0: UncountedOutput(decoded.text, decoded.chunk_text_lens, phases, decoded.other_text)}
    [done] = finish_records([record], uncounted, Words())
    assert done.output_len == 5 and (done.reasoning_tokens, done.answer_tokens) == (3, 2)


def test_the_summary_reports_reasoning_statistics_only_when_a_request_reasoned():
    thinking = record_of_events((0.1, delta(ids=3, reasoning="hmm")), (0.3, delta("a", finish="stop")), (0.3, usage(4)))
    plain = record_of_events((0.2, delta("b")), (0.2, usage(1)))
    summary = m.summarize([thinking, plain], 1.0)
    assert summary["reasoning_requests"] == 1 and summary["mean_reasoning_tokens"] == 3.0
    assert summary["median_reasoning_ttft_ms"] == pytest.approx(100.0)
    assert summary["median_answer_ttft_ms"] == pytest.approx(300.0)
    assert "mean_reasoning_ttft_ms" not in m.summarize([plain], 1.0)
