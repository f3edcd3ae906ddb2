"""Multi-turn conversations on the streaming client: each turn is sent after the previous answer has arrived and a
think time has passed, with the history (every earlier user turn and the answer the server actually gave), so a
server's prefix cache can reuse what it computed for the previous turn. Each turn becomes one RequestRecord, tagged
with its conversation and turn number. A turn that fails ends its conversation: the later turns cannot be built
without its answer, and are counted as not sent.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deepserve.bench.arrivals import sleep_until
from deepserve.bench.client import DecodedStream, Endpoint, StreamingClient, build_request_bytes
from deepserve.bench.records import record_of, send_safely
from deepserve.bench.types import ConversationSpec, RequestRecord, TurnSpec


@dataclass
class PreparedConversation:
    """A conversation and what every one of its requests carries besides the prompt and the lengths."""

    spec: ConversationSpec
    payload: dict[str, Any]  # model, stream, stream_options, the run's body extras
    headers: dict[str, str]


def turn_payload(conversation: PreparedConversation, answers: list[str], turn: TurnSpec, chat: bool) -> dict[str, Any]:
    """The body of the next turn: the history (earlier user turns and ANSWERS) and TURN's user text. On chat, as
    messages; on completions, as one text: each user turn followed by its answer, then the new user text."""
    turns = conversation.spec.turns
    payload = dict(conversation.payload)
    if chat:
        messages: list[dict[str, str]] = []
        for earlier, answer in zip(turns, answers, strict=False):
            messages += [{"role": "user", "content": earlier.user_text}, {"role": "assistant", "content": answer}]
        payload["messages"] = [*messages, {"role": "user", "content": turn.user_text}]
    else:
        history = "".join(earlier.user_text + answer for earlier, answer in zip(turns, answers, strict=False))
        payload["prompt"] = history + turn.user_text
    payload["max_tokens"] = turn.output_len
    if conversation.spec.exact_output_len:
        payload["min_tokens"] = turn.output_len
    if conversation.spec.ignore_eos:
        payload["ignore_eos"] = True
    return payload


def estimated_prompt_len(turn: TurnSpec, previous: RequestRecord | None) -> int:
    """Prompt tokens of TURN for when the server reports none: the first turn's are exact; a later turn's are the
    PREVIOUS prompt and answer plus the new user text (the chat template's tokens around the added messages are not
    counted)."""
    if previous is None:
        return turn.user_len
    return previous.prompt_len + previous.output_len + turn.user_len


async def converse(
    client: StreamingClient,
    conversation: PreparedConversation,
    endpoint: Endpoint,
    chat: bool,
    first_index: int,
    id_prefix: str,
    t0: float,
    scheduled_s: float,
    on_record: Callable[[RequestRecord, DecodedStream], None],
    not_after: float | None = None,
) -> int:
    """Send CONVERSATION's turns in order, handing each turn's record to ON_RECORD as it completes; returns the
    turns not sent (after a failed one). Turn i gets index FIRST_INDEX + i and id ID_PREFIX + index. SCHEDULED_S:
    when the conversation was released (run clock); a later turn is scheduled at the end of the previous answer
    plus its think time. NOT_AFTER: the first turn is not sent after it (a duration-bound run has ended); a
    conversation in progress goes on."""
    answers: list[str] = []
    previous: RequestRecord | None = None
    turns = conversation.spec.turns
    for number, turn in enumerate(turns):
        if number:
            await sleep_until(time.perf_counter() + turn.think_time_s)
            scheduled_s = time.perf_counter() - t0
        index = first_index + number
        request_id = f"{id_prefix}{index}"
        payload = turn_payload(conversation, answers, turn, chat)
        wire = build_request_bytes(endpoint, payload, conversation.headers, request_id)
        sent = await send_safely(client, wire, not_after if number == 0 else None)
        if sent is None:
            return 0  # the run ended before the conversation could start: nothing of it was sent
        sent_abs, response = sent
        prompt_len = estimated_prompt_len(turn, previous)
        record, decoded = record_of(index, prompt_len, scheduled_s, sent_abs, response, t0)
        record.request_id, record.conversation, record.turn = request_id, conversation.spec.index, number + 1
        on_record(record, decoded)
        if not record.success:
            return len(turns) - number - 1
        answers.append(decoded.text)
        previous = record
    return 0
