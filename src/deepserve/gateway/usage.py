"""What an engine's usage block says, in one shape: prompt, completion and reasoning tokens.

Chat and completion answers say `prompt_tokens`, `completion_tokens` and (vLLM with a reasoning parser, OpenAI)
`completion_tokens_details.reasoning_tokens`; Responses answers say `input_tokens`, `output_tokens` and
`output_tokens_details.reasoning_tokens`. An engine may send anything: a count is believed only when it is a
plausible integer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Token counts from an upstream's usage block are believed only in this range (SQLite's INTEGER holds them).
MAX_TOKEN_COUNT = 2**53


@dataclass(frozen=True)
class TokenCounts:
    prompt: int | None = None
    completion: int | None = None
    reasoning: int | None = None  # of the completion tokens, those spent reasoning
    reasoning_source: str | None = None  # "usage": the engine's count; "deltas": events with reasoning text


NO_COUNTS = TokenCounts()


def read_usage(usage: dict[str, Any]) -> TokenCounts:
    """The counts in USAGE (either API's shape)."""
    if "input_tokens" in usage or "output_tokens" in usage:  # the Responses API
        prompt, completion, details = usage.get("input_tokens"), usage.get("output_tokens"), "output_tokens_details"
    else:
        prompt, completion, details = (
            usage.get("prompt_tokens"),
            usage.get("completion_tokens"),
            "completion_tokens_details",
        )
    detail = usage.get(details)
    reasoning = token_count(detail.get("reasoning_tokens")) if isinstance(detail, dict) else None
    return TokenCounts(
        token_count(prompt), token_count(completion), reasoning, "usage" if reasoning is not None else None
    )


def token_count(value: Any) -> int | None:
    """VALUE when it is a plausible token count (an upstream may send anything)."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKEN_COUNT:
        return value
    return None
