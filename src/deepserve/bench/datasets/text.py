"""Random prompts of an exact token count.

Decoding random token ids and re-encoding the text does not give the same count back: neighbours merge ("call" +
"s" → "calls"), bytes of a multi-byte character split, the BOS and the chat template add tokens. So a prompt is
built from a seeded sample of text pieces (single tokens that re-encode to themselves, from the tokenizer's own
vocabulary, or pseudo-words when only the server's /tokenize is available), then measured the way the server
measures it and trimmed or padded, token by token, until the count is exact.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

from deepserve.bench.tokenizer import TokenCounter, TokenizerError
from deepserve.bench.types import ChatMessages
from deepserve.errors import ConfigError

MAX_ADJUST_ROUNDS = 24  # each round moves by the measured error; two or three are the norm
MAX_FILLERS = 16  # without /detokenize, shortfalls up to this many tokens are made up with one-token fillers
# Texts that add one token each in most vocabularies: a space-led letter (byte-level BPE, SentencePiece), a letter
# alone or a full stop (byte-level vocabularies without merges, like the tiny model's)
FILLER_CANDIDATES = (" a", " x", ".", "a", " .")
_WORD_UNITS = re.compile(r"\s*\S+")
CALIBRATION_PIECES = 1024
OVERSHOOT = 0.03  # 3 % more text than the estimate (plus two tokens), then one exact cut
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


@dataclass(frozen=True)
class HeadInfo:
    text: str
    prompt_len: int  # measure(text)
    shared_ids: list[int]  # the server tokens every prompt built on this head starts with


@dataclass
class PromptBuilder:
    """Builds texts whose rendered prompt is exactly N tokens as the server counts them (BOS and chat template
    included). `head` lets prompts share an exact prefix: the head's tokens are kept unchanged.

    Tokenizer calls are what a build costs (each is an HTTP round trip with the server's /tokenize), so a build
    measures once, and when it must cut, cuts the measured ids and decodes once: usually one call with a
    vocabulary that does not merge, three with pseudo-words."""

    counter: TokenCounter
    chat: bool
    pieces: list[str] = field(default_factory=list)
    text_source: str = ""
    tokens_per_piece: float = 1.0
    overshoot: float = 0.0  # extra fraction of random text when pieces merge: cutting is exact, padding is not
    _split: tuple[int, int] | None = None
    _heads: dict[str, HeadInfo] = field(default_factory=dict)
    _filler: str | None = None  # without /detokenize: a text that adds exactly one token at the end of a prompt

    @classmethod
    def create(cls, counter: TokenCounter, chat: bool) -> PromptBuilder:
        vocab = counter.vocab_pieces()
        pieces, source = (vocab, "vocab") if vocab else (pseudo_words(), "pseudo_words")
        builder = cls(counter, chat, pieces, source)
        sample = "".join(pieces[i % len(pieces)] for i in range(0, CALIBRATION_PIECES * 7, 7))
        sample_tokens = counter.count(sample)
        builder.tokens_per_piece = max(sample_tokens, 1) / CALIBRATION_PIECES
        builder.overshoot = 0.0 if sample_tokens == CALIBRATION_PIECES else OVERSHOOT
        return builder

    def measure(self, text: str) -> int:
        """Tokens the server processes for TEXT sent as the prompt."""
        return len(self.counter.prompt_ids(render_prompt(text, self.chat)))

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

    def random_text(self, rng: np.random.Generator, n_tokens: int, overshoot: float = 0.0) -> str:
        """About N_TOKENS (plus OVERSHOOT) tokens of seeded random pieces (`build` makes the count exact)."""
        wanted = n_tokens * (1 + overshoot) + (2 if overshoot and n_tokens else 0)
        n_pieces = max(math.ceil(wanted / self.tokens_per_piece), 0)
        return "".join(self.pieces[i] for i in rng.integers(0, len(self.pieces), size=n_pieces))

    def build(self, target: int, rng: np.random.Generator, head: str = "") -> str:
        """A text T = HEAD + tail such that measure(T) == TARGET and the server's tokens of T start with those of
        HEAD's prompt (minus what the template puts after the text)."""
        base = self.head_info(head)
        if target < base.prompt_len:
            what = "the chat template" if self.chat else "the special tokens (BOS)"
            raise ConfigError(
                f"a prompt of {target} tokens is impossible: {base.prompt_len} tokens go to {what}"
                + (" and the shared prefix" if head else "")
                + "; ask for a longer input length"
            )
        tail = self.random_text(rng, target - base.prompt_len, self.overshoot)
        for _ in range(MAX_ADJUST_ROUNDS):
            ids = self.counter.prompt_ids(render_prompt(head + tail, self.chat))
            error = len(ids) - target
            if error == 0 and ids[: len(base.shared_ids)] == base.shared_ids:
                return head + tail
            if error > 0:
                tail = self._cut(ids, head, tail, error) if self.can_decode else self._cut_words(tail, error)
            elif error < 0:
                tail += self._pad(rng, -error)
            else:  # right count, but the tail merged into the head's last token: start the tail afresh
                tail = self.random_text(rng, target - base.prompt_len)
        raise TokenizerError(
            f"could not build a prompt of exactly {target} tokens with {self.counter.source} "
            f"after {MAX_ADJUST_ROUNDS} adjustments (the tokenizer keeps merging the random text)"
        )

    @property
    def can_decode(self) -> bool:
        """Whether the tokenizer turns ids back into text (a server without /detokenize cannot)."""
        return self.counter.can_decode

    def _pad(self, rng: np.random.Generator, n_tokens: int) -> str:
        """About N_TOKENS more tokens of random pieces; without /detokenize, a short shortfall is made up exactly
        with the one-token filler (cutting again would only find another near miss)."""
        if not self.can_decode and n_tokens <= MAX_FILLERS and self.filler():
            return self.filler() * n_tokens
        return self.random_text(rng, n_tokens)

    def _cut_words(self, tail: str, n_tokens: int) -> str:
        """TAIL without enough of its last words to drop N_TOKENS tokens or a few more (by the pieces' measured
        tokens per piece): the next measurement then finds a small shortfall, which fillers make up."""
        units = _WORD_UNITS.findall(tail)
        drop = min(len(units), math.ceil(n_tokens / max(self.tokens_per_piece, 1e-9)) + 1)
        return "".join(units[: len(units) - drop])

    def filler(self) -> str:
        """A text that adds exactly one token wherever it is appended to a prompt (checked on a sample, once):
        without /detokenize, what makes a prompt's last few tokens exact. "" when no candidate does."""
        if self._filler is None:
            self._filler = ""
            base = self.random_text(np.random.default_rng(0), 32)
            measured = self.measure(base)
            for candidate in FILLER_CANDIDATES:
                if all(self.measure(base + candidate * k) == measured + k for k in (1, 2, 3)):
                    self._filler = candidate
                    break
        return self._filler

    def head_info(self, head: str) -> HeadInfo:
        """HEAD measured once and remembered: every prompt of a group builds on it."""
        if head not in self._heads:
            ids = self.counter.prompt_ids(render_prompt(head, self.chat))
            _, trailer = self.template_split()
            shared = ids[: len(ids) - trailer] if head else []
            self._heads[head] = HeadInfo(head, len(ids), shared)
        return self._heads[head]

    def _cut(self, ids: list[int], head: str, tail: str, n_tokens: int) -> str:
        """TAIL without its last N_TOKENS tokens, cut at a token boundary of the measured IDS (one decode), so
        that the rest re-encodes alike; if the template's tokens do not frame the text cleanly, cut the tail
        on its own instead."""
        header, trailer = self.template_split()
        text_ids = ids[header : len(ids) - trailer]
        cut = self.counter.decode(text_ids[: max(len(text_ids) - n_tokens, 0)])
        if cut.startswith(head) and len(cut) < len(head + tail):
            return cut[len(head) :]
        tail_ids = self.counter.encode(tail)
        return self.counter.decode(tail_ids[: max(len(tail_ids) - n_tokens, 0)])
