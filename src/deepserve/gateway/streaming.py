"""Server-sent events on the way through: forward each complete event as soon as it arrives, pick the usage block
out of the stream, and drop the usage chunk when the gateway (not the client) asked for it.

Only event boundaries are looked for (a bytes search); an event that carries usage is the only one parsed (orjson).
Events are forwarded as they came: reasoning (`reasoning`, `reasoning_content`), tool calls and their deltas pass
through unchanged. What is counted on the way, so that a stream that ends before its usage (the client went away,
the gateway shut down) still says what it delivered, and so that reasoning is counted where the engine's usage does
not say: the token events forwarded (one more bytes search per chunk) and the events that carry reasoning text.

Chat and completion streams (`CHAT_STREAM`, `COMPLETION_STREAM`) are `data:` events ending with `[DONE]`; the usage
is the last chunk's `usage`. Responses streams (`RESPONSES_STREAM`) are typed events (`event: response.…`) whose
token events are the `….delta` ones; the usage is in the final `response.completed` event's response."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

_USAGE_MARK = b'"usage"'
_DATA_MARK = b"data:"
_DONE_MARK = b"[DONE]"
_REASONING_MARK = b'"reasoning'
# A chat delta's reasoning field with a string value (vLLM 0.32: `reasoning`; older vLLM and SGLang:
# `reasoning_content`, which SGLang may also send as null). Looked for only in chunks that name it.
_REASONING_TEXT = re.compile(rb'"reasoning(?:_content)?"\s*:\s*"')


@dataclass(frozen=True)
class StreamShape:
    """How one endpoint's streams mark their token events and their reasoning events."""

    token_mark: bytes  # each token event contains this once
    done_mark: bytes | None  # the final event that is no token ([DONE]), if any
    reasoning_mark: bytes | None  # a chunk with reasoning contains this; then REASONING_PATTERN counts the events
    reasoning_pattern: re.Pattern[bytes] | None


CHAT_STREAM = StreamShape(_DATA_MARK, _DONE_MARK, _REASONING_MARK, _REASONING_TEXT)
COMPLETION_STREAM = StreamShape(_DATA_MARK, _DONE_MARK, None, None)
RESPONSES_STREAM = StreamShape(
    b'.delta"', None, b'"response.reasoning_text.delta"', re.compile(rb'"response\.reasoning_text\.delta"')
)


class StreamTap:
    def __init__(self, strip_usage_chunk: bool, shape: StreamShape = CHAT_STREAM) -> None:
        self.strip_usage_chunk = strip_usage_chunk
        self.shape = shape
        self.usage: dict[str, Any] | None = None
        self.response_id: str | None = None  # a Responses stream's id (from its events that carry the response)
        self.token_events = 0  # token events forwarded so far (`data:` lines, or Responses' delta events)
        self.reasoning_events = 0  # events forwarded that carried reasoning text
        self._tail = b""
        self._last = b""  # the last events forwarded (to tell whether [DONE] went through)

    def feed(self, chunk: bytes) -> bytes:
        """The complete events in TAIL + CHUNK, to forward now; keeps the unfinished rest for later."""
        data = self._tail + chunk if self._tail else chunk
        end = _last_boundary(data)
        if end < 0:
            self._tail = data
            return b""
        self._tail = data[end:]
        events = data[:end]
        if _USAGE_MARK in events:
            events = self._take_usage(events)
        self._count(events)
        return events

    def finish(self) -> bytes:
        """Whatever is left when the upstream ends (an event without its blank line)."""
        rest, self._tail = self._tail, b""
        if rest and _USAGE_MARK in rest:
            rest = self._take_usage(rest)
        if rest:
            self._count(rest)
        return rest

    def _count(self, events: bytes) -> None:
        shape = self.shape
        self.token_events += events.count(shape.token_mark)
        if shape.reasoning_mark is not None and shape.reasoning_mark in events:
            assert shape.reasoning_pattern is not None
            self.reasoning_events += len(shape.reasoning_pattern.findall(events))
        self._last = events

    def delivered_tokens(self) -> int:
        """Completion tokens forwarded so far, counted as events: one per token as vLLM and SGLang stream by
        default (an engine that batches tokens into events, vLLM's --stream-interval, is undercounted; the role-only
        first event of a chat stream is counted). The `[DONE]` event is not a token. Use the usage block when there
        is one: this is for streams that ended without it."""
        done = self.shape.done_mark
        return max(0, self.token_events - (1 if done is not None and done in self._last else 0))

    def _take_usage(self, events: bytes) -> bytes:
        kept = []
        for event in _split_events(events):
            payload = _data_of(event)
            usage_only = False
            if payload is not None and _USAGE_MARK in payload:
                try:
                    parsed = orjson.loads(payload)
                except (ValueError, RecursionError):  # not ours to judge: forwarded as is, only not accounted
                    parsed = None
                if isinstance(parsed, dict):
                    usage_only = self._read_usage(parsed)
            if not (usage_only and self.strip_usage_chunk):
                kept.append(event)
        return b"".join(kept)

    def _read_usage(self, parsed: dict[str, Any]) -> bool:
        """Take the usage out of PARSED (a chunk's, or a Responses event's response); whether the event is a
        usage-only chat or completion chunk (which the gateway drops when it asked for it)."""
        usage = parsed.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
            return not parsed.get("choices")
        response = parsed.get("response")
        if isinstance(response, dict):  # a Responses event: created, in_progress, completed, …
            if isinstance(response.get("id"), str):
                self.response_id = response["id"]
            if isinstance(response.get("usage"), dict):
                self.usage = response["usage"]
        return False


def _last_boundary(data: bytes) -> int:
    """The index just after the last blank line (\\n\\n or \\r\\n\\r\\n), or -1."""
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\r\n\r\n")
    if lf < 0 and crlf < 0:
        return -1
    return max(lf + 2 if lf >= 0 else -1, crlf + 4 if crlf >= 0 else -1)


def _split_events(events: bytes) -> list[bytes]:
    """Events with their terminating blank line kept, so that re-joining gives the same bytes."""
    normalised = events.replace(b"\r\n", b"\n") if b"\r\n" in events else events
    parts = normalised.split(b"\n\n")
    return [part + b"\n\n" for part in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def _data_of(event: bytes) -> bytes | None:
    lines = [line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None
