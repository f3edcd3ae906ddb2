"""Reasoning models and tool calls through the gateway (issue 18, point 3): their fields and deltas pass through
unchanged, reasoning tokens are counted in the ledger and /metrics (from the engine's usage when it says, else from
the stream's reasoning events), the extensions these models' clients send are accepted while malformed values are
refused with a 400 in OpenAI's shape, and a per-model default thinking mode is applied when a request does not say.

The upstream is the simulator with `--reasoning-tokens` (the first tokens of a chat reply are reasoning, in vLLM 0.32's
`reasoning` field with the count in usage, or the older `reasoning_content` without it) and `--tool-calls`."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import openai
import pytest

from deepserve.simulate.tokenizer import generated_text
from tests.helpers import FAKE_MODEL

from .conftest import ledger_rows, upstream_and_gateway

CHAT: dict[str, Any] = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 9}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
_VARYING = re.compile(rb'"(id|created)":("[^"]*"|\d+)')


def _comparable(stream: bytes) -> bytes:
    """A stream with its per-request id and timestamp blanked (the rest must be byte for byte the engine's)."""
    return _VARYING.sub(rb'"\1":_', stream)


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> bytes:
    async with client.stream("POST", url, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        return b"".join([chunk async for chunk in response.aiter_raw()])


async def test_reasoning_deltas_pass_through_unchanged_and_the_usage_count_is_recorded() -> None:
    async with upstream_and_gateway(upstream_options={"reasoning_tokens": 5}) as (fake, app, client):
        body = {**CHAT, "stream_options": {"include_usage": True}}
        through = await _stream(client, "/chat/completions", body)
        async with httpx.AsyncClient(base_url=fake.base_url) as direct:
            straight = await _stream(direct, "/chat/completions", body)
        assert _comparable(through) == _comparable(straight)
        assert through.count(b'"reasoning":"') == 5
        assert b'"completion_tokens_details":{"reasoning_tokens":5}' in through
        assert app.ledger is not None and app.ledger.flush()
        assert ledger_rows("completion_tokens, reasoning_tokens, reasoning_source") == [(9, 5, "usage")]
        metrics = app.metrics.render().decode()
        assert (
            'deepserve_gateway_reasoning_tokens_total{key="anonymous",model="fake-model",source="usage"} 5.0' in metrics
        )


async def test_reasoning_content_without_a_usage_count_is_counted_from_the_deltas() -> None:
    options = {"reasoning_tokens": 4, "reasoning_field": "reasoning_content"}
    async with upstream_and_gateway(upstream_options=options) as (_, app, client):
        openai_client = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="unused")
        stream = await openai_client.chat.completions.create(**{**CHAT, "stream": True})
        reasoning, answer = "", ""
        async for chunk in stream:
            if chunk.choices:
                delta = chunk.choices[0].delta
                reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
                answer += delta.content or ""
        assert reasoning == generated_text(0, 4) and answer == generated_text(4, 5)
        assert app.ledger is not None and app.ledger.flush()
        assert ledger_rows("completion_tokens, reasoning_tokens, reasoning_source") == [(9, 4, "deltas")]


async def test_a_non_streamed_reasoning_answer_is_forwarded_and_counted_from_its_usage() -> None:
    async with upstream_and_gateway(upstream_options={"reasoning_tokens": 3}) as (_, app, client):
        answer = (await client.post("/chat/completions", json=CHAT)).json()
        message = answer["choices"][0]["message"]
        assert message["reasoning"] == generated_text(0, 3) and message["content"] == generated_text(3, 6)
        assert app.ledger is not None and app.ledger.flush()
        assert ledger_rows("reasoning_tokens, reasoning_source") == [(3, "usage")]


async def test_a_streamed_tool_call_reaches_the_openai_client_whole() -> None:
    options = {"reasoning_tokens": 2, "tool_calls": True}
    async with upstream_and_gateway(upstream_options=options) as (_, _, client):
        openai_client = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="unused")
        stream = await openai_client.chat.completions.create(**{**CHAT, "stream": True, "tools": TOOLS})
        name, arguments, finish = "", "", None
        async for chunk in stream:
            for call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                assert call.function is not None
                name += call.function.name or ""
                arguments += call.function.arguments or ""
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        assert name == "get_weather" and finish == "tool_calls"
        assert json.loads(arguments) == {"text": generated_text(2, 7)}
        whole = await openai_client.chat.completions.create(**{**CHAT, "tools": TOOLS, "tool_choice": "auto"})
        (call,) = whole.choices[0].message.tool_calls or []
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["text"]


EXTENSIONS: list[dict[str, Any]] = [
    {"chat_template_kwargs": {"thinking": True}},
    {"chat_template_kwargs": {"reasoning_effort": "high"}},
    {"reasoning_effort": "high"},
    {"include_reasoning": False, "thinking_token_budget": 100},
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
    {"return_token_ids": True, "kv_transfer_params": {"do_remote_decode": False}},
    {"separate_reasoning": True, "stream_reasoning": False},  # SGLang's
    {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "stream_interval": 4, "session_id": "s-1"},
]


@pytest.mark.parametrize("extension", EXTENSIONS, ids=lambda extension: ",".join(extension))
async def test_what_reasoning_models_clients_send_is_accepted(extension: dict[str, Any]) -> None:
    async with upstream_and_gateway() as (fake, _, client):
        response = await client.post("/chat/completions", json={**CHAT, **extension})
        assert response.status_code == 200, response.text
        assert fake.app.stats.bodies[-1] == {**CHAT, **extension}  # forwarded unchanged


MALFORMED: list[tuple[dict[str, Any], str]] = [
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"chat_template_kwargs": "thinking"}, "chat_template_kwargs"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": 3}, "tool_choice"),
    ({"include_reasoning": "yes"}, "include_reasoning"),
    ({"reasoning_tokens": 5}, "reasoning_tokens"),  # no such request field
]


@pytest.mark.parametrize(("extension", "param"), MALFORMED, ids=lambda value: str(value)[:40])
async def test_malformed_extensions_get_a_400_in_openai_shape(extension: dict[str, Any], param: str) -> None:
    async with upstream_and_gateway() as (fake, _, client):
        response = await client.post("/chat/completions", json={**CHAT, **extension})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error"
        assert fake.app.stats.requests == 0


async def test_the_models_default_thinking_mode_applies_when_the_request_does_not_say() -> None:
    defaults = [f'{FAKE_MODEL}={{"thinking": false}}']
    async with upstream_and_gateway(
        upstream_options={"reasoning_tokens": 3}, default_chat_template_kwargs=defaults
    ) as (fake, _, client):
        plain = (await client.post("/chat/completions", json=CHAT)).json()["choices"][0]["message"]
        assert "reasoning" not in plain and fake.app.stats.bodies[-1]["chat_template_kwargs"] == {"thinking": False}
        on = {**CHAT, "chat_template_kwargs": {"thinking": True}}
        thinking = (await client.post("/chat/completions", json=on)).json()["choices"][0]["message"]
        assert thinking["reasoning"] == generated_text(0, 3) and fake.app.stats.bodies[-1] == on  # the request's own
        chose = {**CHAT, "reasoning_effort": "low"}
        await client.post("/chat/completions", json=chose)
        assert fake.app.stats.bodies[-1] == chose  # a reasoning_effort is the client's choice: no default added
