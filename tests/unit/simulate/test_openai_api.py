"""Requests checked as vLLM checks them; answers shaped as vLLM shapes them."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from deepserve.simulate.openai_api import ApiError, Generation, ReplyFormat, called_tool, parse_generation
from deepserve.simulate.tokenizer import EOS_ID, ByteTokenizer, generated_text, generated_token

TOKENIZER = ByteTokenizer()
MODELS = ("m", "lora-a")


def parse(body: dict[str, Any], chat: bool = False, max_model_len: int = 100) -> Generation:
    return parse_generation(body, chat, TOKENIZER, max_model_len, MODELS)


def test_defaults_and_fields() -> None:
    generation = parse({"prompt": "hello", "stream": True, "stream_options": {"include_usage": True}})
    assert generation.model == "m" and generation.prompt_ids == TOKENIZER.encode("hello", add_special_tokens=True)
    assert generation.max_tokens == 100 - 6  # vLLM's default: what the context has left
    assert generation.stream and generation.include_usage and not generation.return_token_ids
    body = {"model": "lora-a", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 3}
    body |= {"max_tokens": 9, "min_tokens": 2, "ignore_eos": True, "return_token_ids": True}
    chat = parse(body, chat=True)
    assert (chat.max_tokens, chat.min_tokens, chat.ignore_eos, chat.return_token_ids) == (3, 2, True, True)
    assert parse({"prompt": [[5, 6, 7]]}).prompt_ids == [5, 6, 7]


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"model": "other", "prompt": "x"}, 404, "does not exist"),
        ({"prompt": "x" * 100}, 400, "maximum context length is 100 tokens"),
        ({"prompt": "x", "max_tokens": 99}, 400, "too large: 99"),
        ({"prompt": "x", "max_tokens": 0}, 400, "positive integer"),
        ({"prompt": "x", "max_tokens": 5, "min_tokens": 6}, 400, "min_tokens"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream=True"),
        ({"prompt": "x", "n": 2}, 400, "n must be 1"),
        ({"prompt": ["a", "b"]}, 400, "batched prompts"),
        ({"prompt": 5}, 400, "prompt must be"),
        ({"prompt": "x", "stream": "yes"}, 400, "stream must be true or false"),
    ],
)
def test_bad_requests_are_refused_with_vllms_status(body: dict, status: int, message: str) -> None:
    with pytest.raises(ApiError, match=message) as caught:
        parse(body)
    assert caught.value.status == status
    assert caught.value.body()["error"]["code"] == status


def test_bad_chat_messages_are_a_400() -> None:
    with pytest.raises(ApiError, match="messages"):
        parse({"messages": []}, chat=True)
    with pytest.raises(ApiError, match="role"):
        parse({"messages": [{"role": "wizard", "content": "x"}]}, chat=True)


def events(data: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in data.decode().split("\n\n") if line.startswith("data: {")]


def test_completion_chunks_carry_text_ids_and_the_finish_reason() -> None:
    generation = parse({"prompt": "hi", "stream": True, "return_token_ids": True})
    fmt = ReplyFormat(generation, "abc", created=7)
    ids = [generated_token(0), generated_token(1)]
    first, last = events(fmt.token_event(0, ids, None, b""))[0], events(fmt.token_event(2, [EOS_ID], "stop", b""))[0]
    assert first["id"] == "cmpl-abc" and first["object"] == "text_completion" and first["created"] == 7
    choice = first["choices"][0]
    assert choice["text"] == TOKENIZER.decode(ids) and choice["token_ids"] == ids
    assert choice["prompt_token_ids"] == generation.prompt_ids and choice["finish_reason"] is None
    assert last["choices"][0]["text"] == "" and last["choices"][0]["finish_reason"] == "stop"
    usage = events(fmt.usage_event(3))[0]
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


def test_chat_streams_open_with_the_role_and_full_replies_have_a_message() -> None:
    generation = parse({"messages": [{"role": "user", "content": "x"}], "stream": True}, chat=True)
    fmt = ReplyFormat(generation, "r1", created=1)
    role = events(fmt.role_event())[0]
    assert role["id"] == "chatcmpl-r1" and role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    token = events(fmt.token_event(0, [generated_token(0)], "length", b""))[0]
    assert token["object"] == "chat.completion.chunk" and token["choices"][0]["delta"]["content"] == "T"
    whole = json.loads(fmt.full_response([generated_token(0), generated_token(1)], "length"))
    assert whole["object"] == "chat.completion" and whole["choices"][0]["message"]["content"] == "Th"
    assert whole["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_plain_one_token_chunks_are_the_bytes_token_event_builds(chat: bool) -> None:
    body = {"model": "m", "max_tokens": 50, "stream": True}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    fmt = ReplyFormat(parse(body, chat=chat), "r", created=3)
    assert fmt.plain_chunks
    expected = [fmt.token_event(5 + i, [generated_token(5 + i)], None, b"") for i in range(7)]
    assert fmt.plain_token_events(5, 7) == expected
    with_ids = ReplyFormat(parse({**body, "return_token_ids": True}, chat=chat), "r", created=3)
    assert not with_ids.plain_chunks  # chunks that list their ids take the general path


def test_reasoning_and_tool_calls_shape_chat_replies_as_vllms_parsers_do() -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 6, "stream": True}
    generation = dataclasses.replace(parse(body, chat=True), reasoning_tokens=2, tool_name="f")
    reply = ReplyFormat(generation, "1", 0)
    events = [reply.token_event(position, [generated_token(position)], None, b"") for position in range(5)]
    events.append(reply.token_event(5, [generated_token(5), EOS_ID], "stop", b""))
    deltas = [json.loads(event[6:])["choices"][0] for event in events]
    assert [d["delta"].get("reasoning") for d in deltas[:2]] == [generated_text(0, 1), generated_text(1, 1)]
    opening = deltas[2]["delta"]["tool_calls"][0]
    assert opening["id"] == "chatcmpl-tool-1" and opening["function"]["name"] == "f"
    arguments = "".join(d["delta"]["tool_calls"][0]["function"]["arguments"] for d in deltas[2:])
    assert json.loads(arguments) == {"text": generated_text(2, 4)} and deltas[-1]["finish_reason"] == "tool_calls"
    assert reply.usage_dict(6)["completion_tokens_details"] == {"reasoning_tokens": 2}
    older = ReplyFormat(dataclasses.replace(generation, reasoning_field="reasoning_content", tool_name=None), "2", 0)
    whole = json.loads(older.full_response([generated_token(p) for p in range(6)], "length"))
    message = whole["choices"][0]["message"]
    assert message["reasoning_content"] == generated_text(0, 2) and message["content"] == generated_text(2, 4)
    assert "completion_tokens_details" not in whole["usage"]  # the older servers' usage does not count them


def test_the_called_tool_is_the_chosen_or_the_first_function_and_none_says_none() -> None:
    tools = [{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "b"}}]
    assert called_tool({"tools": tools}) == "a"
    assert called_tool({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "b"}}}) == "b"
    assert called_tool({"tools": tools, "tool_choice": "none"}) is None
    assert called_tool({"messages": []}) is None
