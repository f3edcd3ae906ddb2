"""`deepserve serve --model tiny-v4`: the tiny DeepSeek-V4 on vLLM's CPU build (with deepserve's workarounds for its
defects), through the gateway, called with the official openai client; V4's reasoning and tool-call parsers come
from the model's serving defaults.

The weights are random, so the model never writes a tool call by itself: the tool-call test makes it write one with
vLLM's structured outputs (a regex that only V4's DSML text for one call matches), and checks that vLLM's V4 parser
turns the streamed text into `tool_calls` deltas that reach the client through the gateway."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from openai import OpenAI

from tests.e2e.conftest import ServedTiny, start_deepserve, stop_and_wait

IGNORE_EOS = {"ignore_eos": True}
THINKING_OFF = {"chat_template_kwargs": {"thinking": False}}
DSML = "｜DSML｜"
WEATHER_CALL = (
    f'<{DSML}tool_calls>\n<{DSML}invoke name="get_weather">\n'
    f'<{DSML}parameter name="city" string="true">Paris</{DSML}parameter>\n'
    f"</{DSML}invoke>\n</{DSML}tool_calls>"
)
WEATHER_TOOL = {
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
    content = "".join(delta.get("content") or "" for delta in deltas)
    assert reasoning and not content


def test_streamed_chat_thinking_off_answers_in_content(served_v4: ServedTiny, client: OpenAI) -> None:
    deltas = _stream_deltas(client, served_v4.model, {"max_tokens": 12, "extra_body": {**IGNORE_EOS, **THINKING_OFF}})
    assert "".join(delta.get("content") or "" for delta in deltas)
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
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        max_tokens=200,
        temperature=0,
        stream=True,
        extra_body={**THINKING_OFF, "structured_outputs": {"regex": re.escape(WEATHER_CALL)}},
    )
    calls, finish_reasons = [], []
    for chunk in stream:
        for choice in chunk.choices:
            calls += choice.delta.tool_calls or []
            finish_reasons.append(choice.finish_reason)
    assert calls, "no tool_calls deltas reached the client"
    assert calls[0].function is not None and calls[0].function.name == "get_weather"
    arguments = "".join(call.function.arguments or "" for call in calls if call.function is not None)
    assert arguments.replace(" ", "") == '{"city":"Paris"}'
    assert "tool_calls" in finish_reasons


def _stream_deltas(client: OpenAI, model: str, options: dict[str, object]) -> list[dict[str, object]]:
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hi."}],
        stream=True,
        **options,  # type: ignore[call-overload]
    )
    return [choice.delta.model_dump() for chunk in stream for choice in chunk.choices]


def _reasoning(delta: dict[str, object]) -> str:
    """vLLM 0.32 names the field `reasoning`; DeepSeek's API and older vLLMs `reasoning_content`."""
    return str(delta.get("reasoning") or delta.get("reasoning_content") or "")
