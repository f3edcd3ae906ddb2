"""Warm-up requests reuse the workload's first requests, led by a mark of their own, so that an engine's prefix cache
cannot serve the measured requests from what a warm-up left."""

from __future__ import annotations

from typing import Any

from deepserve.bench.drive_plan import warm_up_variant
from deepserve.bench.types import RequestSpec

TEXT = "The same long prompt"


def _spec(prompt: str | list[dict[str, Any]]) -> RequestSpec:
    return RequestSpec(index=0, prompt=prompt, prompt_len=5, output_len=8, extra_body={"tools": []})


def test_a_text_prompt_is_led_by_the_warm_ups_own_mark() -> None:
    spec = _spec(TEXT)
    first, second = warm_up_variant(spec, 0), warm_up_variant(spec, 1)
    assert isinstance(first.prompt, str) and isinstance(second.prompt, str)
    assert first.prompt.endswith(TEXT) and second.prompt.endswith(TEXT)
    assert not first.prompt.startswith(TEXT[:1]) and first.prompt[:12] != second.prompt[:12]
    assert (first.output_len, first.extra_body) == (spec.output_len, spec.extra_body)
    assert spec.prompt == TEXT  # the measured request is untouched


def test_a_chat_prompt_marks_its_first_message_and_keeps_the_rest() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "shared system prompt"},
        {"role": "user", "content": "question"},
    ]
    warm = warm_up_variant(_spec(messages), 0)
    assert isinstance(warm.prompt, list)
    assert warm.prompt[0]["role"] == "system" and warm.prompt[0]["content"] != "shared system prompt"
    assert str(warm.prompt[0]["content"]).endswith("shared system prompt") and warm.prompt[1:] == messages[1:]
    assert messages[0]["content"] == "shared system prompt"


def test_a_first_message_that_is_not_plain_text_is_sent_as_it_is() -> None:
    parts: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    spec = _spec(parts)
    assert warm_up_variant(spec, 0) is spec
