"""The values that flow through the benchmark. Workloads make RequestSpecs; the client turns each into a
RequestRecord; metrics summarise records. Keep these plain: they are saved, reloaded and tested on their own."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ChatMessages = list[dict[str, Any]]  # OpenAI chat messages (tool calls and tool results included)


@dataclass(frozen=True)
class RequestSpec:
    """One request a workload wants sent."""

    index: int
    prompt: str | ChatMessages  # text for /v1/completions, messages for /v1/chat/completions
    prompt_len: int  # tokens in the prompt, as the workload's tokenizer counted them
    output_len: int  # max_tokens
    min_output_len: int | None = None  # sent as min_tokens where the server supports it
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)  # this request's own fields: tools, tool_choice, …
    arrival_s: float | None = None  # a replayed trace's release time (s after the start); None: the arrival process
    session: int | None = None  # an agent trace's session, and the request's place in it (from 1): the records'
    turn: int | None = None  # conversation and turn


@dataclass(frozen=True)
class TurnSpec:
    """One user turn of a conversation. Its request carries the history: every earlier user turn and the answer
    the server actually gave to it."""

    user_text: str
    user_len: int  # tokens of user_text: server tokens of the whole prompt for the first turn, text tokens after
    output_len: int  # max_tokens of this turn's answer
    think_time_s: float = 0.0  # waited after the previous answer arrived, before this turn is sent (0 for the first)


@dataclass(frozen=True)
class ConversationSpec:
    """A multi-turn conversation: its turns are sent one after the other, each after the previous answer."""

    index: int
    turns: tuple[TurnSpec, ...]
    ignore_eos: bool = False
    exact_output_len: bool = False  # send min_tokens = max_tokens with each turn


@dataclass
class RequestRecord:
    """What happened to one request. Failures are data: `error` is set and the timings may be partial.

    Times are seconds on the runner's monotonic clock, relative to the start of the measured run."""

    index: int
    prompt_len: int
    scheduled_s: float  # when the arrival process released it
    sent_s: float  # when the client sent it; sent_s - scheduled_s is client-side queue time
    first_token_s: float | None = None  # first chunk that carried a token
    end_s: float | None = None  # last byte of the response
    output_len: int = 0  # tokens generated
    output_len_source: str = "usage"  # "usage" (server-reported), "token_ids", "tokenizer" or "chunks"
    chunk_times_s: list[float] = field(default_factory=list)  # arrival of each chunk that carried tokens
    chunk_tokens: list[int] = field(default_factory=list)  # tokens carried by each of those chunks
    token_attribution: str = "exact"  # how chunk_tokens are known: exact, estimated, one-per-chunk (attribution.py)
    error: str | None = None
    status_code: int | None = None
    request_id: str | None = None  # the x-request-id it was sent with
    conversation: int | None = None  # multi-turn workloads: the conversation's index
    turn: int | None = None  # and the turn's number in it, from 1
    # phases.py: reasoning models and tool calls (None where the response had none)
    first_reasoning_s: float | None = None  # first chunk with reasoning text
    first_answer_s: float | None = None  # first chunk with answer text (after the reasoning)
    reasoning_tokens: int | None = None  # of output_len: the server's count (usage) where given, else by chunk
    answer_tokens: int | None = None  # output_len - reasoning_tokens
    first_tool_call_s: float | None = None  # first chunk with a tool-call delta
    tool_call_end_s: float | None = None  # the tool calls complete: their last delta, or the finish reason after it
    tool_calls: int = 0  # tool calls the response made
    run: int | None = None  # --num-runs: which run (from 1) the request belongs to

    @property
    def success(self) -> bool:
        return self.error is None
