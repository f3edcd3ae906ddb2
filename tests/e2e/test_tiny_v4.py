"""`deepserve serve --model tiny-v4`: the tiny DeepSeek-V4 on vLLM's CPU build (with deepserve's workarounds for its
defects), through the gateway, called with the official openai client; V4's reasoning and tool-call parsers come
from the model's serving defaults.

The weights are random, so the model never writes a tool call by itself: the tool-call test makes it write one with
vLLM's structured outputs (a regex that only V4's DSML text for one call matches), and checks that vLLM's V4 parser
turns the streamed text into `tool_calls` deltas that reach the client through the gateway.

`deepserve bench` measures reasoning on it: requests with thinking on and off (each line's own
chat_template_kwargs), reasoning closed after a few tokens by vLLM's thinking_token_budget so that the same request
also answers (random weights never write </think> themselves), and the output kept to whole characters with
allowed_token_ids: vLLM counts reasoning tokens by the text its parser emits, and a random byte that ends inside a
UTF-8 character emits none (the budget's 6 reasoning tokens were counted as 3)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionToolParam
from openai.types.chat.chat_completion_chunk import ChoiceDeltaToolCall

from deepserve.bench.config import BenchConfig
from deepserve.bench.runner import run_benchmark, save_result
from deepserve.models.tiny.tokenizer import BYTE_TOKEN_OFFSET, special_token_id
from tests.e2e.conftest import ServedTiny, start_deepserve, stop_and_wait

IGNORE_EOS = {"ignore_eos": True}
THINKING_OFF = {"chat_template_kwargs": {"thinking": False}}
DSML = "｜DSML｜"
WEATHER_CALL = (
    f'<{DSML}tool_calls>\n<{DSML}invoke name="get_weather">\n'
    f'<{DSML}parameter name="city" string="true">Paris</{DSML}parameter>\n'
    f"</{DSML}invoke>\n</{DSML}tool_calls>"
)
REASONING_BUDGET, BENCH_OUTPUT_LEN = 6, 16
# Lower-case letters (one token each) and </think>, which the thinking budget forces
WHOLE_CHARACTERS = [BYTE_TOKEN_OFFSET + byte for byte in b"abcdefghijklmnopqrstuvwxyz"] + [special_token_id("</think>")]
WEATHER_TOOL: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def served_v4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedTiny]:
    served = start_deepserve(tmp_path_factory.mktemp("served-v4"), "--model", "tiny-v4")
    yield served
    stop_and_wait(served)


@pytest.fixture(scope="module")
def client(served_v4: ServedTiny) -> OpenAI:
    return OpenAI(base_url=served_v4.base_url, api_key="unused", timeout=180, max_retries=0)


def test_serves_the_tiny_v4(client: OpenAI) -> None:
    assert [model.id for model in client.models.list()] == ["deepserve/tiny-deepseek-v4"]


def test_completion(served_v4: ServedTiny, client: OpenAI) -> None:
    response = client.completions.create(model=served_v4.model, prompt="Hello", max_tokens=8, extra_body=IGNORE_EOS)
    assert response.usage is not None and response.usage.completion_tokens == 8
    assert response.usage.prompt_tokens == 1 + len(b"Hello")  # BOS + one token per byte, as the tiny V3


def test_streamed_chat_thinking_by_default_puts_reasoning_in_its_field(served_v4: ServedTiny, client: OpenAI) -> None:
    """V4's encoder thinks unless told not to; random weights never close </think>, so everything is reasoning."""
    deltas = _stream_deltas(client, served_v4.model, {"max_tokens": 12, "extra_body": IGNORE_EOS})
    reasoning = "".join(_reasoning(delta) for delta in deltas)
    content = "".join(_content(delta) for delta in deltas)
    assert reasoning and not content


def test_streamed_chat_thinking_off_answers_in_content(served_v4: ServedTiny, client: OpenAI) -> None:
    deltas = _stream_deltas(client, served_v4.model, {"max_tokens": 12, "extra_body": {**IGNORE_EOS, **THINKING_OFF}})
    assert "".join(_content(delta) for delta in deltas)
    assert not "".join(_reasoning(delta) for delta in deltas)


def test_thinking_off_prompt_is_v4s_chat_format(served_v4: ServedTiny, client: OpenAI) -> None:
    response = client.chat.completions.create(
        model=served_v4.model,
        messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=1,
        extra_body=THINKING_OFF,
    )
    assert response.usage is not None
    assert response.usage.prompt_tokens == 11  # BOS <｜User｜> "Say hi." <｜Assistant｜> </think>


