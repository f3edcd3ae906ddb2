"""Multi-turn workloads without a network: the conversations the dataset draws (exact first prompts and user turns,
seeded lengths and think times), the body of each turn (the history with the answers actually received), and the
per-turn TTFT summary."""

from __future__ import annotations

import pytest

from deepserve.bench import metrics as m
from deepserve.bench.conversations import PreparedConversation, estimated_prompt_len, turn_payload
from deepserve.bench.datasets.text import PromptBuilder
from deepserve.bench.tokenizer import LocalTokenCounter
from deepserve.bench.types import ConversationSpec, RequestRecord, TurnSpec
from deepserve.bench.workloads import WorkloadConfig, build_workload

MULTI_TURN = {
    "dataset_name": "multi_turn",
    "num_prompts": 5,
    "multi_turn_num_turns": 3,
    "random_input_len": 60,
    "multi_turn_input_len": 20,
    "random_output_len": 12,
    "random_range_ratio": 0.5,
    "multi_turn_think_time_s": 2.0,
    "multi_turn_think_time_ratio": 0.5,
}


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_conversations_have_exact_turn_lengths_and_seeded_think_times(tiny: LocalTokenCounter, chat: bool):
    workload = build_workload(WorkloadConfig(**MULTI_TURN), tiny, chat)
    assert workload.requests == [] and len(workload.conversations) == 5  # --num-prompts counts conversations
    header, trailer = PromptBuilder.create(tiny, chat).template_split()
    for conversation in workload.conversations:
        first, *later = conversation.turns
        assert len(conversation.turns) == 3 and first.think_time_s == 0
        assert len(tiny.prompt_ids([{"role": "user", "content": first.user_text}] if chat else first.user_text)) == (
            first.user_len
        )  # the first prompt: exact server tokens, as every dataset's
        assert 30 <= first.user_len <= 90
        for turn in later:
            assert 10 <= turn.user_len <= 30 and 1.0 <= turn.think_time_s <= 3.0
            rendered = [{"role": "user", "content": turn.user_text}] if chat else turn.user_text
            assert len(tiny.prompt_ids(rendered)) == turn.user_len + header + trailer  # text tokens, exact
        assert all(6 <= turn.output_len <= 18 for turn in conversation.turns)
    again = build_workload(WorkloadConfig(**MULTI_TURN), tiny, chat)
    assert again.digest() == workload.digest()
    other = build_workload(WorkloadConfig(**{**MULTI_TURN, "seed": 1}), tiny, chat)
    assert other.digest() != workload.digest()
    assert workload.definition["num_requests"] == 15 and workload.definition["turns_per_conversation"] == 3


def conversation() -> PreparedConversation:
    turns = (TurnSpec("Hi there", 3, 5), TurnSpec(" and then?", 3, 7, 1.5), TurnSpec(" bye", 2, 4, 0.5))
    spec = ConversationSpec(0, turns, ignore_eos=True, exact_output_len=True)
    return PreparedConversation(spec, {"model": "m", "stream": True, "temperature": 0}, {})


def test_each_turn_carries_the_history_with_the_answers_received():
    prepared = conversation()
    first = turn_payload(prepared, [], prepared.spec.turns[0], chat=True)
    assert first["messages"] == [{"role": "user", "content": "Hi there"}]
    assert (first["max_tokens"], first["min_tokens"], first["ignore_eos"], first["temperature"]) == (5, 5, True, 0)
    third = turn_payload(prepared, ["Hello!", "Then this."], prepared.spec.turns[2], chat=True)
    assert third["messages"] == [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": " and then?"},
        {"role": "assistant", "content": "Then this."},
        {"role": "user", "content": " bye"},
    ]
    text = turn_payload(prepared, ["Hello!", "Then this."], prepared.spec.turns[2], chat=False)
    assert text["prompt"] == "Hi thereHello! and then?Then this. bye" and text["max_tokens"] == 4
    assert "messages" not in text and prepared.payload == {"model": "m", "stream": True, "temperature": 0}


def test_a_turns_prompt_length_without_usage_adds_up_the_history():
    turns = conversation().spec.turns
    assert estimated_prompt_len(turns[0], None) == 3
    previous = RequestRecord(0, prompt_len=40, scheduled_s=0, sent_s=0, output_len=5)
    assert estimated_prompt_len(turns[1], previous) == 40 + 5 + 3


def test_ttft_by_turn():
    def turn(number: int, sent: float, first: float, prompt_len: int, error: str | None = None) -> RequestRecord:
        return RequestRecord(
            number, prompt_len, sent, sent, first_token_s=first, end_s=first + 0.1, turn=number, error=error
        )

    records = [
        turn(1, 0.0, 0.30, 100),
        turn(1, 0.0, 0.50, 120),
        turn(2, 1.0, 1.05, 300),  # the history was cached: a short prefill
        turn(2, 1.0, 1.15, 340),
        turn(3, 2.0, 2.9, 500, error="HTTP 500: boom"),  # failed: in no turn's figures
    ]
    assert m.ttft_by_turn_ms(records) == {1: pytest.approx([300.0, 500.0]), 2: pytest.approx([50.0, 150.0])}
    assert m.input_tokens_by_turn(records) == {1: 110.0, 2: 320.0}
    summary = m.summarize(records, 3.0)
    assert summary["ttft_by_turn_ms"]["1"]["mean"] == pytest.approx(400.0)
    assert summary["ttft_by_turn_ms"]["2"]["median"] == pytest.approx(100.0)
    assert summary["ttft_by_turn_ms"]["2"]["p99"] == pytest.approx(50 + 0.99 * 100)
    assert summary["mean_input_tokens_by_turn"] == {"1": 110.0, "2": 320.0}
    single_turn = RequestRecord(0, 10, 0.0, 0.0, first_token_s=0.1, end_s=0.2, output_len=1)
    assert "ttft_by_turn_ms" not in m.summarize([single_turn], 1.0)  # only multi-turn runs report it
