"""What every dataset gets (tokenizer, prompt builder, seeded random streams) and gives back (draft requests)."""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

from deepserve.bench.datasets.text import PromptBuilder
from deepserve.bench.tokenizer import TokenCounter
from deepserve.bench.types import ChatMessages, ConversationSpec
from deepserve.errors import ConfigError

if TYPE_CHECKING:
    from deepserve.bench.workloads import WorkloadConfig

TOKENIZE_CONCURRENCY = 8  # /tokenize calls in flight while building prompts with a server tokenizer
T = TypeVar("T")


class DatasetError(ConfigError):
    """A dataset file that cannot be used: the message names the file, the line and what was expected."""


@dataclass(frozen=True)
class DraftRequest:
    """A request before the output-length policy is applied. OUTPUT_LEN None: the policy decides."""

    prompt: str | ChatMessages
    prompt_len: int  # tokens the server processes for PROMPT (BOS, chat template included)
    output_len: int | None = None
    arrival_s: float | None = None  # a trace's release time, seconds after the first request
    extra_body: dict[str, Any] = field(default_factory=dict)  # the request's own body fields (tools, tool_choice, …)
    session: int | None = None  # an agent trace's session and the request's place in it (from 1)
    turn: int | None = None


@dataclass
class DatasetResult:
    requests: list[DraftRequest]
    details: dict[str, Any] = field(default_factory=dict)  # what the dataset resolved, for the results
    conversations: list[ConversationSpec] = field(default_factory=list)  # multi-turn datasets: instead of requests


class Dataset(Protocol):
    """A named way to make requests. DEFAULT_NUM_PROMPTS applies when --num-prompts is not given. A dataset whose
    requests carry their own release times (`DraftRequest.arrival_s`) sets `replays_trace = True`: they are
    then replayed at those times (unless --no-self-timed), with ignore_eos (unless --no-ignore-eos)."""

    name: str
    default_num_prompts: int
    replays_trace: bool

    def build(self, config: WorkloadConfig, ctx: DatasetContext, num_prompts: int) -> DatasetResult: ...


@dataclass
class DatasetContext:
    """Shared by a workload's datasets. Each random stream has its own seed, so that, e.g., the lengths of a
    random workload are the same numbers vLLM draws for the same --seed, whatever the prompt text consumed."""

    counter: TokenCounter
    chat: bool
    seed: int
    _builder: PromptBuilder | None = None

    @property
    def builder(self) -> PromptBuilder:
        if self._builder is None:  # built on first use: file datasets never need the vocabulary scan
            self._builder = PromptBuilder.create(self.counter, self.chat)
        return self._builder

    def text_source(self) -> str:
        """Where random prompt text came from ("vocab" or "pseudo_words"), or "file" if none was made."""
        return self._builder.text_source if self._builder else "file"

    def rng(self, stream: str) -> np.random.Generator:
        """A generator for STREAM: "lengths" is seeded with the bare seed (vLLM's draws); others are independent."""
        if stream == "lengths":
            return np.random.default_rng(self.seed)
        return np.random.default_rng([self.seed, *(ord(c) for c in stream)])

    def build_texts(self, targets: list[int], heads: list[str] | None = None, stream: str = "text") -> list[str]:
        """Texts of exactly TARGETS[i] server tokens, each on HEADS[i]. Request i draws its text from its own
        stream, so the result does not depend on the order of work: with a server tokenizer the builds overlap
        (each one is a few HTTP round trips), with a local one they run in turn."""
        heads = heads or [""] * len(targets)
        for head in set(heads):  # measure each shared head once, before the builds share it
            self.builder.head_info(head)

        def one(i: int) -> str:
            return self.builder.build(targets[i], self.rng(f"{stream}/{i}"), heads[i])

        return self.map_tokenizing(one, len(targets))

    def map_tokenizing(self, work: Callable[[int], T], n: int) -> list[T]:
        """[WORK(0), …, WORK(N-1)]: overlapped when each call is a round trip to the server's /tokenize, in turn
        with a local tokenizer. WORK must not depend on the order of the calls."""
        if not self.counter.concurrent or n < 2:
            return [work(i) for i in range(n)]
        with ThreadPoolExecutor(max_workers=TOKENIZE_CONCURRENCY) as pool:
            return list(pool.map(work, range(n)))

    def special_tokens(self) -> int:
        """Tokens the tokenizer adds to a bare text prompt (the BOS): vLLM's num_special_tokens_to_add()."""
        return len(self.counter.prompt_ids(""))

    def render_len(self, prompt: str | ChatMessages) -> int:
        """Tokens the server processes for PROMPT as sent to this endpoint."""
        if self.chat and isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        return len(self.counter.prompt_ids(prompt))


def range_bounds(mean: int, ratio: float) -> tuple[int, int]:
    """vLLM's --random-range-ratio interval: [floor(mean * (1 - r)), ceil(mean * (1 + r))], both included."""
    return math.floor(mean * (1 - ratio)), math.ceil(mean * (1 + ratio))


def output_bounds(mean: int, ratio: float) -> tuple[int, int]:
    """vLLM's output interval: as `range_bounds`, but never below one token."""
    low, high = range_bounds(mean, ratio)
    return max(low, 1), max(high, 1)


def draw_uniform_ints(rng: np.random.Generator, low: int, high: int, n: int) -> list[int]:
    """N integers uniform in [LOW, HIGH], both included (numpy's `integers`, as vLLM draws them)."""
    return [int(x) for x in rng.integers(low, high + 1, size=n)]
