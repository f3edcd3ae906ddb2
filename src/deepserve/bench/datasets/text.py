"""Random prompts of an exact token count.

Decoding random token ids and re-encoding the text does not give the same count back: neighbours merge ("call" +
"s" → "calls"), bytes of a multi-byte character split, the BOS and the chat template add tokens. So a prompt is
built from a seeded sample of text pieces (single tokens that re-encode to themselves, from the tokenizer's own
vocabulary, or pseudo-words when only the server's /tokenize is available), then measured the way the server
measures it and trimmed or padded, token by token, until the count is exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from deepserve.bench.tokenizer import TokenCounter, TokenizerError
from deepserve.bench.types import ChatMessages
from deepserve.errors import ConfigError

MAX_ADJUST_ROUNDS = 24  # each round moves by the measured error; two or three are the norm
CALIBRATION_PIECES = 256
PSEUDO_WORD_COUNT = 4096
_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"


def pseudo_words(count: int = PSEUDO_WORD_COUNT) -> list[str]:
    """A fixed list of pronounceable, space-led pseudo-words (" tokavi"): text any tokenizer splits into a few
    tokens per word. Fixed (seed 0) so that a workload depends only on its own seed."""
    rng = np.random.default_rng(0)
    words: set[str] = set()
    while len(words) < count:
        syllables = int(rng.integers(1, 4))
        word = "".join(
            _CONSONANTS[rng.integers(len(_CONSONANTS))] + _VOWELS[rng.integers(len(_VOWELS))] for _ in range(syllables)
        )
        words.add(" " + word)
    return sorted(words)


def render_prompt(text: str, chat: bool) -> str | ChatMessages:
    """What is sent: the text itself (completions) or one user message holding it (chat)."""
    return [{"role": "user", "content": text}] if chat else text


@dataclass
class PromptBuilder:
    """Builds texts whose rendered prompt is exactly N tokens as the server counts them (BOS and chat template
    included). `head` lets prompts share an exact prefix: the head's tokens are kept unchanged."""

    counter: TokenCounter
    chat: bool
    pieces: list[str] = field(default_factory=list)
    text_source: str = ""
    tokens_per_piece: float = 1.0
    _split: tuple[int, int] | None = None

    @classmethod
    def create(cls, counter: TokenCounter, chat: bool) -> PromptBuilder:
        vocab = counter.vocab_pieces()
        pieces, source = (vocab, "vocab") if vocab else (pseudo_words(), "pseudo_words")
        builder = cls(counter, chat, pieces, source)
        sample = "".join(pieces[i % len(pieces)] for i in range(0, CALIBRATION_PIECES * 7, 7))
        builder.tokens_per_piece = max(counter.count(sample), 1) / CALIBRATION_PIECES
        return builder

    def measure(self, text: str) -> int:
        """Tokens the server processes for TEXT sent as the prompt."""
        return len(self.counter.prompt_ids(render_prompt(text, self.chat)))

    def overhead(self) -> int:
        """Tokens an empty prompt costs: the BOS, or the chat template around an empty user message."""
        return self.measure("")

    def template_split(self) -> tuple[int, int]:
        """(header, trailer): tokens the server puts before and after the prompt text: (1, 0) for a BOS-adding
        completion prompt; for DeepSeek's chat template BOS + <｜User｜> before and <｜Assistant｜> after."""
        if self._split is None:
            empty = self.counter.prompt_ids(render_prompt("", self.chat))
            some = self.counter.prompt_ids(render_prompt(self.pieces[0], self.chat))
            header = 0
            while header < min(len(empty), len(some)) and empty[header] == some[header]:
                header += 1
            self._split = (header, len(empty) - header)
        return self._split

    def prefix(self, shared_tokens: int, rng: np.random.Generator) -> str:
        """A head text such that prompts built on it share their first SHARED_TOKENS server tokens (the template
        header included)."""
        header, trailer = self.template_split()
        if shared_tokens < header:
            raise ConfigError(
                f"a shared prefix of {shared_tokens} tokens is shorter than the {header} tokens the "
                "server adds before any prompt; ask for a longer prefix"
            )
        return self.build(shared_tokens + trailer, rng) if shared_tokens > header else ""

    def random_text(self, rng: np.random.Generator, n_tokens: int) -> str:
        """About N_TOKENS tokens of seeded random pieces (not exact: `build` makes it exact)."""
        n_pieces = max(math.ceil(n_tokens / self.tokens_per_piece), 0)
        return "".join(self.pieces[i] for i in rng.integers(0, len(self.pieces), size=n_pieces))

    def build(self, target: int, rng: np.random.Generator, head: str = "") -> str:
        """A text T = HEAD + tail such that measure(T) == TARGET and encode(T) starts with encode(HEAD)."""
        floor = self.measure(head)
        if target < floor:
            what = "the chat template" if self.chat else "the special tokens (BOS)"
            raise ConfigError(
                f"a prompt of {target} tokens is impossible: {floor} tokens go to {what}"
                + (" and the shared prefix" if head else "")
                + "; ask for a longer input length"
            )
        head_ids = self.counter.encode(head)
        tail = self.random_text(rng, target - floor)
        for _ in range(MAX_ADJUST_ROUNDS):
            text = head + tail
            error = self.measure(text) - target
            if error == 0 and self.counter.encode(text)[: len(head_ids)] == head_ids:
                return text
            if error > 0:
                tail = self._trim(tail, error)
            elif error < 0:
                tail += self.random_text(rng, -error)
            else:  # right count, but the tail merged into the head's last token: start the tail afresh
                tail = self.random_text(rng, target - floor)
        raise TokenizerError(
            f"could not build a prompt of exactly {target} tokens with {self.counter.source} "
            f"after {MAX_ADJUST_ROUNDS} adjustments (the tokenizer keeps merging the random text)"
        )

    def _trim(self, tail: str, n_tokens: int) -> str:
        """TAIL without its last N_TOKENS tokens (cut at a token boundary, so the rest re-encodes alike)."""
        ids = self.counter.encode(tail)
        return self.counter.decode(ids[: max(len(ids) - n_tokens, 0)])
