"""What a response's tokens were: reasoning, the answer, or tool calls, and when each began and ended.

A reasoning model's stream (vLLM with a reasoning parser: `delta.reasoning`; DeepSeek's API and older vLLM:
`delta.reasoning_content`) sends its thinking first, then the answer; a tool-calling model streams `delta.tool_calls`
(a call's id and name first, then its arguments in pieces). The client notes per token chunk which of them it carried
(bit flags below); the record keeps, per request, when the first reasoning token, the first answer token and the
first tool-call delta arrived, when the tool calls were complete, and how many tokens were reasoning and how many
answer. TTFT stays vLLM's: the first token of any kind (vLLM 0.32's benchmarks/lib/endpoint_request_func.py stamps
its TTFT at the first chunk with choices, reasoning or not).
"""

from __future__ import annotations

from deepserve.bench.types import RequestRecord

REASONING = 1
ANSWER = 2
TOOL_CALL = 4


def chunk_kind_tokens(tokens: list[int], kinds: list[int], reasoning_share: dict[int, float]) -> tuple[int, int]:
    """(reasoning tokens, other tokens) of chunks carrying TOKENS, with KINDS (empty: all answer) and, for a chunk
    with reasoning and answer text, the reasoning's share of its text (its tokens are split by it, the reasoning
    getting at least one)."""
    if not kinds:
        return 0, sum(tokens)
    reasoning = 0
    for position, (count, kind) in enumerate(zip(tokens, kinds, strict=True)):
        if not kind & REASONING:
            continue
        share = reasoning_share.get(position)
        reasoning += count if share is None else min(count, max(1, round(count * share)))
    return reasoning, sum(tokens) - reasoning


def set_phases(
    record: RequestRecord,
    kinds: list[int],
    reasoning_share: dict[int, float],
    usage_reasoning: int | None,
    tool_calls: int,
    finish_s: float | None,
) -> None:
    """Fill RECORD's phase fields from its token chunks (times relative to the run, tokens attributed) and what
    the stream said: KINDS per chunk, the server's reasoning-token count (usage) where it gave one, the tool
    calls it made and when its finish reason arrived (FINISH_S, relative too)."""
    times, tokens = record.chunk_times_s, record.chunk_tokens
    if not kinds:
        return
    record.first_reasoning_s = _first(times, kinds, REASONING)
    record.first_answer_s = _first(times, kinds, ANSWER)
    if record.first_reasoning_s is not None or usage_reasoning:
        counted, _ = chunk_kind_tokens(tokens, kinds, reasoning_share)
        record.reasoning_tokens = usage_reasoning if usage_reasoning is not None else counted
        record.answer_tokens = max(record.output_len - record.reasoning_tokens, 0)
    if tool_calls:
        record.tool_calls = tool_calls
        record.first_tool_call_s = _first(times, kinds, TOOL_CALL)
        last = max((t for t, kind in zip(times, kinds, strict=True) if kind & TOOL_CALL), default=None)
        record.tool_call_end_s = max(t for t in (last, finish_s) if t is not None) if last is not None else finish_s


def _first(times: list[float], kinds: list[int], flag: int) -> float | None:
    return next((t for t, kind in zip(times, kinds, strict=True) if kind & flag), None)
