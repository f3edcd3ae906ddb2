"""The simulator's tokenizer counts exactly as the benchmark's local tokenizer does for the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepserve.bench.tokenizer import CHECK_PROMPTS, LocalTokenCounter
from deepserve.models.tiny import tokenizer_config, tokenizer_json
from deepserve.simulate.tokenizer import (
    BOS_ID,
    EOS_ID,
    GENERATED_TEXT,
    ByteTokenizer,
    ChatFormatError,
    generated_text,
    generated_token,
)

PROMPTS = [
    "",
    "Hello, world!",
    "naïve café ✓ 2048 tokens",
    "a special token inside: <｜User｜>hi<｜Assistant｜>",
    "<think>reasoning</think> and <｜place▁holder▁no▁3｜>",
    "<｜User" + "｜ not quite a special token",
]
CHATS = [
    [{"role": "user", "content": "How long is this prompt?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "And <｜User｜> inside?"},
    ],
    [{"role": "user", "content": "x"}, {"role": "tool", "content": "42"}],
]


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> LocalTokenCounter:
    """The bench's own counter, loaded (by transformers) from the tiny model's tokenizer files."""
    directory: Path = tmp_path_factory.mktemp("tiny-tokenizer")
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer_json(), ensure_ascii=False))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), ensure_ascii=False))
    return LocalTokenCounter.load(str(directory))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_prompts_count_as_the_bench_counts(local: LocalTokenCounter, prompt: str) -> None:
    ours = ByteTokenizer()
    assert ours.encode(prompt, add_special_tokens=True) == local.prompt_ids(prompt)
    assert ours.encode(prompt) == local.encode(prompt)
    assert ours.decode(ours.encode(prompt)) == local.decode(local.encode(prompt))


@pytest.mark.parametrize("messages", CHATS)
def test_chat_prompts_render_as_the_template(local: LocalTokenCounter, messages: list[dict[str, str]]) -> None:
    assert ByteTokenizer().chat_ids(messages) == local.prompt_ids(messages)


def test_the_benchmarks_own_check_prompts_match(local: LocalTokenCounter) -> None:
    ours = ByteTokenizer()
    for prompt in CHECK_PROMPTS:
        expected = local.prompt_ids(prompt)
        got = ours.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else ours.chat_ids(prompt)
        assert got == expected


def test_content_parts_join_with_newlines_and_bad_messages_are_refused() -> None:
    tokenizer = ByteTokenizer()
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tokenizer.render_chat(parts).endswith("<｜User｜>a\nb<｜Assistant｜>")
    with pytest.raises(ChatFormatError, match="role"):
        tokenizer.chat_ids([{"role": "robot", "content": "x"}])
    with pytest.raises(ChatFormatError, match="text parts"):
        tokenizer.chat_ids([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_generated_tokens_spell_the_generated_text() -> None:
    tokenizer = ByteTokenizer()
    count = len(GENERATED_TEXT) + 7  # wraps around
    ids = [generated_token(i) for i in range(count)]
    assert tokenizer.decode(ids) == generated_text(0, count) == (GENERATED_TEXT * 2)[:count]
    assert generated_text(5, 3) == GENERATED_TEXT[5:8]
    assert BOS_ID not in ids and EOS_ID not in ids
