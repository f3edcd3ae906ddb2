"""Server-sent events on the way through: forward each complete event as soon as it arrives, pick the usage block
out of the final chunk, and drop that chunk when the gateway (not the client) asked for it.

Only event boundaries are looked for (a bytes search); the one event that carries usage is the only one parsed.
The `data:` lines forwarded are counted (one more bytes search per chunk), so that a stream that ends before its
usage block (the client went away, the gateway shut down) still says how many tokens it delivered."""

from __future__ import annotations

import json
from typing import Any

_USAGE_MARK = b'"usage"'
_DATA_MARK = b"data:"
_DONE_MARK = b"[DONE]"


class StreamTap:
    def __init__(self, strip_usage_chunk: bool) -> None:
        self.strip_usage_chunk = strip_usage_chunk
        self.usage: dict[str, Any] | None = None
        self.data_events = 0  # `data:` lines forwarded so far
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
        self.data_events += events.count(_DATA_MARK)
        self._last = events
        return events

    def finish(self) -> bytes:
        """Whatever is left when the upstream ends (an event without its blank line)."""
        rest, self._tail = self._tail, b""
        if rest and _USAGE_MARK in rest:
            rest = self._take_usage(rest)
        if rest:
            self.data_events += rest.count(_DATA_MARK)
            self._last = rest
        return rest

    def delivered_tokens(self) -> int:
        """Completion tokens forwarded so far, counted as events: one per token as vLLM and SGLang stream by
        default (an engine that batches tokens into events, vLLM's --stream-interval, is undercounted; the role-only
        first event of a chat stream is counted). The `[DONE]` event is not a token. Use the usage block when there
        is one: this is for streams that ended without it."""
        return max(0, self.data_events - (1 if _DONE_MARK in self._last else 0))

    def _take_usage(self, events: bytes) -> bytes:
        kept = []
        for event in _split_events(events):
            payload = _data_of(event)
            usage_only = False
            if payload is not None and _USAGE_MARK in payload:
                try:
                    parsed = json.loads(payload)
                except (ValueError, RecursionError):  # not ours to judge: forwarded as is, only not accounted
                    parsed = None
                if isinstance(parsed, dict) and isinstance(parsed.get("usage"), dict):
                    self.usage = parsed["usage"]
                    usage_only = not parsed.get("choices")
            if not (usage_only and self.strip_usage_chunk):
                kept.append(event)
        return b"".join(kept)


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
