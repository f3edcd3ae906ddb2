"""The stated approximation of prompt lengths (a server that cannot count tokens, no local tokenizer): one token per
common English word, the template's tokens as the server's usage measured them, and exact builds on that count."""

from __future__ import annotations

import numpy as np

from deepserve.bench.approximate import COMMON_WORDS, ApproximateTokenCounter, Calibration
from deepserve.bench.datasets.text import PromptBuilder


def counter(template_tokens: int = 3) -> ApproximateTokenCounter:
    return ApproximateTokenCounter(Calibration(1.02, template_tokens, "checked"), "http://x/v1/completions")


def test_a_word_is_a_token_and_ids_decode_back_to_the_text():
    approx = counter()
    ids = approx.encode(" the cat  sat")
    assert len(ids) == approx.count(" the cat  sat") == 3
    assert approx.decode(ids) == " the cat  sat" and approx.decode(ids[:2]) == " the cat"
    assert approx.prompt_ids("the cat") == [-1, -1, -1, *approx.encode("the cat")]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    assert len(approx.prompt_ids(messages)) == 3 + 2 + 4 + 2  # template, words, one more message's markers, words


def test_prompts_are_built_to_the_approximate_count_exactly_from_common_words():
    approx = counter()
    builder = PromptBuilder.create(approx, chat=False)
    assert builder.text_source == "vocab" and builder.tokens_per_piece == 1.0
    text = builder.build(100, np.random.default_rng(0))
    assert builder.measure(text) == 100 and approx.count(text) == 97
    assert set(text.split()) <= {word.strip() for word in COMMON_WORDS}
    assert len(COMMON_WORDS) == len(set(COMMON_WORDS)) > 400