def test_tool_call_parsed_from_the_stream(served_v4: ServedTiny, client: OpenAI) -> None:
    stream = client.chat.completions.create(
        model=served_v4.model,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL],
        max_tokens=200,
        temperature=0,
        stream=True,
        extra_body={**THINKING_OFF, "structured_outputs": {"regex": re.escape(WEATHER_CALL)}},
    )
    calls: list[ChoiceDeltaToolCall] = []
    finish_reasons: list[str | None] = []
    for chunk in stream:
        for choice in chunk.choices:
            calls += choice.delta.tool_calls or []
            finish_reasons.append(choice.finish_reason)
    assert calls, "no tool_calls deltas reached the client"
    assert calls[0].function is not None and calls[0].function.name == "get_weather"
    arguments = "".join(call.function.arguments or "" for call in calls if call.function is not None)
    assert arguments.replace(" ", "") == '{"city":"Paris"}'
    assert "tool_calls" in finish_reasons


def test_bench_measures_reasoning_and_answer_with_thinking_on_and_off(served_v4: ServedTiny, tmp_path: Path) -> None:
    """`deepserve bench` through the gateway, a custom dataset whose lines turn thinking on and off: the thinking
    requests reason first (their reasoning closed by vLLM's thinking_token_budget), then answer; the others answer
    at once and have no reasoning tokens."""
    thinking = [True, False, True, False]
    dataset = tmp_path / "thinking.jsonl"
    lines = [
        {
            "messages": [{"role": "user", "content": f"Question {i}: say hi."}],
            "output_tokens": BENCH_OUTPUT_LEN,
            "chat_template_kwargs": {"thinking": on},
        }
        for i, on in enumerate(thinking)
    ]
    dataset.write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = BenchConfig.model_validate(
        {
            "target": {
                "base_url": served_v4.base_url,
                "endpoint": "/v1/chat/completions",
                "temperature": 0,
                "extra_body": json.dumps(
                    {"thinking_token_budget": REASONING_BUDGET, "allowed_token_ids": WHOLE_CHARACTERS}
                ),
            },
            "workload": {
                "dataset_name": "custom",
                "dataset_path": str(dataset),
                "disable_shuffle": True,  # record i is line i
                "ignore_eos": True,
            },
            "load": {"max_concurrency": 2, "num_warmups": 0},
        }
    )
    result = run_benchmark(config, display=False)
    data = json.loads(save_result(result, tmp_path / "result.json").read_text())
    assert data["completed"] == len(thinking), data["errors_by_message"]
    assert data["total_output_tokens"] == len(thinking) * BENCH_OUTPUT_LEN

    records = sorted(result.records, key=lambda record: record.index)
    for record, on in zip(records, thinking, strict=True):
        assert record.output_len == BENCH_OUTPUT_LEN and record.first_token_s is not None
        if on:
            assert record.reasoning_tokens == REASONING_BUDGET, record  # the server's count (usage)
            assert record.answer_tokens == BENCH_OUTPUT_LEN - REASONING_BUDGET  # </think> and the answer
            assert record.first_answer_s is not None, record
            # <=: a starved API server merges the deltas the consumer has not taken yet (vLLM's output collector),
            # so the whole reasoning and the answer's first token can arrive in the first write
            assert record.first_reasoning_s == record.first_token_s <= record.first_answer_s
            assert record.prompt_len > 400  # the server's count: V4's encoder adds its reasoning instruction
        else:  # no reasoning: left out of the reasoning figures (its answer's first token is its TTFT)
            assert record.reasoning_tokens is None and record.answer_tokens is None, record
            assert record.first_reasoning_s is None and record.first_answer_s is None
            assert record.prompt_len < 40  # the line's own chat_template_kwargs reached the server

    on_records = [record for record, on in zip(records, thinking, strict=True) if on]
    assert data["reasoning_requests"] == len(on_records)
    assert data["total_reasoning_tokens"] == len(on_records) * REASONING_BUDGET
    assert data["total_answer_tokens"] == len(on_records) * (BENCH_OUTPUT_LEN - REASONING_BUDGET)
    assert data["mean_reasoning_tokens"] == REASONING_BUDGET
    for key in ("mean_reasoning_ttft_ms", "median_reasoning_ttft_ms", "mean_answer_ttft_ms", "p99_answer_ttft_ms"):
        assert data[key] > 0, key
    assert data["mean_answer_ttft_ms"] >= data["mean_reasoning_ttft_ms"]  # the answer never before the reasoning
    # over the requests that reasoned, from their own records
    for name, moment in (("reasoning", "first_reasoning_s"), ("answer", "first_answer_s")):
        waits_ms = [(getattr(record, moment) - record.sent_s) * 1000 for record in on_records]
        assert data[f"mean_{name}_ttft_ms"] == pytest.approx(sum(waits_ms) / len(waits_ms)), name


def _stream_deltas(client: OpenAI, model: str, options: dict[str, object]) -> list[dict[str, object]]:
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hi."}],
        stream=True,
        **options,  # type: ignore[call-overload]
    )
    return [choice.delta.model_dump() for chunk in stream for choice in chunk.choices]


def _content(delta: dict[str, object]) -> str:
    return str(delta.get("content") or "")


def _reasoning(delta: dict[str, object]) -> str:
    """vLLM 0.32 names the field `reasoning`; DeepSeek's API and older vLLMs `reasoning_content`."""
    return str(delta.get("reasoning") or delta.get("reasoning_content") or "")
